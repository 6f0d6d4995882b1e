//! Destination memory: aligned, huge-page backed allocations, carved into per-tensor byte ranges
//! that keep their allocation alive. Most of the crate's `unsafe` lives here.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;
use std::sync::Arc;

use crate::platform;
use crate::read::pool::Mapping;

/// Alignment of every tensor start (cache line; what vectorised kernels expect).
pub const TENSOR_ALIGN: usize = 64;
/// Tensors at least this large get an allocation of their own.
pub const OWN_ALLOCATION_BYTES: usize = 1 << 20;
/// Allocations at least this large are 2 MiB aligned and advised to use transparent huge pages.
pub const HUGE_PAGE: usize = 2 << 20;
/// Small tensors are packed into arenas of at most this size.
pub const ARENA_BYTES: usize = 8 << 20;

/// A region of memory tensor bytes live in (owned, a file map, or someone else's); every byte
/// initialised (zeroed or earlier bytes) so readers can borrow it.
pub enum Region {
    /// Small: from the global allocator.
    Heap { ptr: NonNull<u8>, len: usize },
    /// Large: an aligned, huge-page advised anonymous mapping, fresh or reused from the pool.
    Mapped { mapping: Mapping, len: usize },
    /// A private (copy-on-write) map of a file, for the mmap backend, with the file, its path
    /// and its length at open (to tell whether it still covers a view: [`TensorBytes::checked`]).
    Map {
        map: memmap2::MmapMut,
        file: std::fs::File,
        path: std::path::PathBuf,
        was: u64,
    },
    /// Memory someone else owns (a device buffer's host alias), alive as long as `keep` is.
    External {
        ptr: NonNull<u8>,
        len: usize,
        keep: Box<dyn std::any::Any + Send + Sync>,
    },
}

// SAFETY: the storage is plain memory; concurrent writers only touch disjoint ranges (enforced by
// the read plan), and Python readers only see a range after its reader finished.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl Region {
    /// A file's map: its faults read the page they need, nothing around it (parts of the file
    /// are read by range: `read::source::Source::read_slice`). Nothing for other memory.
    pub fn advise_random(&self) {
        if let Region::Map { map, .. } = self {
            crate::platform::advise_map_random(map);
        }
    }

    /// `len` bytes, 64-byte aligned (2 MiB and huge pages when large), initialised (zeroed, or an
    /// earlier load's bytes when pooled memory is reused).
    pub fn alloc(len: usize) -> std::io::Result<Region> {
        if len >= HUGE_PAGE {
            return Self::alloc_mapped(len);
        }
        let layout = Layout::from_size_align(len.max(1), TENSOR_ALIGN)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::OutOfMemory, e))?;
        // SAFETY: layout has non-zero size. Zeroed, so every byte is initialised before a reader
        // borrows it as `&mut [u8]` (calloc'd fresh pages cost nothing extra).
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) }).ok_or_else(oom)?;
        crate::read::memory::account(len as i64);
        Ok(Region::Heap { ptr, len })
    }

    /// Anonymous memory aligned to the platform's map alignment (2 MiB on Linux; what uncached reads
    /// need too), advised to use huge pages where that cannot stall; memory freed by an earlier
    /// load is reused when one of a similar size is pooled (see [`crate::read::pool`]).
    pub fn alloc_mapped(len: usize) -> std::io::Result<Region> {
        let mapping = Mapping::take(len)?;
        if huge_pages_enabled() {
            platform::advise_huge_pages(mapping.as_ptr(), mapping.capacity());
        }
        Ok(Region::Mapped { mapping, len })
    }

    pub fn len(&self) -> usize {
        match self {
            Region::Heap { len, .. }
            | Region::Mapped { len, .. }
            | Region::External { len, .. } => *len,
            Region::Map { map, .. } => map.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The whole allocation as bytes, for a scratch buffer its owner reads into; None for
    /// allocator memory, which may be uninitialised, and for memory owned elsewhere.
    pub fn as_bytes_mut(&mut self) -> Option<&mut [u8]> {
        if matches!(self, Region::Heap { .. } | Region::External { .. }) {
            return None;
        }
        // SAFETY: `len` bytes from the start are ours; `&mut self` makes this the only access;
        // mapped memory comes zeroed from the OS or holds an earlier load's bytes, and a file
        // map holds the file's bytes.
        Some(unsafe { std::slice::from_raw_parts_mut(self.as_mut_ptr(), self.len()) })
    }

    /// First byte; writable (anonymous and private maps only).
    pub fn as_mut_ptr(&self) -> *mut u8 {
        match self {
            Region::Heap { ptr, .. } => ptr.as_ptr(),
            Region::Mapped { mapping, .. } => mapping.as_ptr().as_ptr(),
            Region::Map { map, .. } => map.as_ptr() as *mut u8,
            Region::External { ptr, .. } => ptr.as_ptr(),
        }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // Mapped storage goes back through its Mapping (to the pool or the OS); maps unmap.
        if let Region::Heap { ptr, len } = *self {
            let layout =
                Layout::from_size_align(len.max(1), TENSOR_ALIGN).expect("checked at alloc");
            // SAFETY: allocated in `alloc` with this layout.
            unsafe { dealloc(ptr.as_ptr(), layout) };
            crate::read::memory::account(-(len as i64));
        }
    }
}

/// Whether large destinations are advised to use transparent huge pages.
///
/// Measured on the dev machine (docs/backends.md, "Huge pages"): where the kernel compacts memory on a
/// huge-page fault (`defrag` = `always`, `madvise` or `defer+madvise`), the first touch of fresh
/// memory in a process runs at 0.4-1 GiB/s against 2.4-4 GiB/s for 4 KiB pages, so advising only
/// pays where faults cannot stall (`defer`, `never`). `SAFELOAD_HUGE_PAGES=1`/`0` overrides.
pub fn huge_pages_enabled() -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENABLED.get_or_init(|| match std::env::var("SAFELOAD_HUGE_PAGES").as_deref() {
        Ok("1") => true,
        Ok("0") => false,
        _ => platform::huge_page_faults_cannot_stall(),
    })
}

