//! The verified record (`verify_cache=` / `$SAFELOAD_VERIFY_CACHE`, opt-in): files that hashed to
//! their pinned digest, remembered with their identity, so that a later load of the same
//! unchanged file under the same pin skips the hash.
//!
//! The record is a directory with one entry per file, named by the SHA-256 (hex) of the file's
//! canonical path, holding one line:
//!
//! ```text
//! v1 <device> <inode> <size> <mtime_ns> <ctime_ns> <digest, 64 hex>\n
//! ```
//!
//! The identity (device, inode, size, mtime, ctime; [`crate::platform::FileIdentity`]) is read
//! from the open handle, never by a second lookup of the path: the path only picks the entry, and
//! a file swapped in at that path has another identity. An entry is replaced whole (a temporary
//! file renamed over it), so a reader sees the old line or the new one. Anything but exactly such
//! a line means "not known": the file is hashed again. Entries are not fsynced: after a crash an
//! entry is whole, empty or missing, and the last two are not known either.
//!
//! # What the record trusts
//!
//! - **That an unchanged identity means unchanged bytes.** A write, a truncation, a `chmod`, a
//!   rename onto the path (a new inode) all change the ctime, which Unix sets from the kernel's
//!   clock only: `utimensat` resets the mtime, never the ctime. So a file whose five fields all
//!   match has the bytes it was hashed with, unless the system clock was set back (root) to the
//!   very tick of the recorded ctime, or the filesystem was changed beneath the kernel (a raw
//!   block device, a network file server, another system mounting the disk).
//! - **That the clock ticked between the file's last change and the entry.** A change within
//!   one timestamp tick after the identity was read would leave both times as they were, so an
//!   entry written no later (by the record's filesystem clock) than the file's mtime or ctime is
//!   not trusted (git's "racy clean" rule): the file is hashed again and the entry rewritten. This
//!   takes the record directory and the file to share a clock, as local filesystems do; a network
//!   server's clock may differ. A file dated in the future is hashed every time.
//! - **Nothing about a file that changed while it was hashed.** Its identity is read before the
//!   hash and again after; [`Record::remember`] writes nothing when they differ.
//! - **The record directory itself.** Whoever can write it can make a changed file skip its
//!   hash. It is created 0700, and on Unix one that group or others may write is refused; the
//!   model is one user's files against accidents (a rewrite in place, a bad copy, a partial
//!   download), not against another process of that user, which could as well change the pin.
//! - **Windows** identifies a file by volume serial number and 64-bit file index (ReFS's 128-bit
//!   ids are not always unique in those), `LastWriteTime` and `ChangeTime`. Whoever may write a
//!   file's attributes can set its `ChangeTime` there, so on Windows the record guards against
//!   accidents only.

use std::fs::File;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::format::digest::Digest;
use crate::platform::{self, FileIdentity};

/// The environment variable naming the record's directory.
pub const ENV: &str = "SAFELOAD_VERIFY_CACHE";

/// The longest entry read: a line of the largest numbers is about 200 bytes.
const MAX_ENTRY: u64 = 256;

/// The record kept in one directory.
#[derive(Debug, Clone)]
pub struct Record {
    dir: PathBuf,
}

impl Record {
    /// The record kept in `dir`, created if missing (mode 0700 on Unix). On Unix a directory
    /// that group or others may write is refused: they could make a changed file skip its hash.
    pub fn open(dir: &Path) -> Result<Record> {
        let dir = std::path::absolute(dir).map_err(|source| Error::Write {
            path: dir.to_path_buf(),
            source,
        })?;
        create_private_dir(&dir).map_err(|source| Error::Write {
            path: dir.clone(),
            source,
        })?;
        refuse_shared(&dir)?;
        Ok(Record { dir })
    }

    /// The record at `$SAFELOAD_VERIFY_CACHE`; None when that is unset or empty.
    pub fn from_env() -> Result<Option<Record>> {
        Self::from_setting(std::env::var_os(ENV).as_deref())
    }

    fn from_setting(value: Option<&std::ffi::OsStr>) -> Result<Option<Record>> {
        match value {
            Some(dir) if !dir.is_empty() => Record::open(Path::new(dir)).map(Some),
            _ => Ok(None),
        }
    }

