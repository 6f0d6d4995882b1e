//! The file format, and nothing about where a file lives or how it is read: the header parsed
//! and validated (`header`), dtypes (`dtype`) and their conversions (`convert`), the writer
//! (`serialize`), Python-style indices turned into byte rows (`slice`), the names an index may
//! give its files (`names`), SHA-256 digests and
//! `sha256sum` manifests (`digest`). May use: `error`, `platform` (the writer's files). Used by
//! every layer above.

pub(crate) mod convert;
pub(crate) mod digest;
pub(crate) mod dtype;
pub(crate) mod header;
pub(crate) mod names;
pub(crate) mod serialize;
pub(crate) mod slice;