fn oom() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::OutOfMemory, "out of memory")
}

/// The bytes of one tensor: a range of a shared `Region` that keeps it alive.
#[derive(Clone)]
pub struct TensorBytes {
    storage: Option<Arc<Region>>,
    offset: usize,
    len: usize,
}

impl TensorBytes {
    pub fn empty() -> Self {
        TensorBytes {
            storage: None,
            offset: 0,
            len: 0,
        }
    }

    pub fn new(storage: Arc<Region>, offset: usize, len: usize) -> Self {
        assert!(
            offset
                .checked_add(len)
                .is_some_and(|end| end <= storage.len())
        );
        TensorBytes {
            storage: Some(storage),
            offset,
            len,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Start of the range; writable (every storage is private to this process).
    pub fn as_mut_ptr(&self) -> *mut u8 {
        match &self.storage {
            // SAFETY: offset <= storage.len() (checked in `new`).
            Some(s) => unsafe { s.as_mut_ptr().add(self.offset) },
            None => NonNull::<u8>::dangling().as_ptr(),
        }
    }

    /// Reads the bytes. Only valid once a reader has filled them.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the range is in bounds and, by the contract above, initialised.
        unsafe { std::slice::from_raw_parts(self.as_mut_ptr(), self.len) }
    }

    /// `len` of these bytes from `at` (within them), sharing their memory.
    pub fn sub(&self, at: usize, len: usize) -> TensorBytes {
        assert!(at.checked_add(len).is_some_and(|end| end <= self.len));
        match &self.storage {
            _ if len == 0 => TensorBytes::empty(),
            Some(storage) => TensorBytes::new(storage.clone(), self.offset + at, len),
            None => TensorBytes::empty(),
        }
    }

    /// The region these bytes are a range of (None for empty bytes).
    pub fn region(&self) -> Option<&Arc<Region>> {
        self.storage.as_ref()
    }

    /// These bytes as they may be handed out now: a view of a file's map that the file no
    /// longer covers (it shrank under the map since the view was made, so a touch would raise
    /// SIGBUS) is an error naming the file and `tensor`. One `lseek` for a view of a map;
    /// nothing for memory of our own.
    pub fn checked(self, tensor: &str) -> crate::error::Result<TensorBytes> {
        let Some(Region::Map {
            file, path, was, ..
        }) = self.storage.as_deref()
        else {
            return Ok(self);
        };
        let len = crate::platform::file_len(file).unwrap_or(0);
        if len >= (self.offset + self.len) as u64 {
            return Ok(self);
        }
        Err(crate::error::Error::Shrank {
            path: path.clone(),
            tensor: tensor.to_string(),
            len,
            was: *was,
        })
    }

    /// What keeps memory owned elsewhere alive (`Fresh::external`); None for our own memory.
    pub fn keep(&self) -> Option<&(dyn std::any::Any + Send + Sync)> {
        match self.storage.as_deref() {
            Some(Region::External { keep, .. }) => Some(keep.as_ref()),
            _ => None,
        }
    }
}

/// A newly allocated tensor range that no one else can see yet: the one place a reader may
/// borrow tensor memory mutably. Not `Clone`; [`Fresh::into_shared`] hands it out once filled.
pub struct Fresh(TensorBytes);

impl Fresh {
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// The bytes as they are now (tests check what a reader wrote).
    #[cfg(test)]
    pub fn as_slice(&self) -> &[u8] {
        self.0.as_slice()
    }

