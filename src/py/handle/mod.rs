//! `Handle`: one open file as the Python `safe_open` uses it: a shard of a
//! [`crate::Checkpoint`] (a one-shard checkpoint of its own when opened by path, or one of a
//! checkpoint's, from `Checkpoint.handles`), whose reads it converts. Here its state and the one
//! `#[pymethods]` block, whose methods convert arguments; what they read is in `reads` (whole
//! tensors), `slices` (parts of one) and `ahead` (the read-ahead, `take_into`, `prefetch`).

mod ahead;
mod reads;
mod slices;

use slices::{covers, part_made, slice_plan};

use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::args::parse_dtype;
use super::bytes::{Importer, TensorTuple};
use super::errors::detached;
use super::info::Info;
use super::options::OpenOptions;
use super::prefetch::{self, MakersArg, Prefetch};
use super::stats::Stats;
use crate::checkpoint::{Checkpoint, ReadStats};
use crate::error::Error;
use crate::read::readahead::{self, ReadAhead};
use crate::read::source::Source;

#[pyclass(frozen, module = "safeload._safeload")]
pub struct Handle {
    /// The file, as a one-shard checkpoint: its strategy (resolved at the first read, so
    /// `open()` + `keys()` costs no residency probe) and the totals of every read, shared with
    /// this handle's shares (slices). None once closed.
    open: RwLock<Option<Arc<Checkpoint>>>,
    /// Which of the checkpoint's shards this handle reads (0 but for `Checkpoint.handles`).
    shard: usize,
    /// The totals when it closed (`stats` after close).
    closed: Mutex<Option<ReadStats>>,
    /// Read-ahead for tensors pulled one at a time, shared with this handle's shares;
    /// made at the first such read, None when `SAFELOAD_READAHEAD_BYTES=0`.
    ahead: Arc<OnceLock<Option<ReadAhead>>>,
}

impl Handle {
    /// A handle on shard `shard` of `ckpt`, sharing its strategy and totals.
    pub(crate) fn of_shard(ckpt: Arc<Checkpoint>, shard: usize, readahead: bool) -> Handle {
        Handle {
            open: RwLock::new(Some(ckpt)),
            shard,
            closed: Mutex::new(None),
            ahead: Arc::new(if readahead {
                OnceLock::new()
            } else {
                OnceLock::from(None)
            }),
        }
    }

    fn ckpt(&self) -> PyResult<Arc<Checkpoint>> {
        self.open
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| Error::Closed("File").into())
    }

    /// The file.
    fn source(&self) -> PyResult<Arc<Source>> {
        Ok(self.ckpt()?.shards[self.shard].clone())
    }

    /// [`Handle::totals`] while open, the totals at close after.
    fn latest(&self) -> ReadStats {
        let open = self.open.read().unwrap_or_else(|p| p.into_inner());
        match &*open {
            Some(ckpt) => ckpt.totals(true), // read-aheads and loaders count there
            None => self
                .closed
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .expect("set at close"),
        }
    }

    /// Bytes the read-ahead holds for tensors not asked for yet (owned memory, or page cache
    /// under mmap): `_testing.readahead_bytes`, for tests that bound it.
    #[cfg(feature = "testing")]
    pub(super) fn readahead_bytes(&self) -> u64 {
        match self.ahead.get() {
            Some(Some(a)) => a.held_bytes(),
            _ => 0,
        }
    }
}

