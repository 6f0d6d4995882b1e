//! safeload: a fast, strict reader and writer of safetensors files.
//!
//! The core (everything but `py`) has no Python in it: header validation, dtypes, slicing,
//! read planning, the parallel pread engine and destination buffers. `py` is the thin PyO3
//! binding, built only with the `python` feature (maturin turns it on).
//!
//! Modules are private; the Rust API is what is re-exported here. Most of the core is driven by
//! the binding, so the compiler's dead-code check is meaningful in the build that has it
//! (`cargo clippy --features python`); without it, code only the binding calls looks unused.
#![cfg_attr(not(feature = "python"), allow(dead_code))]

mod backing;
mod buffer;
mod cancel;
mod checkpoint;
mod convert;
mod digest;
mod dtype;
mod engine;
mod error;
mod filehash;
mod header;
mod memory;
mod plan;
mod platform;
mod pool;
mod prefetch;
mod readahead;
mod record;
mod redact;
mod remote;
mod serialize;
mod shards;
mod shares;
mod slice;
mod source;
mod staging;
mod strategy;
mod stream;
mod verify;

#[cfg(feature = "python")]
mod py;

pub use buffer::TensorBytes;
pub use checkpoint::{Checkpoint, Entry, ReadStats};
pub use digest::{Digest, ManifestEntry, ManifestError, Sha256, manifest_line, parse_manifest};
pub use dtype::Dtype;
pub use error::{Error, Result};
pub use header::{Header, HeaderError, TensorInfo, byte_size, header_len, parse as parse_header};
pub use serialize::{TensorIn, to_bytes, to_file};
pub use source::{ReadOptions, Source, hash_files};
pub use strategy::{Backend, Strategy};
