//! Page-cache pages readied ahead of a file's writer, on a thread it does not use (a thread of
//! its own for [`super::write_files`], the calling thread once it has hashed a staged buffer for
//! [`super::Session`]). A buffered write
//! into a file the size of a checkpoint spends much of its time making the pages it copies into
//! (under the file's lock, one at a time); read-ahead over the temporary's reserved blocks makes
//! them (zero-filled, without I/O) on a spare core instead, a little ahead of the writer, which
//! then only copies. Measured on this project's 2-core VM, 1 GiB in 16 MiB writes into a
//! reserved file: 3.8-4.1 s with fresh memory, 0.75-1.2 s with pages readied ahead; with memory
//! just freed (where making a page is cheap) 0.63-1.78 s against 0.50-0.65 s. Readying pages on
//! the writer's own thread instead was slower than not readying them at all when pages are cheap
//! (0.80-0.99 s), so it is done only where a core is spare.
//!
//! The readier stays at most [`LEAD`] ahead of the writer (it is told where each piece ends
//! before the piece is written), so the pages it makes are written within moments and are not
//! there to be reclaimed, and never readies below where the writer goes (a page written, synced
//! and dropped would be read back from the disk).

use std::fs::File;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};

use super::pieces::PIECE;
use crate::platform::{self, FsKind};

/// How far ahead of its writer a file's pages are readied.
const LEAD: u64 = 64 << 20;

/// What a writer tells the readier: (its file, where the piece it is about to write ends), or
/// None when the writers are done.
type Word = Option<(usize, u64)>;

/// Readies the pages of the files of one save ahead of their writers, when worth it.
pub(super) struct Ahead {
    tx: Option<Sender<Word>>,
}

impl Ahead {
    /// A readier where [`wanted`], else one that does nothing. The receiving end goes to
    /// [`Ahead::run`] on a thread of its own.
    pub fn new(
        kinds: impl IntoIterator<Item = FsKind>,
        per_file: usize,
        writers: usize,
    ) -> (Ahead, Option<Receiver<Word>>) {
        if !wanted(kinds, per_file, writers) {
            return (Ahead { tx: None }, None);
        }
        let (tx, rx) = channel();
        (Ahead { tx: Some(tx) }, Some(rx))
    }

    /// File `file`'s writer is about to write up to `end`.
    pub fn before(&self, file: usize, end: u64) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(Some((file, end)));
        }
    }

    /// A guard that, when dropped (the writers done, or a panic unwinding past it), makes
    /// [`Ahead::run`] return, so the scope joining it never waits on it.
    pub fn done_on_drop(&self) -> Done<'_> {
        Done(self)
    }

    /// Readies the pages of `files` (each with its length) up to [`LEAD`] past where their writers
    /// said they were going, until told the writers are done or the save stops.
    pub fn run(rx: Receiver<Word>, files: &[(&File, u64)], stop: &AtomicBool) {
        let mut readied = vec![0u64; files.len()];
        while let Ok(Some((i, end))) = rx.recv() {
            if let (Some(&(file, len)), Some(at)) = (files.get(i), readied.get_mut(i)) {
                ready(file, len, at, end, stop);
            }
        }
    }
}

/// Whether pages are worth readying: every file on a local disk (a network filesystem's pages
/// are the server's; tmpfs has no read-ahead), each with one writer, an OS that readies them
/// without I/O, and a core left over by the save's `writers`.
pub(super) fn wanted(
    kinds: impl IntoIterator<Item = FsKind>,
    per_file: usize,
    writers: usize,
) -> bool {
    platform::READIES_PAGES_FOR_WRITES
        && per_file == 1
        && writers < platform::cores()
        && kinds.into_iter().all(|k| k == FsKind::Local)
}

/// Readies the pages of `file` (`len` bytes) from `end` (where its writer is about to write to)
/// or `readied` (how far they are readied), whichever is further, to [`LEAD`] past `end`.
pub(super) fn ready(file: &File, len: u64, readied: &mut u64, end: u64, stop: &AtomicBool) {
    let until = end.saturating_add(LEAD).min(len);
    *readied = (*readied).max(end);
    while *readied < until && !stop.load(Ordering::Relaxed) {
        let step = (until - *readied).min(PIECE as u64);
        platform::ready_pages_for_writes(file, *readied, step);
        *readied += step;
    }
}

