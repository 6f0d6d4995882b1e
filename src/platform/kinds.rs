//! What the platform files share: the kinds of filesystem and of file they tell apart, the
//! uncached handle and a file's identity they return. `mod.rs` re-exports them; the platform
//! files use them from here, never from `mod.rs` (which calls them).

use std::fs::{File, FileType};
use std::io;

/// Where a file's bytes come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsKind {
    /// A local block-device filesystem (ext4, xfs, btrfs, overlay ...).
    Local,
    /// Memory-backed (tmpfs, ramfs): already in RAM, O_DIRECT pointless or refused.
    Memory,
    /// Network or userspace: FUSE (hf-mount, s3fs, virtiofs ...), NFS, SMB, Lustre, CephFS, GPFS, 9p.
    Network(&'static str),
}

impl FsKind {
    pub fn name(self) -> &'static str {
        match self {
            FsKind::Local => "local",
            FsKind::Memory => "memory",
            FsKind::Network(name) => name,
        }
    }
}

/// A second handle on a file that reads around the page cache.
#[derive(Debug)]
pub struct Uncached {
    pub file: File,
    /// Offsets, lengths and addresses of reads must be multiples of this (1: no rule).
    pub align: u64,
}

/// Which file an open handle is and when it last changed, as the OS tells it from the handle
/// (never a second lookup of a path): what [`crate::checkpoint::record`] trusts a file's bytes by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileIdentity {
    /// The filesystem holding the file: Unix `st_dev`, Windows the volume serial number.
    pub device: u64,
    /// The file on that filesystem: Unix `st_ino`, Windows the 64-bit file index.
    pub inode: u64,
    pub size: u64,
    /// Last write of the bytes, in ns since the Unix epoch; whoever may write the file can set it.
    pub mtime_ns: i128,
    /// Last change of the bytes or the attributes (Unix `st_ctime`, Windows `ChangeTime`), in ns
    /// since the Unix epoch. Unix sets it from the kernel's clock only; Windows lets whoever may
    /// write the file's attributes set it.
    pub ctime_ns: i128,
}

/// `Ok` when `file` (just opened without blocking) is a regular file; else the error naming what
/// it is (`special_kind`: the platform's words for it).
pub fn regular(file: &File, special_kind: fn(&FileType) -> &'static str) -> io::Result<()> {
    let kind = file.metadata()?.file_type();
    if kind.is_file() {
        return Ok(());
    }
    if kind.is_dir() {
        return Err(io::Error::new(
            io::ErrorKind::IsADirectory,
            "Is a directory",
        ));
    }
    Err(io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("not a regular file: {}", special_kind(&kind)),
    ))
}
