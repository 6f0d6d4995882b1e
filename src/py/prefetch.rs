//! `Prefetch`: safetensors 0.9's `PrefetchLoader` on the Rust read-ahead. A plan's items are
//! read in file order by the read-ahead's workers within a memory budget, from the moment the
//! loader is made, and handed over by `take` (each once); the Python `PrefetchLoader` makes
//! framework tensors of what it gets.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use pyo3::prelude::*;
use pyo3::types::{PyDict, PySlice};

use super::bytes::{Bytes, Importer};
use super::errors::detached;
use super::provided;
use crate::checkpoint::Checkpoint;
use crate::error::Error;
use crate::read::prefetch::{self, Handovers, Rows};
use crate::read::readahead::{Mode, ReadAhead};
use crate::read::source::{ReadOptions, Source};

/// A plan dict (`name -> None | slice`), in the dict's order.
pub(super) fn parse_plan(plan: &Bound<'_, PyDict>) -> PyResult<Vec<(String, Rows)>> {
    let mut out = Vec::with_capacity(plan.len());
    for (name, value) in plan.iter() {
        let name: String = name.extract()?;
        let rows = if value.is_none() {
            Rows::All
        } else if let Ok(slice) = value.cast::<PySlice>() {
            let bound = |attr: &str| -> PyResult<Option<i64>> {
                let v = slice.getattr(attr)?;
                if v.is_none() {
                    return Ok(None);
                }
                v.extract::<i64>().map(Some).map_err(|_| {
                    PyErr::from(Error::Prefetch(format!(
                        "prefetch plan entry {name}: slice bounds must be ints or None"
                    )))
                })
            };
            Rows::Slice {
                start: bound("start")?,
                stop: bound("stop")?,
                step: bound("step")?,
            }
        } else {
            return Err(PyErr::from(Error::Prefetch(format!(
                "prefetch plan entry {name}: expected None or a slice, got {}",
                value.get_type().name()?
            ))));
        };
        out.push((name, rows));
    }
    Ok(out)
}

/// What makes a take's tensor, given once when the loader is made (`Handle.prefetch`):
/// `allocate` makes the destinations a loader reading into provided memory writes (devices),
/// `importer` makes framework tensors of the dtypes it makes, `convert(name, dtype code, shape,
/// bytes)` the rest (that tuple without it).
pub(super) struct Makers {
    pub allocate: Option<Py<PyAny>>,
    pub importer: Option<Py<Importer>>,
    pub convert: Option<Py<PyAny>>,
}

/// [`Makers`] as Python passes them: `(allocate, importer, convert)`.
pub(super) type MakersArg = (Option<Py<PyAny>>, Option<Py<Importer>>, Option<Py<PyAny>>);

impl From<MakersArg> for Makers {
    fn from((allocate, importer, convert): MakersArg) -> Makers {
        Makers {
            allocate,
            importer,
            convert,
        }
    }
}

/// [`Prefetch::item_of`] of a tensor the plan does not take.
const NOT_PLANNED: usize = usize::MAX;

#[pyclass(frozen, module = "safeload._safeload")]
pub struct Prefetch {
    /// Keeps the files open (a loader may outlive its handle); reads items the read-ahead has
    /// not reached, by its plan, counted in its totals (the handle's stats).
    ckpt: Arc<Checkpoint>,
    shard: usize,
    /// The file, `ckpt`'s shard `shard`.
    source: Arc<Source>,
    ahead: ReadAhead,
    /// The item of each of the header's tensors (by position in file order), `NOT_PLANNED`
    /// where the plan left it out: a take finds its item through the header's own name index.
    item_of: Vec<usize>,
    delivered: Mutex<Handovers>,
    closed: AtomicBool,
    budget: u64,
    /// Bytes read by takes the read-ahead had not reached.
    read_by_takes: AtomicU64,
    makers: Makers,
}

impl Prefetch {
    /// A loader of `plan` (every tensor when None) of shard `shard` of `ckpt`, read ahead in
    /// `mode` (into the destinations `makers.allocate` makes, where it is given; None: nothing is
    /// read ahead, every take maps its view) with `opts`, at
    /// most `budget` bytes ahead.
    pub(super) fn start(
        (ckpt, shard): (Arc<Checkpoint>, usize),
        plan: Option<Vec<(String, Rows)>>,
        mode: Option<Mode>,
        makers: Makers,
        opts: ReadOptions,
        budget: u64,
    ) -> Result<Prefetch, Error> {
        let source = ckpt.shards[shard].clone();
        let items = prefetch::items(&source.header, plan.as_deref())?;
        let mut item_of = vec![NOT_PLANNED; source.header.tensors.len()];
        for (i, t) in items.iter().enumerate() {
            let at = source
                .header
                .index_of(&t.name)
                .expect("planned from the header");
            item_of[at] = i;
        }
        let n = items.len();
        let ahead = ReadAhead::eager(source.clone(), ckpt.tally(), items, mode, opts, budget);
        Ok(Prefetch {
            ckpt,
            shard,
            source,
            ahead,
            item_of,
            delivered: Mutex::new(Handovers::new(n)),
            closed: AtomicBool::new(false),
            budget,
            read_by_takes: AtomicU64::new(0),
            makers,
        })
    }

