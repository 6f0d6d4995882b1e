//! How much memory this process may still take: the smallest of the host's available memory,
//! the headroom of the cgroup it runs in (a Kubernetes pod, a Slurm job), and what
//! `SAFELOAD_MEMORY_LIMIT` leaves of what safeload holds. Every budget reads it from here: the
//! pool of freed memory ([`crate::read::pool`]), the cold-read switch to uncached reads
//! ([`crate::read::strategy::direct_above`]), the read-ahead ([`crate::read::readahead`]), and the check that
//! a load into owned memory fits before it reads anything ([`crate::read::pool::ensure_fits`]).
//!
//! The cgroup is found as the kernel describes it: the process's path in `/proc/self/cgroup`
//! (v2 `0::/path`; v1 the line whose controllers include `memory`) under the matching mount in
//! `/proc/self/mountinfo` (`cgroup2`, or `cgroup` with the `memory` option). Every level from
//! the process's cgroup up to the mount's root counts: its limit is the smaller of `memory.max`
//! and `memory.high` (v1: `memory.limit_in_bytes`), its use `memory.current` (v1
//! `memory.usage_in_bytes`) less the inactive file cache the kernel reclaims first (`memory.stat`
//! `inactive_file`, v1 `total_inactive_file`: the "working set" Kubernetes evicts on). The
//! headroom is the smallest `limit - use` over the levels that have a limit.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::platform;

/// A v1 limit at or above this is "no limit" (the kernel reports `PAGE_COUNTER_MAX` pages).
const V1_UNLIMITED: u64 = 1 << 62;
/// [`available`] is worked out again after this long (it reads a few small files).
const REFRESH: Duration = Duration::from_millis(200);

/// Bytes safeload's own destination memory holds right now (owned tensors and the pool), which
/// `SAFELOAD_MEMORY_LIMIT` bounds.
static HELD: AtomicU64 = AtomicU64::new(0);

/// Owned destination memory was allocated (`bytes` > 0) or freed (`bytes` < 0).
pub fn account(bytes: i64) {
    if bytes >= 0 {
        HELD.fetch_add(bytes as u64, Ordering::Relaxed);
    } else {
        HELD.fetch_sub(bytes.unsigned_abs(), Ordering::Relaxed);
    }
}

/// Bytes of owned destination memory safeload holds (live tensors and the pool).
pub fn held() -> u64 {
    HELD.load(Ordering::Relaxed)
}

/// `SAFELOAD_MEMORY_LIMIT` (bytes, or `8GiB`-style): the most safeload may hold at once.
pub fn user_limit() -> Option<u64> {
    static LIMIT: OnceLock<Option<u64>> = OnceLock::new();
    *LIMIT.get_or_init(|| {
        std::env::var("SAFELOAD_MEMORY_LIMIT")
            .ok()
            .and_then(|v| parse_bytes(&v))
    })
}

/// Where the cgroup files are read from: `/` (tests point it at a fixture tree).
fn root() -> &'static Mutex<PathBuf> {
    static ROOT: OnceLock<Mutex<PathBuf>> = OnceLock::new();
    ROOT.get_or_init(|| Mutex::new(PathBuf::from("/")))
}

/// Reads the cgroup files under `root` instead of `/` from now on (tests, with a fixture tree;
/// only the `testing` build's `_testing.set_cgroup_root` calls it).
#[cfg(feature = "testing")]
pub fn set_cgroup_root(path: &Path) {
    *root().lock().unwrap_or_else(|p| p.into_inner()) = path.to_path_buf();
    forget_snapshot();
}

/// What bounds a process's memory, as [`snapshot`] found it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Budget {
    /// The host's available memory (Linux `MemAvailable`).
    pub host: Option<u64>,
    /// The container's headroom: the cgroup's, where a level of it has a limit (Linux); the
    /// job object's, where it limits memory (Windows).
    pub container: Option<u64>,
    /// `SAFELOAD_MEMORY_LIMIT` less what safeload holds.
    pub user: Option<u64>,
}

