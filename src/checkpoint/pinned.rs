//! A checkpoint pinned to digests (`verify=`): what each shard must hash to, and the rule that
//! nothing of a pinned shard is handed out before its whole file hashed right.
//!
//! Two ways a pinned shard is read, both one pass over the file:
//!
//! - **whole, straight into the caller's buffers**: a read that asks for every tensor of the
//!   shards it touches (`load_file`, `load_checkpoint`, a stream's shard-sized batch) hashes as it
//!   reads and compares before it returns;
//! - **held**: any other read (a `get_tensor` loop, parts of a tensor, ranges for a device's
//!   staging, an in-place load, a batch smaller than its shard) first reads the whole shard into
//!   memory of its own, hashing it, and compares; every later read of that shard is served from
//!   those bytes, never from storage or a map of the file (a write in place would change a map
//!   after the hash). A tensor handed out whole leaves the store (zero copy); asked for again, the
//!   shard is read and hashed again, so the bytes returned are always bytes that were hashed.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use super::pins::{Held, Pins};
use super::{Checkpoint, Entry, Opening, ReadPlan};
use crate::checkpoint::record::Record;
use crate::checkpoint::verify::{self, Expected, Pin, Verified};
use crate::error::{Error, Result};
use crate::format::digest::Digest;
use crate::format::dtype::Dtype;
use crate::format::header::TensorInfo;
use crate::format::slice::SlicePlan;
use crate::read::buffer::TensorBytes;
use crate::read::counts::ReadCounts;
use crate::read::source::{self, ReadOptions, Target, Tensors};
use crate::read::strategy::Purpose;

impl Checkpoint {
    /// [`Checkpoint::open_with`] of `paths` with what an open was given (`with`), pinned by its
    /// `pin` when there is one ([`Checkpoint::expect`]; `root` as there): the one way every
    /// entry point opens a checkpoint it may verify.
    pub fn open_pinned(
        paths: &[PathBuf],
        root: Option<&Path>,
        with: &Opening,
    ) -> Result<Checkpoint> {
        let opts = ReadOptions {
            hash: with.read.hash || with.pin.is_some(),
            ..with.read
        };
        let mut ckpt = Checkpoint::open_with(paths, with.backend, opts, &with.store)?;
        if let Some(pin) = &with.pin {
            ckpt.expect(pin, root, with.record.clone(), &with.store)?;
        }
        Ok(ckpt)
    }

    /// Pins every shard to a digest (`verify=`), resolved now, before anything is read
    /// (`verify::expectations`); the checkpoint must hash its reads (`ReadOptions::hash`).
    /// `root`: what names are relative to (`checkpoint::files::root_of`). A shard with no digest (a
    /// lenient `Pin::Known`) loads as it would unpinned; when none has one, nothing is hashed.
    /// `record`: the verified record (`crate::checkpoint::record`): a local file it vouches for is read
    /// as unpinned, and one that hashes right is remembered in it. `store`: the `storage_options`
    /// the shards were opened with (where a `SHA256SUMS` may be looked for is their places' answer).
    ///
    /// [`ReadOptions::hash`]: crate::read::source::ReadOptions::hash
    pub fn expect(
        &mut self,
        pin: &Pin,
        root: Option<&Path>,
        record: Option<Record>,
        store: &crate::storage::remote::Options,
    ) -> Result<()> {
        if !self.opts.hash {
            return Err(Error::Argument(
                "verify= needs a checkpoint opened with hash=True".into(),
            ));
        }
        let paths: Vec<_> = self.shards.iter().map(|s| s.path.clone()).collect();
        let reported: Vec<_> = (self.shards.iter())
            .map(|s| (s.reported_digest()).map(|(digest, from)| Expected { digest, from }))
            .collect();
        let expected = verify::expectations(pin, root, &paths, &reported, store)?;
        let n = expected.len();
        let (mut recorded, mut before) = (vec![false; n], vec![None; n]);
        for (s, (shard, e)) in self.shards.iter().zip(&expected).enumerate() {
            let (Some(record), Some(e), Some(file)) = (&record, e, shard.backing.file()) else {
                continue;
            };
            recorded[s] = record.knows(&shard.path, file, &e.digest);
            before[s] = (!recorded[s]).then(|| Record::identity(file)).flatten();
        }
        let unverified = expected.iter().filter(|e| e.is_none()).count();
        let counts = Verified {
            unverified,
            recorded: recorded.iter().filter(|&&r| r).count(),
            ..Verified::default()
        };
        self.pins = Pins {
            held: expected.iter().map(|_| Mutex::new(None)).collect(),
            expected,
            counts: Mutex::new(counts),
            recorded,
            record,
            before,
        };
        // Each pinned read hashes its shards itself (`hashed_and_checked`); the others are not
        // hashed for the pins.
        for (s, shard) in self.shards.iter().enumerate() {
            if !self.pins.pinned(s) {
                shard.stop_hash();
            }
        }
        if !self.is_pinned() {
            self.opts.hash = false; // nothing to hash: read as if unpinned
        }
        Ok(())
    }

