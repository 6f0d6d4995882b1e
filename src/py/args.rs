//! Arguments as Python passes them, parsed once for every binding class: backend names, read
//! options, dtype codes, `[...]` keys; and the tuple a tensor crosses back as.

use pyo3::exceptions::{PyIndexError, PyOverflowError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyInt, PyList, PySlice, PyTuple};

use crate::error::Error;
use crate::format::dtype::Dtype;
use crate::format::slice::{Bounds, Index};
use crate::read::source::ReadOptions;
use crate::read::strategy::Backend;

/// A `backend=` argument: a str naming one of [`Backend::NAMES`] ("auto" gives way to
/// `$SAFELOAD_BACKEND`: [`Backend::requested`]); anything else is a `TypeError`, as 0.8's typed
/// arguments raise.
pub(super) struct BackendArg(pub Backend);

impl<'py> FromPyObject<'_, 'py> for BackendArg {
    type Error = PyErr;

    fn extract(ob: Borrowed<'_, 'py, PyAny>) -> PyResult<Self> {
        let name = ob.extract::<String>().map_err(|_| {
            let kind = ob.get_type().name().map_or("?".into(), |n| n.to_string());
            PyTypeError::new_err(format!("{kind:?} object is not a str").replace('"', "'"))
        })?;
        Ok(BackendArg(Backend::requested(&name)?))
    }
}

impl BackendArg {
    /// The backend given, else the default ("auto", or `$SAFELOAD_BACKEND`).
    pub(super) fn or_default(given: Option<BackendArg>) -> PyResult<Backend> {
        match given {
            Some(BackendArg(backend)) => Ok(backend),
            None => Ok(Backend::requested(Backend::Auto.name())?),
        }
    }
}

/// What a caller names as a checkpoint: one place (a file, a directory, an index.json, a URL
/// or a prefix; str or os.PathLike), resolved in the core by `checkpoint::files`' rule; or a list or tuple
/// of shard files, read as given.
#[derive(FromPyObject)]
pub(super) enum CheckpointArg {
    At(std::path::PathBuf),
    Files(Vec<std::path::PathBuf>),
}

/// `verify=` as Python passes it: False (off), True (the digests the source knows, a file with
/// none an error), a `{name: digest}` mapping, or a manifest's path (`str` or `os.PathLike`);
/// None (not given) leaves it to `SAFELOAD_VERIFY` ([`VerifyArg::pin`]). Anything else is
/// refused.
#[derive(Clone)]
pub(super) struct VerifyArg(Option<crate::checkpoint::verify::Pin>);

impl VerifyArg {
    /// What `verify` asks for (not given: what `SAFELOAD_VERIFY` asks for), and the backend to
    /// open with: `backend` as given, but where `SAFELOAD_VERIFY` turns verification on for a
    /// caller that asked for "mmap" (transformers passes it to every `safe_open`), "auto": a
    /// verified file is read, never mapped, and the variable is the user's word over the
    /// library's. The same two given by one caller are refused at open.
    pub(super) fn pin(
        verify: Option<VerifyArg>,
        backend: Backend,
    ) -> PyResult<(Option<crate::checkpoint::verify::Pin>, Backend)> {
        match verify {
            Some(v) => Ok((v.0, backend)),
            None => match crate::checkpoint::verify::Pin::from_env()? {
                Some(pin) => Ok((Some(pin), backend.pinned_by_env())),
                None => Ok((None, backend)),
            },
        }
    }
}

impl<'py> FromPyObject<'_, 'py> for VerifyArg {
    type Error = PyErr;

    fn extract(ob: Borrowed<'_, 'py, PyAny>) -> PyResult<Self> {
        use crate::checkpoint::verify::Pin;
        use pyo3::types::{PyBool, PyDict};
        if ob.is_none() {
            return Ok(VerifyArg(None));
        }
        if let Ok(flag) = ob.cast::<PyBool>() {
            return Ok(VerifyArg(
                flag.is_true().then_some(Pin::Known { strict: true }),
            ));
        }
        if let Ok(mapping) = ob.cast::<PyDict>() {
            let pairs = (mapping.iter())
                .map(|(k, v)| Ok((k.extract::<String>()?, v.extract::<String>()?)))
                .collect::<PyResult<Vec<_>>>()
                .map_err(|_| {
                    Error::Argument("verify: a mapping of file names to digests (str: str)".into())
                })?;
            return Ok(VerifyArg(Some(Pin::Mapping(pairs))));
        }
        if let Ok(path) = ob.extract::<std::path::PathBuf>() {
            return Ok(VerifyArg(Some(Pin::Manifest(path))));
        }
        Err(Error::Argument(format!(
            "verify= takes None, True, a {{name: digest}} mapping or a manifest's path, not {}",
            ob.get_type().name()?
        ))
        .into())
    }
}