impl Budget {
    /// The smallest of the three (None: nothing is known).
    pub fn available(&self) -> Option<u64> {
        [self.host, self.container, self.user]
            .into_iter()
            .flatten()
            .min()
    }

    /// Which bound [`Budget::available`] is, for messages.
    pub fn source(&self) -> &'static str {
        let available = self.available();
        if available.is_some() && available == self.user {
            "SAFELOAD_MEMORY_LIMIT less what safeload holds"
        } else if available.is_some() && available == self.container {
            "the container's memory limit (cgroup, job object) less its use"
        } else {
            "the system's available memory"
        }
    }
}

fn cache() -> &'static Mutex<Option<(Instant, Budget)>> {
    static CACHE: OnceLock<Mutex<Option<(Instant, Budget)>>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(None))
}

/// Makes the next [`snapshot`] work the bounds out afresh (after memory was given back).
pub fn forget_snapshot() {
    *cache().lock().unwrap_or_else(|p| p.into_inner()) = None;
}

/// The bounds now (worked out at most every [`REFRESH`]).
pub fn snapshot() -> Budget {
    let mut cached = cache().lock().unwrap_or_else(|p| p.into_inner());
    if let Some((at, budget)) = *cached
        && at.elapsed() < REFRESH
    {
        return with_user(budget);
    }
    let root = root().lock().unwrap_or_else(|p| p.into_inner()).clone();
    let budget = Budget {
        host: platform::available_memory(),
        container: cgroup_headroom(&root).or_else(platform::job_memory_headroom),
        user: None,
    };
    *cached = Some((Instant::now(), budget));
    with_user(budget)
}

/// `budget` with the user's limit as it stands now (what safeload holds changes by the call).
fn with_user(budget: Budget) -> Budget {
    Budget {
        user: user_limit().map(|limit| limit.saturating_sub(held())),
        ..budget
    }
}

/// Memory this process may still take, in bytes (None: nothing is known).
pub fn available() -> Option<u64> {
    snapshot().available()
}

/// `"1073741824"`, `"1GiB"`, `"512MiB"`, `"64KiB"`, `"2GB"` ... as bytes.
pub fn parse_bytes(text: &str) -> Option<u64> {
    let t = text.trim();
    let digits = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(digits);
    let number: f64 = number.parse().ok()?;
    let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return None,
    };
    (number >= 0.0).then_some((number * scale as f64) as u64)
}

// -- cgroups ----------------------------------------------------------------------------------

/// The headroom of the cgroup the process is in, read under `root` (`/` on a live system);
/// None outside cgroups, or where no level has a limit.
pub fn cgroup_headroom(root: &Path) -> Option<u64> {
    let membership = std::fs::read_to_string(root.join("proc/self/cgroup")).ok()?;
    let mounts = std::fs::read_to_string(root.join("proc/self/mountinfo")).ok()?;
    let (v2, path) = membership.lines().find_map(|line| {
        let mut parts = line.splitn(3, ':');
        let (id, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        if id == "0" && controllers.is_empty() {
            return Some((true, path));
        }
        controllers
            .split(',')
            .any(|c| c == "memory")
            .then_some((false, path))
    })?;
    let (mount_root, mount_point) = mounts.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        let fields: Vec<&str> = left.split(' ').collect();
        let mut rest = right.split(' ');
        let (fstype, _source, options) = (rest.next()?, rest.next()?, rest.next().unwrap_or(""));
        let matches = if v2 {
            fstype == "cgroup2"
        } else {
            fstype == "cgroup" && options.split(',').any(|o| o == "memory")
        };
        (matches && fields.len() >= 5).then(|| (unescape(fields[3]), unescape(fields[4])))
    })?;
    // The process's path is relative to the hierarchy's root; the mount shows the hierarchy from
    // `mount_root` on (a container sees its own cgroup as the mount's root).
    let relative = path
        .strip_prefix(mount_root.as_str())
        .filter(|_| mount_root != "/")
        .unwrap_or(path)
        .trim_start_matches('/');
    let top = root.join(mount_point.trim_start_matches('/'));
    let mut dir = top.join(relative);
    let mut headroom: Option<u64> = None;
    loop {
        if let Some((limit, used)) = level(&dir, v2) {
            let room = limit.saturating_sub(used);
            headroom = Some(headroom.map_or(room, |h| h.min(room)));
        }
        if dir == top || !dir.pop() || !dir.starts_with(&top) {
            break;
        }
    }
    headroom
}

