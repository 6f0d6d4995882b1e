//! A file to write cut into pieces that workers write side by side: each large run of bytes (a
//! tensor's memory, the header) in pieces of at most [`PIECE`] written straight from where it
//! lies, and runs of small ones gathered into one piece of at most [`GATHER`] (copied into the
//! worker's scratch, then written with one call), so 20,000 small tensors are a few hundred writes.

/// The most one piece writes straight from the caller's memory.
pub const PIECE: usize = 16 << 20;
/// The most one gathered piece holds (the size of each worker's scratch buffer).
pub const GATHER: usize = 4 << 20;
/// A run at least this long is written from where it lies, never gathered.
const DIRECT: usize = 1 << 20;

/// What one piece writes at `offset` of file `file`: one run from its memory, or several short
/// ones back to back.
#[derive(Debug, PartialEq, Eq)]
pub struct Piece<'a> {
    pub file: usize,
    pub offset: u64,
    pub runs: Vec<&'a [u8]>,
}

impl Piece<'_> {
    pub fn len(&self) -> usize {
        self.runs.iter().map(|r| r.len()).sum()
    }
}

/// The pieces of file `file`, whose bytes are `runs` back to back from offset 0, in file order.
pub fn cut<'a>(file: usize, runs: impl IntoIterator<Item = &'a [u8]>, out: &mut Vec<Piece<'a>>) {
    let mut offset = 0u64;
    let mut gathered: Option<Piece<'a>> = None;
    for run in runs {
        if run.is_empty() {
            continue;
        }
        if run.len() >= DIRECT {
            out.extend(gathered.take());
            for part in run.chunks(PIECE) {
                out.push(Piece {
                    file,
                    offset,
                    runs: vec![part],
                });
                offset += part.len() as u64;
            }
            continue;
        }
        if gathered
            .as_ref()
            .is_some_and(|g| g.len() + run.len() > GATHER)
        {
            out.extend(gathered.take());
        }
        let g = gathered.get_or_insert_with(|| Piece {
            file,
            offset,
            runs: Vec::new(),
        });
        g.runs.push(run);
        offset += run.len() as u64;
    }
    out.extend(gathered);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(pieces: &[Piece<'_>]) -> Vec<(u64, Vec<usize>)> {
        (pieces.iter())
            .map(|p| (p.offset, p.runs.iter().map(|r| r.len()).collect()))
            .collect()
    }

    #[test]
    fn large_runs_are_split_and_small_ones_gathered() {
        let big = vec![0u8; PIECE + 5];
        let small = vec![1u8; 1000];
        let header = [2u8; 64];
        let mut out = Vec::new();
        cut(3, [&header[..], &small, &big, &small, &small], &mut out);
        assert_eq!(
            shape(&out),
            vec![
                (0, vec![64, 1000]),
                (1064, vec![PIECE]),
                (1064 + PIECE as u64, vec![5]),
                (1069 + PIECE as u64, vec![1000, 1000]),
            ]
        );
        assert!(out.iter().all(|p| p.file == 3));
    }

    #[test]
    fn gathers_stop_at_their_size_and_empty_runs_are_skipped() {
        let small = vec![0u8; DIRECT - 1];
        let runs: Vec<&[u8]> = vec![&small, &[], &small, &small, &small, &small];
        let mut out = Vec::new();
        cut(0, runs, &mut out);
        let per = GATHER / (DIRECT - 1);
        assert_eq!(out[0].runs.len(), per);
        assert_eq!(out.iter().map(|p| p.runs.len()).sum::<usize>(), 5);
        let mut at = 0;
        for p in &out {
            assert_eq!(p.offset, at);
            assert!(p.len() <= GATHER);
            at += p.len() as u64;
        }
        assert_eq!(at, 5 * (DIRECT as u64 - 1));
    }

    #[test]
    fn nothing_to_write_is_no_piece() {
        let mut out = Vec::new();
        cut(0, std::iter::empty(), &mut out);
        assert!(out.is_empty());
    }
}
