//! What only Linux has, as the other platforms answer it: no FUSE connection settings to read,
//! no populate or prefault call (the caller hints, or the writes fault), no transparent huge
//! pages. `macos.rs` and `windows.rs` re-export these rather than each writing them out.

use std::fs::File;
use std::ptr::NonNull;

/// No FUSE connection settings to read here.
pub fn fuse_requests_in_flight(_file: &File) -> Option<usize> {
    None
}

/// No populate call here: the caller hints instead.
pub fn populate_mapped(_ptr: NonNull<u8>, _len: usize) -> bool {
    false
}

/// No prefault call here: the writes fault.
pub fn prefault(_ptr: *mut u8, _len: usize) {}

pub fn advise_huge_pages(_ptr: NonNull<u8>, _len: usize) {}

pub fn huge_page_faults_cannot_stall() -> bool {
    false
}
