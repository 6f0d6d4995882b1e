//! SHA-256 and its text forms: the hasher every file digest is computed with, a digest written
//! and read as hex (`sha256:<64 hex>` or 64 hex), and the manifests `sha256sum` writes and
//! `sha256sum -c` checks. No I/O here.
//!
//! The implementation behind [`Sha256`] is RustCrypto's `sha2` (SHA-NI / AVX2 picked at run time;
//! why it and not `ring`: Cargo.toml and docs/cli.md). Nothing outside this file names it.

use std::fmt;
use std::str::FromStr;

use sha2::Digest as _;

/// An incremental SHA-256.
#[derive(Clone, Default)]
pub struct Sha256(sha2::Sha256);

/// Inputs this long are hashed through a small buffer, [`STAGE`] bytes at a time. SHA-256's
/// loads wait on each block's rounds, so memory that is not in the core's cache (a tensor
/// another thread just read, one a save writes) hashes at the memory's latency; a copy keeps
/// many loads in flight and the copied bytes then hash from L1. Measured here (SHA-NI, 1 GiB
/// in memory): 1.02-1.08 GB/s hashed where it lies, 1.42-1.44 GB/s staged through 4-16 KiB,
/// 1.69 GB/s for bytes already in L1.
const STAGED_FROM: usize = 64 << 10;
const STAGE: usize = 8 << 10;

impl Sha256 {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn update(&mut self, bytes: &[u8]) {
        if bytes.len() < STAGED_FROM {
            self.0.update(bytes);
            return;
        }
        let mut stage = [0u8; STAGE];
        for part in bytes.chunks(STAGE) {
            let staged = &mut stage[..part.len()];
            staged.copy_from_slice(part);
            self.0.update(staged);
        }
    }

    pub fn finish(self) -> Digest {
        Digest(self.0.finalize().into())
    }
}

/// A SHA-256 digest. Shown as 64 lowercase hex digits (what `sha256sum` prints); read from
/// those (either case), optionally after `sha256:`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Digest(pub [u8; 32]);

impl Digest {
    /// The digest of `bytes`, in one call.
    pub fn of(bytes: &[u8]) -> Digest {
        let mut sha = Sha256::new();
        sha.update(bytes);
        sha.finish()
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{self}")
    }
}

impl FromStr for Digest {
    type Err = String;

    /// `sha256:<64 hex>` or `<64 hex>`; the message of a refusal says what was expected.
    fn from_str(text: &str) -> Result<Digest, String> {
        let hex = text.strip_prefix("sha256:").unwrap_or(text);
        let refused = || {
            format!(
                "expected a SHA-256 as 64 hex digits (optionally after \"sha256:\"), got {text:?}"
            )
        };
        if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(refused());
        }
        let mut out = [0u8; 32];
        for (byte, pair) in out.iter_mut().zip(hex.as_bytes().chunks(2)) {
            let pair = std::str::from_utf8(pair).map_err(|_| refused())?;
            *byte = u8::from_str_radix(pair, 16).map_err(|_| refused())?;
        }
        Ok(Digest(out))
    }
}

/// One line of a manifest: a file's name as written (relative to the manifest's folder unless
/// absolute) and its digest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManifestEntry {
    pub name: String,
    pub digest: Digest,
}

/// A manifest line that is not in `sha256sum`'s format; `line` counts from 1.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManifestError {
    pub line: usize,
    pub reason: String,
}

impl fmt::Display for ManifestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}", self.line, self.reason)
    }
}

impl std::error::Error for ManifestError {}

/// What a manifest line must look like, for messages.
const LINE_FORMAT: &str = "expected \"<64 hex digits>  <name>\" or \"<64 hex digits> *<name>\" \
                           (as sha256sum writes)";

/// Parses a manifest as `sha256sum` writes it: per line `<64 hex>  <name>` (text mode) or
/// `<64 hex> *<name>` (binary mode; the same bytes are hashed either way), a leading `\` marking
/// a name with `\\`, `\n` or `\r` escapes (GNU's form for names holding those). Blank lines are
/// skipped and a CRLF ending is taken as LF; anything else, a name listed twice with two
/// digests included, is an error naming the line.
pub fn parse_manifest(text: &[u8]) -> Result<Vec<ManifestEntry>, ManifestError> {
    let mut entries: Vec<ManifestEntry> = Vec::new();
    let mut seen = std::collections::HashMap::new();
    for (i, raw) in text.split(|&b| b == b'\n').enumerate() {
        let line = i + 1;
        let raw = raw.strip_suffix(b"\r").unwrap_or(raw);
        if raw.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let fail = |reason: String| ManifestError { line, reason };
        let raw = std::str::from_utf8(raw).map_err(|_| fail("not UTF-8".into()))?;
        let entry = parse_line(raw).map_err(fail)?;
        match seen.insert(entry.name.clone(), (line, entry.digest)) {
            Some((first, digest)) if digest != entry.digest => {
                return Err(fail(format!(
                    "{:?} is listed again with another digest (line {first})",
                    entry.name
                )));
            }
            Some(_) => {}
            None => entries.push(entry),
        }
    }
    Ok(entries)
}

