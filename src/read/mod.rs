//! How bytes are read into memory: an opened file (`source`), the offset-ordered plan of chunks
//! (`plan`) the parallel engine executes (`engine`) and what reads moved (`counts`), hashing as
//! it reads (`filehash`), the strategy a backend resolves to (`strategy`), destination memory
//! (`buffer`, `pool`, `memory`),
//! tensors pulled one at a time (`readahead`, `prefetch`) and accelerator staging (`staging`).
//! May use: `format`, `storage`, `platform`, `error`.

pub(crate) mod buffer;
pub(crate) mod counts;
pub(crate) mod engine;
pub(crate) mod filehash;
pub(crate) mod memory;
pub(crate) mod plan;
pub(crate) mod pool;
pub(crate) mod prefetch;
pub(crate) mod readahead;
pub(crate) mod source;
pub(crate) mod staging;
pub(crate) mod strategy;
