//! An opened checkpoint file: its validated header, and the ways to get tensor bytes out of it
//! (parallel pread into owned buffers, a private map, or the byte rows of a slice).
//!
//! Here: the file (a local file or an object in a store alike: the storage layer opens it and
//! says what it can do; one open path, its header read through its backing), its strategy, its
//! map and its hash; a slice's rows and spans of the data area in `ranges`, whole tensors (typed
//! targets, new memory, map views) in `tensors`, whole files read for their digests in
//! `digests`.

use std::path::{Path, PathBuf};

pub use crate::storage::backing::Backing;
use std::sync::{Arc, OnceLock};

use crate::error::{Error, Result};
use crate::format::digest::Digest;
use crate::format::header::{self, Header, TensorInfo};
use crate::platform::FsKind;
use crate::platform::{self, Uncached};
use crate::read::buffer::{self, Region, TensorBytes};
use crate::read::counts::ReadCounts;
use crate::read::engine::{self, Input, Settings};
use crate::read::filehash::{self, FileHash};
use crate::read::strategy::{self, Strategy};

mod digests;
mod ranges;
mod tensors;

pub use digests::hash_files;
pub use ranges::Part;
pub(crate) use ranges::read_data_ranges;
pub(crate) use tensors::{Target, Tensors, check_fits, read_or_map, read_targets};

/// Tuning of a read.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReadOptions {
    /// Workers; None picks from the cores and the filesystem.
    pub threads: Option<usize>,
    /// Bytes per read request; None picks from the filesystem.
    pub chunk_bytes: Option<usize>,
    /// Drop the files' pages from the page cache after reading (load-once hygiene).
    pub drop_cache: bool,
    /// Reads feed the SHA-256 of the files whose hash was started ([`Source::start_hash`]);
    /// such reads are never maps.
    pub hash: bool,
}

impl ReadOptions {
    /// Whether the reader must read the files' bytes itself (a map reads none): to drop their
    /// pages after, or to hash them.
    pub fn reads_bytes(&self) -> bool {
        self.drop_cache || self.hash
    }
}

pub struct Source {
    /// The file's path, or the object's URL.
    pub path: PathBuf,
    pub backing: Backing,
    pub file_len: u64,
    pub header: Header,
    pub kind: FsKind,
    /// The 8-byte prefix and the JSON header, exactly as read and parsed: a digest of the file
    /// starts with them.
    head: Box<[u8]>,
    map: OnceLock<Arc<Region>>,
    direct: OnceLock<Option<Uncached>>,
    /// The file's SHA-256 so far, when started.
    hash: filehash::Slot,
    /// Set once parts of the file are read by range: the kernel is told to read only what is
    /// asked (`platform::advise_random`).
    exact: std::sync::Once,
}

impl Source {
    /// Opens `path` and validates its header; nothing is allocated from header fields before that.
    pub fn open(path: &Path) -> Result<Source> {
        Self::open_with(path, &[])
    }

    /// [`Source::open`] of a path or a URL (`s3://`, `gs://`, `az://`, `http(s)://`, `hf://`),
    /// with the store's `storage_options` (ignored for paths): opened by the storage layer
    /// (`storage::open`), its prefix and header then read through its backing, on from
    /// what the opening brought (an object's opening GET: often all of it).
    pub fn open_with(path: &Path, options: &crate::storage::remote::Options) -> Result<Source> {
        let mut opened = crate::storage::open(path, options)?;
        let header_err = |reason| Error::header(Some(path), reason);
        opened.read_start(path, 8)?;
        let prefix = &opened.start[..opened.start.len().min(8)];
        let json_len = header::header_len(prefix, opened.len).map_err(header_err)?;
        let header_end = 8 + json_len as usize;
        opened.read_start(path, header_end)?;
        if opened.start.len() < header_end {
            return Err(header_err(header::HeaderError::InvalidHeaderLength));
        }
        // The opening GET may have brought some of the data too: the source keeps the prefix
        // and header alone (what a digest of the file starts with).
        let mut head = opened.start;
        head.truncate(header_end);
        head.shrink_to_fit();
        Source::new(path, opened.kind, opened.backing, opened.len, head)
    }

