//! The checkpoint layer: which files make a checkpoint (`files`: the rule, asked of the place
//! the storage layer picks for a path or URL), the checkpoint itself (here), what its files must
//! hash to and the reads that honour it (`verify`, `pinned`, `record`), its batches (`stream`)
//! and each rank's part (`ranks`). May use every layer below: `format`, `storage`, `read`,
//! `platform`.
//!
//! A checkpoint: one or many shards opened once (headers parsed once, storage probed once), its
//! tensor table, byte-bounded batches of a selection, and the reads every consumer uses (a
//! single-file `safe_open` is a one-shard checkpoint): into new memory or into memory the caller
//! hands over, converting dtypes on the way, parts of a tensor, data-area ranges; one strategy
//! cache and one total of every read.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use crate::error::{Error, Result};
use crate::format::digest::Digest;
use crate::format::dtype::Dtype;
use crate::format::header::TensorInfo;
use crate::format::slice::SlicePlan;
use crate::read::counts::{ReadCounts, SharedTotals};
use crate::read::source::{self, Part, ReadOptions, Source, Target, Tensors};
use crate::read::strategy::{self, Backend, Known, Mode, Plan, Purpose, Strategy};

pub(crate) mod files;
mod pinned;
mod pins;
pub(crate) mod ranks;
pub(crate) mod record;
pub(crate) mod stream;
pub(crate) mod verify;

pub use verify::Verified;

/// What one read did: the strategy that ran (the backend asked for, resolved), its workers and
/// request size, the bytes it moved.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReadStats {
    pub strategy: Strategy,
    pub threads: usize,
    pub chunk_bytes: usize,
    pub bytes: u64,
    pub seconds: f64,
    /// The filesystem kind of the first shard ("local", "fuse", "hf-mount", "nfs" ...).
    pub storage: &'static str,
    /// What verification (`verify=`) checked so far, across the checkpoint.
    pub verified: Verified,
    /// What the read's plan leaves to be read ahead after it (every tensor of a mapped file
    /// whose pages are not resident: `Purpose::All`); None in totals.
    pub ahead: Option<Mode>,
}

/// What an open is given, resolved (the binding's `OpenOptions` at open): the backend asked
/// for, the reader's options, the store's settings, the digests the files must have and the
/// verified record.
#[derive(Debug, Clone, Default)]
pub struct Opening {
    pub backend: Backend,
    pub read: ReadOptions,
    pub store: Vec<(String, String)>,
    pub pin: Option<verify::Pin>,
    pub record: Option<record::Record>,
}

/// A tensor of the checkpoint: its shard and its header entry.
pub type Entry<'c> = (usize, &'c TensorInfo);

pub struct Checkpoint {
    /// Shared with what outlives a read: read-ahead, prefetch loaders.
    pub shards: Vec<Arc<Source>>,
    /// Name -> (shard, tensor) when there are several shards.
    index: HashMap<String, (usize, usize)>,
    backend: Backend,
    opts: ReadOptions,
    /// The request size reads use (the caller's, else one suited to the slowest shard).
    chunk_bytes: usize,
    /// Each shard's resolution of `backend` and the residency measured for it: probed once, at
    /// the first read of the shard.
    resolved: Vec<OnceLock<(Strategy, Option<f64>)>>,
    /// Uncached reads were asked for and the filesystem refused them: reads are buffered since.
    direct_refused: AtomicBool,
    /// Every read so far, its read-aheads' and prefetches' included.
    totals: Arc<SharedTotals>,
    /// What each shard must hash to and the bytes held for them (`verify=`:
    /// [`Checkpoint::expect`]); empty when unpinned.
    pins: pins::Pins,
}

impl Checkpoint {
    /// Opens every shard and indexes the tensors; a name in two shards is an error.
    pub fn open(paths: &[PathBuf], backend: Backend, opts: ReadOptions) -> Result<Checkpoint> {
        Self::open_with(paths, backend, opts, &[])
    }

    /// The checkpoint at `at`: a file, a directory, an index.json, a URL or a URL prefix,
    /// resolved to its shards by `files`' rule, then opened as [`Checkpoint::open_with`].
    pub fn open_at(
        at: &Path,
        backend: Backend,
        opts: ReadOptions,
        store: &crate::storage::remote::Options,
    ) -> Result<Checkpoint> {
        Self::open_with(&files::at(at, store)?, backend, opts, store)
    }

