//! `Handle`: one open file, as the Python `safe_open` uses it.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::args::{TensorTuple, options, parse_backend, parse_bounds, parse_dtype, parse_key};
use super::bytes::Bytes;
use super::dlpack::Destinations;
use super::errors::{SafetensorError, detached, to_py};
use super::prefetch::{self, Prefetch};
use super::provided;
use crate::dtype::Dtype;
use crate::engine::Report;
use crate::error::Error;
use crate::header::TensorInfo;
use crate::readahead::{self, Mode, ReadAhead};
use crate::slice;
use crate::source::{self, ReadOptions, Source};
use crate::storage::{Backend, Strategy};

/// Totals over a handle's reads, for `f.stats`.
#[derive(Default, Clone, Copy)]
struct Totals {
    bytes: u64,
    seconds: f64,
    threads: usize,
    reads: u64,
}

#[pyclass(frozen, module = "safeload._safeload")]
pub struct Handle {
    source: RwLock<Option<Arc<Source>>>,
    requested: Backend,
    /// What reads this file: `requested` resolved at the first read (so `open()` + `keys()`
    /// costs no residency probe). Direct falls back to Pread when the filesystem refuses O_DIRECT.
    strategy: RwLock<Option<Strategy>>,
    opts: ReadOptions,
    totals: Mutex<Totals>,
    /// Read-ahead for tensors pulled one at a time, shared with this handle's shares (slices);
    /// made at the first such read, None when `SAFELOAD_READAHEAD_BYTES=0`.
    ahead: Arc<OnceLock<Option<ReadAhead>>>,
}

/// (name, dtype code, shape, begin, end): a header entry.
type InfoTuple = (String, &'static str, Vec<usize>, usize, usize);

impl Handle {
    fn source(&self) -> PyResult<Arc<Source>> {
        self.source
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| SafetensorError::new_err("File is closed"))
    }

    fn strategy(&self) -> Strategy {
        if let Some(known) = *self.strategy.read().unwrap_or_else(|p| p.into_inner()) {
            return known;
        }
        let open = self
            .source
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let resolved = open.map_or(Strategy::Pread, |s| s.resolve(self.requested));
        *self.strategy.write().unwrap_or_else(|p| p.into_inner()) = Some(resolved);
        resolved
    }

    fn record(&self, report: &Report) {
        let mut t = self.totals.lock().unwrap_or_else(|p| p.into_inner());
        t.bytes += report.bytes;
        t.seconds += report.seconds;
        t.threads = report.threads;
        t.reads += 1;
        if report.direct_refused {
            *self.strategy.write().unwrap_or_else(|p| p.into_inner()) = Some(Strategy::Pread);
        }
    }

    /// The handle's read-ahead, made at the first call: into `provided` destinations (see
    /// `take_into`), or the handle's own memory or page cache.
    fn ahead(&self, source: &Arc<Source>, provided: bool) -> Option<&ReadAhead> {
        self.ahead
            .get_or_init(|| {
                let budget = readahead::budget_from_env();
                let mode = if provided {
                    Mode::Provided
                } else {
                    Mode::for_strategy(self.strategy())
                };
                (budget > 0).then(|| ReadAhead::new(source.clone(), mode, self.opts, budget))
            })
            .as_ref()
    }

    /// Tensor `info` whole, as `get_tensor` gives it: from the read-ahead when it has read it,
    /// else read now (a view of the map under mmap). Starts the read-ahead on first use (parts of
    /// a tensor, in `read_slice`, only use what it already holds).
    fn whole(
        &self,
        py: Python<'_>,
        source: &Arc<Source>,
        info: &TensorInfo,
    ) -> PyResult<TensorTuple> {
        let index = source
            .header
            .index_of(&info.name)
            .expect("info comes from this header");
        if let Some(ahead) = self.ahead(source, false)
            && ahead.mode() != Mode::Provided
        {
            let taken = detached(py, |poll| ahead.take(index, true, poll))?;
            if let Some(bytes) = taken {
                return Ok((
                    info.name.clone(),
                    info.dtype.code(),
                    info.shape.clone(),
                    Bytes::new(bytes),
                ));
            }
        }
        let (mut out, _) = self.read_infos(py, source, vec![info], None)?;
        Ok(out.pop().expect("one tensor asked, one read"))
    }

    /// Reads (or maps) `infos`; returns their tuples and the strategy that ran (a map cannot
    /// convert dtypes, so `Mmap` with a converting `dtype` runs `Pread`).
    fn read_infos(
        &self,
        py: Python<'_>,
        source: &Arc<Source>,
        infos: Vec<&TensorInfo>,
        dtype: Option<Dtype>,
    ) -> PyResult<(Vec<TensorTuple>, Strategy)> {
        let wanted: Vec<(usize, &TensorInfo)> = infos.iter().map(|t| (0, *t)).collect();
        let (opts, strategy) = (self.opts, self.strategy());
        let s: &Source = source;
        let (buffers, report, ran) = detached(py, |poll| {
            source::read_or_map(&[s], &wanted, strategy, dtype, &opts, poll)
        })?;
        if ran != Strategy::Mmap {
            self.record(&report);
        }
        let tuples = infos
            .into_iter()
            .zip(buffers)
            .map(|(t, (b, d))| (t.name.clone(), d.code(), t.shape.clone(), Bytes::new(b)))
            .collect();
        Ok((tuples, ran))
    }
}