#[pymethods]
impl Handle {
    /// `options`: an `OpenOptions` (what safe_open passes), else a backend's name or None and
    /// `OpenOptions`' keywords. `readahead=False` for callers that know exactly which bytes they
    /// want (slice plans): whole-tensor reads then never read ahead. `verify` (in the options):
    /// the file's SHA-256 pinned (see `Checkpoint`'s): the file is read whole and hashed now, and
    /// every tensor is served from those bytes; a mismatch raises here.
    #[new]
    #[pyo3(signature = (path, options=None, *, readahead=true, **keywords))]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        options: Option<&Bound<'_, PyAny>>,
        readahead: bool,
        keywords: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let given = OpenOptions::given(py, options, keywords)?.get().resolve()?;
        let ckpt = detached(py, |poll| {
            let ckpt = Checkpoint::open_pinned(&[path], None, &given)?;
            ckpt.hold_all(poll)?;
            Ok(ckpt)
        })?;
        Ok(Handle::of_shard(Arc::new(ckpt), 0, readahead))
    }

    /// `(path, where its digest came from)` when `verify=` pinned the file (None: no digest is
    /// known and it loads unverified, under `SAFELOAD_VERIFY=1`); empty when not pinned.
    fn pinned(&self) -> PyResult<Vec<(PathBuf, Option<String>)>> {
        Ok(super::digest::pinned(&*self.ckpt()?))
    }

    /// The backend reading this file: "mmap", "pread" or "direct": what the latest read that
    /// moved bytes ran (a device's staging reads, a converting read), else what whole tensors
    /// will be read with.
    #[getter]
    fn backend(&self) -> PyResult<&'static str> {
        Ok(self.ckpt()?.totals(true).strategy.name())
    }

    /// The backend this file was asked to be read with, after the process's overrides (a
    /// patch's forced backend, `$SAFELOAD_BACKEND`: `Backend::requested`): "auto", "mmap",
    /// "pread" or "direct".
    #[getter]
    fn asked_backend(&self) -> PyResult<&'static str> {
        Ok(self.ckpt()?.backend().name())
    }

    /// The filesystem kind the file lives on ("local", "memory", "fuse", "nfs", ...).
    #[getter]
    fn storage(&self) -> PyResult<&'static str> {
        Ok(self.source()?.kind.name())
    }

    /// Totals of this file's reads so far (its slices' and read-ahead's included): the backend,
    /// the most workers a read used, the request size, bytes, seconds, the filesystem kind.
    fn stats(&self) -> Stats {
        Stats::from(self.latest())
    }

    #[getter]
    fn threads(&self) -> PyResult<Option<usize>> {
        Ok(self.ckpt()?.options().threads)
    }

    #[getter]
    fn chunk_bytes(&self) -> usize {
        self.latest().chunk_bytes
    }

    #[getter]
    fn closed(&self) -> bool {
        self.open
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .is_none()
    }

    /// A second handle on the same open file that stays open when this one closes (what a
    /// slice keeps, as safetensors' slices keep the file).
    fn share(&self) -> PyResult<Handle> {
        Ok(Handle {
            open: RwLock::new(Some(self.ckpt()?)),
            shard: self.shard,
            closed: Mutex::new(None),
            ahead: self.ahead.clone(),
        })
    }

    /// Closes this handle; the read-ahead stops (and frees what it read) once no share of it
    /// (a slice) is left either.
    fn close(&self) {
        let mut open = self.open.write().unwrap_or_else(|p| p.into_inner());
        let Some(ckpt) = open.take() else {
            return;
        };
        // Under the write lock: `latest` sees the handle open or these totals.
        *self.closed.lock().unwrap_or_else(|p| p.into_inner()) = Some(ckpt.totals(false)); // probes nothing at close
        drop(open);
        if Arc::strong_count(&self.ahead) == 1
            && let Some(Some(ahead)) = self.ahead.get()
        {
            ahead.close();
        }
    }

    fn keys(&self) -> PyResult<Vec<String>> {
        let source = self.source()?;
        Ok(source
            .header
            .sorted_names()
            .into_iter()
            .map(String::from)
            .collect())
    }

    fn offset_keys(&self) -> PyResult<Vec<String>> {
        Ok(self
            .source()?
            .header
            .tensors
            .iter()
            .map(|t| t.name.clone())
            .collect())
    }

    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let source = self.source()?;
        let Some(entries) = &source.header.metadata else {
            return Ok(None);
        };
        let dict = PyDict::new(py);
        for (k, v) in entries {
            dict.set_item(k, v)?;
        }
        Ok(Some(dict))
    }

    /// (dtype code, shape, begin, end) of one tensor, data offsets relative to the data area.
    fn meta(&self, name: &str) -> PyResult<(&'static str, Vec<usize>, usize, usize)> {
        let source = self.source()?;
        let t = source.tensor(name)?;
        Ok((t.dtype.code(), t.shape.clone(), t.begin, t.end))
    }

    /// safetensors 0.9's `prefetch`: starts reading `plan` (a dict `name -> None | slice` of the
    /// first dimension; every tensor when None) in the background, in file order, with at most
    /// `budget_bytes` read and not taken (`SAFELOAD_PREFETCH_BYTES`, default 4 GiB), and returns
    /// the loader at once. Its takes make tensors with `makers`: `(allocate, importer, convert)`
    /// (see `Prefetch.take`); with `allocate`, the loader reads into the destinations it makes
    /// (devices). `staging`: those are staging memory (CUDA), whose default budget is 1 GiB.
    #[pyo3(signature = (plan=None, *, threads=None, budget_bytes=None, staging=false, makers=(None, None, None)))]
    fn prefetch(
        &self,
        py: Python<'_>,
        plan: Option<Bound<'_, PyDict>>,
        threads: Option<usize>,
        budget_bytes: Option<u64>,
        staging: bool,
        makers: MakersArg,
    ) -> PyResult<Prefetch> {
        let ckpt = self.ckpt()?;
        let plan = plan.map(|p| prefetch::parse_plan(&p)).transpose()?;
        let budget = budget_bytes.unwrap_or_else(|| readahead::prefetch_budget_from_env(staging));
        self.start_prefetch(py, &ckpt, plan, threads, budget, makers.into())
    }

    /// (dtype code, shape) of one tensor.
    fn info(&self, name: &str) -> PyResult<(&'static str, Vec<usize>)> {
        let source = self.source()?;
        let t = source.tensor(name)?;
        Ok((t.dtype.code(), t.shape.clone()))
    }

    /// Every tensor's header entry, in file (offset) order.
    fn infos(&self) -> PyResult<Vec<Info>> {
        let source = self.source()?;
        Ok(source
            .header
            .tensors
            .iter()
            .map(|t| Info::new(0, t))
            .collect())
    }

    #[getter]
    fn data_start(&self) -> PyResult<u64> {
        Ok(self.source()?.header.data_start())
    }

    /// The file's path or URL, as messages and logs show it (a URL without its secrets).
    #[getter]
    fn path(&self) -> PyResult<PathBuf> {
        Ok(crate::redact::shown(&self.source()?.path))
    }

    /// One tensor: `(name, dtype code, shape, bytes)`, or the tensor `importer` makes of them
    /// where it makes that dtype (a `get_tensor` loop's tensors without Python per tensor).
    #[pyo3(signature = (name, importer=None))]
    fn read(
        &self,
        py: Python<'_>,
        name: &str,
        importer: Option<PyRef<'_, Importer>>,
    ) -> PyResult<Py<PyAny>> {
        let ckpt = self.ckpt()?;
        let info = ckpt.shards[self.shard].tensor(name)?;
        let tuple = self.whole(py, &ckpt, info)?;
        Importer::made(py, importer.as_deref(), None, tuple)
    }

    /// Bytes of the named tensors (all when `names` is None), in file order, read together;
    /// `dtype` ("F32", "F16", "BF16") converts the floating-point ones on the way.
    #[pyo3(signature = (names=None, dtype=None))]
    fn read_many(
        &self,
        py: Python<'_>,
        names: Option<Vec<String>>,
        dtype: Option<&str>,
    ) -> PyResult<Vec<TensorTuple>> {
        self.read_named(py, names, parse_dtype(dtype)?)
    }

    /// `read_many` as one framework's tensors, made by `importer` without Python per tensor:
    /// `({name: tensor}, rest)`, file order; a tensor it does not make (empty, or a dtype its
    /// framework's DLPack import lacks) maps to its `(dtype code, shape, bytes)` and is named in
    /// `rest`.
    #[pyo3(signature = (importer, names=None, dtype=None))]
    fn import_many<'py>(
        &self,
        py: Python<'py>,
        importer: PyRef<'py, Importer>,
        names: Option<Vec<String>>,
        dtype: Option<&str>,
    ) -> PyResult<(Bound<'py, PyDict>, Vec<String>)> {
        let items = self.read_named(py, names, parse_dtype(dtype)?)?;
        importer.import_all(py, items)
    }

    /// Reads data-area ranges straight into the caller's memory, all in one plan read by the
    /// worker pool in file order, GIL released: each `(dest, offset)` fills `dest` (any host
    /// tensor or array exporting DLPack: a pinned staging buffer, an MPS storage's CPU alias;
    /// destinations may not overlap) from `offset` bytes into the data area. Returns the stats
    /// of this read.
    fn read_ranges(&self, py: Python<'_>, ranges: Vec<(Bound<'_, PyAny>, u64)>) -> PyResult<Stats> {
        self.read_data_ranges(py, ranges)
    }

    /// Tensor `name` whole (or `[indices]` when they cover it) for a device whose memory the host
    /// can write (MPS, through torch's host alias): the read-ahead reads it, and the tensors after
    /// it in file order within its budget, straight into device memory. `allocate(items)` makes
    /// that memory on this thread: `items` lists (name, dtype code, shape, bytes) the read-ahead
    /// needs now; it returns one (tensor, host view) pair per item, the view a contiguous host
    /// tensor of exactly that many bytes exporting DLPack, or None when it cannot (those tensors
    /// are not read ahead). Returns the tensor made for `name`, or None: then the caller reads it
    /// its own way (a part of a tensor, read-ahead off, no destination).
    #[pyo3(signature = (name, allocate, key=None, bounds="strict"))]
    fn take_into(
        &self,
        py: Python<'_>,
        name: &str,
        allocate: Bound<'_, PyAny>,
        key: Option<Bound<'_, PyAny>>,
        bounds: &str,
    ) -> PyResult<Option<Py<PyAny>>> {
        let ckpt = self.ckpt()?;
        let info = ckpt.shards[self.shard].tensor(name)?;
        if let Some(key) = key
            && !covers(&slice_plan(info, &key, bounds)?, info)
        {
            return Ok(None);
        }
        self.take_provided(py, &ckpt, info, &allocate)
    }

    /// `tensor[key]`, `key` as `__getitem__` got it (ints, slices, `...`, a tuple of those),
    /// `bounds` "strict" (0.8's pread and numpy rule) or "clamp" (torch's; see
    /// `slice::Bounds`). Returns (dtype, shape, bytes), or the tensor `importer` makes of them
    /// where it makes that dtype; only the needed byte ranges are read. Of a map, with an
    /// importer, the part is the imported tensor's view `[key]` (as 0.8's slices of a map are:
    /// nothing copied).
    #[pyo3(signature = (name, key, bounds="strict", importer=None))]
    fn read_slice(
        &self,
        py: Python<'_>,
        name: &str,
        key: &Bound<'_, PyAny>,
        bounds: &str,
        importer: Option<PyRef<'_, Importer>>,
    ) -> PyResult<Py<PyAny>> {
        let ckpt = self.ckpt()?;
        let info = ckpt.shards[self.shard].tensor(name)?;
        let plan = slice_plan(info, key, bounds)?;
        let importer = importer.as_deref();
        let part = self.read_part(py, &ckpt, info, &plan, importer.is_some())?;
        part_made(py, part, info, &plan, key, importer)
    }
}