    /// The bytes, to be filled by a reader.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        if self.0.is_empty() {
            return &mut [];
        }
        // SAFETY: `allocate` gives every Fresh its own in-bounds range of an allocation whose
        // bytes are initialised; the inner TensorBytes has not been cloned (this type is not
        // Clone and only `into_shared` lets it out), so `&mut self` is the only access.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr(), self.0.len()) }
    }

    /// The filled bytes, shareable (with Python, with other views).
    pub fn into_shared(self) -> TensorBytes {
        self.0
    }

    /// `len` bytes at `ptr` that someone else owns (a device buffer's host alias), to be read
    /// into; `keep` keeps them alive and comes back from [`TensorBytes::keep`].
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes for as long as `keep` lives, and
    /// nothing else may touch those bytes until the returned value (or what it is shared into)
    /// hands them back.
    pub unsafe fn external(
        ptr: *mut u8,
        len: usize,
        keep: Box<dyn std::any::Any + Send + Sync>,
    ) -> Fresh {
        let ptr = NonNull::new(ptr).unwrap_or(NonNull::dangling());
        let storage = Region::External { ptr, len, keep };
        Fresh(TensorBytes::new(Arc::new(storage), 0, len))
    }
}

/// Gives each requested size a 64-byte aligned home: large sizes their own allocation, small ones
/// packed into shared arenas.
pub fn allocate(sizes: &[usize]) -> std::io::Result<Vec<Fresh>> {
    let mut out: Vec<TensorBytes> = Vec::with_capacity(sizes.len());
    let mut pending: Vec<(usize, usize)> = Vec::new(); // (index in out, offset in arena)
    let mut arena_len = 0usize;
    let flush =
        |out: &mut Vec<TensorBytes>, pending: &mut Vec<(usize, usize)>, arena_len: &mut usize| {
            if pending.is_empty() {
                return Ok::<(), std::io::Error>(());
            }
            let storage = Arc::new(Region::alloc(*arena_len)?);
            for &(i, offset) in pending.iter() {
                out[i] = TensorBytes::new(storage.clone(), offset, sizes[i]);
            }
            pending.clear();
            *arena_len = 0;
            Ok(())
        };
    for (i, &len) in sizes.iter().enumerate() {
        out.push(TensorBytes::empty());
        if len == 0 {
            continue;
        }
        if len >= OWN_ALLOCATION_BYTES {
            out[i] = TensorBytes::new(Arc::new(Region::alloc(len)?), 0, len);
            continue;
        }
        let offset = arena_len.next_multiple_of(TENSOR_ALIGN);
        if offset + len > ARENA_BYTES {
            flush(&mut out, &mut pending, &mut arena_len)?;
            pending.push((i, 0));
            arena_len = len;
        } else {
            pending.push((i, offset));
            arena_len = offset + len;
        }
    }
    flush(&mut out, &mut pending, &mut arena_len)?;
    Ok(out.into_iter().map(Fresh).collect())
}

/// The elements of `plan` cut out of a whole tensor's bytes (`whole`: its map view or the
/// read-ahead's copy) into new memory.
pub fn cut(
    plan: &crate::format::slice::SlicePlan,
    whole: &TensorBytes,
) -> crate::error::Result<TensorBytes> {
    let mut out = allocate(&[plan.nbytes])
        .map_err(|e| {
            crate::error::Error::Memory(format!(
                "cannot allocate {} bytes for a slice: {e}",
                plan.nbytes
            ))
        })?
        .pop()
        .expect("one size, one buffer");
    crate::format::slice::gather(plan, whole.as_slice(), out.as_mut_slice());
    Ok(out.into_shared())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alignment_and_disjointness() {
        let sizes = [3, 0, 100, OWN_ALLOCATION_BYTES, 5 * HUGE_PAGE + 7, 64, 1];
        let mut bufs = allocate(&sizes).unwrap();
        let mut ranges = Vec::new();
        for (b, &len) in bufs.iter_mut().zip(&sizes) {
            assert_eq!(b.len(), len);
            let bytes = b.as_mut_slice();
            let at = bytes.as_ptr() as usize;
            if len > 0 {
                assert_eq!(at % TENSOR_ALIGN, 0);
                ranges.push((at, at + len));
            }
            if len >= HUGE_PAGE {
                assert_eq!(at % platform::MAP_ALIGN, 0);
            }
            // Every byte initialised and writable.
            assert!(bytes.iter().all(|&x| x == 0) || len >= HUGE_PAGE);
            for (k, x) in bytes.iter_mut().enumerate() {
                *x = k as u8;
            }
        }
        ranges.sort();
        for w in ranges.windows(2) {
            assert!(w[0].1 <= w[1].0);
        }
    }
}