#[pymethods]
impl Handle {
    /// `readahead=False` for callers that know exactly which bytes they want (slice plans):
    /// whole-tensor reads then never read ahead.
    #[new]
    #[pyo3(signature = (path, backend="auto", *, threads=None, chunk_bytes=None, drop_cache=false, readahead=true, storage_options=None))]
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments, one each
    fn new(
        py: Python<'_>,
        path: PathBuf,
        backend: &str,
        threads: Option<usize>,
        chunk_bytes: Option<usize>,
        drop_cache: bool,
        readahead: bool,
        storage_options: Option<super::remote::StorageOptions>,
    ) -> PyResult<Self> {
        let backend = parse_backend(backend)?;
        let store = storage_options.unwrap_or_default().0;
        let source = py
            .detach(|| Source::open_with(&path, &store))
            .map_err(to_py)?;
        Ok(Handle {
            source: RwLock::new(Some(Arc::new(source))),
            requested: backend,
            strategy: RwLock::new(None),
            opts: options(threads, chunk_bytes, drop_cache),
            totals: Mutex::new(Totals::default()),
            ahead: Arc::new(if readahead {
                OnceLock::new()
            } else {
                OnceLock::from(None)
            }),
        })
    }

    /// The backend reading this file: "mmap", "pread" or "direct".
    #[getter]
    fn backend(&self) -> &'static str {
        self.strategy().name()
    }

    /// The filesystem kind the file lives on ("local", "memory", "fuse", "nfs", ...).
    #[getter]
    fn storage(&self) -> PyResult<&'static str> {
        Ok(self.source()?.kind.name())
    }

    /// Totals of the reads made so far: bytes, seconds, threads of the last read, reads.
    fn stats(&self) -> (u64, f64, usize, u64) {
        let t = *self.totals.lock().unwrap_or_else(|p| p.into_inner());
        let ahead = match self.ahead.get() {
            Some(Some(a)) => a.totals(),
            _ => readahead::Totals::default(),
        };
        (
            t.bytes + ahead.bytes_read,
            t.seconds + ahead.seconds,
            t.threads,
            t.reads,
        )
    }

    /// Bytes the read-ahead holds for tensors not asked for yet (owned memory, or page cache
    /// under mmap).
    #[getter]
    fn readahead_bytes(&self) -> u64 {
        match self.ahead.get() {
            Some(Some(a)) => a.held_bytes(),
            _ => 0,
        }
    }

    #[getter]
    fn threads(&self) -> Option<usize> {
        self.opts.threads
    }

    #[getter]
    fn chunk_bytes(&self) -> PyResult<usize> {
        Ok(source::chunk_bytes(&[&*self.source()?], &self.opts))
    }

    #[getter]
    fn closed(&self) -> bool {
        self.source
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .is_none()
    }

    /// A second handle on the same open file that stays open when this one closes (what a
    /// slice keeps, as safetensors' slices keep the file).
    fn share(&self) -> PyResult<Handle> {
        Ok(Handle {
            source: RwLock::new(Some(self.source()?)),
            requested: self.requested,
            strategy: RwLock::new(Some(self.strategy())),
            opts: self.opts,
            totals: Mutex::new(Totals::default()),
            ahead: self.ahead.clone(),
        })
    }

    /// Closes this handle; the read-ahead stops (and frees what it read) once no share of it
    /// (a slice) is left either.
    fn close(&self) {
        *self.source.write().unwrap_or_else(|p| p.into_inner()) = None;
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
        let t = source.tensor(name).map_err(to_py)?;
        Ok((t.dtype.code(), t.shape.clone(), t.begin, t.end))
    }

    /// safetensors 0.9's `prefetch`: starts reading `plan` (a dict `name -> None | slice` of the
    /// first dimension; every tensor when None) in the background, in file order, with at most
    /// `budget_bytes` read and not taken (`SAFELOAD_PREFETCH_BYTES`, default 4 GiB), and returns
    /// the loader at once. `provided`: into destinations the loader's `take` gets made (devices);
    /// `staging`: those are staging memory (CUDA), whose default budget is 1 GiB.
    #[pyo3(signature = (plan=None, *, threads=None, budget_bytes=None, provided=false, staging=false))]
    fn prefetch(
        &self,
        py: Python<'_>,
        plan: Option<Bound<'_, PyDict>>,
        threads: Option<usize>,
        budget_bytes: Option<u64>,
        provided: bool,
        staging: bool,
    ) -> PyResult<Prefetch> {
        let source = self.source()?;
        let plan = plan.map(|p| prefetch::parse_plan(&p)).transpose()?;
        let mut opts = self.opts;
        if let Some(t) = threads {
            opts.threads = Some(t.max(1));
        }
        let strategy = self.strategy();
        let budget = budget_bytes.unwrap_or_else(|| readahead::prefetch_budget_from_env(staging));
        py.detach(|| Prefetch::start(source, plan, strategy, provided, opts, budget))
            .map_err(to_py)
    }

    /// (dtype code, shape) of one tensor.
    fn info(&self, name: &str) -> PyResult<(&'static str, Vec<usize>)> {
        let source = self.source()?;
        let t = source.tensor(name).map_err(to_py)?;
        Ok((t.dtype.code(), t.shape.clone()))
    }

    /// (name, dtype, shape, begin, end) of every tensor, in file order.
    fn infos(&self) -> PyResult<Vec<InfoTuple>> {
        let source = self.source()?;
        Ok(source
            .header
            .tensors
            .iter()
            .map(|t| {
                (
                    t.name.clone(),
                    t.dtype.code(),
                    t.shape.clone(),
                    t.begin,
                    t.end,
                )
            })
            .collect())
    }

    #[getter]
    fn data_start(&self) -> PyResult<u64> {
        Ok(self.source()?.header.data_start())
    }

    #[getter]
    fn path(&self) -> PyResult<PathBuf> {
        Ok(self.source()?.path.clone())
    }

    /// Bytes of one tensor.
    fn read(&self, py: Python<'_>, name: &str) -> PyResult<TensorTuple> {
        let source = self.source()?;
        let info = source.tensor(name).map_err(to_py)?;
        self.whole(py, &source, info)
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
        let dtype = parse_dtype(dtype)?;
        let source = self.source()?;
        let infos: Vec<&TensorInfo> = match &names {
            None => source.header.tensors.iter().collect(),
            Some(names) => {
                let mut infos = names
                    .iter()
                    .map(|n| source.tensor(n))
                    .collect::<Result<Vec<_>, Error>>()
                    .map_err(to_py)?;
                infos.sort_by_key(|t| t.begin);
                infos
            }
        };
        let (out, ran) = self.read_infos(py, &source, infos, dtype)?;
        // Views of a map: its pages are made resident ahead of the caller's touches, in file
        // order (not when the tensors were read into memory, converting).
        if names.is_none()
            && ran == Strategy::Mmap
            && let Some(ahead) = self.ahead(&source, false)
        {
            ahead.want_all();
        }
        Ok(out)
    }

    /// Reads the data area from `offset` on straight into `dest`, any host tensor or array
    /// exporting DLPack (a pinned staging buffer, an MPS storage's CPU alias), as many bytes as
    /// it holds; GIL released. Returns bytes read.
    fn read_into(&self, py: Python<'_>, dest: Bound<'_, PyAny>, offset: u64) -> PyResult<u64> {
        let source = self.source()?;
        let opts = self.opts;
        let s: &Source = &source;
        let mut held = Destinations::borrow(&[dest], &["<staging>"])?;
        let mut slices = held.slices();
        let dest = slices.pop().expect("one destination");
        let report = detached(py, |poll| {
            source::read_data_into(s, offset, dest, &opts, poll)
        })?;
        self.record(&report);
        Ok(report.bytes)
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
        let source = self.source()?;
        let info = source.tensor(name).map_err(to_py)?;
        if let Some(key) = key {
            let plan = slice_plan(info, &key, bounds)?;
            if !covers(&plan, info) {
                return Ok(None);
            }
        }
        let Some(ahead) = self.ahead(&source, true) else {
            return Ok(None);
        };
        if ahead.mode() != Mode::Provided {
            return Ok(None);
        }
        let index = source.header.index_of(name).expect("found above");
        provided::provide(py, ahead, index, &allocate)?;
        let taken = detached(py, |poll| ahead.take(index, true, poll))?;
        Ok(taken.and_then(|bytes| provided::tensor(py, &bytes)))
    }

    /// `tensor[key]`, `key` as `__getitem__` got it (ints, slices, `...`, a tuple of those),
    /// `bounds` "strict" (0.8's pread and numpy rule) or "clamp" (torch's; see
    /// `slice::Bounds`). Returns (dtype, shape, bytes); only the needed byte ranges are read.
    #[pyo3(signature = (name, key, bounds="strict"))]
    fn read_slice(
        &self,
        py: Python<'_>,
        name: &str,
        key: &Bound<'_, PyAny>,
        bounds: &str,
    ) -> PyResult<(&'static str, Vec<usize>, Bytes)> {
        let source = self.source()?;
        let info = source.tensor(name).map_err(to_py)?;
        let plan = slice_plan(info, key, bounds)?;
        if covers(&plan, info) {
            // The whole tensor (`[...]`, `[:]`): what get_tensor gives, a view of the map
            // under mmap (zero copy, as safetensors' default), the read-ahead's bytes otherwise.
            let (_, code, shape, bytes) = self.whole(py, &source, info)?;
            return Ok((code, shape, bytes));
        }
        // Part of a tensor the read-ahead already holds: cut from its bytes.
        let held = match self.ahead.get() {
            Some(Some(ahead)) if matches!(ahead.mode(), Mode::Owned(_)) => {
                let index = source.header.index_of(name).expect("found above");
                detached(py, |poll| ahead.take(index, false, poll))?
            }
            _ => None,
        };
        let bytes = match (held, self.strategy()) {
            (Some(whole), _) => gather(&plan, &whole)?,
            (None, Strategy::Mmap) => {
                let whole = source.map_tensor(info).map_err(to_py)?;
                gather(&plan, &whole)?
            }
            _ => {
                let opts = self.opts;
                let s: &Source = &source;
                let (bytes, report) = detached(py, |poll| s.read_slice(info, &plan, &opts, poll))?;
                self.record(&report);
                bytes
            }
        };
        Ok((info.dtype.code(), plan.shape, Bytes::new(bytes)))
    }
}

