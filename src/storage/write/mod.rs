//! Writing safetensors files at the disk's speed: every file of a save (one for `save_file`, each
//! shard of a checkpoint) goes to a temporary sibling made at its final size, its bytes written by
//! a few threads with positional writes straight from the tensors' memory (small tensors gathered
//! first: [`pieces`]), hashed on threads of their own from the same memory when asked (one per
//! file, so shards hash side by side), optionally synced, and only then renamed over the targets,
//! all of them after all are written. A save that fails or is cancelled (Ctrl-C) removes its
//! temporaries and leaves every earlier file as it was.
//!
//! The bytes are exactly `format::serialize`'s (0.8's layout). Tensors are read while they are
//! written: one changed by another thread during the save may be written half old, half new (as
//! with 0.8), and its file's digest is of what the hash thread read, so `verify` then fails.

mod ahead;
pub(crate) mod pieces;
mod session;

use std::fs::{File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use crate::error::{Error, Result};
use crate::format::digest::{Digest, Sha256};
use crate::format::serialize::{TensorIn, header};
use crate::platform::{self, FsKind};
use crate::storage::cancel;
use ahead::Ahead;
use pieces::{GATHER, Piece};
pub use session::Session;

/// One file to write: its tensors (sorted into file order by the write) and `__metadata__`.
pub struct FileOut<'a> {
    pub path: PathBuf,
    pub tensors: Vec<TensorIn<'a>>,
    pub metadata: Option<Vec<(String, String)>>,
}

/// How a save runs.
#[derive(Debug, Clone, Copy)]
pub struct WriteOptions {
    /// Sync each file's bytes (and the directory's entry) before returning.
    pub fsync: bool,
    /// Compute each file's SHA-256 from the bytes written.
    pub hash: bool,
    /// Threads writing one file (`SAFELOAD_WRITE_THREADS`), else by its filesystem: one on a
    /// local disk or in memory, one per core (2 to 8) on a network filesystem.
    pub threads: Option<usize>,
}

impl WriteOptions {
    /// `fsync` and `hash` as asked, with the thread count `SAFELOAD_WRITE_THREADS` gives.
    pub fn new(fsync: bool, hash: bool) -> Self {
        let threads = std::env::var("SAFELOAD_WRITE_THREADS")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&n| n > 0);
        WriteOptions {
            fsync,
            hash,
            threads,
        }
    }
}

