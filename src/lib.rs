//! safeload: a fast, strict reader and writer of safetensors files.
//!
//! The core (everything but `py`) has no Python in it. It is four layers, each a folder:
//! `format` (the file format: header, dtypes, conversions, the writer, slices, digests),
//! `storage` (where bytes live: local files and object stores), `read` (how they are read into
//! memory: the opened file, the plan, the parallel engine, strategies, buffers, read-ahead) and
//! `checkpoint` (which files make a checkpoint, its reads, verification, each rank's part), with
//! `platform` (every OS call), `error` and `redact` (URLs without their secrets) beneath them all. `py` is the thin PyO3 binding, built only with
//! the `python` feature (maturin turns it on).
//!
//! Modules are private; the Rust API is what is re-exported here. Most of the core is driven by
//! the binding, so the compiler's dead-code check is meaningful in the build that has it
//! (`cargo clippy --features python`); without it, code only the binding calls looks unused.
#![cfg_attr(not(feature = "python"), allow(dead_code))]

// The layers, each a folder whose mod.rs says what it owns and what it may use; a layer uses
// only those below it: format <- storage <- read <- checkpoint <- py (the binding).
mod checkpoint;
mod error;
mod format;
mod platform;
mod read;
mod redact;
mod storage;

#[cfg(feature = "python")]
mod py;

pub use checkpoint::{Checkpoint, Entry, Opening, ReadStats};
pub use error::{Error, Result};
pub use format::digest::{
    Digest, ManifestEntry, ManifestError, Sha256, manifest_line, parse_manifest,
};
pub use format::dtype::Dtype;
pub use format::header::{
    Header, HeaderError, TensorInfo, byte_size, header_len, parse as parse_header,
};
pub use format::serialize::{TensorIn, TensorLayout, to_bytes};
pub use read::buffer::TensorBytes;
pub use read::source::{ReadOptions, Source, hash_files};
pub use read::strategy::{Backend, Strategy};
pub use storage::write::{FileOut, Session, WriteOptions, to_file, write_files};
