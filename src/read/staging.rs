//! Accelerator loads through a ring of host staging buffers: the ring's size (arguments, the
//! environment, what the process may take) and the fills that bring tensors' bytes through it.
//! The copies out of the ring (CUDA streams, MPS, other devices) are the Python package's.

use crate::error::{Error, Result};

pub const DEFAULT_RING_BUFFERS: usize = 4;
pub const DEFAULT_BUFFER_BYTES: usize = 64 << 20;
/// Environment variable for the ring, e.g. "4x64MiB", "2x256MiB", "8x16777216".
pub const RING_ENV: &str = "SAFELOAD_STAGING_RING";
/// The default buffers shrink to fit what the process may take, down to this.
const MIN_DEFAULT_BUFFER_BYTES: usize = 8 << 20;

/// `"4x64MiB"` -> (4, 67108864): COUNTxSIZE, SIZE as [`crate::read::memory::parse_bytes`] reads it
/// (binary units); both at least 1.
pub fn parse_ring(text: &str) -> Option<(usize, usize)> {
    let (count, size) = text.split_once(['x', 'X', '*'])?;
    let count: usize = count.trim().parse().ok()?;
    let size = usize::try_from(crate::read::memory::parse_bytes(size)?).ok()?;
    (count >= 1 && size >= 1).then_some((count, size))
}

/// The ring to use: the arguments, else `$SAFELOAD_STAGING_RING`, else 4 x 64 MiB, the default
/// buffers smaller where a quarter of what the process may still take is less (8 MiB at least).
pub fn ring(ring_buffers: Option<usize>, buffer_bytes: Option<usize>) -> Result<(usize, usize)> {
    let (mut n, mut b) = (DEFAULT_RING_BUFFERS, DEFAULT_BUFFER_BYTES);
    match std::env::var(RING_ENV) {
        Ok(text) if !text.is_empty() => {
            (n, b) = parse_ring(&text).ok_or_else(|| {
                Error::Staging(format!(
                    "${RING_ENV}: ring {text:?}: expected COUNTxSIZE, e.g. 4x64MiB"
                ))
            })?;
        }
        // Only the default buffers are sized by what the process may take.
        _ if buffer_bytes.is_none() => {
            if let Some(available) = crate::read::memory::available() {
                let share = usize::try_from(available / 4).unwrap_or(usize::MAX) / n;
                b = b.min(share).max(MIN_DEFAULT_BUFFER_BYTES);
            }
        }
        _ => {}
    }
    let (n, b) = (ring_buffers.unwrap_or(n), buffer_bytes.unwrap_or(b));
    if n < 1 || b < 1 {
        return Err(Error::Staging(format!(
            "staging ring {n} x {b} bytes: both must be positive"
        )));
    }
    Ok((n, b))
}

/// One fill of a staging buffer (accelerator loads): `reads` are (data offset, length, offset in
/// the buffer), contiguous spans of the data area read with one call each; `copies` are (tensor
/// index, offset in the tensor's bytes, offset in the buffer, length), the pieces to copy out to
/// device tensors once the fill is read. `length` is the buffer bytes used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fill {
    pub source: usize,
    pub reads: Vec<(u64, usize, usize)>,
    pub length: usize,
    pub copies: Vec<(usize, usize, usize, usize)>,
}

/// The fills that bring the data-area spans `(begin, end)` of tensors (indexed as given) of one
/// source through staging buffers of `buffer_bytes`: tensors in offset order, small ones packed
/// together, large ones split across fills, contiguous tensors sharing one read. Zero-size
/// tensors need no fill.
pub fn staging_fills(spans: &[(usize, usize)], buffer_bytes: usize, source: usize) -> Vec<Fill> {
    let buffer_bytes = buffer_bytes.max(1);
    let mut order: Vec<usize> = (0..spans.len()).collect();
    order.sort_by_key(|&i| spans[i]);
    let mut fills = Vec::new();
    let mut current = Fill {
        source,
        reads: Vec::new(),
        length: 0,
        copies: Vec::new(),
    };
    let flush = |current: &mut Fill, fills: &mut Vec<Fill>| {
        let done = std::mem::replace(
            current,
            Fill {
                source,
                reads: Vec::new(),
                length: 0,
                copies: Vec::new(),
            },
        );
        if !done.copies.is_empty() {
            fills.push(done);
        }
    };
    for i in order {
        let (begin, end) = spans[i];
        let mut pos = begin;
        while pos < end {
            if current.length == buffer_bytes {
                flush(&mut current, &mut fills);
            }
            let take = (end - pos).min(buffer_bytes - current.length);
            match current.reads.last_mut() {
                Some((off, len, _)) if *off + *len as u64 == pos as u64 => *len += take,
                _ => current.reads.push((pos as u64, take, current.length)),
            }
            current.copies.push((i, pos - begin, current.length, take));
            current.length += take;
            pos += take;
        }
    }
    flush(&mut current, &mut fills);
    fills
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fills_pack_split_and_merge() {
        // a: 0..10, b: 10..30 (contiguous with a), empty at 30, c: 40..45 (a gap).
        let spans = [(10, 30), (0, 10), (30, 30), (40, 45)];
        let fills = staging_fills(&spans, 16, 2);
        assert_eq!(
            fills,
            vec![
                Fill {
                    source: 2,
                    reads: vec![(0, 16, 0)],
                    length: 16,
                    copies: vec![(1, 0, 0, 10), (0, 0, 10, 6)],
                },
                Fill {
                    source: 2,
                    reads: vec![(16, 14, 0), (40, 2, 14)],
                    length: 16,
                    copies: vec![(0, 6, 0, 14), (3, 0, 14, 2)],
                },
                Fill {
                    source: 2,
                    reads: vec![(42, 3, 0)],
                    length: 3,
                    copies: vec![(3, 2, 0, 3)],
                },
            ]
        );
        assert!(staging_fills(&[(5, 5)], 16, 0).is_empty());
    }

    #[test]
    fn rings_parse() {
        assert_eq!(parse_ring("4x64MiB"), Some((4, 64 << 20)));
        assert_eq!(parse_ring("2 x 256M"), Some((2, 256 << 20)));
        assert_eq!(parse_ring("8*4096"), Some((8, 4096)));
        assert_eq!(parse_ring("1X1GiB"), Some((1, 1 << 30)));
        for bad in ["", "4", "0x64MiB", "4x0", "x64MiB", "4x64PB", "-1x4"] {
            assert_eq!(parse_ring(bad), None, "{bad}");
        }
    }
}
