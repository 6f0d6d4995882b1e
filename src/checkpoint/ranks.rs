//! Per-rank shares of a checkpoint that the ranks of a process group read together: which ranks
//! need each tensor, which rank reads it (contiguous runs balanced by bytes), and the rounds the
//! reads and exchanges go in. The collectives themselves stay with torch.distributed (Python).

use std::collections::{BTreeSet, HashMap};

use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};

/// One tensor of the load: its place in [`Checkpoint::entries`] order, who reads it, who needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Share {
    pub entry: usize,
    pub owner: usize,
    pub needing: Vec<usize>,
}

/// Who asks for what: `ranks_needing` names the ranks needing a tensor (a tensor it leaves out:
/// every rank, or the ranks that select it); `selections` is each rank's list of names (None:
/// that rank wants everything); both None: every rank needs every tensor.
pub struct Wants<'a> {
    pub ranks_needing: Option<&'a HashMap<String, Vec<i64>>>,
    pub selections: Option<&'a [Option<Vec<String>>]>,
}

/// The load's plan: the shares of the tensors some rank needs, in (shard, offset) order, and the
/// rounds (indices into `shares`): round k holds batch k of every rank's reads.
#[derive(Debug)]
pub struct SharePlan {
    pub shares: Vec<Share>,
    pub rounds: Vec<Vec<usize>>,
}

/// The rank reading each item (in offset order): contiguous runs, balanced by bytes. `preset`
/// gives a fixed owner to some items (a tensor only one rank needs); the others are split so that
/// every rank's total is as close to an equal share as contiguous runs allow (an item goes to the
/// rank whose byte range holds its midpoint).
pub fn assign_owners(sizes: &[u64], world: usize, preset: &[Option<usize>]) -> Vec<usize> {
    let world = world.max(1);
    let mut load = vec![0f64; world];
    for (&size, owner) in sizes.iter().zip(preset) {
        if let Some(o) = owner {
            load[*o] += size as f64;
        }
    }
    let free: Vec<usize> = (0..sizes.len())
        .filter(|&i| preset.get(i).copied().flatten().is_none())
        .collect();
    let mut owners: Vec<usize> = (0..sizes.len())
        .map(|i| preset.get(i).copied().flatten().unwrap_or(0))
        .collect();
    if free.is_empty() {
        return owners;
    }
    let free_total: f64 = free.iter().map(|&i| sizes[i] as f64).sum();
    let target = (load.iter().sum::<f64>() + free_total) / world as f64;
    let room: Vec<f64> = load.iter().map(|l| (target - l).max(0.0)).collect();
    let room_total = match room.iter().sum::<f64>() {
        t if t > 0.0 => t,
        _ => 1.0,
    };
    let scale = if free_total > 0.0 {
        free_total / room_total
    } else {
        0.0
    };
    let bounds: Vec<f64> = room
        .iter()
        .scan(0.0, |acc, r| {
            *acc += r * scale;
            Some(*acc)
        })
        .collect();
    let (mut rank, mut done) = (0usize, 0f64);
    for i in free {
        let mid = done + sizes[i] as f64 / 2.0;
        while rank < world - 1 && mid >= bounds[rank] {
            rank += 1;
        }
        owners[i] = rank;
        done += sizes[i] as f64;
    }
    owners
}

/// Which ranks need each tensor of `ckpt` (in entries order); errors name the rank or the tensor.
fn needing(ckpt: &Checkpoint, world: usize, wants: &Wants<'_>) -> Result<Vec<Vec<usize>>> {
    let bad = |m: String| Err(Error::Checkpoint(m));
    let mut selected: HashMap<&str, BTreeSet<usize>> = HashMap::new();
    if let Some(selections) = wants.selections {
        for (rank, names) in selections.iter().enumerate() {
            match names {
                None => ckpt.entries().for_each(|(_, t)| {
                    selected.entry(t.name.as_str()).or_default().insert(rank);
                }),
                Some(names) => {
                    for n in names {
                        let Ok((_, t)) = ckpt.get(n) else {
                            return bad(format!(
                                "rank {rank} selected tensor {n:?}, which the checkpoint does not have"
                            ));
                        };
                        selected.entry(t.name.as_str()).or_default().insert(rank);
                    }
                }
            }
        }
    }
    if let Some(ranks_needing) = wants.ranks_needing {
        let mut unknown: Vec<&String> = (ranks_needing.keys())
            .filter(|n| ckpt.get(n).is_err())
            .collect();
        if !unknown.is_empty() {
            unknown.sort();
            unknown.truncate(5);
            return bad(format!(
                "ranks_needing names tensors the checkpoint does not have: {unknown:?}"
            ));
        }
    }
    let mut out = Vec::new();
    for (_, t) in ckpt.entries() {
        let ranks = match wants.ranks_needing.and_then(|r| r.get(&t.name)) {
            Some(ranks) => {
                let set: BTreeSet<i64> = ranks.iter().copied().collect();
                if set.iter().any(|&r| r < 0 || r >= world as i64) {
                    let listed: Vec<i64> = set.into_iter().collect();
                    return bad(format!(
                        "ranks_needing[{:?}] = {listed:?}: ranks must be in 0..{}",
                        t.name,
                        world - 1
                    ));
                }
                set.into_iter().map(|r| r as usize).collect()
            }
            None if wants.selections.is_some() => (selected.get(t.name.as_str()))
                .map_or_else(Vec::new, |s| s.iter().copied().collect()),
            None => (0..world).collect(),
        };
        out.push(ranks);
    }
    Ok(out)
}

