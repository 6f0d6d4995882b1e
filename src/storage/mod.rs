//! Where bytes live: a local file or an object in a store (`backing`), the object stores
//! themselves (`remote`: S3, GCS, Azure, HTTP, the Hub), cancellation of the waits they make
//! (`cancel`) and URLs without their secrets in every message (`redact`). May use: `format`
//! (digests a store reports), `platform`, `error`. Nothing above this layer asks which kind of
//! storage it has; it asks the backing what it can do.

pub(crate) mod backing;
pub(crate) mod cancel;
pub(crate) mod redact;
pub(crate) mod remote;