    /// Whether `path` (a local file, open as `file`) was remembered as hashing to `digest` and
    /// its identity is unchanged since, in an entry written after the file's last change. Any
    /// error reading the record or the file's identity is "no": the file is hashed again.
    pub fn knows(&self, path: &Path, file: &File, digest: &Digest) -> bool {
        let Ok(now) = platform::file_identity(file) else {
            return false;
        };
        let Some((entry, written_ns)) = self.read_entry(path) else {
            return false;
        };
        entry.digest == *digest && entry.identity == now && !racy(&now, written_ns)
    }

    /// Remembers that `path` (open as `file`) hashed to `digest`, when its identity is still
    /// `before`, the one [`Record::identity`] read before the hash began: a file that changed
    /// while it was hashed is not remembered (`Ok(false)`), and its next load hashes it again.
    /// The entry is replaced atomically (a temporary file in the record renamed over it), so a
    /// concurrent reader sees the old entry or the new one.
    pub fn remember(
        &self,
        path: &Path,
        file: &File,
        before: &FileIdentity,
        digest: &Digest,
    ) -> Result<bool> {
        let unreadable = |source| Error::Open {
            path: path.to_path_buf(),
            source,
        };
        let identity = platform::file_identity(file).map_err(unreadable)?;
        if identity != *before {
            return Ok(false);
        }
        let entry_path = self.entry_path(path).map_err(unreadable)?;
        let line = Entry {
            identity,
            digest: *digest,
        }
        .line();
        replace(&entry_path, line.as_bytes()).map_err(|source| Error::Write {
            path: entry_path,
            source,
        })?;
        Ok(true)
    }

    /// `file`'s identity now (None where it cannot be read): what [`Record::remember`] compares
    /// after the hash.
    pub fn identity(file: &File) -> Option<FileIdentity> {
        platform::file_identity(file).ok()
    }

    /// Where the entry of `path` lives: named by the SHA-256 of its canonical path's bytes.
    fn entry_path(&self, path: &Path) -> io::Result<PathBuf> {
        let canonical = std::fs::canonicalize(path)?;
        let key = Digest::of(canonical.as_os_str().as_encoded_bytes());
        Ok(self.dir.join(key.to_string()))
    }

    /// The entry of `path` and when it was written (its mtime, in ns since the Unix epoch). A
    /// FIFO or a device in its place is refused at open, not read (or waited on).
    fn read_entry(&self, path: &Path) -> Option<(Entry, i128)> {
        let file = platform::open_regular(&self.entry_path(path).ok()?).ok()?;
        let written_ns = platform::file_identity(&file).ok()?.mtime_ns;
        let mut text = Vec::new();
        file.take(MAX_ENTRY + 1).read_to_end(&mut text).ok()?;
        Some((Entry::parse(&text)?, written_ns))
    }
}

/// Whether a change to the file made after its identity was read could have left that identity
/// as it was: the entry was written within the tick of the file's last change, or before it.
fn racy(identity: &FileIdentity, written_ns: i128) -> bool {
    identity.mtime_ns >= written_ns || identity.ctime_ns >= written_ns
}

/// One entry's content.
#[derive(Debug, PartialEq, Eq)]
struct Entry {
    identity: FileIdentity,
    digest: Digest,
}

impl Entry {
    fn line(&self) -> String {
        let FileIdentity {
            device,
            inode,
            size,
            mtime_ns,
            ctime_ns,
        } = self.identity;
        format!(
            "v1 {device} {inode} {size} {mtime_ns} {ctime_ns} {}\n",
            self.digest
        )
    }

    /// Exactly the text [`Entry::line`] writes, or None: no sign, leading zero, upper-case hex,
    /// `sha256:` prefix, extra space or missing newline is taken.
    fn parse(text: &[u8]) -> Option<Entry> {
        let text = std::str::from_utf8(text).ok()?;
        let mut fields = text.strip_suffix('\n')?.split(' ');
        if fields.next()? != "v1" {
            return None;
        }
        let mut number = || fields.next()?.parse::<i128>().ok();
        let (device, inode, size) = (number()?, number()?, number()?);
        let (mtime_ns, ctime_ns) = (number()?, number()?);
        let digest = fields.next()?.parse().ok()?;
        if fields.next().is_some() {
            return None;
        }
        let entry = Entry {
            identity: FileIdentity {
                device: device.try_into().ok()?,
                inode: inode.try_into().ok()?,
                size: size.try_into().ok()?,
                mtime_ns,
                ctime_ns,
            },
            digest,
        };
        (entry.line() == text).then_some(entry)
    }
}