    /// The source of a file of `file_len` bytes starting with `head` (its prefix and header),
    /// once the header is parsed.
    fn new(
        path: &Path,
        kind: FsKind,
        backing: Backing,
        file_len: u64,
        head: Vec<u8>,
    ) -> Result<Source> {
        let header_err = |reason| Error::header(Some(path), reason);
        let header = header::parse(&head[8..], file_len).map_err(header_err)?;
        Ok(Source {
            path: path.to_path_buf(),
            kind,
            backing,
            file_len,
            header,
            head: head.into_boxed_slice(),
            map: OnceLock::new(),
            direct: OnceLock::new(),
            hash: filehash::Slot::default(),
            exact: std::sync::Once::new(),
        })
    }

    /// Starts (or starts again) the file's SHA-256: its prefix and header now, its data as
    /// reads with [`ReadOptions::hash`] cover it in file order, each byte once.
    pub fn start_hash(&self) {
        let hash = FileHash::start(&self.head, self.file_len);
        *self.hash.lock().unwrap_or_else(|p| p.into_inner()) = Some(hash);
    }

    /// Stops the file's SHA-256: reads no longer feed it.
    pub fn stop_hash(&self) {
        *self.hash.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// The file's SHA-256, when its reads since [`Source::start_hash`] covered every byte; else
    /// an error naming the range not read. Hashing ends either way.
    pub fn finish_hash(&self) -> Result<Digest> {
        let hash = self.hash.lock().unwrap_or_else(|p| p.into_inner()).take();
        let hash = hash.ok_or_else(|| {
            Error::Internal(format!(
                "the SHA-256 of {} was not started",
                self.path.display()
            ))
        })?;
        hash.finish().map_err(|missing| Error::Unhashed {
            path: self.path.clone(),
            from: missing.from,
            to: missing.to,
            len: self.file_len,
        })
    }

    /// The SHA-256 the file's store reported when it was opened, and which of its headers said
    /// it (`hf://` and Hub `resolve` URLs: the Hub's `X-Linked-Etag` of an LFS or Xet file);
    /// taken from the opening request's answer, never asked for again. None for a local file,
    /// for stores that report none, and for a Hub file kept in git (its ETag is a git blob id).
    pub fn reported_digest(&self) -> Option<(Digest, String)> {
        (self.backing.reported_digest()).map(|(digest, from)| (digest, from.to_string()))
    }

    /// What the read plan needs to know of this file (`strategy::resolve`); `reads_bytes`:
    /// the read must pass its bytes through the reader ([`ReadOptions::reads_bytes`]).
    pub fn facts(&self, reads_bytes: bool) -> strategy::Facts {
        strategy::Facts {
            kind: self.kind,
            can_map: self.backing.can_map(),
            data_len: self.header.data_len(),
            reads_bytes,
        }
    }

    /// Fraction (0..=1) of the data area in the page cache now, sampled; None where it cannot
    /// be told (an object in a store, a platform without `mincore`).
    pub fn cached(&self) -> Option<f64> {
        let file = self.backing.file()?;
        strategy::cached_fraction(file, self.header.data_start(), self.header.data_len())
    }

    /// The file opened to read around the page cache, or None where that is refused.
    fn direct_file(&self) -> Option<&Uncached> {
        self.direct
            .get_or_init(|| platform::open_uncached(&self.path))
            .as_ref()
    }

    pub fn tensor(&self, name: &str) -> Result<&TensorInfo> {
        self.header.get(name).ok_or_else(|| Error::TensorNotFound {
            name: name.to_string(),
        })
    }

    fn input(&self, strategy: Strategy, opts: &ReadOptions) -> Input<'_> {
        Input {
            path: &self.path,
            backing: &self.backing,
            direct: if strategy == Strategy::Direct {
                self.direct_file()
            } else {
                None
            },
            hash: opts.hash.then_some(&self.hash),
        }
    }

    /// Bytes of a tensor as a view of a private (copy-on-write) map of the file: lazy, zero-copy.
    /// Falls back to a copy when the tensor is not aligned to its element size in the file.
    pub fn map_tensor(&self, info: &TensorInfo) -> Result<TensorBytes> {
        if info.nbytes() == 0 {
            return Ok(TensorBytes::empty());
        }
        let span = self.map_span(&info.name, info.begin, info.end)?;
        self.view(span.region().expect("a view of the map"), info)
    }

