//! The per-rank plan of a process group's shared load (`crate::checkpoint::ranks`), as
//! `safeload.distributed` runs it: typed shares and rounds, the agreement digest, and
//! `assign_owners`.

use std::collections::HashMap;

use pyo3::prelude::*;

use super::info::Info;
use crate::checkpoint::Checkpoint;
use crate::checkpoint::ranks::{self, Wants};

/// One tensor of a shared load: its header entry, the rank that reads it, the ranks that need it.
#[pyclass(frozen, get_all, module = "safeload._safeload")]
pub struct Share {
    info: Info,
    owner: usize,
    needing: Vec<usize>,
}

#[pymethods]
impl Share {
    fn __repr__(&self) -> String {
        format!(
            "Share(info={:?}, owner={}, needing={:?})",
            self.info.name(),
            self.owner,
            self.needing
        )
    }
}

/// The plan of a load by `world` ranks (see `Checkpoint.shares`).
pub(super) fn plan(
    ckpt: &Checkpoint,
    world: usize,
    ranks_needing: Option<HashMap<String, Vec<i64>>>,
    selections: Option<Vec<Option<Vec<String>>>>,
    batch_bytes: u64,
) -> PyResult<(Vec<Share>, Vec<Vec<usize>>)> {
    let wants = Wants {
        ranks_needing: ranks_needing.as_ref(),
        selections: selections.as_deref(),
    };
    let plan = ranks::plan(ckpt, world, &wants, batch_bytes)?;
    let entries: Vec<_> = ckpt.entries().collect();
    let out = (plan.shares.into_iter())
        .map(|s| {
            let (shard, t) = entries[s.entry];
            Share {
                info: Info::new(shard, t),
                owner: s.owner,
                needing: s.needing,
            }
        })
        .collect();
    Ok((out, plan.rounds))
}

/// The rank reading each item (in offset order): contiguous runs balanced by bytes; `preset`
/// gives a fixed owner (>= 0) to some items (see `crate::checkpoint::ranks::assign_owners`).
#[pyfunction]
#[pyo3(signature = (sizes, world, preset=None))]
pub fn assign_owners(
    sizes: Vec<u64>,
    world: usize,
    preset: Option<Vec<i64>>,
) -> PyResult<Vec<usize>> {
    let preset: Vec<Option<usize>> = match preset {
        None => vec![None; sizes.len()],
        Some(p) => p.into_iter().map(|o| usize::try_from(o).ok()).collect(),
    };
    if preset.len() != sizes.len() || preset.iter().flatten().any(|&o| o >= world) {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "preset: one owner (or -1) per size, each below world",
        ));
    }
    Ok(ranks::assign_owners(&sizes, world, &preset))
}