    /// Each shard's path and where its expected digest came from (None: loaded unverified),
    /// for the log; empty when the checkpoint is not pinned.
    pub fn pinned(&self) -> Vec<(&Path, Option<String>)> {
        (self.shards.iter().zip(&self.pins.expected).enumerate())
            .map(|(s, (shard, e))| {
                let from = e.as_ref().map(|e| match self.pins.recorded[s] {
                    true => format!(
                        "{}, by the verified record (unchanged since it last matched; not hashed)",
                        e.from
                    ),
                    false => e.from.clone(),
                });
                (shard.path.as_path(), from)
            })
            .collect()
    }

    /// What verification did so far.
    pub fn verified(&self) -> Verified {
        *self.pins.counts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether any shard is pinned: reads then go through this module.
    pub fn is_pinned(&self) -> bool {
        (0..self.pins.expected.len()).any(|s| self.pins.pinned(s))
    }

    /// Reads, hashes and checks every pinned shard now (what a pinned `safe_open` does at open,
    /// so a mismatch is raised there and every tensor is served from hashed bytes).
    pub fn hold_all(&self, poll: &mut dyn FnMut() -> bool) -> Result<()> {
        if !self.is_pinned() {
            return Ok(());
        }
        let mut done = ReadCounts::default();
        let mut all = || {
            for shard in (0..self.shards.len()).filter(|&s| self.pins.pinned(s)) {
                let mut held = self.pins.held(shard);
                self.hold(shard, &mut held, poll, &mut done)?;
            }
            Ok(())
        };
        let result = all();
        self.record(self.plan(Purpose::Views, 0), &done);
        result
    }

    /// [`Checkpoint::read`] of a pinned checkpoint: the shards the selection takes whole and
    /// holds nothing of are read straight into new buffers, hashed on the way; the rest is served
    /// from held bytes. Checked before anything is returned.
    pub(super) fn read_pinned(
        &self,
        selection: &[Entry<'_>],
        dtype: Option<Dtype>,
        plan: &ReadPlan,
        poll: &mut dyn FnMut() -> bool,
        done: &mut ReadCounts,
    ) -> Result<Tensors> {
        let mut shards: Vec<usize> = selection.iter().map(|(s, _)| *s).collect();
        shards.dedup();
        let mut locks: Vec<(usize, Held<'_>)> = Vec::new();
        let mut direct = Vec::new();
        for &s in &shards {
            let held = self.pins.held(s);
            let whole = selection.iter().filter(|(of, _)| *of == s).count()
                == self.shards[s].header.tensors.len();
            if self.pins.pinned(s) && (held.is_some() || !whole) {
                locks.push((s, held));
            } else {
                direct.push(s);
                locks.push((s, held)); // no other read hashes it meanwhile
            }
        }
        let straight: Vec<Entry<'_>> = (selection.iter().copied())
            .filter(|(s, _)| direct.contains(s))
            .collect();
        let mut read = Vec::new().into_iter();
        if !straight.is_empty() {
            let out = self.hashed_and_checked(&direct, || {
                self.read_whole(&straight, plan, dtype, poll, done)
            })?;
            read = out.into_iter();
        }
        let mut out = Vec::with_capacity(selection.len());
        for &(s, info) in selection {
            if direct.contains(&s) {
                out.push(read.next().expect("one buffer per tensor read"));
                continue;
            }
            let held = &mut locks.iter_mut().find(|(of, _)| *of == s).expect("locked").1;
            let bytes = self.take(s, info, held, poll, done)?;
            out.push(converted(bytes, info, dtype)?);
        }
        Ok(out)
    }

    /// [`Checkpoint::read_into`] of a pinned checkpoint: every pinned shard is held (read whole
    /// and checked) before the first byte is copied into the caller's memory, so a mismatch
    /// leaves it untouched; unpinned shards' targets are read as usual.
    pub(super) fn read_into_pinned(
        &self,
        targets: Vec<Target<'_, '_>>,
        plan: &ReadPlan,
        poll: &mut dyn FnMut() -> bool,
        done: &mut ReadCounts,
    ) -> Result<()> {
        source::check_fits(&self.sources(), &targets)?;
        let mut locks: Vec<Held<'_>> = (0..self.shards.len()).map(|s| self.pins.held(s)).collect();
        for (s, held) in locks.iter_mut().enumerate() {
            if self.pins.pinned(s) {
                self.hold(s, held, poll, done)?;
            }
        }
        let (pinned, rest): (Vec<_>, Vec<_>) =
            (targets.into_iter()).partition(|t| self.pins.pinned(t.source));
        for t in pinned {
            let bytes = self.take(t.source, t.info, &mut locks[t.source], poll, done)?;
            copy_into(&bytes, t)?;
        }
        drop(locks);
        if !rest.is_empty() {
            self.read_targets(rest, plan, poll, done)?;
        }
        Ok(())
    }

    /// Part of tensor `info` of pinned shard `shard`, cut from its held bytes; a part that is the
    /// whole tensor (`get_slice(k)[...]`, as transformers materializes every tensor) is handed
    /// out as [`Checkpoint::take`] hands out a `get_tensor`: no copy, and it leaves the store.
    pub(super) fn slice_pinned(
        &self,
        shard: usize,
        info: &TensorInfo,
        plan: &SlicePlan,
        poll: &mut dyn FnMut() -> bool,
        done: &mut ReadCounts,
    ) -> Result<TensorBytes> {
        let mut held = self.pins.held(shard);
        if plan.is_whole(info.end - info.begin) {
            return self.take(shard, info, &mut held, poll, done);
        }
        let index = self.index_in(shard, info);
        let whole = self.present(shard, index, &mut held, poll, done)?;
        crate::read::buffer::cut(plan, whole)
    }

    /// Data-area ranges of pinned shard `shard`, copied from its held bytes.
    pub(super) fn ranges_pinned(
        &self,
        shard: usize,
        ranges: Vec<(u64, &mut [u8])>,
        poll: &mut dyn FnMut() -> bool,
        done: &mut ReadCounts,
    ) -> Result<()> {
        let source = &self.shards[shard];
        let data_len = source.header.data_len();
        let mut held = self.pins.held(shard);
        for (offset, dest) in ranges {
            let end = offset.checked_add(dest.len() as u64);
            if end.is_none_or(|end| end > data_len) {
                return Err(Error::Slice(format!(
                    "byte range {offset}+{} is outside the data area ({data_len} bytes) of {}",
                    dest.len(),
                    source.path.display()
                )));
            }
            let mut at = 0usize;
            // The header's rules make the data area one run of tensors, in file order.
            for (index, t) in source.header.tensors.iter().enumerate() {
                let (begin, stop) = (t.begin as u64, t.end as u64);
                let from = offset + at as u64;
                if at == dest.len() || stop <= from || begin >= offset + dest.len() as u64 {
                    continue;
                }
                let bytes = self.present(shard, index, &mut held, poll, done)?;
                let skip = (from - begin) as usize;
                let n = (stop - from).min((dest.len() - at) as u64) as usize;
                dest[at..at + n].copy_from_slice(&bytes.as_slice()[skip..skip + n]);
                at += n;
            }
            if at != dest.len() {
                return Err(Error::Internal(format!(
                    "byte range {offset}+{} of {} is not covered by its tensors",
                    dest.len(),
                    source.path.display()
                )));
            }
        }
        Ok(())
    }

    /// Whether shard `shard` is pinned: its reads are served from hashed bytes only.
    pub fn pinned_shard(&self, shard: usize) -> bool {
        self.pins.pinned(shard)
    }

    /// Tensor `info` of held shard `shard`, handed out (it leaves the store); the shard is read
    /// and hashed again when it was handed out before.
    fn take(
        &self,
        shard: usize,
        info: &TensorInfo,
        held: &mut Held<'_>,
        poll: &mut dyn FnMut() -> bool,
        done: &mut ReadCounts,
    ) -> Result<TensorBytes> {
        let index = self.index_in(shard, info);
        self.present(shard, index, held, poll, done)?;
        let slots = held.as_mut().expect("held above");
        let bytes = slots[index].take().expect("present above");
        if slots.iter().all(Option::is_none) {
            **held = None; // all handed out: nothing left to keep
        }
        Ok(bytes)
    }

    /// Tensor `index` of shard `shard` in the store, held (and hashed) first where it is not.
    fn present<'h>(
        &self,
        shard: usize,
        index: usize,
        held: &'h mut Held<'_>,
        poll: &mut dyn FnMut() -> bool,
        done: &mut ReadCounts,
    ) -> Result<&'h TensorBytes> {
        let missing = held.as_ref().is_none_or(|slots| slots[index].is_none());
        if missing {
            self.hold(shard, held, poll, done)?;
        }
        Ok(held.as_ref().expect("held above")[index]
            .as_ref()
            .expect("filled above"))
    }

    /// Reads shard `shard` whole into memory of its own, hashing it, and checks it; fills the
    /// slots that are empty (a tensor still held keeps its bytes, the new copy is dropped).
    fn hold(
        &self,
        shard: usize,
        held: &mut Held<'_>,
        poll: &mut dyn FnMut() -> bool,
        done: &mut ReadCounts,
    ) -> Result<()> {
        if held.as_ref().is_some_and(|s| s.iter().all(Option::is_some)) {
            return Ok(());
        }
        let source = &self.shards[shard];
        let all: Vec<Entry<'_>> = source.header.tensors.iter().map(|t| (shard, t)).collect();
        let plan = self.plan_read(Purpose::Views, [shard]);
        let out =
            self.hashed_and_checked(&[shard], || self.read_whole(&all, &plan, None, poll, done))?;
        let slots = held.get_or_insert_with(|| vec![None; all.len()]);
        for (slot, (bytes, _)) in slots.iter_mut().zip(out) {
            slot.get_or_insert(bytes);
        }
        Ok(())
    }

    /// The one place a pinned read is verified: `read` runs hashed ([`source::hashed`]: the
    /// SHA-256 of each of `shards` that is pinned, started before it and finished after it),
    /// then each digest is checked against its pin. What `read` returned is given back only when
    /// every check passed.
    fn hashed_and_checked<T>(
        &self,
        shards: &[usize],
        read: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        let pinned: Vec<usize> = (shards.iter().copied())
            .filter(|&s| self.pins.pinned(s))
            .collect();
        let sources: Vec<&source::Source> = pinned.iter().map(|&s| &*self.shards[s]).collect();
        let (out, digests) = source::hashed(&sources, read)?;
        for (shard, actual) in pinned.into_iter().zip(digests) {
            self.check_shard(shard, &actual)?;
        }
        Ok(out)
    }

    /// Compares pinned shard `shard`'s digest with `actual`, what its read hashed, and counts it.
    fn check_shard(&self, shard: usize, actual: &Digest) -> Result<()> {
        let Some(expected) = self.pins.expected[shard].as_ref() else {
            return Ok(()); // not pinned
        };
        let source = &self.shards[shard];
        expected.check(&source.path, actual)?;
        if let (Some(record), Some(before), Some(file)) = (
            &self.pins.record,
            &self.pins.before[shard],
            source.backing.file(),
        ) {
            // Best effort: a record that cannot be written costs the next load a hash, no more.
            let _ = record.remember(&source.path, file, before, actual);
        }
        let mut counts = self.pins.counts.lock().unwrap_or_else(|p| p.into_inner());
        counts.files += 1;
        counts.bytes += source.file_len;
        Ok(())
    }

    fn index_in(&self, shard: usize, info: &TensorInfo) -> usize {
        self.shards[shard]
            .header
            .index_of(&info.name)
            .expect("info comes from this header")
    }
}

/// `bytes` (tensor `info` as the file holds it) as `dtype` asks: themselves, or converted into
/// new memory (floating-point tensors only, as every read converts).
fn converted(
    bytes: TensorBytes,
    info: &TensorInfo,
    dtype: Option<Dtype>,
) -> Result<(TensorBytes, Dtype)> {
    let to = crate::format::convert::read_as(info.dtype, dtype);
    if to == info.dtype {
        return Ok((bytes, to));
    }
    let len = crate::format::convert::converted_len(info.dtype, to, bytes.len())
        .map_err(|e| Error::Destination(format!("tensor {}: {e}", info.name)))?;
    let mut out = crate::read::buffer::allocate(&[len]).map_err(|e| {
        Error::Memory(format!(
            "cannot allocate {len} bytes for {}: {e}",
            info.name
        ))
    })?;
    let mut fresh = out.pop().expect("one asked");
    let target = Target {
        source: 0,
        info,
        dtype: to,
        dest: fresh.as_mut_slice(),
    };
    copy_into(&bytes, target)?;
    Ok((fresh.into_shared(), to))
}

/// Copies (converting where the target's dtype differs) held bytes into a target that fits.
fn copy_into(bytes: &TensorBytes, t: Target<'_, '_>) -> Result<()> {
    if t.dtype == t.info.dtype {
        t.dest.copy_from_slice(bytes.as_slice());
        return Ok(());
    }
    crate::format::convert::convert(t.info.dtype, t.dtype, bytes.as_slice(), t.dest)
        .map_err(|e| Error::Destination(format!("tensor {}: {e}", t.info.name)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::serialize;

    fn file(dir: &Path, name: &str) -> (PathBuf, Digest) {
        let path = dir.join(name);
        let a: Vec<u8> = (0..4000u32)
            .flat_map(|i| (i as f32).to_le_bytes())
            .collect();
        let b: Vec<u8> = (0..=255u8).collect();
        let specs = vec![
            serialize::TensorIn {
                name: "a",
                dtype: Dtype::F32,
                shape: &[4000],
                data: &a,
            },
            serialize::TensorIn {
                name: "b",
                dtype: Dtype::U8,
                shape: &[256],
                data: &b,
            },
        ];
        crate::storage::write::to_file(&path, &specs, None, false).unwrap();
        let digest = Digest::of(&std::fs::read(&path).unwrap());
        (path, digest)
    }

    fn pinned(path: &Path, digest: &str) -> Checkpoint {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let with = Opening {
            pin: Some(Pin::Mapping(vec![(name, digest.to_string())])),
            ..Opening::default()
        };
        Checkpoint::open_pinned(&[path.to_path_buf()], None, &with).unwrap()
    }

    #[test]
    fn every_read_of_a_pinned_shard_returns_hashed_bytes_or_an_error() {
        let dir = std::env::temp_dir().join(format!("safeload-pinned-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (path, digest) = file(&dir, "m.safetensors");
        let on_disk = std::fs::read(&path).unwrap();
        let start = on_disk.len() - 4000 * 4 - 256;
        let ckpt = pinned(&path, &digest.to_string());
        let (_, b) = ckpt.get("b").unwrap();
        let (_, a) = ckpt.get("a").unwrap();
        // One tensor: the whole file is held, hashed and checked; the tensor handed out.
        let (out, _) = ckpt.read(&[(0, b)], None, &mut || false).unwrap();
        assert_eq!(
            out[0].0.as_slice(),
            &on_disk[start + b.begin..start + b.end]
        );
        assert_eq!(ckpt.verified().files, 1);
        // Ranges and parts come from the held bytes; the file changing now shows in none.
        let mut flipped = on_disk.clone();
        flipped[start + a.begin] ^= 1;
        std::fs::write(&path, &flipped).unwrap();
        let mut range = vec![0u8; 16];
        ckpt.read_ranges(0, vec![(a.begin as u64, &mut range[..])], &mut || false)
            .unwrap();
        assert_eq!(range, on_disk[start + a.begin..start + a.begin + 16]);
        let (out, _) = ckpt
            .read(&[(0, a)], Some(Dtype::F32), &mut || false)
            .unwrap();
        assert_eq!(
            out[0].0.as_slice(),
            &on_disk[start + a.begin..start + a.end]
        );
        // Asked for again once handed out: read and hashed again, and the file changed.
        let err = ckpt.read(&[(0, b)], None, &mut || false).err().unwrap();
        assert!(err.to_string().contains("SHA-256 mismatch"), "{err}");
        // In place: nothing copied before the check, so the destination keeps its bytes.
        let in_place = pinned(&path, &digest.to_string());
        let (_, a) = in_place.get("a").unwrap();
        let mut dest = vec![7u8; a.nbytes()];
        let target = Target {
            source: 0,
            info: a,
            dtype: Dtype::F32,
            dest: &mut dest,
        };
        let err = in_place.read_into(vec![target], &mut || false).unwrap_err();
        assert!(err.to_string().contains("SHA-256 mismatch"), "{err}");
        assert!(dest.iter().all(|&x| x == 7));
        // Whole, straight into new buffers: hashed on the way.
        std::fs::write(&path, &on_disk).unwrap();
        let fresh = pinned(&path, &digest.to_string());
        let all = fresh.select(None).unwrap();
        let (out, _) = fresh.read(&all, None, &mut || false).unwrap();
        assert_eq!(out[1].0.as_slice(), &on_disk[start + 16000..]);
        assert_eq!(fresh.verified().bytes, on_disk.len() as u64);
        drop((ckpt, in_place, fresh)); // Windows cannot remove files still open
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