fn parse_line(raw: &str) -> Result<ManifestEntry, String> {
    let (escaped, rest) = match raw.strip_prefix('\\') {
        Some(rest) => (true, rest),
        None => (false, raw),
    };
    let shown = || format!("{LINE_FORMAT}, got {raw:?}");
    let (hex, name) = match (rest.get(..64), rest.get(64..66)) {
        (Some(hex), Some("  " | " *")) => (hex, &rest[66..]),
        _ => return Err(shown()),
    };
    let digest = hex.parse::<Digest>().map_err(|_| shown())?;
    if name.is_empty() {
        return Err(shown());
    }
    let name = if escaped {
        unescape(name).ok_or_else(|| {
            format!("{raw:?}: a name after \"\\\" with an escape other than \\\\, \\n or \\r")
        })?
    } else {
        name.to_string()
    };
    Ok(ManifestEntry { name, digest })
}

/// GNU's escapes of a name (`\\`, `\n`, `\r`); None for any other backslash.
fn unescape(name: &str) -> Option<String> {
    let mut out = String::with_capacity(name.len());
    let mut chars = name.chars();
    while let Some(c) = chars.next() {
        out.push(match c {
            '\\' => match chars.next()? {
                '\\' => '\\',
                'n' => '\n',
                'r' => '\r',
                _ => return None,
            },
            c => c,
        });
    }
    Some(out)
}

/// The manifest line `sha256sum` writes for `name` (text mode, no newline): `<hex>  <name>`, or
/// `\<hex>  <escaped name>` when the name holds a backslash, LF or CR, so that
/// [`parse_manifest`] and `sha256sum -c` read the same name back.
pub fn manifest_line(digest: &Digest, name: &str) -> String {
    if !name.contains(['\\', '\n', '\r']) {
        return format!("{digest}  {name}");
    }
    let escaped = name
        .replace('\\', "\\\\")
        .replace('\n', "\\n")
        .replace('\r', "\\r");
    format!("\\{digest}  {escaped}")
}

/// The digest of `path` as the `sha256sum` command computes it, and the line it prints; None
/// where the command is not installed (a test then checks against [`Digest::of`] alone).
#[cfg(test)]
pub fn sha256sum(path: &std::path::Path) -> Option<(Digest, String)> {
    let Ok(out) = std::process::Command::new("sha256sum").arg(path).output() else {
        eprintln!("sha256sum is not installed: not compared");
        return None;
    };
    assert!(
        out.status.success(),
        "sha256sum {}: {:?}",
        path.display(),
        out
    );
    let line = String::from_utf8(out.stdout)
        .unwrap()
        .trim_end()
        .to_string();
    let entry = parse_manifest(line.as_bytes()).unwrap().remove(0);
    Some((entry.digest, line))
}

#[cfg(test)]
mod tests {
    use super::*;

    const EMPTY: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
    const ABC: &str = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";

    #[test]
    fn long_inputs_hash_alike_whole_staged_or_in_short_pieces() {
        // FIPS 180-2's third vector: a million 'a's (longer than STAGED_FROM, not a whole
        // number of stages), whole, in long uneven pieces and in short ones (hashed where
        // they lie).
        const MILLION_A: &str = "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0";
        let msg = vec![b'a'; 1_000_000];
        assert_eq!(Digest::of(&msg).to_string(), MILLION_A);
        for piece in [100_003, STAGED_FROM + 1, 997] {
            let mut sha = Sha256::new();
            msg.chunks(piece).for_each(|p| sha.update(p));
            assert_eq!(sha.finish().to_string(), MILLION_A, "pieces of {piece}");
        }
    }

    #[test]
    fn known_vectors() {
        assert_eq!(Digest::of(b"").to_string(), EMPTY);
        assert_eq!(Digest::of(b"abc").to_string(), ABC);
        // FIPS 180-2's two-block message, fed in uneven pieces.
        let msg = b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
        let mut sha = Sha256::new();
        for piece in msg.chunks(7) {
            sha.update(piece);
        }
        assert_eq!(
            sha.finish().to_string(),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"
        );
        // A million 'a's.
        let mut sha = Sha256::new();
        (0..1000).for_each(|_| sha.update(&[b'a'; 1000]));
        assert_eq!(
            sha.finish().to_string(),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"
        );
    }

