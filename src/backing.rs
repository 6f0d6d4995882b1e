//! What a [`crate::source::Source`] reads from: a local file (pread, uncached reads, maps), or an
//! object in a store read with ranged GETs (`remote`, the pread path only).

use std::fs::File;
use std::io;

use crate::platform;

pub enum Backing {
    File(File),
    #[cfg(feature = "remote")]
    Remote(crate::remote::Object),
}

impl Backing {
    /// The local file; None for an object in a store.
    pub fn file(&self) -> Option<&File> {
        match self {
            Backing::File(file) => Some(file),
            #[cfg(feature = "remote")]
            Backing::Remote(_) => None,
        }
    }

    pub fn is_remote(&self) -> bool {
        self.file().is_none()
    }

    /// Fills `buf` from `offset`, short only at the end; returns the bytes read.
    pub fn read_fully_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        match self {
            Backing::File(file) => platform::read_fully_at(file, buf, offset),
            #[cfg(feature = "remote")]
            Backing::Remote(object) => object.read_fully_at(buf, offset),
        }
    }
}
