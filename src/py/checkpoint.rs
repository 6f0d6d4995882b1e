//! `Checkpoint`: one or many shards opened once, read into new memory or into the caller's
//! tensors (handed over as DLPack), converting dtypes on the way. Every multi-shard consumer
//! (load_checkpoint, iter_checkpoint, load_model, distributed shares) reads through it.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::args::{CheckpointArg, parse_dtype};
use super::bytes::{Bytes, Importer, TensorTuple};
use super::dlpack::Destinations;
use super::errors::detached;
use super::handle::Handle;
use super::info::Info;
use super::options::OpenOptions;
use super::shares::{self, Share};
use super::stats::Stats;
use super::stream::Stream;
use crate::checkpoint::{self, Entry};
use crate::error::Error;
use crate::read::readahead;
use crate::read::source::Target;

fn tuples(entries: &[Entry<'_>], read: crate::read::source::Tensors) -> Vec<TensorTuple> {
    entries
        .iter()
        .zip(read)
        .map(|((_, t), (bytes, dtype))| {
            (
                t.name.clone(),
                dtype.code(),
                t.shape.clone(),
                Bytes::new(bytes),
            )
        })
        .collect()
}

#[pyclass(frozen, module = "safeload._safeload")]
pub struct Checkpoint {
    inner: RwLock<Option<Arc<checkpoint::Checkpoint>>>,
}

impl Checkpoint {
    fn get(&self) -> PyResult<Arc<checkpoint::Checkpoint>> {
        self.inner
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| Error::Closed("Checkpoint").into())
    }
}

#[pymethods]
impl Checkpoint {
    /// `options`: an `OpenOptions` (what every loader passes), else a backend's name or None and
    /// `OpenOptions`' keywords. `hash=True`: reads of every byte of each shard in file order (its
    /// batches, one after the other) compute its SHA-256 in the same pass (`digests()`); never a
    /// map. `verify` (in the options) pins every shard to a SHA-256: resolved at open, checked by
    /// `read` before it returns (see `crate::checkpoint::verify`); implies `hash`.
    #[new]
    #[pyo3(signature = (path_or_paths, options=None, *, hash=false, **keywords))]
    fn new(
        py: Python<'_>,
        path_or_paths: CheckpointArg,
        options: Option<&Bound<'_, PyAny>>,
        hash: bool,
        keywords: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let mut given = OpenOptions::given(py, options, keywords)?.get().resolve()?;
        given.read.hash |= hash;
        let inner = detached(py, |_| {
            let (files, root) = match &path_or_paths {
                CheckpointArg::At(at) => {
                    // Resolved once: the files to open, and the folder their names are in.
                    let files = checkpoint::files::at(at, &given.store)?;
                    let root = checkpoint::files::root_of(at, &files);
                    (files, root)
                }
                CheckpointArg::Files(paths) => (paths.clone(), None),
            };
            checkpoint::Checkpoint::open_pinned(&files, root.as_deref(), &given)
        })?;
        Ok(Checkpoint {
            inner: RwLock::new(Some(Arc::new(inner))),
        })
    }

    /// `(path, where its digest came from)` of each shard when `verify=` pinned the checkpoint
    /// (None: no digest is known and it loads unverified, under `SAFELOAD_VERIFY=1`), URLs
    /// without their secrets, in order; empty when not pinned.
    fn pinned(&self) -> PyResult<Vec<(PathBuf, Option<String>)>> {
        Ok(super::digest::pinned(&*self.get()?))
    }