/// Writes `bytes` to a new temporary file beside `path` and renames it over `path`; the
/// temporary file is removed when that fails.
fn replace(path: &Path, bytes: &[u8]) -> io::Result<()> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let temp = path.with_file_name(format!(
        ".{name}.{}.{}.tmp",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let mut options = std::fs::OpenOptions::new();
    // A new file only: two processes with the same id (containers sharing the record) cannot
    // write into one temporary file.
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let written = (|| {
        options.open(&temp)?.write_all(bytes)?;
        std::fs::rename(&temp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&temp);
    }
    written
}

fn create_private_dir(dir: &Path) -> io::Result<()> {
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
    builder.create(dir)
}

/// Unix: an error when group or others may write `dir`.
fn refuse_shared(dir: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir)
            .map_err(|source| Error::Open {
                path: dir.to_path_buf(),
                source,
            })?
            .permissions()
            .mode();
        if mode & 0o022 != 0 {
            return Err(Error::Argument(format!(
                "verify cache {}: group or others may write it (mode {:o}), and whoever can \
                 write it can make a changed file skip its hash; `chmod go-w` it or name \
                 another directory",
                dir.display(),
                mode & 0o7777
            )));
        }
    }
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Remembers `path` as hashing to `digest(name)`, its identity read now.
    fn remember(record: &Record, path: &Path, file: &File, name: &str) {
        let before = Record::identity(file).unwrap();
        record.remember(path, file, &before, &digest(name)).unwrap();
    }
    use std::time::{Duration, SystemTime};

    /// A fresh directory for one test; removed by [`Scratch`]'s drop.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(tag: &str) -> Scratch {
            let dir =
                std::env::temp_dir().join(format!("safeload-record-{}-{tag}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Scratch(dir)
        }

        /// A file of `bytes` in the scratch directory, and a handle open on it to read.
        fn file(&self, name: &str, bytes: &[u8]) -> (PathBuf, File) {
            let path = self.0.join(name);
            std::fs::write(&path, bytes).unwrap();
            let file = File::open(&path).unwrap();
            (path, file)
        }

        fn record(&self) -> Record {
            Record::open(&self.0.join("record")).unwrap()
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn digest(text: &str) -> Digest {
        Digest::of(text.as_bytes())
    }

    /// Dates the entry of `path` `offset` after the file's last change (before it when negative):
    /// as if recorded that much later, with no wait on the clock.
    fn date_entry(record: &Record, path: &Path, file: &File, offset_s: i64) {
        let changed = platform::file_identity(file).unwrap();
        let last_ns = changed.mtime_ns.max(changed.ctime_ns);
        let at_ns = last_ns + i128::from(offset_s) * 1_000_000_000;
        let at = SystemTime::UNIX_EPOCH + Duration::from_nanos(u64::try_from(at_ns).unwrap());
        let entry = std::fs::OpenOptions::new()
            .write(true)
            .open(record.entry_path(path).unwrap())
            .unwrap();
        entry.set_modified(at).unwrap();
    }

    /// Writes `text` as the entry of `path`, dated well after the file's last change.
    fn write_entry(record: &Record, path: &Path, file: &File, text: &[u8]) {
        std::fs::write(record.entry_path(path).unwrap(), text).unwrap();
        date_entry(record, path, file, 3600);
    }

    fn entry_text(record: &Record, path: &Path) -> String {
        std::fs::read_to_string(record.entry_path(path).unwrap()).unwrap()
    }

    #[test]
    fn a_remembered_file_is_known_under_its_digest_only() {
        let scratch = Scratch::new("known");
        let (path, file) = scratch.file("model.safetensors", b"tensor bytes");
        let record = scratch.record();
        assert!(!record.knows(&path, &file, &digest("a")));
        remember(&record, &path, &file, "a");
        date_entry(&record, &path, &file, 3600);
        assert!(record.knows(&path, &file, &digest("a")));
        assert!(!record.knows(&path, &file, &digest("b")));
        // Another spelling of the same path finds the same entry.
        let dotted = scratch.0.join(".").join("model.safetensors");
        assert!(record.knows(&dotted, &file, &digest("a")));
    }

    #[test]
    fn remembering_again_replaces_the_entry_and_leaves_no_temporary_file() {
        let scratch = Scratch::new("replace");
        let (path, file) = scratch.file("model.safetensors", b"tensor bytes");
        let record = scratch.record();
        remember(&record, &path, &file, "a");
        remember(&record, &path, &file, "b");
        date_entry(&record, &path, &file, 3600);
        assert!(record.knows(&path, &file, &digest("b")));
        assert!(!record.knows(&path, &file, &digest("a")));
        let names: Vec<_> = std::fs::read_dir(&record.dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
        assert!(names[0].len() == 64 && names[0].bytes().all(|b| b.is_ascii_hexdigit()));
    }

    /// The identity read before the hash differs from the file's after it: nothing is written.
    #[test]
    fn a_file_that_changed_while_it_was_hashed_is_not_remembered() {
        let scratch = Scratch::new("changed");
        let (path, file) = scratch.file("model.safetensors", b"tensor bytes");
        let record = scratch.record();
        let mut before = Record::identity(&file).unwrap();
        before.size += 1;
        assert!(
            !record
                .remember(&path, &file, &before, &digest("a"))
                .unwrap()
        );
        assert!(std::fs::read_dir(&record.dir).unwrap().next().is_none());
    }

    /// Each of the five fields decides alone: an entry that differs from the file in one of them
    /// only is not known.
    #[test]
    fn every_field_of_the_identity_counts() {
        let scratch = Scratch::new("fields");
        let (path, file) = scratch.file("model.safetensors", b"tensor bytes");
        let record = scratch.record();
        let id = platform::file_identity(&file).unwrap();
        let with = |change: fn(&mut FileIdentity)| {
            let mut identity = id;
            change(&mut identity);
            identity
        };
        let changed = [
            ("device", with(|id| id.device ^= 1)),
            ("inode", with(|id| id.inode ^= 1)),
            ("size", with(|id| id.size += 1)),
            ("mtime", with(|id| id.mtime_ns -= 1)),
            ("ctime", with(|id| id.ctime_ns -= 1)),
        ];
        for (field, identity) in changed {
            let entry = Entry {
                identity,
                digest: digest("a"),
            };
            write_entry(&record, &path, &file, entry.line().as_bytes());
            assert!(!record.knows(&path, &file, &digest("a")), "{field}");
        }
        let unchanged = Entry {
            identity: id,
            digest: digest("a"),
        };
        write_entry(&record, &path, &file, unchanged.line().as_bytes());
        assert!(record.knows(&path, &file, &digest("a")));
    }

    /// Same size, new bytes, the old mtime put back: not known. Either the rewrite moved the
    /// ctime, or it fell in the tick the entry was written in, which the racy rule refuses; so
    /// this holds whatever the clock's granularity.
    #[test]
    fn a_file_rewritten_in_place_with_its_old_mtime_is_not_known() {
        let scratch = Scratch::new("rewrite");
        let (path, file) = scratch.file("model.safetensors", b"tensor bytes");
        let record = scratch.record();
        remember(&record, &path, &file, "a");
        let old_mtime = file.metadata().unwrap().modified().unwrap();
        let mut writer = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        writer.write_all(b"TENSOR BYTES").unwrap();
        writer.set_modified(old_mtime).unwrap();
        assert_eq!(file.metadata().unwrap().modified().unwrap(), old_mtime);
        assert!(!record.knows(&path, &file, &digest("a")));
    }

    /// An entry written in the tick of the file's last change, or before it, is not trusted.
    #[test]
    fn an_entry_not_written_after_the_last_change_is_not_known() {
        let scratch = Scratch::new("racy");
        let (path, file) = scratch.file("model.safetensors", b"tensor bytes");
        let record = scratch.record();
        remember(&record, &path, &file, "a");
        date_entry(&record, &path, &file, -3600);
        assert!(!record.knows(&path, &file, &digest("a")));
        date_entry(&record, &path, &file, 3600);
        assert!(record.knows(&path, &file, &digest("a")));
        let id = platform::file_identity(&file).unwrap();
        assert!(racy(&id, id.ctime_ns));
        assert!(racy(&id, id.mtime_ns));
        assert!(!racy(&id, id.mtime_ns.max(id.ctime_ns) + 1));
    }

    #[test]
    fn anything_but_the_exact_line_is_not_known() {
        let scratch = Scratch::new("corrupt");
        let (path, file) = scratch.file("model.safetensors", b"tensor bytes");
        let record = scratch.record();
        let id = platform::file_identity(&file).unwrap();
        let good = Entry {
            identity: id,
            digest: digest("a"),
        }
        .line();
        let hex = digest("a").to_string();
        let fields = |digest: &str| {
            format!(
                "{} {} {} {} {} {digest}",
                id.device, id.inode, id.size, id.mtime_ns, id.ctime_ns
            )
        };
        let bad = [
            String::new(),
            "\n".to_string(),
            good.trim_end().to_string(),
            good[..good.len() / 2].to_string(),
            format!("v2 {}\n", fields(&hex)),
            format!("v1  {}\n", fields(&hex)),
            format!("v1 {}\r\n", fields(&hex)),
            format!("v1 {} extra\n", fields(&hex)),
            format!("v1 {}\n\n", fields(&hex)),
            format!("v1 {}\n", fields(&hex.to_uppercase())),
            format!("v1 {}\n", fields(&format!("sha256:{hex}"))),
            format!("v1 {}\n", fields(&hex[1..])),
            format!("v1 +{}\n", fields(&hex)),
            format!("v1 0{}\n", fields(&hex)),
            good.replace(' ', "\t"),
            good.repeat(2),
            format!("{good}{}", " ".repeat(MAX_ENTRY as usize)),
        ];
        for text in &bad {
            write_entry(&record, &path, &file, text.as_bytes());
            assert!(!record.knows(&path, &file, &digest("a")), "{text:?}");
        }
        write_entry(&record, &path, &file, b"v1 \xff\xfe\n");
        assert!(!record.knows(&path, &file, &digest("a")));
        write_entry(&record, &path, &file, good.as_bytes());
        assert!(record.knows(&path, &file, &digest("a")));
        assert_eq!(entry_text(&record, &path), good);
    }

    /// A FIFO where the entry should be is not known, at once (a plain open would wait for a
    /// writer for ever).
    #[cfg(unix)]
    #[test]
    fn a_fifo_in_place_of_the_entry_is_not_known() {
        let scratch = Scratch::new("fifo");
        let (path, file) = scratch.file("model.safetensors", b"tensor bytes");
        let record = scratch.record();
        let made = std::process::Command::new("mkfifo")
            .arg(record.entry_path(&path).unwrap())
            .status()
            .unwrap();
        assert!(made.success());
        assert!(!record.knows(&path, &file, &digest("a")));
    }

    #[test]
    fn a_missing_directory_is_created_private() {
        let scratch = Scratch::new("create");
        let dir = scratch.0.join("a").join("b");
        let record = Record::open(&dir).unwrap();
        assert!(dir.is_dir());
        let (path, file) = scratch.file("model.safetensors", b"tensor bytes");
        remember(&record, &path, &file, "a");
        assert!(record.entry_path(&path).unwrap().starts_with(&dir));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode(&dir), 0o700);
            assert_eq!(mode(&record.entry_path(&path).unwrap()), 0o600);
        }
    }

    #[cfg(unix)]
    #[test]
    fn a_directory_others_may_write_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let scratch = Scratch::new("shared");
        let dir = scratch.0.join("shared");
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let err = Record::open(&dir).unwrap_err().to_string();
        assert!(
            err.contains("group or others may write it (mode 777)"),
            "{err}"
        );
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        Record::open(&dir).unwrap();
    }

    #[test]
    fn the_setting_names_a_directory_or_nothing() {
        let scratch = Scratch::new("setting");
        assert!(Record::from_setting(None).unwrap().is_none());
        assert!(Record::from_setting(Some("".as_ref())).unwrap().is_none());
        let dir = scratch.0.join("from-env");
        let record = Record::from_setting(Some(dir.as_os_str()))
            .unwrap()
            .unwrap();
        assert_eq!(record.dir, dir);
        assert!(dir.is_dir());
    }
}
