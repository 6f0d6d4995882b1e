//! A save whose bytes arrive in pieces: a device's tensors staged through host buffers (the
//! binding's ring copies a buffer from the device while the previous one is written). The files'
//! headers are known from the tensors' layouts alone, so each file is made (at its final size)
//! and its header written when the session starts; each staged buffer is then written at its
//! offset by the writer's threads while the calling thread hashes it, and the session ends with
//! [`Session::finish`] (synced, renamed, digests) or is dropped (temporaries removed).
//!
//! Hashing needs each file's bytes in order, so a hashed session takes each file's data in file
//! order (the ring produces it so); a write out of order is an error, never a wrong digest.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use super::ahead;
use super::pieces::{self, Piece};
use super::{Temporaries, WriteOptions, sync_all, write_error, write_piece};
use crate::error::{Error, Result};
use crate::format::digest::{Digest, Sha256};
use crate::format::serialize::{Described, TensorLayout, header};
use crate::platform;

/// The files of a save in progress.
pub struct Session {
    paths: Vec<PathBuf>,
    temps: Temporaries,
    /// Each file's length, where its data starts (after the header), and the bytes written so
    /// far (the header's included; in order when hashed).
    lens: Vec<u64>,
    starts: Vec<u64>,
    written: Vec<u64>,
    hashes: Option<Vec<Sha256>>,
    options: WriteOptions,
    /// Threads writing each file, by its filesystem (asked once, at the start).
    threads: Vec<usize>,
    /// How far each file's pages are readied ahead of its writes, where they are
    /// ([`ahead::wanted`]; the calling thread readies them once it has hashed a write's bytes).
    readied: Vec<Option<u64>>,
}

/// Where each tensor of a file goes: `(name, offset in the file)`, in file order.
pub type Offsets = Vec<(String, u64)>;

/// One file of a session: its path, its tensors' layouts and its `__metadata__`.
pub type FileLayout = (PathBuf, Vec<TensorLayout>, Option<Vec<(String, String)>>);

impl Session {
    /// Starts a save of `files` (path, tensors' layouts, `__metadata__`): every file made at its
    /// final size with its header written. Returns where each file's tensors go.
    pub fn start(files: Vec<FileLayout>, options: WriteOptions) -> Result<(Session, Vec<Offsets>)> {
        let mut heads = Vec::with_capacity(files.len());
        let mut offsets = Vec::with_capacity(files.len());
        let mut lens = Vec::with_capacity(files.len());
        let mut paths = Vec::with_capacity(files.len());
        for (path, mut tensors, metadata) in files {
            let head = header(&mut tensors, metadata.as_deref())?;
            let mut at = head.len() as u64;
            let placed = (tensors.iter())
                .map(|t| {
                    let start = at;
                    at += t.len() as u64;
                    (t.name().to_string(), start)
                })
                .collect();
            lens.push(at);
            offsets.push(placed);
            heads.push(head);
            paths.push(path);
        }
        let temps =
            Temporaries::create(paths.iter().map(PathBuf::as_path).zip(lens.iter().copied()))?;
        let mut threads = Vec::with_capacity(paths.len());
        let mut readied = Vec::with_capacity(paths.len());
        for (i, ((path, head), file)) in paths.iter().zip(&heads).zip(temps.handles()).enumerate() {
            platform::write_all_at(file, head, 0).map_err(|e| write_error(path, e))?;
            let per_file = options.per_file(temps.kind(i));
            threads.push(per_file);
            readied.push(ahead::wanted([temps.kind(i)], per_file, per_file).then_some(0));
        }
        let hashes = options.hash.then(|| {
            (heads.iter())
                .map(|head| {
                    let mut sha = Sha256::new();
                    sha.update(head);
                    sha
                })
                .collect()
        });
        let starts: Vec<u64> = heads.iter().map(|h| h.len() as u64).collect();
        let session = Session {
            paths,
            temps,
            lens,
            written: starts.clone(),
            starts,
            hashes,
            options,
            threads,
            readied,
        };
        Ok((session, offsets))
    }