/// Plans the load of `ckpt` by `world` ranks: tensors no rank needs are left out, one needed by a
/// single rank is read by it, the rest are split into contiguous runs balanced by bytes; each
/// rank's run is cut into batches of at most `batch_bytes` (whole tensors, file order).
pub fn plan(
    ckpt: &Checkpoint,
    world: usize,
    wants: &Wants<'_>,
    batch_bytes: u64,
) -> Result<SharePlan> {
    if world == 0 {
        return Err(Error::Checkpoint("a process group of no ranks".into()));
    }
    let entries: Vec<_> = ckpt.entries().collect();
    let needing = needing(ckpt, world, wants)?;
    let kept: Vec<usize> = (0..entries.len())
        .filter(|&i| !needing[i].is_empty())
        .collect();
    let sizes: Vec<u64> = kept.iter().map(|&i| entries[i].1.nbytes() as u64).collect();
    let preset: Vec<Option<usize>> = (kept.iter())
        .map(|&i| (needing[i].len() == 1).then(|| needing[i][0]))
        .collect();
    let owners = assign_owners(&sizes, world, &preset);
    let shares: Vec<Share> = (kept.iter().zip(owners))
        .map(|(&i, owner)| Share {
            entry: i,
            owner,
            needing: needing[i].clone(),
        })
        .collect();
    // Each rank's batches, then round k = batch k of every rank, in (shard, offset) order.
    let mut batch_of = vec![usize::MAX; shares.len()];
    for rank in 0..world {
        let mine: Vec<usize> = (0..shares.len())
            .filter(|&s| shares[s].owner == rank && sizes[s] > 0)
            .collect();
        let picked: Vec<_> = mine.iter().map(|&s| entries[shares[s].entry]).collect();
        let mut at = 0;
        for (k, batch) in Checkpoint::batches(&picked, batch_bytes).iter().enumerate() {
            for s in &mine[at..at + batch.len()] {
                batch_of[*s] = k;
            }
            at += batch.len();
        }
    }
    let n_rounds = batch_of
        .iter()
        .filter(|&&k| k != usize::MAX)
        .max()
        .map_or(0, |k| k + 1);
    let rounds = (0..n_rounds)
        .map(|k| (0..shares.len()).filter(|&s| batch_of[s] == k).collect())
        .collect();
    Ok(SharePlan { shares, rounds })
}

/// What every rank must agree on before a shared load: shard file names and each tensor's place,
/// dtype and shape, as a 64-bit FNV-1a digest in hex (the same on every platform and build).
pub fn digest(ckpt: &Checkpoint) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut feed = |bytes: &[u8]| {
        for b in bytes {
            h = (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    for shard in &ckpt.shards {
        let name = shard.path.file_name().unwrap_or_default();
        feed(name.to_string_lossy().as_bytes());
        feed(b"\0");
    }
    for (s, t) in ckpt.entries() {
        let line = format!(
            "{s}|{}|{}|{:?}|{}|{}\n",
            t.name,
            t.dtype.code(),
            t.shape,
            t.begin,
            t.end
        );
        feed(line.as_bytes());
    }
    format!("{h:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_are_contiguous_balanced_and_keep_presets() {
        let sizes = [10, 10, 10, 10, 10, 10];
        let owners = assign_owners(&sizes, 3, &[None; 6]);
        assert_eq!(owners, vec![0, 0, 1, 1, 2, 2]);
        // A preset owner's bytes count toward its share: rank 0 already has 30.
        let preset = [Some(0), None, None, None, None, None];
        let owners = assign_owners(&[30, 10, 10, 10, 10, 10], 2, &preset);
        assert_eq!(owners[0], 0);
        let load: Vec<u64> = (0..2)
            .map(|r| {
                (owners
                    .iter()
                    .zip([30, 10, 10, 10, 10, 10])
                    .filter(|(o, _)| **o == r))
                .map(|(_, s)| s)
                .sum()
            })
            .collect();
        assert_eq!(load, vec![40, 40]);
        assert!(
            owners.windows(2).skip(1).all(|w| w[0] <= w[1]),
            "{owners:?}"
        );
        assert_eq!(assign_owners(&[], 4, &[]), Vec::<usize>::new());
    }
}
