//! An opened checkpoint file: its validated header, and the ways to get tensor bytes out of it
//! (parallel pread into owned buffers, a private map, or the byte rows of a slice).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use crate::buffer::{self, Fresh, Storage, TensorBytes};
use crate::dtype::Dtype;
use crate::engine::{self, Input, Report, Settings};
use crate::error::{Error, Result};
use crate::header::{self, Header, TensorInfo};
use crate::plan::Plan;
use crate::platform::{self, Uncached, read_fully_at};
use crate::slice::SlicePlan;
use crate::storage::{self, Backend, FsKind, Strategy};

/// Tuning of a read.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReadOptions {
    /// Workers; None picks from the cores and the filesystem.
    pub threads: Option<usize>,
    /// Bytes per read request; None picks from the filesystem.
    pub chunk_bytes: Option<usize>,
    /// Drop the files' pages from the page cache after reading (load-once hygiene).
    pub drop_cache: bool,
}

pub struct Source {
    pub path: PathBuf,
    pub file: File,
    pub file_len: u64,
    pub header: Header,
    pub kind: FsKind,
    map: OnceLock<Arc<Storage>>,
    direct: OnceLock<Option<Uncached>>,
}

/// Slices with runs at least this long are read straight into the output; shorter runs are
/// gathered from one read of the span around them.
const DIRECT_RUN_BYTES: usize = 64 << 10;
/// Small runs closer than this are read together.
const GATHER_GAP_BYTES: usize = 16 << 10;