    /// [`Checkpoint::open`] of paths or URLs, with the stores' `storage_options`. With
    /// [`ReadOptions::hash`], every shard's SHA-256 is started: reads that cover a shard in file
    /// order (batches of [`Checkpoint::select`]'s order, one after the other) compute it, and
    /// [`Checkpoint::digests`] reports it.
    pub fn open_with(
        paths: &[PathBuf],
        backend: Backend,
        opts: ReadOptions,
        store: &crate::storage::remote::Options,
    ) -> Result<Checkpoint> {
        let backend = backend.check(opts.drop_cache, opts.hash)?;
        let shards = paths
            .iter()
            .map(|p| Source::open_with(p, store).map(Arc::new))
            .collect::<Result<Vec<_>>>()?;
        if opts.hash {
            shards.iter().for_each(|s| s.start_hash());
        }
        // One file: its header's own index serves (see `get`).
        let several = if shards.len() > 1 { &shards[..] } else { &[] };
        let mut index = HashMap::new();
        for (s, shard) in several.iter().enumerate() {
            for (t, info) in shard.header.tensors.iter().enumerate() {
                if let Some((first, _)) = index.insert(info.name.clone(), (s, t)) {
                    return Err(Error::Checkpoint(format!(
                        "tensor {} appears in more than one shard ({} and {})",
                        info.name,
                        shards[first].path.display(),
                        shard.path.display()
                    )));
                }
            }
        }
        let chunk_bytes = source::chunk_bytes(&sources(&shards), &opts);
        Ok(Checkpoint {
            shards,
            index,
            backend,
            opts,
            chunk_bytes,
            resolved: paths.iter().map(|_| OnceLock::new()).collect(),
            direct_refused: AtomicBool::new(false),
            totals: Arc::default(),
            pins: pins::Pins::default(),
        })
    }

