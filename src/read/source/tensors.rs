//! Whole tensors read: into typed targets (converting on the way), into new memory, or as
//! views of the file's map.

use crate::error::{Error, Result};
use crate::format::dtype::Dtype;
use crate::format::header::TensorInfo;
use crate::read::buffer::{self, Fresh, TensorBytes};
use crate::read::counts::ReadCounts;
use crate::read::plan::ChunkPlan;
use crate::read::strategy::{self, Strategy};

use super::{ReadOptions, Source, chunk_bytes, execute};

/// One tensor to read and where it goes: `dest` holds exactly the tensor's elements as `dtype`
/// (the file's dtype, or one [`crate::format::convert`] converts it to).
pub struct Target<'s, 'd> {
    /// Index into the sources.
    pub source: usize,
    pub info: &'s TensorInfo,
    pub dtype: Dtype,
    pub dest: &'d mut [u8],
}

impl Target<'_, '_> {
    /// Whether `dest` holds exactly the tensor as `dtype` (one the reader can fill in place).
    pub fn fits(&self) -> bool {
        bytes_as(self.info, self.dtype) == Some(self.dest.len())
    }
}

/// Bytes a tensor takes as `dtype`: its size in the file when the dtype is its own, else what
/// [`crate::format::convert`] turns it into. None when it cannot be converted to `dtype`.
pub fn bytes_as(info: &TensorInfo, dtype: Dtype) -> Option<usize> {
    if dtype == info.dtype {
        return Some(info.nbytes());
    }
    crate::format::convert::converted_len(info.dtype, dtype, info.nbytes()).ok()
}

/// `Ok` when every target's destination holds exactly its tensor as its dtype; else an error
/// naming the first that does not, before anything is read.
pub fn check_fits(sources: &[&Source], targets: &[Target<'_, '_>]) -> Result<()> {
    match targets.iter().find(|t| !t.fits()) {
        None => Ok(()),
        Some(t) => Err(Error::Destination(format!(
            "cannot read tensor {} ({:?}, {} bytes) of {} into {} bytes of {:?}",
            t.info.name,
            t.info.dtype,
            t.info.nbytes(),
            sources[t.source].path.display(),
            t.dest.len(),
            t.dtype
        ))),
    }
}

/// Reads every target with one worker pool, in (source, offset) order, each source with its
/// strategy in `strategies` (Pread or Direct), converting where a target's dtype differs from
/// the file's.
pub fn read_targets(
    sources: &[&Source],
    targets: Vec<Target<'_, '_>>,
    strategies: &[Strategy],
    opts: &ReadOptions,
    poll: &mut dyn FnMut() -> bool,
) -> Result<ReadCounts> {
    check_fits(sources, &targets)?;
    let mut targets = targets;
    targets.sort_by_key(|t| (t.source, t.info.begin));
    let mut plan = ChunkPlan::new(chunk_bytes(sources, opts));
    for t in targets {
        let at = sources[t.source].header.data_start() + t.info.begin as u64;
        if t.dtype == t.info.dtype {
            plan.add(t.source, at, t.dest, &t.info.name);
        } else {
            plan.add_converting(t.source, at, t.dest, t.info.dtype, t.dtype, &t.info.name);
        }
    }
    if opts.hash {
        plan.take_turns(strategy::files_hashed_at_once());
    }
    execute(sources, &plan, strategies, opts, poll)
}