    fn check_open(&self) -> PyResult<()> {
        if self.closed.load(Ordering::Relaxed) {
            return Err(Error::Closed("the PrefetchLoader").into());
        }
        Ok(())
    }

    fn lock_delivered(&self) -> std::sync::MutexGuard<'_, Handovers> {
        self.delivered.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Item `i`, handed over once: see `take`.
    fn take_item(&self, py: Python<'_>, i: usize) -> PyResult<Py<PyAny>> {
        if !self.lock_delivered().claim(i) {
            return Err(PyErr::from(Error::Prefetch(format!(
                "{} was already delivered by this PrefetchLoader",
                self.ahead.items()[i].name
            ))));
        }
        let result = (|| {
            if let Some(allocate) = &self.makers.allocate
                && self.ahead.mode() == Mode::Provided
            {
                provided::provide(py, &self.ahead, i, allocate.bind(py))?;
            }
            let taken = match self.ahead.take_ready(i) {
                Some(ready) => ready?,
                // Nothing read ahead (a resident file's map): the view, made now.
                None if !self.ahead.reads() => None,
                None => detached(py, |poll| self.ahead.take(i, true, poll))?,
            };
            if let Some(bytes) = &taken
                && let Some(tensor) = provided::tensor(py, bytes)
            {
                return Ok(tensor);
            }
            let bytes = match taken {
                Some(bytes) => Bytes::new(bytes),
                None => self.read_now(py, i)?,
            };
            let item = &self.ahead.items()[i];
            let tuple = (
                item.name.clone(),
                item.dtype.code(),
                item.shape.clone(),
                bytes,
            );
            let Makers {
                importer, convert, ..
            } = &self.makers;
            let convert = convert.as_ref().map(|c| c.bind(py));
            Importer::made(py, importer.as_ref().map(Py::get), convert, tuple)
        })();
        if result.is_err() {
            self.lock_delivered().release(i);
        }
        result
    }

    /// Reads item `i` on the calling thread (the read-ahead has not reached it), as the
    /// checkpoint's plan reads a whole tensor (a view of the map, or owned memory), recorded in
    /// its totals.
    fn read_now(&self, py: Python<'_>, i: usize) -> PyResult<Bytes> {
        let item = &self.ahead.items()[i];
        let (mut read, stats) =
            detached(py, |poll| self.ckpt.read(&[(self.shard, item)], None, poll))?;
        self.read_by_takes.fetch_add(stats.bytes, Ordering::Relaxed);
        Ok(Bytes::new(read.pop().expect("one item, one read").0))
    }
}

#[pymethods]
impl Prefetch {
    /// The names in the plan, in file order.
    fn names(&self) -> Vec<String> {
        self.ahead.items().iter().map(|t| t.name.clone()).collect()
    }

    fn __len__(&self) -> usize {
        self.ahead.items().len()
    }

    /// The first item in file order not taken yet, taken (iteration): `(name, what take
    /// returns)`, or None when every item was taken.
    fn take_next(&self, py: Python<'_>) -> PyResult<Option<(String, Py<PyAny>)>> {
        self.check_open()?;
        let Some(i) = self.lock_delivered().first_pending() else {
            return Ok(None);
        };
        let tensor = self.take_item(py, i)?;
        Ok(Some((self.ahead.items()[i].name.clone(), tensor)))
    }

    /// Tensor `name` as planned: waits for its bytes (or reads them now if the read-ahead has
    /// not reached them). Returns the tensor the makers' `allocate` made for it when the loader
    /// reads into provided destinations (see `Handle.take_into`), else the tensor their
    /// `importer` makes of the bytes where it makes that dtype, else `convert(name, dtype code,
    /// shape, bytes)` (that tuple without `convert`).
    fn take(&self, py: Python<'_>, name: &str) -> PyResult<Py<PyAny>> {
        self.check_open()?;
        let planned = self.source.header.index_of(name).map(|at| self.item_of[at]);
        let Some(i) = planned.filter(|&i| i != NOT_PLANNED) else {
            return Err(PyErr::from(Error::Prefetch(format!(
                "{name} is not in the prefetch plan of {}",
                self.source.path.display()
            ))));
        };
        self.take_item(py, i)
    }

    /// Stops reading ahead and frees what was not taken; tensors handed out keep their memory.
    fn close(&self, py: Python<'_>) {
        self.closed.store(true, Ordering::Relaxed);
        py.detach(|| self.ahead.stop());
    }

    #[getter]
    fn closed(&self) -> bool {
        self.closed.load(Ordering::Relaxed)
    }

    /// Bytes read ahead and not taken yet.
    #[getter]
    fn held_bytes(&self) -> u64 {
        self.ahead.held_bytes()
    }

    /// The most bytes read ahead and not taken at once.
    #[getter]
    fn budget_bytes(&self) -> u64 {
        self.budget
    }

    /// Bytes read so far, by the read-ahead (into memory, or into the page cache for a mapped
    /// file) and by takes it had not reached.
    #[getter]
    fn bytes_read(&self) -> u64 {
        let totals = self.ahead.totals();
        totals.bytes_read + totals.hinted + self.read_by_takes.load(Ordering::Relaxed)
    }
}