    #[test]
    fn digests_as_text() {
        let abc = Digest::of(b"abc");
        assert_eq!(ABC.parse::<Digest>(), Ok(abc));
        assert_eq!(format!("sha256:{ABC}").parse::<Digest>(), Ok(abc));
        assert_eq!(ABC.to_uppercase().parse::<Digest>(), Ok(abc));
        assert_eq!(format!("{abc:?}"), format!("sha256:{ABC}"));
        for bad in [
            "",
            &ABC[1..],
            &format!("{ABC}0"),
            &ABC.replace('a', "g"),
            &format!("md5:{ABC}"),
            &format!(" {ABC}"),
        ] {
            let err = bad.parse::<Digest>().unwrap_err();
            assert!(
                err.contains("64 hex digits") && err.contains(&format!("{bad:?}")),
                "{err}"
            );
        }
    }

    #[test]
    fn manifests_as_sha256sum_writes_them() {
        let text = format!(
            "{ABC}  model-00001.safetensors\r\n\n   \n{EMPTY} *sub dir/two  spaces.safetensors\n\
             \\{EMPTY}  back\\\\slash\\nnewline\n{ABC}  model-00001.safetensors\n"
        );
        let entries = parse_manifest(text.as_bytes()).unwrap();
        let names: Vec<&str> = entries.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "model-00001.safetensors",
                "sub dir/two  spaces.safetensors",
                "back\\slash\nnewline"
            ]
        );
        assert_eq!(entries[0].digest, Digest::of(b"abc"));
        assert_eq!(entries[1].digest, Digest::of(b""));
        // What manifest_line writes reads back as the same name.
        for name in ["plain.safetensors", "a\\b", "two\nlines\r"] {
            let line = manifest_line(&Digest::of(b"abc"), name);
            assert_eq!(parse_manifest(line.as_bytes()).unwrap()[0].name, name);
        }
        assert_eq!(manifest_line(&Digest::of(b""), "x"), format!("{EMPTY}  x"));
    }

    #[test]
    fn malformed_manifest_lines_are_named() {
        let cases = [
            (format!("{ABC}  ok\n{ABC} one-space"), 2, "expected"),
            (ABC.to_string(), 1, "expected"),
            (format!("{ABC}  "), 1, "expected"),
            (format!("\n\n{}  short", &ABC[2..]), 3, "expected"),
            (format!("sha256:{ABC}  prefixed"), 1, "expected"),
            (format!("{}  not-hex", ABC.replace('b', "z")), 1, "expected"),
            (format!("# comment\n{ABC}  x"), 1, "expected"),
            (format!("\\{ABC}  bad\\tescape"), 1, "escape"),
            (format!("{ABC}  x\n{EMPTY}  x"), 2, "listed again"),
        ];
        for (text, line, says) in cases {
            let err = parse_manifest(text.as_bytes()).unwrap_err();
            assert_eq!(err.line, line, "{text:?}: {err}");
            assert!(
                err.to_string().starts_with(&format!("line {line}: ")) && err.reason.contains(says),
                "{err}"
            );
        }
        let err = parse_manifest(b"\xff\xfe  x").unwrap_err();
        assert_eq!(err.to_string(), "line 1: not UTF-8");
        assert_eq!(parse_manifest(b"").unwrap(), []);
    }

    #[test]
    fn agrees_with_sha256sum() {
        let data: Vec<u8> = (0..3_000_017u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        let path = std::env::temp_dir().join(format!("safeload-digest-{}", std::process::id()));
        std::fs::write(&path, &data).unwrap();
        let theirs = sha256sum(&path);
        std::fs::remove_file(&path).unwrap();
        let ours = Digest::of(&data);
        if let Some((digest, line)) = theirs {
            assert_eq!(digest, ours);
            assert_eq!(manifest_line(&ours, &path.display().to_string()), line);
        }
    }

    /// Throughput of [`Sha256`] over 1 GiB in memory (docs/cli.md, "SHA-256"):
    /// `cargo test --release --lib digest -- --ignored --nocapture`.
    #[test]
    #[ignore = "a measurement, not a check"]
    fn throughput() {
        let data: Vec<u8> = (0..1usize << 30).map(|i| (i >> 5) as u8).collect();
        for _ in 0..5 {
            let started = std::time::Instant::now();
            let mut sha = Sha256::new();
            data.chunks(8 << 20).for_each(|c| sha.update(c));
            std::hint::black_box(sha.finish());
            let seconds = started.elapsed().as_secs_f64();
            println!("sha256: {:.0} MB/s", data.len() as f64 / seconds / 1e6);
        }
    }
}