/// Reads tensors of one or more sources into new memory with one worker pool; `dtype` converts
/// the F32/F16/BF16 ones (others keep theirs). Returns buffers in the order of `wanted`, each
/// with the dtype it holds.
fn read_tensors(
    sources: &[&Source],
    wanted: &[(usize, &TensorInfo)],
    strategies: &[Strategy],
    dtype: Option<Dtype>,
    opts: &ReadOptions,
    poll: &mut dyn FnMut() -> bool,
) -> Result<(Tensors, ReadCounts)> {
    let dtypes: Vec<Dtype> = wanted
        .iter()
        .map(|(_, t)| crate::format::convert::read_as(t.dtype, dtype))
        .collect();
    let sizes: Vec<usize> = wanted
        .iter()
        .zip(&dtypes)
        .map(|((_, t), d)| bytes_as(t, *d).expect("supported, checked above"))
        .collect();
    let needed: u64 = sizes.iter().map(|&n| n as u64).sum();
    crate::read::pool::ensure_fits(needed, || {
        let mut paths: Vec<String> = wanted
            .iter()
            .map(|(s, _)| sources[*s].path.display().to_string())
            .collect();
        paths.dedup();
        format!("{} tensors of {}", wanted.len(), paths.join(", "))
    })?;
    let mut buffers = buffer::allocate(&sizes).map_err(|e| {
        let path = wanted.first().map_or(String::new(), |(s, _)| {
            sources[*s].path.display().to_string()
        });
        Error::Memory(format!(
            "cannot allocate {needed} bytes for {} tensors of {path}: {e}",
            wanted.len()
        ))
    })?;
    let targets = wanted
        .iter()
        .zip(&dtypes)
        .zip(buffers.iter_mut())
        .map(|(((source, info), dtype), b)| Target {
            source: *source,
            info,
            dtype: *dtype,
            dest: b.as_mut_slice(),
        })
        .collect();
    let report = read_targets(sources, targets, strategies, opts, poll)?;
    let out = buffers
        .into_iter()
        .map(Fresh::into_shared)
        .zip(dtypes)
        .collect();
    Ok((out, report))
}

/// What a read of several tensors gives: each one's bytes and the dtype they hold.
pub type Tensors = Vec<(TensorBytes, Dtype)>;

/// Tensors of one or more sources as each source's strategy in `strategies` gives them: views
/// of its file's map for `Mmap` (zero copy; `dtype` must convert none of them: a map cannot
/// change dtypes, so the read plan, `crate::read::strategy::plan`, never maps for a converting
/// read), else read by the parallel reader (one worker pool for every source read), converting
/// to `dtype`. Returns the bytes and dtype of each, in the order of `wanted`, and the read's
/// report (empty for maps).
pub fn read_or_map(
    sources: &[&Source],
    wanted: &[(usize, &TensorInfo)],
    strategies: &[Strategy],
    dtype: Option<Dtype>,
    opts: &ReadOptions,
    poll: &mut dyn FnMut() -> bool,
) -> Result<(Tensors, ReadCounts)> {
    let (mapped, read): (Vec<usize>, Vec<usize>) =
        (0..wanted.len()).partition(|&i| strategies[wanted[i].0] == Strategy::Mmap);
    if mapped.is_empty() {
        return read_tensors(sources, wanted, strategies, dtype, opts, poll);
    }
    let pick = |at: &[usize]| at.iter().map(|&i| wanted[i]).collect::<Vec<_>>();
    let mut out: Vec<Option<(TensorBytes, Dtype)>> = vec![None; wanted.len()];
    let mut report = ReadCounts::default();
    if !read.is_empty() {
        let (bytes, done) = read_tensors(sources, &pick(&read), strategies, dtype, opts, poll)?;
        report = done;
        read.iter().zip(bytes).for_each(|(&i, b)| out[i] = Some(b));
    }
    let views = map_views(sources, &pick(&mapped), dtype)?;
    mapped
        .iter()
        .zip(views)
        .for_each(|(&i, v)| out[i] = Some(v));
    let out = out
        .into_iter()
        .map(|t| t.expect("every tensor read or mapped"));
    Ok((out.collect(), report))
}

/// Views of `wanted` (all of mapped sources) in their files' maps, each source's together: its
/// file's length is checked once for all of them.
fn map_views(
    sources: &[&Source],
    wanted: &[(usize, &TensorInfo)],
    dtype: Option<Dtype>,
) -> Result<Tensors> {
    if let Some((_, t)) = dtype.and_then(|d| wanted.iter().find(|(_, t)| t.dtype != d)) {
        return Err(Error::Internal(format!(
            "tensor {} asked for as a view of the map in another dtype",
            t.name
        )));
    }
    let mut views: Vec<Option<TensorBytes>> = vec![None; wanted.len()];
    for (s, source) in sources.iter().enumerate() {
        let (at, infos): (Vec<usize>, Vec<&TensorInfo>) = (wanted.iter().enumerate())
            .filter(|(_, (of, _))| *of == s)
            .map(|(i, (_, t))| (i, *t))
            .unzip();
        if infos.is_empty() {
            continue;
        }
        for (i, view) in at.into_iter().zip(source.map_tensors(&infos)?) {
            views[i] = Some(view);
        }
    }
    Ok((views.into_iter().zip(wanted))
        .map(|(view, (_, t))| (view.expect("every tensor has a source"), t.dtype))
        .collect())
}