    /// The backend reads will use ("mmap", "pread" or "direct"; "auto" resolved).
    #[getter]
    fn backend(&self) -> PyResult<&'static str> {
        Ok(self.get()?.strategy().name())
    }

    /// The shard files (paths or URLs) in order, as the checkpoint named them (URLs without
    /// their secrets: for messages and logs).
    #[getter]
    fn paths(&self) -> PyResult<Vec<PathBuf>> {
        Ok(self
            .get()?
            .shards
            .iter()
            .map(|s| crate::redact::shown(&s.path))
            .collect())
    }

    /// Every tensor's header entry, in (shard, offset) order.
    fn infos(&self) -> PyResult<Vec<Info>> {
        Ok(self
            .get()?
            .entries()
            .map(|(s, t)| Info::new(s, t))
            .collect())
    }

    /// The named tensors (all when None) in file order, cut into batches of at most
    /// `max_bytes` (a larger tensor is a batch of its own).
    #[pyo3(signature = (names=None, *, max_bytes))]
    fn batches(&self, names: Option<Vec<String>>, max_bytes: u64) -> PyResult<Vec<Vec<String>>> {
        let ckpt = self.get()?;
        let picked = ckpt.select(names.as_deref())?;
        Ok(checkpoint::Checkpoint::batches(&picked, max_bytes)
            .into_iter()
            .map(|b| b.into_iter().map(|(_, t)| t.name.clone()).collect())
            .collect())
    }

    /// Reads the named tensors (all when None) into new memory, in file order, with one worker
    /// pool; `dtype` ("F32", "F16", "BF16") converts the floating-point ones on the way.
    #[pyo3(signature = (names=None, dtype=None))]
    fn read(
        &self,
        py: Python<'_>,
        names: Option<Vec<String>>,
        dtype: Option<&str>,
    ) -> PyResult<(Vec<TensorTuple>, Stats)> {
        let dtype = parse_dtype(dtype)?;
        let ckpt = self.get()?;
        let picked = ckpt.select(names.as_deref())?;
        let c: &checkpoint::Checkpoint = &ckpt;
        let (read, s) = detached(py, |poll| c.read(&picked, dtype, poll))?;
        // What the read's plan leaves to read ahead (the pages of maps of every tensor), with
        // no handle to keep a read-ahead in.
        if s.ahead.is_some() {
            let shards = ckpt.read_ahead_of_all();
            readahead::populate_in_background(shards, ckpt.tally(), ckpt.options());
        }
        Ok((tuples(&picked, read), Stats::from(s)))
    }

    /// Every tensor as one framework's tensors, made without Python per tensor
    /// (`Handle.import_many`): `({name: tensor}, rest)`, `rest` naming the tensors
    /// left as `(code, shape, bytes)` for the caller to convert.
    #[pyo3(signature = (importer, dtype=None))]
    fn import_many<'py>(
        &self,
        py: Python<'py>,
        importer: PyRef<'py, Importer>,
        dtype: Option<&str>,
    ) -> PyResult<(Bound<'py, pyo3::types::PyDict>, Vec<String>)> {
        let (items, _) = self.read(py, None, dtype)?;
        importer.import_all(py, items)
    }

    /// Reads each named tensor straight into its destination where the reader can: a host
    /// tensor or array exporting DLPack, contiguous, sharing memory with no other destination,
    /// of the tensor's size in its own dtype or one it converts to (F32/F16/BF16). Returns the
    /// read's stats and the names it left for the caller to copy (in the order given).
    fn read_into(
        &self,
        py: Python<'_>,
        names: Vec<String>,
        dests: Vec<Bound<'_, PyAny>>,
    ) -> PyResult<(Stats, Vec<String>)> {
        if names.len() != dests.len() {
            return Err(PyErr::from(Error::Argument(format!(
                "{} names for {} destinations",
                names.len(),
                dests.len()
            ))));
        }
        let ckpt = self.get()?;
        let entries = names
            .iter()
            .map(|n| ckpt.get(n))
            .collect::<Result<Vec<_>, _>>()?;
        let (mut held, index) = Destinations::borrow_eligible(&dests);
        let dtypes = held.dtypes();
        let mut in_place = vec![false; names.len()];
        let mut targets = Vec::with_capacity(index.len());
        for ((&i, dest), dtype) in index.iter().zip(held.slices()).zip(dtypes) {
            let (source, info) = entries[i];
            let Some(dtype) = dtype else { continue };
            let target = Target {
                source,
                info,
                dtype,
                dest,
            };
            if target.fits() {
                in_place[i] = true;
                targets.push(target);
            }
        }
        let c: &checkpoint::Checkpoint = &ckpt;
        let s = detached(py, |poll| c.read_into(targets, poll))?;
        let copies = names
            .into_iter()
            .zip(in_place)
            .filter_map(|(n, done)| (!done).then_some(n))
            .collect();
        Ok((Stats::from(s), copies))
    }

    /// The plan of a load by `world` ranks: (shares of the tensors some rank needs, in (shard,
    /// offset) order; rounds, each a list of indices into the shares: batch k of every rank's
    /// reads, at most `batch_bytes` each). `ranks_needing`: {name: ranks}; `selections`: one
    /// list of names (or None: all) per rank. See `crate::checkpoint::ranks`.
    #[pyo3(signature = (world, *, ranks_needing=None, selections=None, batch_bytes))]
    fn shares(
        &self,
        world: usize,
        ranks_needing: Option<HashMap<String, Vec<i64>>>,
        selections: Option<Vec<Option<Vec<String>>>>,
        batch_bytes: u64,
    ) -> PyResult<(Vec<Share>, Vec<Vec<usize>>)> {
        shares::plan(&*self.get()?, world, ranks_needing, selections, batch_bytes)
    }

    /// Every tensor in file order, in batches of at most half of `max_inflight_bytes` (a larger
    /// tensor alone; None: a budget for a whole load reporting progress, ~32 steps), the next
    /// batch read ahead while the caller uses the current one (see `Stream`).
    #[pyo3(signature = (*, max_inflight_bytes=None))]
    fn stream(&self, max_inflight_bytes: Option<u64>) -> PyResult<Stream> {
        Ok(Stream::new(crate::checkpoint::stream::Stream::start(
            self.get()?,
            max_inflight_bytes,
        )))
    }

    /// One `Handle` per shard, in order, reading through this checkpoint (its strategy, its
    /// totals; no read-ahead), for loads that drive reads file by file (the staging ring).
    fn handles(&self) -> PyResult<Vec<Handle>> {
        let ckpt = self.get()?;
        Ok((0..ckpt.shards.len())
            .map(|s| Handle::of_shard(ckpt.clone(), s, false))
            .collect())
    }

    /// Totals of this checkpoint's reads so far: bytes and seconds added up, the most workers a
    /// read used; zeros, with the backend reads will use, before any.
    fn stats(&self) -> PyResult<Stats> {
        Ok(Stats::from(self.get()?.totals(true)))
    }

    /// What every rank must agree on: shard file names and each tensor's place, dtype and shape.
    fn digest(&self) -> PyResult<String> {
        Ok(crate::checkpoint::ranks::digest(&*self.get()?))
    }

    /// Each shard's SHA-256 (hex, in order) when opened with `hash=True` and read in full, in
    /// file order, since; else a `SafetensorError` naming the shard and the bytes not read.
    fn digests(&self) -> PyResult<Vec<String>> {
        let digests = self.get()?.digests()?;
        Ok(digests.iter().map(ToString::to_string).collect())
    }

    fn close(&self) {
        *self.inner.write().unwrap_or_else(|p| p.into_inner()) = None;
    }
}
