//! Arguments as Python passes them, parsed once for every binding class: backend names, read
//! options, dtype codes; and the tuple a tensor crosses back as.

use pyo3::prelude::*;

use super::bytes::Bytes;
use super::errors::SafetensorError;
use crate::dtype::Dtype;
use crate::source::ReadOptions;
use crate::storage::Backend;

/// (name, dtype code, shape, bytes): what Python turns into a tensor.
pub(super) type TensorTuple = (String, &'static str, Vec<usize>, Bytes);

pub(super) fn parse_backend(name: &str) -> PyResult<Backend> {
    Backend::parse(name).ok_or_else(|| {
        SafetensorError::new_err(format!(
            "backend {name:?} is invalid (expected one of: {})",
            Backend::NAMES
        ))
    })
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
    }
}

pub(super) fn parse_dtype(code: Option<&str>) -> PyResult<Option<Dtype>> {
    code.map(|c| {
        Dtype::from_code(c).ok_or_else(|| SafetensorError::new_err(format!("dtype {c} is invalid")))
    })
    .transpose()
}