    /// [`Source::map_tensor`] of several tensors, the file's length checked once for them all
    /// (one `lseek`, against the furthest end: see [`Source::map_span`]).
    pub fn map_tensors(&self, infos: &[&TensorInfo]) -> Result<Vec<TensorBytes>> {
        let furthest = infos
            .iter()
            .filter(|t| t.nbytes() > 0)
            .max_by_key(|t| t.end);
        let Some(furthest) = furthest else {
            return Ok(infos.iter().map(|_| TensorBytes::empty()).collect());
        };
        let span = self.map_span(&furthest.name, furthest.begin, furthest.end)?;
        let map = span.region().expect("a view of the map");
        infos.iter().map(|t| self.view(map, t)).collect()
    }

    /// Tensor `info` in `map` (which covers it: checked by the caller).
    fn view(&self, map: &Arc<Region>, info: &TensorInfo) -> Result<TensorBytes> {
        if info.nbytes() == 0 {
            return Ok(TensorBytes::empty());
        }
        let at = self.header.data_start() as usize + info.begin;
        let bytes = TensorBytes::new(map.clone(), at, info.nbytes());
        let align = (info.dtype.bits() / 8).clamp(1, 8);
        if (bytes.as_mut_ptr() as usize).is_multiple_of(align) {
            return Ok(bytes);
        }
        let mut copy = buffer::allocate(&[info.nbytes()])
            .map_err(|e| self.read_err(info, e))?
            .pop()
            .expect("one size, one buffer");
        copy.as_mut_slice().copy_from_slice(bytes.as_slice());
        Ok(copy.into_shared())
    }

    /// Data bytes `[begin, end)` (offsets into the data area, as tensors' `data_offsets`) as a
    /// view of the file's private map, whatever their alignment; `tensor` names them in errors.
    /// A file that is shorter now than it was at open is an error, never a view whose touch
    /// would raise SIGBUS (views handed out earlier keep safetensors 0.8's behaviour).
    pub fn map_span(&self, tensor: &str, begin: usize, end: usize) -> Result<TensorBytes> {
        self.map_span_to_populate(tensor, begin, end)?
            .checked(tensor)
    }

    /// [`Source::map_span`] without asking whether the file still covers it: for making pages
    /// resident only (`MADV_POPULATE_READ` reports a page past the end of the file as an error,
    /// not a signal), never for bytes anyone reads. The map itself covers it (checked).
    pub fn map_span_to_populate(
        &self,
        tensor: &str,
        begin: usize,
        end: usize,
    ) -> Result<TensorBytes> {
        let map = self.mapping()?;
        let at = self.header.data_start() as usize + begin;
        let len = end - begin;
        if at + len > map.len() {
            return Err(self.shrank(tensor, map.len() as u64));
        }
        Ok(TensorBytes::new(map, at, len))
    }

    fn shrank(&self, tensor: &str, len: u64) -> Error {
        Error::Shrank {
            path: self.path.clone(),
            tensor: tensor.to_string(),
            len,
            was: self.file_len,
        }
    }

    fn mapping(&self) -> Result<Arc<Region>> {
        if let Some(map) = self.map.get() {
            return Ok(map.clone());
        }
        let open_err = |source| Error::Open {
            path: self.path.clone(),
            source,
        };
        let not_a_file =
            || std::io::Error::new(std::io::ErrorKind::Unsupported, "not a local file");
        let file = self.backing.file().ok_or_else(|| open_err(not_a_file()))?;
        // SAFETY: a private mapping; our writes never reach the file. A file truncated under the
        // map is caught before a view is handed out (`TensorBytes::checked`); a view handed out earlier and
        // touched after the truncation raises SIGBUS, as safetensors 0.8's maps do (docs/backends.md).
        let map = unsafe { memmap2::MmapOptions::new().map_copy(file) }.map_err(open_err)?;
        let file = file.try_clone().map_err(open_err)?;
        // Faults read ahead further (what safetensors 0.8 advises on its maps too).
        platform::advise_sequential(&file);
        let region = Region::Map {
            map,
            file,
            path: self.path.clone(),
            was: self.file_len,
        };
        Ok(self.map.get_or_init(|| Arc::new(region)).clone())
    }

