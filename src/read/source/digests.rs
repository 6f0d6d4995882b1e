//! Whole files read for their SHA-256 (`safeload hash`): every byte of every file with the
//! parallel reader, in rounds of at most a given number of bytes into one buffer reused from
//! round to round, so a file larger than memory hashes. The files of a round are read side by
//! side, their chunks taking turns, so that several files hash at once (one file's hash is one
//! core's work).

use std::path::PathBuf;

use crate::error::{Error, Result};
use crate::format::digest::Digest;
use crate::read::buffer;
use crate::read::counts::ReadCounts;
use crate::read::plan::ChunkPlan;
use crate::read::strategy::{self, Backend, Purpose, Strategy};

use super::{ReadOptions, Source, chunk_bytes, execute};

/// The SHA-256 of each of `paths` (files or URLs, with the stores' `store` options), in order,
/// and what the reads did: every byte read once with the parallel reader (`backend` as for a
/// read into memory), in rounds of at most `max_bytes` into one buffer, several files side by
/// side. `poll` returns true to cancel.
pub fn hash_files(
    paths: &[PathBuf],
    backend: Backend,
    opts: &ReadOptions,
    store: &crate::storage::remote::Options,
    max_bytes: u64,
    poll: &mut dyn FnMut() -> bool,
) -> Result<(Vec<Digest>, ReadCounts)> {
    let opts = ReadOptions {
        hash: true,
        ..*opts
    };
    let backend = backend.check(opts.drop_cache, opts.hash)?;
    let sources = (paths.iter())
        .map(|p| Source::open_with(p, store))
        .collect::<Result<Vec<_>>>()?;
    let sources: Vec<&Source> = sources.iter().collect();
    // Each file by its plan for a copy that passes every byte through the reader.
    let strategies: Vec<Strategy> = (sources.iter())
        .map(|s| {
            let (resolved, cached) = strategy::resolve(backend, &s.facts(true), || s.cached());
            let known = strategy::Known {
                resolved,
                cached,
                direct_refused: false,
                pinned: false,
            };
            strategy::strategy_of(&known, Purpose::Copies)
        })
        .collect();
    let (report, digests) = super::hashed(&sources, || {
        read_rounds(&sources, &strategies, &opts, max_bytes, poll)
    })?;
    Ok((digests, report))
}

/// Every byte of `sources` read, each with its strategy in `strategies` (Pread or Direct), in
/// rounds of at most `max_bytes` (at least one byte) into one buffer, several files side by side,
/// its reads hashing (`opts.hash`): what [`hash_files`] hashes; what the reads did.
fn read_rounds(
    sources: &[&Source],
    strategies: &[Strategy],
    opts: &ReadOptions,
    max_bytes: u64,
    poll: &mut dyn FnMut() -> bool,
) -> Result<ReadCounts> {
    debug_assert!(opts.hash, "hash_files asks the reads to hash");
    let data: Vec<u64> = sources.iter().map(|s| s.header.data_len()).collect();
    let room = max_bytes.clamp(1, data.iter().sum::<u64>().max(1));
    crate::read::pool::ensure_fits(room, || format!("hashing {} files", sources.len()))?;
    let mut buffer = buffer::allocate(&[room as usize])
        .map_err(|e| Error::Memory(format!("cannot allocate {room} bytes to hash files: {e}")))?
        .pop()
        .expect("one size, one buffer");
    let chunk = chunk_bytes(sources, opts);
    // Every file with bytes left, as many as get a chunk each: more hashes than workers keep
    // every worker hashing until the end.
    let side_by_side = (room as usize / chunk).clamp(1, sources.len().max(1));
    let mut done = vec![0u64; sources.len()];
    let mut report = ReadCounts::default();
    loop {
        let unread = (0..sources.len()).filter(|&i| done[i] < data[i]);
        let round: Vec<usize> = unread.take(side_by_side).collect();
        if round.is_empty() {
            break;
        }
        let share = room as usize / round.len();
        let mut spans = Vec::with_capacity(round.len());
        let mut rest = buffer.as_mut_slice();
        for &i in &round {
            let take = share.min((data[i] - done[i]) as usize);
            let (dest, tail) = std::mem::take(&mut rest).split_at_mut(take);
            rest = tail;
            spans.push((i, done[i], dest));
            done[i] += take as u64;
        }
        let plan = interleaved(sources, spans, chunk);
        let read = execute(sources, &plan, strategies, opts, poll)?;
        report.bytes += read.bytes;
        report.seconds += read.seconds;
        report.threads = report.threads.max(read.threads);
        report.direct_refused |= read.direct_refused;
    }
    Ok(report)
}

