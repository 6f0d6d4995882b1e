//! Read-ahead budgets: how many bytes a handle's read-ahead or a prefetch loader may hold, from
//! the environment or the defaults, bounded by what the process may still take.

/// Default budget of owned read-ahead memory (`SAFELOAD_READAHEAD_BYTES`; 0 turns it off).
pub const DEFAULT_BUDGET: u64 = 256 << 20;

/// The read-ahead budget from `SAFELOAD_READAHEAD_BYTES` (bytes, or `256MiB`-style), else
/// [`DEFAULT_BUDGET`], at most a quarter of what the process may still take
/// ([`crate::read::memory::available`]). 0 turns read-ahead off.
pub fn budget_from_env() -> u64 {
    budget("SAFELOAD_READAHEAD_BYTES", DEFAULT_BUDGET)
}

/// Default budget of a prefetch loader (`SAFELOAD_PREFETCH_BYTES`): a loader's tensors are the
/// caller's final memory, which a caller taking every tensor holds in the end anyway, and a
/// window as large as the file lets it be read in file order whatever the order of the takes.
pub const DEFAULT_PREFETCH_BUDGET: u64 = 4 << 30;

/// Default budget of a loader whose destinations are staging memory (CUDA: pinned host
/// tensors, each copied to the device when taken), not the caller's final memory.
pub const DEFAULT_STAGING_BUDGET: u64 = 1 << 30;

/// A prefetch loader's budget when the caller gives none: `SAFELOAD_PREFETCH_BYTES`, else
/// [`DEFAULT_STAGING_BUDGET`] for a `staging` loader and [`DEFAULT_PREFETCH_BUDGET`] for the
/// others, at most a quarter of what the process may still take.
pub fn prefetch_budget_from_env(staging: bool) -> u64 {
    let default = if staging {
        DEFAULT_STAGING_BUDGET
    } else {
        DEFAULT_PREFETCH_BUDGET
    };
    budget("SAFELOAD_PREFETCH_BYTES", default)
}

fn budget(var: &str, default: u64) -> u64 {
    let asked = std::env::var(var)
        .ok()
        .and_then(|v| crate::read::memory::parse_bytes(&v))
        .unwrap_or(default);
    crate::read::memory::available().map_or(asked, |a| asked.min(a / 4))
}