    fn read_err(&self, info: &TensorInfo, source: std::io::Error) -> Error {
        Error::Read {
            path: self.path.clone(),
            tensor: info.name.clone(),
            offset: self.header.data_start() + info.begin as u64,
            source,
        }
    }
}

/// The SHA-256 of each of `sources` over what `read` reads: the one place a read is hashed.
/// Each file's hash is started (its prefix and header now), `read` runs (its reads feed the
/// hashes, every byte once, in file order, where its options ask: [`ReadOptions::hash`]), then
/// each is finished: its digest, or an error naming the range `read` left unread. What `read`
/// returned is given back only with every digest.
pub fn hashed<T>(
    sources: &[&Source],
    read: impl FnOnce() -> Result<T>,
) -> Result<(T, Vec<Digest>)> {
    sources.iter().for_each(|s| s.start_hash());
    let out = read();
    let digests: Result<Vec<Digest>> = sources.iter().map(|s| s.finish_hash()).collect();
    Ok((out?, digests?))
}

/// The chunk size for these sources: the caller's, else one suited to the slowest filesystem.
pub fn chunk_bytes(sources: &[&Source], opts: &ReadOptions) -> usize {
    let kind = sources
        .iter()
        .map(|s| s.kind)
        .find(|k| matches!(k, FsKind::Network(_)));
    let storage = sources.iter().find_map(|s| s.backing.defaults());
    opts.chunk_bytes.unwrap_or_else(|| match storage {
        Some((_, chunk_bytes)) => chunk_bytes,
        None => strategy::chunk_bytes_for(kind.unwrap_or(FsKind::Local)),
    })
}

/// The workers a read of these sources runs: the caller's count, else one suited to the slowest
/// filesystem.
pub fn threads(sources: &[&Source], opts: &ReadOptions) -> usize {
    settings(sources, opts).threads
}

/// Runs `plan` over `sources`, each read with its strategy in `strategies` (one per source:
/// Pread or Direct): the one way a read asks the engine, so every read notes uncached reads
/// refused (a file that could not be opened for them is read buffered) and honours `drop_cache`
/// alike.
fn execute(
    sources: &[&Source],
    plan: &crate::read::plan::ChunkPlan<'_>,
    strategies: &[Strategy],
    opts: &ReadOptions,
    poll: &mut dyn FnMut() -> bool,
) -> Result<ReadCounts> {
    let inputs: Vec<Input<'_>> = (sources.iter().zip(strategies))
        .map(|(s, strategy)| s.input(*strategy, opts))
        .collect();
    let mut settings = settings(sources, opts);
    let waits = sources.iter().any(|s| s.backing.may_wait_long());
    settings.inline = strategy::runs_inline(waits, settings.threads, plan.total_bytes());
    let mut report = engine::execute(&inputs, plan, settings, poll)?;
    report.direct_refused |= (inputs.iter().zip(strategies))
        .any(|(i, strategy)| *strategy == Strategy::Direct && i.direct.is_none());
    if opts.drop_cache {
        (sources.iter())
            .filter_map(|s| s.backing.file())
            .for_each(strategy::drop_cached);
    }
    Ok(report)
}

fn settings(sources: &[&Source], opts: &ReadOptions) -> Settings {
    let network = sources
        .iter()
        .find(|s| matches!(s.kind, FsKind::Network(_)));
    let cores = strategy::default_threads();
    Settings {
        threads: opts.threads.unwrap_or_else(|| {
            if let Some((threads, _)) = sources.iter().find_map(|s| s.backing.defaults()) {
                return threads;
            }
            let kind = network.map_or(FsKind::Local, |s| s.kind);
            let in_flight = network
                .and_then(|s| s.backing.file())
                .and_then(platform::fuse_requests_in_flight);
            strategy::threads_for(kind, cores, in_flight)
        }),
        own_fds: network.is_some() || !platform::PARALLEL_READS_SHARE_HANDLE,
        inline: false,
    }
}