/// A plan of `spans` (file, data-area offset, destination) whose chunks take turns between the
/// files ([`ChunkPlan::take_turns`]), so that the workers start every file's hash at once.
fn interleaved<'d>(
    sources: &[&Source],
    spans: Vec<(usize, u64, &'d mut [u8])>,
    chunk: usize,
) -> ChunkPlan<'d> {
    let mut plan = ChunkPlan::new(chunk);
    for (file, at, dest) in spans {
        add_span(&mut plan, file, sources[file], at, dest);
    }
    plan.take_turns(strategy::files_hashed_at_once());
    plan
}

/// Adds the data-area bytes of `source` from `begin` on into `dest` to `plan` (as file `file`),
/// cut at tensor boundaries so that a read error names the tensor. The header's rules make the
/// tensors one contiguous run over the data area.
fn add_span<'d>(
    plan: &mut ChunkPlan<'d>,
    file: usize,
    source: &Source,
    begin: u64,
    dest: &'d mut [u8],
) {
    let tensors = &source.header.tensors;
    let mut at = begin as usize;
    let mut rest = dest;
    for t in &tensors[tensors.partition_point(|t| t.end <= at)..] {
        if rest.is_empty() {
            break;
        }
        let take = (t.end - at).min(rest.len());
        let (here, tail) = std::mem::take(&mut rest).split_at_mut(take);
        rest = tail;
        plan.add(file, source.header.data_start() + at as u64, here, &t.name);
        at += take;
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::checkpoint::Checkpoint;
    use crate::format::digest::sha256sum;
    use crate::format::dtype::Dtype;
    use crate::format::serialize::TensorIn;
    use crate::storage::write::to_file;

    /// Writes a file of several dtypes (about `scale` x 10 MB: 16-bit ones that convert, odd
    /// sizes, an empty tensor) with the crate's writer; returns its bytes.
    fn write_mixed(path: &Path, scale: usize) -> Vec<u8> {
        let shapes: [(&str, Dtype, Vec<usize>); 7] = [
            ("a.f32", Dtype::F32, vec![1_100_000 * scale]),
            ("b.bf16", Dtype::BF16, vec![1_100_001 * scale]),
            ("c.f16", Dtype::F16, vec![3, 400_000 * scale]),
            ("d.u8", Dtype::U8, vec![1_000_003 * scale]),
            ("e.i64", Dtype::I64, vec![1000]),
            ("f.empty", Dtype::F64, vec![0, 4]),
            ("g.bool", Dtype::BOOL, vec![7]),
        ];
        let data: Vec<Vec<u8>> = (shapes.iter().enumerate())
            .map(|(k, (_, dtype, shape))| {
                let len = crate::format::header::byte_size(*dtype, shape).unwrap();
                let seed = (k as u32 + 1).wrapping_mul(0x9e37_79b9);
                let bit = |i: u32| (i.wrapping_mul(seed) >> 11) as u8;
                (0..len as u32)
                    .map(|i| {
                        if *dtype == Dtype::BOOL {
                            bit(i) & 1
                        } else {
                            bit(i)
                        }
                    })
                    .collect()
            })
            .collect();
        let tensors: Vec<TensorIn<'_>> = (shapes.iter().zip(&data))
            .map(|((name, dtype, shape), data)| TensorIn {
                name,
                dtype: *dtype,
                shape,
                data,
            })
            .collect();
        to_file(path, &tensors, None, false).unwrap();
        std::fs::read(path).unwrap()
    }

    fn temp_dir(tag: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("safeload-digests-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn options(threads: usize, chunk_bytes: usize) -> ReadOptions {
        ReadOptions {
            threads: Some(threads),
            chunk_bytes: Some(chunk_bytes),
            hash: true,
            ..ReadOptions::default()
        }
    }

    /// A read ran as asked, or buffered where the temp directory's filesystem refuses uncached
    /// reads (tmpfs).
    fn ran_as(asked: Strategy, ran: Strategy) {
        let refused = asked == Strategy::Direct && ran == Strategy::Pread;
        assert!(ran == asked || refused, "{asked:?} ran as {ran:?}");
    }

    #[test]
    fn reads_in_file_order_hash_the_file() {
        let dir = temp_dir("order");
        let path = dir.join("mixed.safetensors");
        let bytes = write_mixed(&path, 1);
        let want = Digest::of(&bytes);
        if let Some((theirs, _)) = sha256sum(&path) {
            assert_eq!(theirs, want);
        }
        for (backend, asked) in [
            (Backend::Pread, Strategy::Pread),
            (Backend::Direct, Strategy::Direct),
        ] {
            for threads in [1, 2, 5] {
                for dtype in [None, Some(Dtype::F32), Some(Dtype::F16)] {
                    // One batch; batches of 4 MiB and more (workers); 1 MiB (on this thread).
                    for batch_bytes in [u64::MAX, 5 << 20, 1 << 20] {
                        let case = format!(
                            "{backend:?} threads {threads} {dtype:?} batches of {batch_bytes}"
                        );
                        let ckpt = Checkpoint::open(
                            std::slice::from_ref(&path),
                            backend,
                            options(threads, 256 << 10),
                        )
                        .unwrap();
                        let all = ckpt.select(None).unwrap();
                        for batch in Checkpoint::batches(&all, batch_bytes) {
                            let (_, stats) = ckpt.read(&batch, dtype, &mut || false).unwrap();
                            ran_as(asked, stats.strategy);
                        }
                        assert_eq!(ckpt.digests().unwrap(), [want], "{case}");
                    }
                }
            }
        }
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn reads_that_miss_bytes_or_skip_back_report_no_digest() {
        let dir = temp_dir("partial");
        let path = dir.join("mixed.safetensors");
        let bytes = write_mixed(&path, 1);
        let open = || {
            Checkpoint::open(
                std::slice::from_ref(&path),
                Backend::Pread,
                options(3, 64 << 10),
            )
            .unwrap()
        };
        let read = |ckpt: &Checkpoint, batch: &[crate::checkpoint::Entry<'_>], dtype| {
            ckpt.read(batch, dtype, &mut || false).unwrap();
        };
        // All but the first tensor: the first one's bytes are the range missing.
        let ckpt = open();
        let all = ckpt.select(None).unwrap();
        read(&ckpt, &all[1..], None);
        let start = ckpt.shards[0].header.data_start();
        let (first, file_len) = (all[0].1.end as u64, bytes.len());
        let err = ckpt.digests().unwrap_err().to_string();
        let range = format!(
            "bytes {start}..{} of its {file_len} were not read",
            start + first
        );
        assert!(
            err.contains(&range) && err.contains("mixed.safetensors"),
            "{err}"
        );
        drop(ckpt); // every handle closed before the folder goes (Windows keeps open files)
        // The tensors in reverse order, converting: a hash cannot go back for what it skipped.
        let ckpt = open();
        let all = ckpt.select(None).unwrap();
        for batch in Checkpoint::batches(&all, 1 << 20).iter().rev() {
            read(&ckpt, batch, Some(Dtype::F32));
        }
        assert!(matches!(ckpt.digests(), Err(Error::Unhashed { .. })));
        drop(ckpt);
        // A batch read twice is hashed once: the digest stands.
        let ckpt = open();
        let all = ckpt.select(None).unwrap();
        let batches = Checkpoint::batches(&all, 1 << 20);
        read(&ckpt, &batches[0], None);
        for batch in &batches {
            read(&ckpt, batch, None);
        }
        assert_eq!(ckpt.digests().unwrap(), [Digest::of(&bytes)]);
        // Nothing read: the header alone is hashed.
        let err = open().digests().unwrap_err().to_string();
        assert!(
            err.contains(&format!("bytes {start}..{file_len} ")),
            "{err}"
        );
        let plain = Checkpoint::open(
            std::slice::from_ref(&path),
            Backend::Pread,
            ReadOptions::default(),
        )
        .unwrap();
        assert!(
            plain
                .digests()
                .unwrap_err()
                .to_string()
                .contains("without hash=True")
        );
        drop((ckpt, plain));
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn several_files_hash_side_by_side_in_bounded_rounds() {
        let dir = temp_dir("files");
        let mut paths = Vec::new();
        let mut want = Vec::new();
        for (k, scale) in [1, 2, 1].into_iter().enumerate() {
            let path = dir.join(format!("shard-{k}.safetensors"));
            want.push(Digest::of(&write_mixed(&path, scale)));
            paths.push(path);
        }
        let header_only = dir.join("empty.safetensors");
        to_file(&header_only, &[], None, false).unwrap();
        want.push(Digest::of(&std::fs::read(&header_only).unwrap()));
        paths.push(header_only);
        let store: &crate::storage::remote::Options = &[];
        for (backend, threads, max_bytes) in [
            (Backend::Pread, 1, 3 << 20),
            (Backend::Pread, 5, 1_000_001),
            (Backend::Direct, 2, 8 << 20),
            (Backend::Auto, 4, u64::MAX),
        ] {
            let opts = options(threads, 1 << 20);
            let (digests, report) =
                hash_files(&paths, backend, &opts, store, max_bytes, &mut || false).unwrap();
            assert_eq!(
                digests, want,
                "{backend:?} threads {threads} rounds of {max_bytes}"
            );
            let data: u64 = (paths.iter())
                .map(|p| Source::open(p).unwrap().header.data_len())
                .sum();
            assert_eq!(report.bytes, data, "each file's data read once");
            assert!(report.threads <= threads);
        }
        let err = hash_files(
            &paths,
            Backend::Mmap,
            &options(2, 1 << 20),
            store,
            1 << 20,
            &mut || false,
        );
        assert!(matches!(err, Err(Error::Argument(_))));
        std::fs::remove_dir_all(dir).unwrap();
    }
}