/// Writes `files` (the whole save): each is complete at its path, or none is changed and the
/// error names the file that failed. Returns each file's SHA-256 when `options.hash`.
pub fn write_files(files: &mut [FileOut<'_>], options: &WriteOptions) -> Result<Vec<Digest>> {
    let heads = (files.iter_mut())
        .map(|f| header(&mut f.tensors, f.metadata.as_deref()))
        .collect::<Result<Vec<_>>>()?;
    let sized = (files.iter().zip(&heads))
        .map(|(f, head)| (f.path.as_path(), head.len() as u64 + data_len(&f.tensors)));
    let temps = Temporaries::create(sized)?;
    let mut all = Vec::new();
    for (i, (f, head)) in files.iter().zip(&heads).enumerate() {
        let runs = std::iter::once(&head[..]).chain(f.tensors.iter().map(|t| t.data));
        pieces::cut(i, runs, &mut all);
    }
    let per_file = options.per_file(temps.kind(0));
    let digests = write_and_hash(files, &heads, &temps, &all, per_file, options)?;
    let paths: Vec<&Path> = files.iter().map(|f| f.path.as_path()).collect();
    if options.fsync {
        sync_all(&paths, &temps.handles())?;
    }
    temps.commit(&paths, options.fsync)?;
    Ok(digests)
}

/// Writes one file (`save_file`): [`write_files`] of it alone, with the default thread count.
pub fn to_file(
    path: &Path,
    tensors: &[TensorIn<'_>],
    metadata: Option<&[(String, String)]>,
    fsync: bool,
) -> Result<()> {
    let mut file = [FileOut {
        path: path.to_path_buf(),
        tensors: tensors.to_vec(),
        metadata: metadata.map(<[_]>::to_vec),
    }];
    write_files(&mut file, &WriteOptions::new(fsync, false)).map(drop)
}

impl WriteOptions {
    /// Threads writing one file on `kind`: as asked, else one on a local disk or in memory (their
    /// buffered writes hold the file's lock, so a second thread on the same file only waits: 2
    /// GiB to tmpfs took 0.655 s with two, 0.63 s with one, 0.62 s for 0.8), and one per core
    /// (2 to 8) on a network filesystem, whose writes wait on requests in flight.
    pub(super) fn per_file(&self, kind: FsKind) -> usize {
        self.threads.unwrap_or(match kind {
            FsKind::Network(_) => platform::cores().clamp(2, 8),
            FsKind::Local | FsKind::Memory => 1,
        })
    }
}

/// The bytes of every piece written (and each file hashed) by the worker threads, `per_file` of
/// them to a file; the calling thread is one of them and the one that watches for Ctrl-C.
fn write_and_hash(
    files: &[FileOut<'_>],
    heads: &[Vec<u8>],
    temps: &Temporaries,
    all: &[Piece<'_>],
    per_file: usize,
    options: &WriteOptions,
) -> Result<Vec<Digest>> {
    let handles = temps.handles();
    let (jobs, workers) = jobs(all, per_file);
    // The hash threads are not counted: hashing (1.4 GB/s a thread) outpaces the buffered writes
    // it runs beside, and with them counted a save with its manifest on 2 cores took 0.82-2.77 s
    // (pages made by the writer) where it took 1.0-1.2 s with them readied.
    let kinds = (0..files.len()).map(|i| temps.kind(i));
    let (ahead, readier) = Ahead::new(kinds, per_file, workers);
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let failed: Mutex<Option<(usize, io::Error)>> = Mutex::new(None);
    let work = |caller: bool| {
        let mut scratch = Vec::new();
        while let Some(job) = jobs.get(next.fetch_add(1, Ordering::Relaxed)) {
            for piece in job.iter() {
                if stop.load(Ordering::Relaxed) || caller && cancel::requested() {
                    stop.store(true, Ordering::Relaxed);
                    return;
                }
                ahead.before(piece.file, piece.offset + piece.len() as u64);
                if let Err(e) = write_piece(handles[piece.file], piece, 0, &mut scratch) {
                    stop.store(true, Ordering::Relaxed);
                    let mut failed = failed.lock().unwrap_or_else(|p| p.into_inner());
                    failed.get_or_insert((piece.file, e));
                    return;
                }
            }
        }
    };
    let lens = temps.sized_handles();
    let digests = std::thread::scope(|s| {
        let hashers: Vec<_> = (files.iter().zip(heads))
            .filter(|_| options.hash)
            .map(|(f, head)| s.spawn(|| hash_file(head, &f.tensors, &stop)))
            .collect();
        let readier = readier.map(|rx| s.spawn(|| Ahead::run(rx, &lens, &stop)));
        let done = ahead.done_on_drop();
        let spawned: Vec<_> = (1..workers).map(|_| s.spawn(|| work(false))).collect();
        work(true);
        for w in spawned {
            let _ = w.join();
        }
        drop(done);
        if let Some(r) = readier {
            let _ = r.join();
        }
        (hashers.into_iter())
            .map(|h| h.join().ok().flatten())
            .collect::<Option<Vec<Digest>>>()
    });
    if let Some((file, e)) = failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(write_error(&files[file].path, e));
    }
    match digests {
        Some(d) if !stop.load(Ordering::Relaxed) => Ok(d),
        _ => Err(Error::Cancelled),
    }
}

/// What a worker takes at a time, and how many workers there are: a file's pieces in order (one
/// writer per file, files side by side, up to one per core), or single pieces (`per_file`
/// writers).
fn jobs<'a, 'p>(all: &'a [Piece<'p>], per_file: usize) -> (Vec<&'a [Piece<'p>]>, usize) {
    let (jobs, workers): (Vec<_>, usize) = if per_file == 1 {
        let jobs: Vec<_> = all.chunk_by(|a, b| a.file == b.file).collect();
        let workers = jobs.len().min(platform::cores().max(2));
        (jobs, workers)
    } else {
        (all.chunks(1).collect(), per_file)
    };
    let workers = workers.clamp(1, jobs.len().max(1));
    (jobs, workers)
}

/// Writes `piece` at `base` + its offset (its runs gathered into `scratch` first when several).
/// A synced save leaves the bytes to the fsync: handing each piece to the disk as it is written
/// (`sync_file_range`) made two synced 512 MiB files slower (1.56 s against 1.23 s, medians of
/// 9) and one of 2 GiB no faster (4.78 s against 4.79 s).
fn write_piece(file: &File, piece: &Piece<'_>, base: u64, scratch: &mut Vec<u8>) -> io::Result<()> {
    let offset = base + piece.offset;
    if let [run] = &piece.runs[..] {
        return platform::write_all_at(file, run, offset);
    }
    scratch.clear();
    scratch.reserve(GATHER);
    for run in &piece.runs {
        scratch.extend_from_slice(run);
    }
    platform::write_all_at(file, scratch, offset)
}

/// The bytes of `tensors`' data.
fn data_len(tensors: &[TensorIn<'_>]) -> u64 {
    tensors.iter().map(|t| t.data.len() as u64).sum()
}

/// One file's SHA-256 from the memory its bytes are written from, in file order; None if the
/// save stopped.
fn hash_file(head: &[u8], tensors: &[TensorIn<'_>], stop: &AtomicBool) -> Option<Digest> {
    let mut sha = Sha256::new();
    sha.update(head);
    for t in tensors {
        for part in t.data.chunks(pieces::PIECE) {
            if stop.load(Ordering::Relaxed) {
                return None;
            }
            sha.update(part);
        }
    }
    Some(sha.finish())
}

/// Every file's bytes on the disk, the files synced side by side.
fn sync_all(paths: &[&Path], handles: &[&File]) -> Result<()> {
    std::thread::scope(|s| {
        let syncs: Vec<_> = handles.iter().map(|h| s.spawn(|| h.sync_all())).collect();
        for (path, sync) in paths.iter().zip(syncs) {
            match sync.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(write_error(path, e)),
                Err(_) => return Err(Error::Internal("a file's sync panicked".into())),
            }
        }
        Ok(())
    })
}

fn write_error(path: &Path, source: io::Error) -> Error {
    Error::Write {
        path: path.to_path_buf(),
        source,
    }
}

/// A new temporary file beside `path` (never one that exists). A target that is a directory is
/// refused here, before anything is written.
fn create_beside(path: &Path) -> io::Result<(PathBuf, File)> {
    if path.is_dir() {
        return Err(io::Error::new(
            io::ErrorKind::IsADirectory,
            "the target is a directory",
        ));
    }
    let temp = temp_sibling(path);
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&temp)?;
    Ok((temp, file))
}

fn temp_sibling(path: &Path) -> PathBuf {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let unique = format!(
        ".{name}.{}.{}.tmp",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    );
    path.with_file_name(unique)
}

/// The temporary files of a save: removed when dropped, unless committed (renamed over their
/// targets).
struct Temporaries(Vec<Temporary>);

/// One file of a save while it is written: its temporary's path (empty once renamed), the open
/// file, its final length, and the filesystem it is on (asked once, when it is made).
struct Temporary {
    path: PathBuf,
    file: Option<File>,
    len: u64,
    kind: FsKind,
}

impl Temporaries {
    /// A temporary beside each `(path, len)`, made at its final size: its blocks reserved on a
    /// disk (a full disk fails here, and synced writes into reserved blocks ran 1.33 s against
    /// 1.94 s for 2 GiB), only extended in memory (tmpfs allocates the pages a reservation asks
    /// for, then the writes fill them: 2 GiB took 0.645 s reserved, 0.632 s not; a full tmpfs
    /// fails at the write, with the same clean-up).
    fn create<'p>(sized: impl Iterator<Item = (&'p Path, u64)>) -> Result<Temporaries> {
        let mut temps = Temporaries(Vec::new());
        for (path, len) in sized {
            let (temp, file) = create_beside(path).map_err(|e| write_error(path, e))?;
            let kind = platform::fs_kind(&file, &temp);
            let reserved = match kind {
                FsKind::Memory => file.set_len(len),
                FsKind::Local | FsKind::Network(_) => platform::preallocate(&file, len),
            };
            temps.0.push(Temporary {
                path: temp,
                file: Some(file),
                len,
                kind,
            });
            reserved.map_err(|e| write_error(path, e))?;
        }
        Ok(temps)
    }

    fn handles(&self) -> Vec<&File> {
        self.0.iter().filter_map(|t| t.file.as_ref()).collect()
    }

    /// Each open file with its final length.
    fn sized_handles(&self) -> Vec<(&File, u64)> {
        (self.0.iter())
            .filter_map(|t| Some((t.file.as_ref()?, t.len)))
            .collect()
    }

    /// The filesystem file `i` is written to (a local disk where there is none).
    fn kind(&self, i: usize) -> FsKind {
        self.0.get(i).map_or(FsKind::Local, |t| t.kind)
    }

    /// Renames each file over its target, then (synced saves) makes the renames durable.
    fn commit(mut self, paths: &[&Path], fsync: bool) -> Result<()> {
        for (i, path) in paths.iter().enumerate() {
            let temp = &mut self.0[i];
            drop(temp.file.take());
            std::fs::rename(&temp.path, path).map_err(|e| write_error(path, e))?;
            temp.path.clear();
        }
        if fsync {
            let mut dirs: Vec<&Path> = (paths.iter())
                .filter_map(|p| p.parent())
                .map(|d| {
                    if d.as_os_str().is_empty() {
                        Path::new(".")
                    } else {
                        d
                    }
                })
                .collect();
            dirs.dedup();
            for dir in dirs {
                platform::sync_dir(dir).map_err(|e| write_error(dir, e))?;
            }
        }
        Ok(())
    }
}

