//! safeload: a fast, strict reader and writer of safetensors files.
//!
//! The core (everything but `py`) has no Python in it: header validation, dtypes, slicing,
//! read planning, the parallel pread engine and destination buffers. `py` is the thin PyO3
//! binding, built only with the `python` feature (maturin turns it on).
#![deny(unsafe_op_in_unsafe_fn)]

pub mod buffer;
pub mod checkpoint;
pub mod convert;
pub mod dtype;
pub mod engine;
pub mod error;
pub mod header;
pub mod memory;
pub mod plan;
pub mod platform;
pub mod pool;
pub mod prefetch;
pub mod readahead;
pub mod serialize;
pub mod slice;
pub mod source;
pub mod storage;

#[cfg(feature = "python")]
mod py;