/// (limit, use) of one cgroup directory, where it has a limit.
fn level(dir: &Path, v2: bool) -> Option<(u64, u64)> {
    let number = |name: &str| -> Option<Option<u64>> {
        let text = std::fs::read_to_string(dir.join(name)).ok()?;
        let text = text.trim();
        if text == "max" {
            return Some(None);
        }
        text.parse().ok().map(Some)
    };
    let limit = if v2 {
        [number("memory.max"), number("memory.high")]
            .into_iter()
            .flatten()
            .flatten()
            .min()?
    } else {
        number("memory.limit_in_bytes")
            .flatten()
            .filter(|&l| l < V1_UNLIMITED)?
    };
    let (usage, reclaimable) = if v2 {
        ("memory.current", "inactive_file")
    } else {
        ("memory.usage_in_bytes", "total_inactive_file")
    };
    let used = number(usage).flatten().unwrap_or(0);
    let inactive = std::fs::read_to_string(dir.join("memory.stat"))
        .ok()
        .and_then(|stat| {
            stat.lines().find_map(|l| {
                let (key, value) = l.split_once(' ')?;
                (key == reclaimable).then(|| value.trim().parse::<u64>().ok())?
            })
        })
        .unwrap_or(0);
    Some((limit, used.saturating_sub(inactive)))
}