    /// Writes `bytes` at `offset` of file `file` (in order when hashed): the writer's threads
    /// write it in pieces while this thread hashes it.
    pub fn write(&mut self, file: usize, offset: u64, bytes: &[u8]) -> Result<()> {
        let (Some(path), Some(&len)) = (self.paths.get(file), self.lens.get(file)) else {
            return Err(Error::Internal(format!("no file {file} in this save")));
        };
        let end = offset.checked_add(bytes.len() as u64).filter(|&e| e <= len);
        let head = self.starts[file];
        if end.is_none() || offset < head {
            return Err(Error::Serialize(format!(
                "Error while serializing: {}: bytes {offset}..+{} are outside the file's data ({head}..{len})",
                path.display(),
                bytes.len()
            )));
        }
        if self.hashes.is_some() && offset != self.written[file] {
            return Err(Error::Serialize(format!(
                "Error while serializing: {}: a hashed save takes its bytes in order (at {}, given {offset})",
                path.display(),
                self.written[file]
            )));
        }
        let handle = self.temps.handles()[file];
        let mut all = Vec::new();
        pieces::cut(file, [bytes], &mut all);
        let threads = self.threads[file];
        let hash = self.hashes.as_mut().map(|h| &mut h[file]);
        let readied = self.readied[file].as_mut();
        let end = offset + bytes.len() as u64;
        write_pieces(handle, path, offset, &all, threads, || {
            if let Some(hash) = hash {
                hash.update(bytes);
            }
            if let Some(at) = readied {
                ahead::ready(handle, len, at, end, &AtomicBool::new(false));
            }
        })?;
        self.written[file] += bytes.len() as u64;
        Ok(())
    }

    /// Whether the files are hashed as they are written.
    pub fn hashed(&self) -> bool {
        self.hashes.is_some()
    }

    /// Every file complete: synced (when asked), renamed over its target; each file's SHA-256
    /// when hashed. A file whose bytes do not add up to its length is an error (and nothing is
    /// renamed).
    pub fn finish(self) -> Result<Vec<Digest>> {
        for ((path, &len), &written) in self.paths.iter().zip(&self.lens).zip(&self.written) {
            if written != len {
                return Err(Error::Serialize(format!(
                    "Error while serializing: {}: the save ended with {written} of {len} bytes written",
                    path.display()
                )));
            }
        }
        let paths: Vec<&Path> = self.paths.iter().map(PathBuf::as_path).collect();
        if self.options.fsync {
            sync_all(&paths, &self.temps.handles())?;
        }
        self.temps.commit(&paths, self.options.fsync)?;
        Ok((self.hashes.into_iter().flatten())
            .map(Sha256::finish)
            .collect())
    }
}

/// `all` (pieces of bytes that start at `offset`) written by up to `threads` threads while the
/// calling thread runs `beside` (the hash).
fn write_pieces(
    file: &File,
    path: &Path,
    offset: u64,
    all: &[Piece<'_>],
    threads: usize,
    beside: impl FnOnce(),
) -> Result<()> {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};

    let next = AtomicUsize::new(0);
    let failed = Mutex::new(None);
    let work = || {
        while let Some(piece) = all.get(next.fetch_add(1, Ordering::Relaxed)) {
            if let Err(e) = write_piece(file, piece, offset, &mut Vec::new()) {
                failed
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get_or_insert(e);
                next.store(all.len(), Ordering::Relaxed);
            }
        }
    };
    std::thread::scope(|s| {
        let writers: Vec<_> = (0..threads.clamp(1, all.len().max(1)))
            .map(|_| s.spawn(work))
            .collect();
        beside();
        for w in writers {
            let _ = w.join();
        }
    });
    match failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(write_error(path, e)),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::dtype::Dtype;
    use crate::format::serialize::{TensorIn, to_bytes};

    /// A file longer than a staged buffer and the readier's lead, its bytes given in order in
    /// 16 MiB buffers (as the ring gives them): where its pages are readied (a local disk, a
    /// core to spare), the calling thread readies the next buffer's while the writer writes.
    #[test]
    fn a_staged_file_written_in_order_equals_the_format_and_its_digest() {
        let dir = std::env::temp_dir().join(format!("safeload-session-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("staged.safetensors");
        let data: Vec<u8> = (0..100usize << 20).map(|b| (b % 253) as u8).collect();
        let layout = TensorLayout {
            name: "big".into(),
            dtype: Dtype::U8,
            shape: vec![data.len()],
            len: data.len(),
        };
        let options = WriteOptions::new(false, true);
        let (mut session, offsets) =
            Session::start(vec![(path.clone(), vec![layout], None)], options).unwrap();
        let start = offsets[0][0].1;
        for (k, part) in data.chunks(16 << 20).enumerate() {
            session
                .write(0, start + (k as u64) * (16 << 20), part)
                .unwrap();
        }
        let digests = session.finish().unwrap();
        let shape = [data.len()];
        let mut tensors = [TensorIn {
            name: "big",
            dtype: Dtype::U8,
            shape: &shape,
            data: &data,
        }];
        let bytes = to_bytes(&mut tensors, None).unwrap();
        assert!(std::fs::read(&path).unwrap() == bytes);
        assert_eq!(digests, vec![Digest::of(&bytes)]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