impl Source {
    /// Opens `path` and validates its header; nothing is allocated from header fields before that.
    pub fn open(path: &Path) -> Result<Source> {
        let open_err = |source| Error::Open {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(open_err)?;
        let meta = file.metadata().map_err(open_err)?;
        if meta.is_dir() {
            return Err(open_err(std::io::Error::new(
                std::io::ErrorKind::IsADirectory,
                "Is a directory",
            )));
        }
        let file_len = meta.len();
        let header_err = |reason| Error::header(Some(path), reason);
        let mut prefix = [0u8; 8];
        let got = read_fully_at(&file, &mut prefix, 0).map_err(open_err)?;
        let json_len = header::header_len(&prefix[..got], file_len).map_err(header_err)?;
        let mut json = vec![0u8; json_len as usize];
        let got = read_fully_at(&file, &mut json, 8).map_err(open_err)?;
        if got < json.len() {
            return Err(header_err(header::HeaderError::InvalidHeaderLength));
        }
        let header = header::parse(&json, file_len).map_err(header_err)?;
        Ok(Source {
            path: path.to_path_buf(),
            kind: FsKind::of(&file, path),
            file,
            file_len,
            header,
            map: OnceLock::new(),
            direct: OnceLock::new(),
        })
    }

    /// The strategy a backend request means for this file ("auto" looks at the filesystem and
    /// at how much of the data is in the page cache).
    pub fn resolve(&self, backend: Backend) -> Strategy {
        self.resolve_measured(backend).0
    }

    /// [`Source::resolve`], with the page-cache residency "auto" measured for it (None when it
    /// was not measured or cannot be told), so a caller can reuse the one probe.
    pub fn resolve_measured(&self, backend: Backend) -> (Strategy, Option<f64>) {
        match backend {
            // Never a map on a network filesystem, even when asked for one: every fault would be
            // a small remote read, and a file that shrinks under a map kills the process. The
            // network reader gives the same tensors.
            Backend::Mmap if !matches!(self.kind, FsKind::Network(_)) => (Strategy::Mmap, None),
            Backend::Pread => (Strategy::Pread, None),
            Backend::Direct => (Strategy::Direct, None),
            Backend::Auto | Backend::Mmap => {
                let cached = storage::cached_fraction(
                    &self.file,
                    self.header.data_start(),
                    self.header.data_len(),
                );
                let available = crate::memory::available();
                let strategy = storage::choose(
                    self.kind,
                    cached,
                    self.header.data_len(),
                    storage::direct_above(available),
                    storage::auto_may_map(),
                    available,
                );
                (strategy, cached)
            }
        }
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

    fn input(&self, strategy: Strategy) -> Input<'_> {
        Input {
            path: &self.path,
            file: &self.file,
            direct: if strategy == Strategy::Direct {
                self.direct_file()
            } else {
                None
            },
        }
    }

    /// Bytes of a tensor as a view of a private (copy-on-write) map of the file: lazy, zero-copy.
    /// Falls back to a copy when the tensor is not aligned to its element size in the file.
    pub fn map_tensor(&self, info: &TensorInfo) -> Result<TensorBytes> {
        if info.nbytes() == 0 {
            return Ok(TensorBytes::empty());
        }
        let bytes = self.map_span(info.begin, info.end)?;
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
    /// view of the file's private map, whatever their alignment.
    pub fn map_span(&self, begin: usize, end: usize) -> Result<TensorBytes> {
        let map = self.mapping()?;
        Ok(TensorBytes::new(
            map,
            self.header.data_start() as usize + begin,
            end - begin,
        ))
    }

    fn mapping(&self) -> Result<Arc<Storage>> {
        if let Some(map) = self.map.get() {
            return Ok(map.clone());
        }
        // SAFETY: a private mapping; our writes never reach the file. Another process truncating
        // the file under the map is the documented risk of the mmap backend (SIGBUS).
        let map =
            unsafe { memmap2::MmapOptions::new().map_copy(&self.file) }.map_err(|source| {
                Error::Open {
                    path: self.path.clone(),
                    source,
                }
            })?;
        // Faults read ahead further (what safetensors 0.8 advises on its maps too).
        platform::advise_sequential(&self.file);
        Ok(self.map.get_or_init(|| Arc::new(Storage::Map(map))).clone())
    }

    fn read_err(&self, info: &TensorInfo, source: std::io::Error) -> Error {
        Error::Read {
            path: self.path.clone(),
            tensor: info.name.clone(),
            offset: self.header.data_start() + info.begin as u64,
            source,
        }
    }

    /// Reads the rows of `plan` (a slice of tensor `info`) into a new buffer; returns it and the
    /// read's report (the bytes read from the file, gathered spans included).
    pub fn read_slice(
        &self,
        info: &TensorInfo,
        plan: &SlicePlan,
        opts: &ReadOptions,
        poll: &mut dyn FnMut() -> bool,
    ) -> Result<(TensorBytes, Report)> {
        let mut out = buffer::allocate(&[plan.nbytes])
            .map_err(|e| self.read_err(info, e))?
            .pop()
            .expect("one size, one buffer");
        let base = self.header.data_start() + info.begin as u64;
        let mut direct = Plan::new(chunk_bytes(&[self], opts));
        // Small runs: (file offset, destination), gathered by span below.
        let mut small: Vec<(u64, &mut [u8])> = Vec::new();
        let mut rest: &mut [u8] = out.as_mut_slice();
        for row in &plan.rows {
            for r in 0..row.count {
                let at = base + (row.offset + r * row.stride_bytes) as u64;
                let (dest, tail) = std::mem::take(&mut rest).split_at_mut(row.run_bytes);
                rest = tail;
                if row.run_bytes >= DIRECT_RUN_BYTES || (row.count == 1 && row.run_bytes >= 4096) {
                    direct.add(0, at, dest, &info.name);
                } else {
                    small.push((at, dest));
                }
            }
        }
        let mut report = engine::execute(
            &[self.input(Strategy::Pread)],
            &direct,
            settings(&[self], opts),
            poll,
        )?;
        drop(direct);
        report.bytes += self.gather_small(info, &mut small)?;
        Ok((out.into_shared(), report))
    }

    /// Reads small runs (file offset, destination), in file order, a span of neighbours at a
    /// time into a scratch buffer, and copies each run out; returns the bytes read.
    fn gather_small(&self, info: &TensorInfo, runs: &mut [(u64, &mut [u8])]) -> Result<u64> {
        let mut read = 0u64;
        let mut scratch = Vec::new();
        let mut i = 0;
        while i < runs.len() {
            let start = runs[i].0;
            let mut end_run = i;
            let mut span_end = start + runs[i].1.len() as u64;
            while end_run + 1 < runs.len() {
                let (next_at, ref next) = runs[end_run + 1];
                let next_end = next_at + next.len() as u64;
                if next_at < span_end
                    || next_at - span_end > GATHER_GAP_BYTES as u64
                    || next_end - start > (4 << 20)
                {
                    break;
                }
                end_run += 1;
                span_end = next_end;
            }
            scratch.resize((span_end - start) as usize, 0);
            let got = read_fully_at(&self.file, &mut scratch, start)
                .map_err(|e| self.read_err(info, e))?;
            if got < scratch.len() {
                return Err(self.read_err(
                    info,
                    std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "file ended early"),
                ));
            }
            for (at, dest) in runs[i..=end_run].iter_mut() {
                let from = (*at - start) as usize;
                dest.copy_from_slice(&scratch[from..from + dest.len()]);
            }
            read += scratch.len() as u64;
            i = end_run + 1;
        }
        Ok(read)
    }
}

/// The chunk size for these sources: the caller's, else one suited to the slowest filesystem.
pub fn chunk_bytes(sources: &[&Source], opts: &ReadOptions) -> usize {
    let kind = sources
        .iter()
        .map(|s| s.kind)
        .find(|k| matches!(k, FsKind::Network(_)));
    opts.chunk_bytes
        .unwrap_or_else(|| storage::chunk_bytes_for(kind.unwrap_or(FsKind::Local)))
}

/// The workers a read of these sources runs: the caller's count, else one suited to the slowest
/// filesystem.
pub fn threads(sources: &[&Source], opts: &ReadOptions) -> usize {
    settings(sources, opts).threads
}

fn settings(sources: &[&Source], opts: &ReadOptions) -> Settings {
    let network = sources
        .iter()
        .find(|s| matches!(s.kind, FsKind::Network(_)));
    let cores = engine::default_threads();
    Settings {
        threads: opts.threads.unwrap_or_else(|| {
            let kind = network.map_or(FsKind::Local, |s| s.kind);
            let in_flight = network.and_then(|s| platform::fuse_requests_in_flight(&s.file));
            storage::threads_for(kind, cores, in_flight)
        }),
        own_fds: network.is_some() || !platform::PARALLEL_READS_SHARE_HANDLE,
    }
}

/// Reads tensor data starting `offset` bytes into the data area into `dest` (accelerator
/// staging buffers, MPS memory). The range must lie within the data area.
pub fn read_data_into(
    source: &Source,
    offset: u64,
    dest: &mut [u8],
    opts: &ReadOptions,
    poll: &mut dyn FnMut() -> bool,
) -> Result<Report> {
    let len = dest.len();
    let end = offset.checked_add(len as u64);
    if end.is_none_or(|end| end > source.header.data_len()) {
        return Err(Error::Slice(format!(
            "byte range {offset}+{len} is outside the data area ({} bytes) of {}",
            source.header.data_len(),
            source.path.display()
        )));
    }
    let name = source
        .header
        .tensors
        .iter()
        .find(|t| (t.begin as u64) <= offset && offset < t.end as u64)
        .map_or("<data>", |t| t.name.as_str());
    let mut plan = Plan::new(chunk_bytes(&[source], opts));
    plan.add(0, source.header.data_start() + offset, dest, name);
    engine::execute(
        &[source.input(Strategy::Pread)],
        &plan,
        settings(&[source], opts),
        poll,
    )
}

/// One tensor to read and where it goes: `dest` holds exactly the tensor's elements as `dtype`
/// (the file's dtype, or one [`crate::convert`] converts it to).
pub struct Target<'s, 'd> {
    /// Index into the sources.
    pub source: usize,
    pub info: &'s TensorInfo,
    pub dtype: Dtype,
    pub dest: &'d mut [u8],
}

/// Bytes a tensor takes as `dtype`: its size in the file when the dtype is its own, else what
/// [`crate::convert`] turns it into. None when it cannot be converted to `dtype`.
pub fn bytes_as(info: &TensorInfo, dtype: Dtype) -> Option<usize> {
    if dtype == info.dtype {
        return Some(info.nbytes());
    }
    crate::convert::converted_len(info.dtype, dtype, info.nbytes()).ok()
}

/// Reads every target with one worker pool, in (source, offset) order, with `strategy` (Pread
/// or Direct), converting where a target's dtype differs from the file's.
pub fn read_targets(
    sources: &[&Source],
    targets: Vec<Target<'_, '_>>,
    strategy: Strategy,
    opts: &ReadOptions,
    poll: &mut dyn FnMut() -> bool,
) -> Result<Report> {
    let mut targets = targets;
    for t in &targets {
        let want = bytes_as(t.info, t.dtype);
        if want != Some(t.dest.len()) {
            return Err(Error::Destination(format!(
                "cannot read tensor {} ({:?}, {} bytes) of {} into {} bytes of {:?}",
                t.info.name,
                t.info.dtype,
                t.info.nbytes(),
                sources[t.source].path.display(),
                t.dest.len(),
                t.dtype
            )));
        }
    }
    targets.sort_by_key(|t| (t.source, t.info.begin));
    let mut plan = Plan::new(chunk_bytes(sources, opts));
    for t in targets {
        let at = sources[t.source].header.data_start() + t.info.begin as u64;
        if t.dtype == t.info.dtype {
            plan.add(t.source, at, t.dest, &t.info.name);
        } else {
            plan.add_converting(t.source, at, t.dest, t.info.dtype, t.dtype, &t.info.name);
        }
    }
    let inputs: Vec<Input<'_>> = sources.iter().map(|s| s.input(strategy)).collect();
    let mut report = engine::execute(&inputs, &plan, settings(sources, opts), poll)?;
    // Uncached reads asked for, but a file could not be opened that way: it was read buffered.
    report.direct_refused |=
        strategy == Strategy::Direct && inputs.iter().any(|i| i.direct.is_none());
    if opts.drop_cache {
        sources.iter().for_each(|s| storage::drop_cached(&s.file));
    }
    Ok(report)
}

/// Reads tensors of one or more sources into new memory with one worker pool; `dtype` converts
/// the F32/F16/BF16 ones (others keep theirs). Returns buffers in the order of `wanted`, each
/// with the dtype it holds.
fn read_tensors(
    sources: &[&Source],
    wanted: &[(usize, &TensorInfo)],
    strategy: Strategy,
    dtype: Option<Dtype>,
    opts: &ReadOptions,
    poll: &mut dyn FnMut() -> bool,
) -> Result<(Tensors, Report)> {
    let dtypes: Vec<Dtype> = wanted
        .iter()
        .map(|(_, t)| match dtype {
            Some(d) if crate::convert::supported(t.dtype, d) => d,
            _ => t.dtype,
        })
        .collect();
    let sizes: Vec<usize> = wanted
        .iter()
        .zip(&dtypes)
        .map(|((_, t), d)| bytes_as(t, *d).expect("supported, checked above"))
        .collect();
    let needed: u64 = sizes.iter().map(|&n| n as u64).sum();
    crate::pool::ensure_fits(needed, || {
        let mut paths: Vec<String> = wanted
            .iter()
            .map(|(s, _)| sources[*s].path.display().to_string())
            .collect();
        paths.dedup();
        format!("{} tensors of {}", wanted.len(), paths.join(", "))
    })?;
    let mut buffers = buffer::allocate(&sizes).map_err(|e| {
        let path = wanted.first().map_or(String::new(), |(s, _)| {
            sources[*s].path.display().to_string()
        });
        Error::Memory(format!(
            "cannot allocate {needed} bytes for {} tensors of {path}: {e}",
            wanted.len()
        ))
    })?;
    let targets = wanted
        .iter()
        .zip(&dtypes)
        .zip(buffers.iter_mut())
        .map(|(((source, info), dtype), b)| Target {
            source: *source,
            info,
            dtype: *dtype,
            dest: b.as_mut_slice(),
        })
        .collect();
    let report = read_targets(sources, targets, strategy, opts, poll)?;
    let out = buffers
        .into_iter()
        .map(Fresh::into_shared)
        .zip(dtypes)
        .collect();
    Ok((out, report))
}

/// What a read of several tensors gives: each one's bytes and the dtype they hold.
pub type Tensors = Vec<(TensorBytes, Dtype)>;

/// Tensors of one or more sources as `strategy` gives them: views of each file's map for
/// `Mmap` (zero copy), unless `dtype` converts some of them (a map cannot change dtypes: then the
/// parallel reader, as for `Pread`/`Direct`). Returns the bytes and dtype of each, the read's
/// report (empty for maps) and the strategy that ran.
pub fn read_or_map(
    sources: &[&Source],
    wanted: &[(usize, &TensorInfo)],
    strategy: Strategy,
    dtype: Option<Dtype>,
    opts: &ReadOptions,
    poll: &mut dyn FnMut() -> bool,
) -> Result<(Tensors, Report, Strategy)> {
    let converts = dtype.is_some_and(|d| wanted.iter().any(|(_, t)| t.dtype != d));
    match strategy {
        Strategy::Mmap if !converts => {
            let views = wanted
                .iter()
                .map(|(s, t)| Ok((sources[*s].map_tensor(t)?, t.dtype)))
                .collect::<Result<Vec<_>>>()?;
            Ok((views, Report::default(), Strategy::Mmap))
        }
        Strategy::Mmap => {
            let (out, report) = read_tensors(sources, wanted, Strategy::Pread, dtype, opts, poll)?;
            Ok((out, report, Strategy::Pread))
        }
        strategy => {
            let (out, report) = read_tensors(sources, wanted, strategy, dtype, opts, poll)?;
            Ok((out, report, strategy))
        }
    }
}