/// Whether a slice plan takes the whole tensor (`[...]`, `[:]`, ranges covering every dimension).
fn slice_plan(
    info: &TensorInfo,
    key: &Bound<'_, PyAny>,
    bounds: &str,
) -> PyResult<slice::SlicePlan> {
    let indices = parse_key(key, info.shape.len())?;
    slice::plan(info.dtype, &info.shape, &indices, parse_bounds(bounds)?).map_err(to_py)
}

fn covers(plan: &slice::SlicePlan, info: &TensorInfo) -> bool {
    plan.shape == info.shape && plan.nbytes == info.nbytes()
}

/// The elements of `plan` cut out of a whole tensor's bytes, into new memory.
fn gather(
    plan: &slice::SlicePlan,
    whole: &crate::buffer::TensorBytes,
) -> PyResult<crate::buffer::TensorBytes> {
    let mut out = crate::buffer::allocate(&[plan.nbytes])
        .map_err(|e| {
            to_py(Error::Memory(format!(
                "cannot allocate {} bytes for a slice: {e}",
                plan.nbytes
            )))
        })?
        .pop()
        .expect("one size, one buffer");
    slice::gather(plan, whole.as_slice(), out.as_mut_slice());
    Ok(out.into_shared())
}

/// Fraction of a file's bytes in the page cache (sampled with mincore), and its filesystem kind.
#[pyfunction]
pub fn residency(path: PathBuf) -> PyResult<(Option<f64>, &'static str)> {
    let open_err = |source| {
        to_py(Error::Open {
            path: path.clone(),
            source,
        })
    };
    let file = std::fs::File::open(&path).map_err(open_err)?;
    let len = file.metadata().map_err(open_err)?.len();
    Ok((
        crate::storage::cached_fraction(&file, 0, len),
        crate::storage::FsKind::of(&file, &path).name(),
    ))
}