/// See [`Ahead::done_on_drop`].
pub(super) struct Done<'a>(&'a Ahead);

impl Drop for Done<'_> {
    fn drop(&mut self) {
        if let Some(tx) = &self.0.tx {
            let _ = tx.send(None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::OpenOptions;

    /// A file of `len` bytes reserved (as a save's temporary is), and whether its pages can be
    /// seen being readied here (Linux, a local disk).
    fn reserved(tag: &str, len: u64) -> (std::path::PathBuf, File, bool) {
        let path =
            std::env::temp_dir().join(format!("safeload-ahead-{tag}-{}", std::process::id()));
        let file = (OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true))
        .open(&path)
        .unwrap();
        platform::preallocate(&file, len).unwrap();
        let seen =
            platform::READIES_PAGES_FOR_WRITES && platform::fs_kind(&file, &path) == FsKind::Local;
        (path, file, seen)
    }

    fn cached(file: &File, from: u64, to: u64) -> f64 {
        platform::cached_fraction(file, from, to - from).unwrap()
    }

    #[test]
    fn pages_are_readied_from_where_the_writer_goes_to_a_lead_past_it_and_keep_the_bytes() {
        let len = 3 * LEAD;
        let (path, file, seen) = reserved("lead", len);
        let end = PIECE as u64;
        let (tx, rx) = channel();
        tx.send(Some((0, end))).unwrap();
        tx.send(Some((7, 0))).unwrap(); // no such file: ignored
        tx.send(None).unwrap();
        tx.send(Some((0, 2 * LEAD))).unwrap(); // after the end: never read
        Ahead::run(rx, &[(&file, len)], &AtomicBool::new(false));
        if seen {
            assert_eq!(cached(&file, 0, end), 0.0, "the writer's own piece");
            assert_eq!(cached(&file, end, end + LEAD), 1.0, "the lead");
            assert_eq!(cached(&file, end + LEAD, len), 0.0, "past the lead");
        }
        // Readied pages hold what the file holds (zeros), and a write over them is what is read.
        let data: Vec<u8> = (0..LEAD as usize + 4097)
            .map(|i| (i * 7 + 1) as u8)
            .collect();
        platform::write_all_at(&file, &data, end - 1).unwrap();
        let mut back = vec![0u8; len as usize];
        platform::read_fully_at(&file, &mut back, 0).unwrap();
        let at = end as usize - 1;
        assert!(back[..at].iter().all(|&b| b == 0));
        assert!(back[at..at + data.len()] == data[..]);
        assert!(back[at + data.len()..].iter().all(|&b| b == 0));
        drop(file);
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn a_stopped_save_readies_nothing() {
        let (path, file, seen) = reserved("stopped", LEAD);
        let (tx, rx) = channel();
        tx.send(Some((0, 0))).unwrap();
        tx.send(None).unwrap();
        Ahead::run(rx, &[(&file, LEAD)], &AtomicBool::new(true));
        if seen {
            assert_eq!(cached(&file, 0, LEAD), 0.0);
        }
        drop(file);
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn only_local_files_with_one_writer_each_and_a_core_to_spare_are_readied() {
        let wanted = |kinds: &[FsKind], per_file, writers| {
            let (ahead, rx) = Ahead::new(kinds.iter().copied(), per_file, writers);
            assert_eq!(ahead.tx.is_some(), rx.is_some());
            rx.is_some()
        };
        let spare = platform::READIES_PAGES_FOR_WRITES && platform::cores() > 1;
        assert_eq!(wanted(&[FsKind::Local, FsKind::Local], 1, 1), spare);
        assert!(!wanted(&[FsKind::Local], 1, platform::cores()));
        assert!(!wanted(&[FsKind::Local], 2, 1));
        assert!(!wanted(&[FsKind::Local, FsKind::Memory], 1, 1));
        assert!(!wanted(&[FsKind::Network("nfs")], 1, 1));
    }
}