/// The verified record a pinned open uses: `verify_cache` (a directory) when given, else
/// `$SAFELOAD_VERIFY_CACHE`; none without a pin (`verify_cache=` alone is refused: there is
/// nothing to remember).
pub(super) fn verify_record(
    verify_cache: Option<std::path::PathBuf>,
    pin: Option<&crate::checkpoint::verify::Pin>,
) -> PyResult<Option<crate::checkpoint::record::Record>> {
    match (verify_cache, pin) {
        (Some(_), None) => Err(Error::Argument(
            "verify_cache= remembers files that hashed right under verify= (or SAFELOAD_VERIFY); \
             without either there is nothing to remember"
                .into(),
        )
        .into()),
        (Some(dir), Some(_)) => Ok(Some(crate::checkpoint::record::Record::open(&dir)?)),
        (None, Some(_)) => Ok(crate::checkpoint::record::Record::from_env()?),
        (None, None) => Ok(None),
    }
}

pub(super) fn options(
    threads: Option<usize>,
    chunk_bytes: Option<usize>,
    drop_cache: bool,
) -> ReadOptions {
    ReadOptions {
        threads: threads.map(|t| t.max(1)),
        chunk_bytes,
        drop_cache,
        hash: false,
    }
}

pub(super) fn parse_dtype(code: Option<&str>) -> PyResult<Option<Dtype>> {
    code.map(|c| {
        Dtype::from_code(c).ok_or_else(|| Error::Argument(format!("dtype {c} is invalid")).into())
    })
    .transpose()
}

/// `"strict"` (numpy, 0.8's pread rule) or `"clamp"` (torch): see [`Bounds`].
pub(super) fn parse_bounds(name: &str) -> PyResult<Bounds> {
    match name {
        "strict" => Ok(Bounds::Strict),
        "clamp" => Ok(Bounds::Clamp),
        _ => Err(PyValueError::new_err(format!(
            "bounds {name:?} is invalid (expected \"strict\" or \"clamp\")"
        ))),
    }
}

/// A `[...]` key as Python hands it to `__getitem__` (an int, a slice, `...`, a tuple of those,
/// or an empty list) over a tensor of `ndim` dimensions: one [`Index`] per leading dimension,
/// `...` expanded. Ints are anything with `__index__`; one past `i64` is clamped to it (it is
/// out of range, or a step that takes one element, either way).
pub(super) fn parse_key(key: &Bound<'_, PyAny>, ndim: usize) -> PyResult<Vec<Index>> {
    let py = key.py();
    let items: Vec<Bound<'_, PyAny>> = if let Ok(list) = key.cast::<PyList>() {
        if !list.is_empty() {
            return Err(Error::Slice("Non empty lists are not implemented".into()).into());
        }
        return Ok(vec![Index::Range {
            start: Some(0),
            stop: Some(0),
            step: 1,
        }]);
    } else if let Ok(tuple) = key.cast::<PyTuple>() {
        tuple.iter().collect()
    } else {
        vec![key.clone()]
    };
    let ellipsis = py.Ellipsis();
    let dots = items.iter().filter(|k| k.is(&ellipsis)).count();
    if dots > 1 {
        return Err(PyIndexError::new_err(
            "an index can only have a single ellipsis ('...')",
        ));
    }
    let fill = (ndim + 1).saturating_sub(items.len());
    let mut out = Vec::with_capacity(items.len().max(ndim));
    for item in &items {
        if item.is(&ellipsis) {
            out.extend((0..fill).map(|_| Index::Range {
                start: None,
                stop: None,
                step: 1,
            }));
        } else if let Ok(s) = item.cast::<PySlice>() {
            let bound = |attr: &str| -> PyResult<Option<i64>> {
                let v = s.getattr(attr)?;
                if v.is_none() {
                    Ok(None)
                } else {
                    index_int(&v).map(Some)
                }
            };
            out.push(Index::Range {
                start: bound("start")?,
                stop: bound("stop")?,
                step: bound("step")?.unwrap_or(1),
            });
        } else if item.is_none() {
            return Err(PyTypeError::new_err(
                "None (newaxis) is not supported in safetensors slices",
            ));
        } else {
            let i = index_int(item).map_err(|e| {
                if e.is_instance_of::<PyTypeError>(py) {
                    PyTypeError::new_err(format!(
                        "slice index must be an int, a slice or '...', not {}",
                        item.get_type()
                            .name()
                            .map_or_else(|_| "?".into(), |n| n.to_string())
                    ))
                } else {
                    e
                }
            })?;
            out.push(Index::Select(i));
        }
    }
    Ok(out)
}

/// `operator.index(v)` as an `i64`, clamped to it.
fn index_int(v: &Bound<'_, PyAny>) -> PyResult<i64> {
    let py = v.py();
    let int = if v.is_instance_of::<PyInt>() {
        v.clone()
    } else {
        py.import("operator")?.call_method1("index", (v,))?
    };
    match int.extract::<i64>() {
        Err(e) if e.is_instance_of::<PyOverflowError>(py) => {
            Ok(if int.lt(0)? { i64::MIN } else { i64::MAX })
        }
        other => other,
    }
}
