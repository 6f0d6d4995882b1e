//! Where bytes live: a location (a path or a URL) told apart once (`location`: a file or object
//! opened, the place a checkpoint's files are listed), a local file or an object in a store as a
//! reader sees it (`backing`), where a checkpoint's files are listed and small files read whole
//! (`place`: the file system; a store's in `remote`), the object stores themselves (`remote`: S3,
//! GCS, Azure, HTTP, the Hub), cancellation of the waits they make (`cancel`), and files written (`write`: a save's files
//! written side by side with positional writes, hashed as written, renamed into place). May use:
//! `format` (names an index may give, digests a store reports), `platform`, `error`, `redact`
//! (URLs without their secrets, beneath every layer: every message goes through it). Nothing above this layer asks which kind of
//! storage it has or whether a location is a URL; it asks what these answer.

pub(crate) mod backing;
pub(crate) mod cancel;
pub(crate) mod location;
pub(crate) mod place;
pub(crate) mod remote;
pub(crate) mod write;

pub use location::{open, place};