    /// Every tensor, in (shard, offset) order.
    pub fn entries(&self) -> impl Iterator<Item = Entry<'_>> {
        self.shards
            .iter()
            .enumerate()
            .flat_map(|(s, shard)| shard.header.tensors.iter().map(move |t| (s, t)))
    }

    pub fn get(&self, name: &str) -> Result<Entry<'_>> {
        let found = match &self.shards[..] {
            [one] => one.header.index_of(name).map(|t| (0, t)),
            _ => self.index.get(name).copied(),
        };
        let (s, t) = found.ok_or_else(|| Error::TensorNotFound {
            name: name.to_string(),
        })?;
        Ok((s, &self.shards[s].header.tensors[t]))
    }

    /// The named tensors (every one when `names` is None), in (shard, offset) order.
    pub fn select(&self, names: Option<&[String]>) -> Result<Vec<Entry<'_>>> {
        let Some(names) = names else {
            return Ok(self.entries().collect());
        };
        let mut picked = names
            .iter()
            .map(|n| self.get(n))
            .collect::<Result<Vec<_>>>()?;
        picked.sort_by_key(|(s, t)| (*s, t.begin));
        Ok(picked)
    }

    /// The named tensors of shard `shard` alone (every one when `names` is None), in offset
    /// order: what a handle on one file of the checkpoint reads.
    pub fn select_in(&self, shard: usize, names: Option<&[String]>) -> Result<Vec<Entry<'_>>> {
        let source = &self.shards[shard];
        let mut picked = match names {
            None => source.header.tensors.iter().collect(),
            Some(names) => names
                .iter()
                .map(|n| source.tensor(n))
                .collect::<Result<Vec<_>>>()?,
        };
        picked.sort_by_key(|t| t.begin);
        Ok(picked.into_iter().map(|t| (shard, t)).collect())
    }

    /// Cuts a selection (in file order) into batches of at most `max_bytes` (a tensor larger
    /// than that is a batch of its own), for streaming and for exchanging shares.
    pub fn batches<'c>(selection: &[Entry<'c>], max_bytes: u64) -> Vec<Vec<Entry<'c>>> {
        let mut out: Vec<Vec<Entry<'c>>> = Vec::new();
        let mut used = 0u64;
        for &(s, t) in selection {
            let n = t.nbytes() as u64;
            match out.last_mut() {
                Some(batch) if !batch.is_empty() && used + n <= max_bytes => {
                    batch.push((s, t));
                    used += n;
                }
                _ => {
                    out.push(vec![(s, t)]);
                    used = n;
                }
            }
        }
        out
    }

    /// The backend asked for (after the process's overrides and [`Backend::check`]).
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// How this checkpoint's whole tensors are read into new memory (see [`Checkpoint::plan`]).
    pub fn strategy(&self) -> Strategy {
        strategy::strategy_of(&self.known(0), Purpose::Views)
    }

    /// How a read of shard `shard` for `purpose` is done: the read plan (`strategy::plan`) from
    /// what was asked and what is known (the shard's resolution of the backend, at its first
    /// read; uncached reads refused earlier; the shard's pin; its residency, measured when a
    /// map's read-ahead depends on it). Every read path executes it; a read of several shards
    /// reads each by its own plan and reports the first one's.
    pub fn plan(&self, purpose: Purpose, shard: usize) -> Plan {
        strategy::plan(&self.known(shard), purpose, || {
            self.shards.get(shard).and_then(|s| s.cached())
        })
    }

    /// What the read plan knows of shard `shard` (resolving the backend at its first ask).
    fn known(&self, shard: usize) -> Known {
        let (resolved, cached) = self.resolution(shard);
        Known {
            resolved,
            cached,
            direct_refused: self.direct_refused.load(Ordering::Relaxed),
            pinned: self.pinned_shard(shard),
        }
    }

    /// The plan of one read for `purpose` of `shards` (in the order it reads them), made once
    /// before it starts: the first shard's [`Checkpoint::plan`], and each shard's strategy (the
    /// others' from `strategy::strategy_of`, so no residency is measured again for a read-ahead
    /// they do not run; a shard the read does not touch is not resolved: pread).
    pub(super) fn plan_read(
        &self,
        purpose: Purpose,
        shards: impl IntoIterator<Item = usize>,
    ) -> ReadPlan {
        let mut strategies = vec![Strategy::Pread; self.shards.len()];
        let mut planned = vec![false; self.shards.len()];
        let mut reported = None;
        for s in shards {
            if std::mem::replace(&mut planned[s], true) {
                continue;
            }
            strategies[s] = match reported {
                None => {
                    let plan = self.plan(purpose, s);
                    reported = Some(plan);
                    plan.strategy
                }
                Some(_) => strategy::strategy_of(&self.known(s), purpose),
            };
        }
        ReadPlan {
            reported: reported.unwrap_or_else(|| self.plan(purpose, 0)),
            strategies,
        }
    }

    /// The shards whose pages the plan for every tensor (`Purpose::All`) reads ahead: mapped
    /// and not resident.
    pub fn read_ahead_of_all(&self) -> Vec<Arc<Source>> {
        (0..self.shards.len())
            .filter(|&s| self.plan(Purpose::All, s).ahead == Some(Mode::PageCache))
            .map(|s| self.shards[s].clone())
            .collect()
    }

    /// What a read of `selection` is for: copies when `dtype` converts any of it; every tensor
    /// of the shards it reads (`Purpose::All`); else views.
    pub(super) fn purpose_of(&self, selection: &[Entry<'_>], dtype: Option<Dtype>) -> Purpose {
        if dtype.is_some_and(|d| selection.iter().any(|(_, t)| t.dtype != d)) {
            return Purpose::Copies;
        }
        let mut touched: Vec<usize> = selection.iter().map(|(s, _)| *s).collect();
        touched.dedup();
        let whole: usize = (touched.iter())
            .map(|s| self.shards[*s].header.tensors.len())
            .sum();
        match selection.len() == whole && !selection.is_empty() {
            true => Purpose::All,
            false => Purpose::Views,
        }
    }

    /// Where reads made for this checkpoint on other threads (read-aheads, prefetch loaders)
    /// count, so that its totals include them.
    pub fn tally(&self) -> Arc<SharedTotals> {
        self.totals.clone()
    }

    /// The tuning reads use (the caller's threads and request size, or None: picked per read).
    pub fn options(&self) -> ReadOptions {
        self.opts
    }

    fn resolution(&self, shard: usize) -> (Strategy, Option<f64>) {
        let Some(s) = self.shards.get(shard) else {
            return (Strategy::Pread, None);
        };
        *self.resolved[shard].get_or_init(|| {
            let facts = s.facts(self.opts.reads_bytes());
            strategy::resolve(self.backend, &facts, || s.cached())
        })
    }

    /// Totals of this checkpoint's reads so far (see [`ReadStats`]); nothing read yet: zeros,
    /// with the backend reads will use, resolved where `probe` lets it probe the storage
    /// (without, a backend nothing has resolved yet, as for a handle closed before any read,
    /// shows as pread).
    pub fn totals(&self, probe: bool) -> ReadStats {
        let (report, latest) = self.totals.get();
        let resolved = self.resolved.first().and_then(OnceLock::get).is_some();
        let unread = || match probe || resolved {
            true => self.strategy(),
            false => Strategy::Pread,
        };
        self.stats(latest.unwrap_or_else(unread), &report)
    }

    /// What a read that executed `plan` did, counted in the totals; uncached reads it found
    /// refused are remembered for the plans after it.
    fn record(&self, plan: Plan, report: &ReadCounts) -> ReadStats {
        if report.direct_refused {
            self.direct_refused.store(true, Ordering::Relaxed);
        }
        let stats = ReadStats {
            ahead: plan.ahead,
            ..self.stats(plan.strategy, report)
        };
        self.totals.add(stats.strategy, report);
        stats
    }

    fn stats(&self, backend: Strategy, report: &ReadCounts) -> ReadStats {
        ReadStats {
            strategy: report.ran_with(backend),
            threads: report.threads,
            chunk_bytes: self.chunk_bytes,
            bytes: report.bytes,
            seconds: report.seconds,
            storage: self.shards.first().map_or("local", |s| s.kind.name()),
            verified: self.verified(),
            ahead: None,
        }
    }

    /// Reads a selection into new memory (mapped views when the strategy is mmap), converting
    /// F32/F16/BF16 tensors to `dtype` when given (a copy: a map cannot change dtypes). Returns
    /// the bytes and dtype of each, in the order of `selection`. Pinned shards are checked
    /// before anything is returned (see `pinned`).
    pub fn read(
        &self,
        selection: &[Entry<'_>],
        dtype: Option<Dtype>,
        poll: &mut dyn FnMut() -> bool,
    ) -> Result<(Tensors, ReadStats)> {
        let purpose = self.purpose_of(selection, dtype);
        let plan = self.plan_read(purpose, selection.iter().map(|(s, _)| *s));
        let mut done = ReadCounts::default();
        if self.is_pinned() {
            let out = self.read_pinned(selection, dtype, &plan, poll, &mut done);
            let stats = self.record(plan.reported, &done);
            return Ok((out?, stats));
        }
        let out = self.read_whole(selection, &plan, dtype, poll, &mut done)?;
        Ok((out, self.record(plan.reported, &done)))
    }

    /// Whole tensors of `selection` into new memory, each shard by the strategy `plan` gives it
    /// (views of the map where it maps), converted to `dtype` where asked; what the read did is
    /// added to `done`. The one read of whole tensors, pinned shards read straight (hashed on the
    /// way) included.
    fn read_whole(
        &self,
        selection: &[Entry<'_>],
        plan: &ReadPlan,
        dtype: Option<Dtype>,
        poll: &mut dyn FnMut() -> bool,
        done: &mut ReadCounts,
    ) -> Result<Tensors> {
        let (out, report) = source::read_or_map(
            &self.sources(),
            selection,
            &plan.strategies,
            dtype,
            &self.opts,
            poll,
        )?;
        done.add(&report);
        Ok(out)
    }

    /// Reads tensors into memory the caller owns (each target names its tensor, its dtype and
    /// its bytes). Destinations are distinct borrows, so they cannot overlap.
    pub fn read_into(
        &self,
        targets: Vec<Target<'_, '_>>,
        poll: &mut dyn FnMut() -> bool,
    ) -> Result<ReadStats> {
        let plan = self.plan_read(Purpose::Copies, targets.iter().map(|t| t.source));
        let mut done = ReadCounts::default();
        if self.is_pinned() {
            let result = self.read_into_pinned(targets, &plan, poll, &mut done);
            let stats = self.record(plan.reported, &done);
            return result.map(|()| stats);
        }
        self.read_targets(targets, &plan, poll, &mut done)?;
        Ok(self.record(plan.reported, &done))
    }

    /// `targets` read as copies, each shard by the strategy `plan` gives it; what the read did
    /// is added to `done`.
    fn read_targets(
        &self,
        targets: Vec<Target<'_, '_>>,
        plan: &ReadPlan,
        poll: &mut dyn FnMut() -> bool,
        done: &mut ReadCounts,
    ) -> Result<()> {
        let sources = self.sources();
        done.add(&source::read_targets(
            &sources,
            targets,
            &plan.strategies,
            &self.opts,
            poll,
        )?);
        Ok(())
    }

    /// Part `plan` of tensor `info` of shard `shard`, by the plan for parts (`Purpose::Parts`:
    /// a map's view or cut, its pages asked of the kernel where the map is not resident; or
    /// exactly the ranges it needs read); `views`: the caller indexes
    /// views, so a slice of a map that is not one run comes back as the whole tensor's view
    /// (`Part::Whole`). A pinned shard's part is cut from its hashed bytes.
    pub fn read_slice(
        &self,
        shard: usize,
        info: &TensorInfo,
        plan: &SlicePlan,
        views: bool,
        poll: &mut dyn FnMut() -> bool,
    ) -> Result<(Part, ReadStats)> {
        let how = self.plan(Purpose::Parts, shard);
        if self.pinned_shard(shard) {
            let mut done = ReadCounts::default();
            let part = self.slice_pinned(shard, info, plan, poll, &mut done);
            let stats = self.record(how, &done);
            return Ok((Part::Bytes(part?), stats));
        }
        let source = &self.shards[shard];
        let (part, report) = source.read_slice(info, plan, how, views, &self.opts, poll)?;
        Ok((part, self.record(how, &report)))
    }

    /// Data-area ranges of shard `shard` (`(offset, dest)`: `dest` filled from `offset` bytes
    /// into its data area) in one plan, in file order.
    pub fn read_ranges(
        &self,
        shard: usize,
        ranges: Vec<(u64, &mut [u8])>,
        poll: &mut dyn FnMut() -> bool,
    ) -> Result<ReadStats> {
        let plan = self.plan(Purpose::Copies, shard);
        let source = &self.shards[shard];
        if self.pinned_shard(shard) {
            let mut done = ReadCounts::default();
            let result = self.ranges_pinned(shard, ranges, poll, &mut done);
            let stats = self.record(plan, &done);
            return result.map(|()| stats);
        }
        let report = source::read_data_ranges(source, ranges, plan.strategy, &self.opts, poll)?;
        Ok(self.record(plan, &report))
    }

    /// Each shard's SHA-256, in order, when the checkpoint was opened to hash them
    /// ([`ReadOptions::hash`]) and its reads since covered every byte of every shard in file
    /// order; else an error naming the first shard and range not read. Hashing ends.
    pub fn digests(&self) -> Result<Vec<Digest>> {
        if !self.opts.hash {
            return Err(Error::Argument(
                "digests of a checkpoint opened without hash=True".into(),
            ));
        }
        self.shards.iter().map(|s| s.finish_hash()).collect()
    }

    fn sources(&self) -> Vec<&Source> {
        sources(&self.shards)
    }
}

/// One read's plan over a checkpoint's shards ([`Checkpoint::plan_read`]): what it reports and
/// how each shard is read.
pub(super) struct ReadPlan {
    /// The plan of the first shard it reads: its stats report this one.
    pub reported: Plan,
    /// Per shard: how it is read.
    pub strategies: Vec<Strategy>,
}

fn sources(shards: &[Arc<Source>]) -> Vec<&Source> {
    shards.iter().map(|s| &**s).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::serialize;

    fn write(path: &std::path::Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
        let specs: Vec<serialize::TensorIn<'_>> = tensors
            .iter()
            .map(|(n, d, s, b)| serialize::TensorIn {
                name: n,
                dtype: *d,
                shape: s,
                data: b,
            })
            .collect();
        crate::storage::write::to_file(path, &specs, None, false).unwrap();
    }

    #[test]
    fn shards_batches_reads_and_conversions() {
        let dir = std::env::temp_dir().join(format!("safeload-ckpt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (a, b) = (dir.join("a.safetensors"), dir.join("b.safetensors"));
        let ones_bf16: Vec<u8> = (0..1000).flat_map(|_| 0x3f80u16.to_le_bytes()).collect();
        write(
            &a,
            &[
                ("x", Dtype::BF16, vec![1000], ones_bf16.clone()),
                ("y", Dtype::U8, vec![3], vec![1, 2, 3]),
            ],
        );
        write(
            &b,
            &[(
                "z",
                Dtype::F32,
                vec![2],
                [1.5f32, -2.0]
                    .iter()
                    .flat_map(|f| f.to_le_bytes())
                    .collect(),
            )],
        );
        let ckpt = Checkpoint::open(
            &[a.clone(), b.clone()],
            Backend::Pread,
            ReadOptions::default(),
        )
        .unwrap();
        let all = ckpt.select(None).unwrap();
        assert_eq!(
            all.iter().map(|(_, t)| t.name.as_str()).collect::<Vec<_>>(),
            ["x", "y", "z"]
        );
        let batches = Checkpoint::batches(&all, 2000);
        assert_eq!(batches.iter().map(Vec::len).collect::<Vec<_>>(), [1, 2]);

        // New memory, BF16 converted to F32, others untouched.
        let (out, stats) = ckpt.read(&all, Some(Dtype::F32), &mut || false).unwrap();
        assert_eq!(stats.strategy, Strategy::Pread);
        assert_eq!(out[0].1, Dtype::F32);
        assert!(
            out[0]
                .0
                .as_slice()
                .chunks(4)
                .all(|c| c == 1.0f32.to_le_bytes())
        );
        assert_eq!(
            (out[1].0.as_slice(), out[1].1),
            (&[1u8, 2, 3][..], Dtype::U8)
        );

        // Into caller memory: F16 destination for the BF16 tensor.
        let mut x = vec![0u8; 2000];
        let mut z = vec![0u8; 8];
        let (_, xi) = ckpt.get("x").unwrap();
        let (zs, zi) = ckpt.get("z").unwrap();
        let targets = vec![
            Target {
                source: 0,
                info: xi,
                dtype: Dtype::F16,
                dest: &mut x,
            },
            Target {
                source: zs,
                info: zi,
                dtype: Dtype::F32,
                dest: &mut z,
            },
        ];
        ckpt.read_into(targets, &mut || false).unwrap();
        assert!(x.chunks(2).all(|c| c == 0x3c00u16.to_le_bytes()));
        assert_eq!(
            z,
            [1.5f32, -2.0]
                .iter()
                .flat_map(|f| f.to_le_bytes())
                .collect::<Vec<_>>()
        );

        // Wrong sizes and unconvertible dtypes are refused before any read.
        let mut small = vec![0u8; 10];
        let bad = vec![Target {
            source: 0,
            info: xi,
            dtype: Dtype::F32,
            dest: &mut small,
        }];
        assert!(matches!(
            ckpt.read_into(bad, &mut || false),
            Err(Error::Destination(_))
        ));
        let (_, yi) = ckpt.get("y").unwrap();
        let mut y = vec![0u8; 12];
        let bad = vec![Target {
            source: 0,
            info: yi,
            dtype: Dtype::F32,
            dest: &mut y,
        }];
        assert!(matches!(
            ckpt.read_into(bad, &mut || false),
            Err(Error::Destination(_))
        ));

        // A name in two shards.
        assert!(
            Checkpoint::open(
                &[a.clone(), a.clone()],
                Backend::Pread,
                ReadOptions::default()
            )
            .is_err()
        );
        drop(ckpt); // Windows cannot delete files still open
        std::fs::remove_dir_all(dir).unwrap();
    }
}