/// A mountinfo field with its octal escapes (`\040` for a space) decoded.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        if bytes[i] == b'\\'
            && let Some(digits) = octal
        {
            let code = digits.iter().fold(0u32, |v, d| v * 8 + u32::from(d - b'0'));
            out.push(code as u8);
            i += 4;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_sizes() {
        assert_eq!(parse_bytes("1024"), Some(1024));
        assert_eq!(parse_bytes("64KiB"), Some(64 << 10));
        assert_eq!(parse_bytes("256MiB"), Some(256 << 20));
        assert_eq!(parse_bytes(" 8 GiB "), Some(8 << 30));
        assert_eq!(parse_bytes("1.5g"), Some(3 << 29));
        assert_eq!(parse_bytes("0"), Some(0));
        assert_eq!(parse_bytes("lots"), None);
        assert_eq!(parse_bytes("5 parsecs"), None);
    }

    /// A fixture root: `files` are (path under the root, contents).
    fn fixture(tag: &str, files: &[(&str, &str)]) -> PathBuf {
        let root = std::env::temp_dir().join(format!("safeload-cg-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for (path, text) in files {
            let path = root.join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }
        root
    }

    const V2_MOUNT: &str = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n";
    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;

    #[test]
    fn v2_limit_less_working_set() {
        let root = fixture(
            "v2",
            &[
                ("proc/self/cgroup", "0::/kubepods/pod1/ctr\n"),
                ("proc/self/mountinfo", V2_MOUNT),
                ("sys/fs/cgroup/kubepods/pod1/ctr/memory.max", "2147483648\n"),
                ("sys/fs/cgroup/kubepods/pod1/ctr/memory.high", "max\n"),
                (
                    "sys/fs/cgroup/kubepods/pod1/ctr/memory.current",
                    "524288000\n",
                ),
                (
                    "sys/fs/cgroup/kubepods/pod1/ctr/memory.stat",
                    "anon 1\nactive_file 5\ninactive_file 104857600\n",
                ),
            ],
        );
        assert_eq!(cgroup_headroom(&root), Some(2 * GIB - 400 * MIB));
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn v2_nested_levels_take_the_tightest_and_high_counts() {
        let root = fixture(
            "nested",
            &[
                ("proc/self/cgroup", "0::/job/step\n"),
                ("proc/self/mountinfo", V2_MOUNT),
                ("sys/fs/cgroup/job/memory.max", "1073741824\n"),
                ("sys/fs/cgroup/job/memory.current", "268435456\n"),
                ("sys/fs/cgroup/job/step/memory.max", "max\n"),
                ("sys/fs/cgroup/job/step/memory.high", "8589934592\n"),
                ("sys/fs/cgroup/job/step/memory.current", "104857600\n"),
            ],
        );
        // The parent: 1 GiB - 256 MiB; the step: 8 GiB (high) - 100 MiB.
        assert_eq!(cgroup_headroom(&root), Some(GIB - 256 * MIB));
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn no_limit_missing_files_and_a_limit_below_use() {
        let unlimited = fixture(
            "max",
            &[
                ("proc/self/cgroup", "0::/\n"),
                ("proc/self/mountinfo", V2_MOUNT),
                ("sys/fs/cgroup/memory.max", "max\n"),
                ("sys/fs/cgroup/memory.current", "1000\n"),
            ],
        );
        assert_eq!(cgroup_headroom(&unlimited), None);
        let missing = fixture("missing", &[("proc/self/cgroup", "0::/a\n")]);
        assert_eq!(cgroup_headroom(&missing), None);
        let no_files = fixture(
            "nofiles",
            &[
                ("proc/self/cgroup", "0::/a\n"),
                ("proc/self/mountinfo", V2_MOUNT),
            ],
        );
        assert_eq!(cgroup_headroom(&no_files), None);
        let over = fixture(
            "over",
            &[
                ("proc/self/cgroup", "0::/a\n"),
                ("proc/self/mountinfo", V2_MOUNT),
                ("sys/fs/cgroup/a/memory.max", "1048576\n"),
                ("sys/fs/cgroup/a/memory.current", "4194304\n"),
            ],
        );
        assert_eq!(cgroup_headroom(&over), Some(0));
        for r in [unlimited, missing, no_files, over] {
            std::fs::remove_dir_all(r).unwrap();
        }
    }

    #[test]
    fn v1_memory_controller_and_a_namespaced_mount() {
        let mounts = "25 20 0:22 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n\
                      26 20 0:23 /docker/abc /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n";
        let root = fixture(
            "v1",
            &[
                (
                    "proc/self/cgroup",
                    "5:cpu:/docker/abc\n4:memory:/docker/abc\n",
                ),
                ("proc/self/mountinfo", mounts),
                ("sys/fs/cgroup/memory/memory.limit_in_bytes", "3221225472\n"),
                ("sys/fs/cgroup/memory/memory.usage_in_bytes", "1073741824\n"),
                (
                    "sys/fs/cgroup/memory/memory.stat",
                    "cache 10\ntotal_inactive_file 536870912\n",
                ),
            ],
        );
        // The mount's root is the container's cgroup: its files are at the mount point.
        assert_eq!(cgroup_headroom(&root), Some(3 * GIB - 512 * MIB));
        let unlimited = fixture(
            "v1max",
            &[
                ("proc/self/cgroup", "4:memory:/\n"),
                (
                    "proc/self/mountinfo",
                    "26 20 0:23 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n",
                ),
                (
                    "sys/fs/cgroup/memory/memory.limit_in_bytes",
                    "9223372036854771712\n",
                ),
                ("sys/fs/cgroup/memory/memory.usage_in_bytes", "1\n"),
            ],
        );
        assert_eq!(cgroup_headroom(&unlimited), None);
        for r in [root, unlimited] {
            std::fs::remove_dir_all(r).unwrap();
        }
    }

    #[test]
    fn mount_points_with_escapes() {
        assert_eq!(unescape(r"/sys/fs/my\040cgroup"), "/sys/fs/my cgroup");
        assert_eq!(unescape("/plain"), "/plain");
    }

    #[test]
    fn the_smallest_bound_wins() {
        let b = Budget {
            host: Some(20 * GIB),
            container: Some(2 * GIB),
            user: None,
        };
        assert_eq!(b.available(), Some(2 * GIB));
        assert!(b.source().contains("container"));
        let b = Budget {
            user: Some(GIB),
            ..b
        };
        assert_eq!(b.available(), Some(GIB));
        assert!(b.source().contains("SAFELOAD_MEMORY_LIMIT"));
        assert_eq!(Budget::default().available(), None);
    }
}