impl Drop for Temporaries {
    fn drop(&mut self) {
        for temp in self.0.drain(..) {
            drop(temp.file);
            if !temp.path.as_os_str().is_empty() {
                let _ = std::fs::remove_file(temp.path);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::dtype::Dtype;
    use crate::format::serialize::to_bytes;

    /// The sample's tensors as U8 vectors (`shapes[i]` is `[data[i].len()]`).
    fn tensors<'a>(
        data: &'a [Vec<u8>],
        names: &'a [String],
        shapes: &'a [[usize; 1]],
    ) -> Vec<TensorIn<'a>> {
        (data.iter().zip(names).zip(shapes))
            .map(|((d, n), shape)| TensorIn {
                name: n,
                dtype: Dtype::U8,
                shape,
                data: d,
            })
            .collect()
    }

    fn sample() -> (Vec<Vec<u8>>, Vec<String>, Vec<[usize; 1]>) {
        let sizes = [3usize, 40 << 20, 1000, 2 << 20, 0, 17];
        let data = (sizes.iter().enumerate())
            .map(|(i, &n)| (0..n).map(|b| (b * 31 + i) as u8).collect())
            .collect();
        let names = (0..sizes.len()).map(|i| format!("t{i}")).collect();
        (data, names, sizes.iter().map(|&n| [n]).collect())
    }

    #[test]
    fn files_equal_the_bytes_of_the_format_and_their_digests() {
        let dir = tempfile_dir("equal");
        let (data, names, shapes) = sample();
        for threads in [1, 3] {
            let mut files: Vec<FileOut<'_>> = (0..2)
                .map(|k| FileOut {
                    path: dir.join(format!("f{k}.safetensors")),
                    tensors: tensors(&data[k..], &names[k..], &shapes[k..]),
                    metadata: Some(vec![("k".into(), k.to_string())]),
                })
                .collect();
            let options = WriteOptions {
                fsync: threads == 1,
                hash: true,
                threads: Some(threads),
            };
            let digests = write_files(&mut files, &options).unwrap();
            for (k, digest) in digests.iter().enumerate() {
                let mut expected = tensors(&data[k..], &names[k..], &shapes[k..]);
                let meta = vec![("k".to_string(), k.to_string())];
                let bytes = to_bytes(&mut expected, Some(&meta)).unwrap();
                let written = std::fs::read(&files[k].path).unwrap();
                assert!(written == bytes, "file {k} differs ({threads} threads)");
                assert_eq!(*digest, Digest::of(&bytes));
            }
        }
        assert_eq!(leftovers(&dir), 0);
    }

    /// One file larger than a piece and the readier's lead, on one writer: where the temporary
    /// directory is a local disk and a core is spare, its pages are readied ahead of the writer.
    #[test]
    fn one_file_written_beside_its_readier_equals_the_format() {
        let dir = tempfile_dir("readied");
        let data = vec![
            (0..90usize << 20)
                .map(|b| (b % 251) as u8)
                .collect::<Vec<u8>>(),
        ];
        let (names, shapes) = (vec!["big".to_string()], vec![[data[0].len()]]);
        let mut files = vec![FileOut {
            path: dir.join("one.safetensors"),
            tensors: tensors(&data, &names, &shapes),
            metadata: None,
        }];
        let digests = write_files(&mut files, &WriteOptions::new(false, true)).unwrap();
        let bytes = to_bytes(&mut tensors(&data, &names, &shapes), None).unwrap();
        let written = std::fs::read(&files[0].path).unwrap();
        assert!(written == bytes);
        assert_eq!(digests, vec![Digest::of(&bytes)]);
        assert_eq!(leftovers(&dir), 0);
    }

    #[test]
    fn a_failed_save_changes_nothing_and_leaves_no_temporary() {
        let dir = tempfile_dir("failed");
        let (data, names, shapes) = sample();
        let kept = dir.join("a.safetensors");
        std::fs::write(&kept, b"earlier").unwrap();
        std::fs::create_dir(dir.join("b.safetensors")).unwrap();
        let mut files = vec![
            FileOut {
                path: kept.clone(),
                tensors: tensors(&data, &names, &shapes),
                metadata: None,
            },
            FileOut {
                path: dir.join("b.safetensors"),
                tensors: tensors(&data, &names, &shapes),
                metadata: None,
            },
        ];
        let err = write_files(&mut files, &WriteOptions::new(false, false)).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("b.safetensors") && text.contains("directory"),
            "{text}"
        );
        assert_eq!(std::fs::read(&kept).unwrap(), b"earlier");
        assert_eq!(leftovers(&dir), 0);
    }

    fn tempfile_dir(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("safeload-write-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn leftovers(dir: &Path) -> usize {
        (std::fs::read_dir(dir).unwrap().flatten())
            .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
            .count()
    }
}
