//! Stores by URL: `object_store` clients configured from the environment (as AWS, Google and
//! Azure users write it) and `storage_options`, built once per bucket or host and options, and
//! the tokio runtime every request runs on (owned by the crate, started on first use).

use std::collections::HashMap;
use std::io;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::azure::MicrosoftAzureBuilder;
use object_store::gcp::GoogleCloudStorageBuilder;
use object_store::http::HttpBuilder;
use object_store::path::Path as ObjectPath;
use object_store::{BackoffConfig, ObjectStore, ObjectStoreScheme, RetryConfig};
use url::Url;

use super::address::{self, Options};
use super::config::{MAX_RETRIES, RETRY_TIMEOUT, is_true};
use super::connector::Connector;

/// The runtime the stores' requests run on. The engine's worker threads block on it
/// (`block_on`), so it only drives connections: one thread per core, 2-8.
pub fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(crate::platform::cores().clamp(2, 8))
            .thread_name("safeload-io")
            .enable_all()
            .build()
            .expect("a tokio runtime (threads and an I/O driver)")
    })
}

/// The store serving `url` and the object's path in it; stores are kept for the process, one per
/// scheme, bucket (or host) and options, so shards and later loads reuse their connections.
/// An `hf://` URL is served by its Hub `resolve` URL (see [`Hub`]).
pub fn locate(url: &str, options: &Options) -> io::Result<(Arc<dyn ObjectStore>, ObjectPath)> {
    match Hub::parse(url)? {
        Some(hub) => locate_as(&hub.resolve_url(), hub.authorization(), options),
        None => locate_as(url, None, options),
    }
}

/// [`locate`] of a URL that is not `hf://`, sent with `authorization` to its own host.
pub fn locate_as(
    url: &str,
    authorization: Option<String>,
    options: &Options,
) -> io::Result<(Arc<dyn ObjectStore>, ObjectPath)> {
    let parsed = Url::parse(url).map_err(|e| invalid(format!("{url}: not a URL ({e})")))?;
    let (scheme, path) = match parsed.scheme() {
        // An http(s) URL is read as it is written, whatever its host looks like: signing an
        // `https://*.amazonaws.com` URL with the environment's credentials would send them where
        // nobody asked, and would break the presigned URL it usually is (use s3:// to sign).
        "http" | "https" => (
            ObjectStoreScheme::Http,
            ObjectPath::from_url_path(parsed.path()).map_err(|e| invalid(format!("{url}: {e}")))?,
        ),
        _ => ObjectStoreScheme::parse(&parsed).map_err(|e| invalid(format!("{url}: {e}")))?,
    };
    let base = &parsed[..url::Position::BeforePath];
    let query = match scheme {
        ObjectStoreScheme::Http => parsed.query().map(str::to_string),
        _ => None,
    };
    let env = Environment::read(&scheme);
    // A store is kept for its URL, options and configuration from the environment: a process
    // that changes AWS_PROFILE or a key after a failed open gets a store built with the change.
    let mut key = format!("{base}?{}", query.as_deref().unwrap_or_default());
    if let Some(authorization) = &authorization {
        key.push_str(&format!("\nauthorization={authorization}"));
    }
    let profile = env.profile.as_deref().unwrap_or_default();
    for (k, v) in options.iter().chain(&env.vars).chain(profile) {
        key.push_str(&format!("\n{k}={v}"));
    }
    static STORES: OnceLock<Mutex<HashMap<String, Arc<dyn ObjectStore>>>> = OnceLock::new();
    let stores = STORES.get_or_init(Default::default);
    if let Some(store) = stores.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
        return Ok((store.clone(), path));
    }
    // object_store's default for allow_http is false, and its options cannot tell a default from
    // a choice: only the caller's allow_http=false refuses plain http (an http:// URL they name
    // is read otherwise).
    let refuse_http = options
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("allow_http") && !is_true(v));
    let connector = Connector {
        query,
        authorization,
        refuse_http,
    };
    let store =
        build(scheme, base, connector, options, env).map_err(|e| invalid(format!("{url}: {e}")))?;
    stores
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(key, store.clone());
    Ok((store, path))
}

/// `hf://[datasets/|spaces/]ORG/REPO[@REVISION]/PATH`: a file or folder of a Hub repository,
/// under `HF_ENDPOINT` (else https://huggingface.co), at the revision named (else `main`).
/// Parsed and checked once, before any request: the repository id as huggingface_hub's
/// `validate_repo_id` takes it, the revision as git takes a ref name (percent-decoded, as
/// huggingface_hub's file system reads `@refs%2Fpr%2F1`), the path as a file inside the
/// repository ([`address::url_outside`]); so no URL of one can reach another repository.
pub struct Hub {
    endpoint: String,
    /// "models", "datasets" or "spaces".
    kind: &'static str,
    /// ORG/REPO.
    repo: String,
    /// Decoded (`refs/pr/1`); encoded whole where a URL holds it.
    revision: String,
    /// In the repository, decoded, without a leading or trailing `/`.
    pub path: String,
}

impl Hub {
    /// The repository path `url` names; None for URLs that are not `hf://`.
    pub fn parse(url: &str) -> io::Result<Option<Hub>> {
        let Some(rest) = url.strip_prefix("hf://") else {
            return Ok(None);
        };
        let bad = |why: String| {
            invalid(format!(
                "{url}: {why} (expected hf://[datasets/|spaces/]ORG/REPO[@REVISION][/PATH])"
            ))
        };
        let (kind, rest) = match rest.split_once('/') {
            Some(("datasets", rest)) => ("datasets", rest),
            Some(("spaces", rest)) => ("spaces", rest),
            _ => ("models", rest),
        };
        let mut parts = rest.splitn(3, '/');
        let (Some(org), Some(repo)) = (parts.next(), parts.next()) else {
            return Err(bad("no repository".into()));
        };
        let (repo, revision) = repo.split_once('@').unwrap_or((repo, "main"));
        let repo_id = format!("{org}/{repo}");
        if let Some(why) = repo_id_refused(org, repo) {
            return Err(bad(format!("repository id {repo_id:?}: {why}")));
        }
        let revision = address::percent_decoded(revision).unwrap_or_else(|| revision.to_string());
        if let Some(why) = revision_refused(&revision) {
            return Err(bad(format!("revision {revision:?}: {why}")));
        }
        let written = parts.next().unwrap_or_default().trim_end_matches('/');
        if let Some(why) = (!written.is_empty())
            .then(|| address::url_outside(written))
            .flatten()
        {
            return Err(bad(format!(
                "path {written:?} is not a file in the repository ({why})"
            )));
        }
        let path = address::percent_decoded(written).unwrap_or_else(|| written.to_string());
        let endpoint = std::env::var("HF_ENDPOINT").unwrap_or_else(|_| HUB_ENDPOINT.into());
        Ok(Some(Hub {
            endpoint: endpoint.trim_end_matches('/').to_string(),
            kind,
            repo: repo_id,
            revision,
            path,
        }))
    }

    /// The file's `resolve` URL, which answers with a redirect to the Hub's storage (followed
    /// by the connector, without the token).
    pub fn resolve_url(&self) -> String {
        let kind = match self.kind {
            "models" => "",
            "datasets" => "datasets/",
            _ => "spaces/",
        };
        let (endpoint, repo) = (&self.endpoint, &self.repo);
        let (revision, path) = self.encoded();
        format!("{endpoint}/{kind}{repo}/resolve/{revision}/{path}")
    }

    /// The Hub API's listing of the folder (`/api/{kind}/ORG/REPO/tree/REVISION/PATH`: a JSON
    /// array of `{"type": "file" | "directory", "path": ...}`, as huggingface_hub lists it).
    pub fn tree_url(&self) -> String {
        let (endpoint, kind, repo) = (&self.endpoint, self.kind, &self.repo);
        let (revision, path) = self.encoded();
        format!("{endpoint}/api/{kind}/{repo}/tree/{revision}/{path}")
    }

    /// The revision and the path as a URL holds them (huggingface_hub's quoting).
    fn encoded(&self) -> (String, String) {
        (
            address::percent_encoded(&self.revision, false),
            address::percent_encoded(&self.path, true),
        )
    }

    /// The `Authorization` huggingface_hub would send (`HF_TOKEN`, `HUGGING_FACE_HUB_TOKEN`, else
    /// the token file under `HF_TOKEN_PATH` / `HF_HOME` / `~/.cache/huggingface`).
    pub fn authorization(&self) -> Option<String> {
        hub_token().map(|t| format!("Bearer {t}"))
    }
}

/// The Hub huggingface_hub talks to unless `HF_ENDPOINT` names another.
const HUB_ENDPOINT: &str = "https://huggingface.co";

/// Whether `url` names a file of a Hub repository, whose answer reports the file's SHA-256
/// (`reported`): an `hf://` URL of a file, or a `resolve` URL
/// (`[datasets/|spaces/]ORG/REPO/resolve/REVISION/PATH`) under `HF_ENDPOINT` or under
/// https://huggingface.co. Any other server's headers are not taken as a Hub's.
pub fn names_hub_file(url: &str) -> bool {
    if let Ok(Some(hub)) = Hub::parse(url) {
        return !hub.path.is_empty();
    }
    let endpoint = std::env::var("HF_ENDPOINT").ok();
    [endpoint.as_deref(), Some(HUB_ENDPOINT)]
        .into_iter()
        .flatten()
        .any(|endpoint| resolve_url_under(url, endpoint))
}

/// Whether `url` is a `resolve` URL of a file under the Hub at `endpoint` (same scheme, host and
/// port; under its path).
fn resolve_url_under(url: &str, endpoint: &str) -> bool {
    let (Ok(url), Ok(endpoint)) = (Url::parse(url), Url::parse(endpoint)) else {
        return false;
    };
    let rest = (url.origin() == endpoint.origin())
        .then(|| {
            url.path()
                .strip_prefix(endpoint.path().trim_end_matches('/'))
        })
        .flatten()
        .and_then(|rest| rest.strip_prefix('/'));
    let Some(rest) = rest else {
        return false;
    };
    let parts: Vec<&str> = rest.split('/').collect();
    let kind = usize::from(matches!(parts[0], "datasets" | "spaces"));
    // ORG, REPO, "resolve", REVISION and at least one part of the file's path, none empty.
    parts.len() >= kind + 5
        && parts[kind + 2] == "resolve"
        && parts[kind..].iter().all(|p| !p.is_empty())
}

/// Why `ORG/REPO` is not a repository id huggingface_hub's `validate_repo_id` accepts: each part
/// letters, digits, `-`, `_`, `.`, starting and ending with a letter, a digit or `_`; no `--` or
/// `..`; no `.git` at the end; 96 characters at most.
fn repo_id_refused(org: &str, repo: &str) -> Option<&'static str> {
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let part_ok = |p: &str| {
        p.chars().all(|c| word(c) || c == '-' || c == '.')
            && p.starts_with(word)
            && p.ends_with(word)
    };
    let doubled = |p: &str| p.contains("--") || p.contains("..");
    if !part_ok(org) || !part_ok(repo) {
        Some("letters, digits, '-', '_' and '.', from and to a letter, a digit or '_'")
    } else if doubled(org) || doubled(repo) {
        Some("'--' and '..' are not allowed")
    } else if repo.ends_with(".git") {
        Some("it cannot end with '.git'")
    } else if org.len() + 1 + repo.len() > 96 {
        Some("longer than 96 characters")
    } else {
        None
    }
}

/// Why `revision` (decoded) is not a ref name or commit git takes: git's rules for ref names
/// (`git check-ref-format`): no `..`, `@{`, control characters, space, `~^:?*[\`; no empty part,
/// no part starting with `.`.
fn revision_refused(revision: &str) -> Option<&'static str> {
    if revision.is_empty() {
        Some("empty")
    } else if revision.contains("..") || revision.contains("@{") {
        Some("'..' and '@{' are not allowed")
    } else if (revision.chars()).any(|c| c.is_control() || " ~^:?*[\\".contains(c)) {
        Some("a control character, a space or one of ~^:?*[\\ is not allowed")
    } else if revision
        .split('/')
        .any(|p| p.is_empty() || p.starts_with('.'))
    {
        Some("an empty part or a part starting with '.' is not allowed")
    } else {
        None
    }
}

fn hub_token() -> Option<String> {
    let set = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    if let Some(token) = set("HF_TOKEN").or_else(|| set("HUGGING_FACE_HUB_TOKEN")) {
        return Some(token.trim().to_string());
    }
    let file = match set("HF_TOKEN_PATH") {
        Some(path) => std::path::PathBuf::from(path),
        None => match set("HF_HOME") {
            Some(home) => std::path::PathBuf::from(home).join("token"),
            None => std::path::PathBuf::from(set("HOME")?).join(".cache/huggingface/token"),
        },
    };
    let token = std::fs::read_to_string(file).ok()?;
    Some(token.trim().to_string()).filter(|t| !t.is_empty())
}

/// What the environment configures for stores of a scheme, read once per open: its variables
/// (`AWS_*`, `GOOGLE_*`, `AZURE_*`, the CA bundle, the proxies) and, for S3, the settings of the AWS profile
/// files (an error where `AWS_PROFILE` names a profile they lack).
struct Environment {
    vars: Pairs,
    profile: Result<Pairs, String>,
}

impl Environment {
    fn read(scheme: &ObjectStoreScheme) -> Environment {
        let prefixes: &[&str] = match scheme {
            ObjectStoreScheme::AmazonS3 => &["AWS_"],
            ObjectStoreScheme::GoogleCloudStorage => &["GOOGLE_"],
            ObjectStoreScheme::MicrosoftAzure => &["AZURE_"],
            _ => &[],
        };
        let mut vars: Pairs = std::env::vars()
            .filter(|(k, _)| {
                k == "SSL_CERT_FILE"
                    || k == "AWS_CA_BUNDLE"
                    || super::proxy::VARIABLES.contains(&k.as_str())
                    || prefixes.iter().any(|p| k.starts_with(p))
            })
            .collect();
        vars.sort();
        let profile = match scheme {
            ObjectStoreScheme::AmazonS3 => {
                let lookup = |name: &str| std::env::var(name).ok();
                super::profile::settings(&lookup)
            }
            _ => Ok(Vec::new()),
        };
        Environment { vars, profile }
    }
}

fn invalid(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, message)
}

type Pairs = Vec<(String, String)>;
type Built = Result<Arc<dyn ObjectStore>, String>;

/// A store from its builder: the URL, the HTTP client, retries, then the options.
macro_rules! store {
    ($builder:expr, $base:expr, $options:expr) => {
        store!($builder, $base, $options, Connector::default())
    };
    ($builder:expr, $base:expr, $options:expr, $connector:expr) => {{
        let b = ($builder)
            .with_url($base)
            .with_http_connector($connector)
            .with_retry(retry());
        let b = apply(b, $options, |b, k, v| Ok(b.with_config(k.parse()?, v)))?;
        Ok(Arc::new(b.build().map_err(|e| e.to_string())?))
    }};
}

fn build(
    scheme: ObjectStoreScheme,
    base: &str,
    connector: Connector,
    options: &Options,
    env: Environment,
) -> Built {
    match scheme {
        ObjectStoreScheme::AmazonS3 => s3(base, options, env),
        ObjectStoreScheme::GoogleCloudStorage => {
            store!(GoogleCloudStorageBuilder::from_env(), base, options)
        }
        ObjectStoreScheme::MicrosoftAzure => {
            store!(MicrosoftAzureBuilder::from_env(), base, options)
        }
        ObjectStoreScheme::Http => store!(HttpBuilder::new(), base, options, connector),
        other => Err(format!("{other:?} URLs are not read by safeload")),
    }
}

/// S3 and S3-compatible stores (MinIO, R2, rclone ...): every `AWS_*` variable `object_store`
/// knows (AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
/// AWS_SESSION_TOKEN, AWS_SKIP_SIGNATURE, AWS_VIRTUAL_HOSTED_STYLE_REQUEST, ...), then the
/// options; AWS_S3_FORCE_PATH_STYLE as the AWS CLI reads it (AWS_CA_BUNDLE: `connector`);
/// under both, the profile of AWS's shared files (`profile`).
fn s3(base: &str, options: &Options, env: Environment) -> Built {
    let Environment { vars, profile } = env;
    let mut b = AmazonS3Builder::new();
    // The shared files' profile first (for what the environment leaves unset); its keys not
    // when the options give a key pair of their own.
    let own_keys = options
        .iter()
        .any(|(k, _)| matches!(canonical(k).as_str(), "access_key_id" | "aws_access_key_id"));
    for (key, value) in profile? {
        if own_keys
            && matches!(
                key.as_str(),
                "access_key_id" | "secret_access_key" | "token"
            )
        {
            continue;
        }
        let k = key
            .parse::<AmazonS3ConfigKey>()
            .map_err(|e| e.to_string())?;
        b = b.with_config(k, value);
    }
    let path_style = vars
        .iter()
        .any(|(k, v)| k == "AWS_S3_FORCE_PATH_STYLE" && is_true(v));
    for (key, value) in vars {
        let parsed = key
            .starts_with("AWS_")
            .then(|| key.to_ascii_lowercase().parse::<AmazonS3ConfigKey>());
        if let Some(Ok(k)) = parsed {
            b = b.with_config(k, value);
        }
    }
    if path_style {
        b = b.with_virtual_hosted_style_request(false);
    }
    store!(b, base, options)
}

fn retry() -> RetryConfig {
    RetryConfig {
        backoff: BackoffConfig {
            init_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(2),
            base: 2.0,
        },
        max_retries: MAX_RETRIES,
        retry_timeout: RETRY_TIMEOUT,
    }
}

/// fsspec (s3fs, gcsfs, adlfs) names for the options `object_store` spells otherwise.
fn canonical(key: &str) -> String {
    let key = key.to_ascii_lowercase();
    match key.as_str() {
        "key" => "access_key_id".into(),
        "secret" => "secret_access_key".into(),
        "anon" => "skip_signature".into(),
        "region_name" => "region".into(),
        "use_ssl" => "allow_http".into(),
        _ => key,
    }
}

/// Applies `options` with `set`; an option the store does not know is an error naming it.
fn apply<B>(
    mut builder: B,
    options: &Options,
    set: impl Fn(B, &str, &str) -> Result<B, object_store::Error>,
) -> Result<B, String> {
    for (key, value) in options {
        let k = canonical(key);
        // fsspec's use_ssl=False means plain HTTP is fine; use_ssl=True refuses nothing (s3fs
        // still reads an endpoint_url that says http://), where allow_http=false refuses http.
        if key.eq_ignore_ascii_case("use_ssl") && is_true(value) {
            continue;
        }
        let value = match k.as_str() {
            "allow_http" if key.eq_ignore_ascii_case("use_ssl") => (!is_true(value)).to_string(),
            _ => value.clone(),
        };
        builder = set(builder, &k, &value)
            .map_err(|e| format!("storage option {key:?} is not known here ({e})"))?;
    }
    Ok(builder)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn https_urls_are_read_as_written_whatever_the_host() {
        // A presigned S3 URL: plain HTTPS (its own signature), never signed with the
        // environment's credentials.
        let url = "https://b.s3.us-east-1.amazonaws.com/m/x.safetensors?X-Amz-Signature=f00d";
        let (store, path) = locate(url, &[]).unwrap();
        assert!(format!("{store}").contains("HttpStore"), "{store}");
        assert_eq!(path.as_ref(), "m/x.safetensors");
        let (store, _) = locate("s3://b/m/x.safetensors", &[]).unwrap();
        assert!(format!("{store}").contains("AmazonS3"), "{store}");
    }

    #[test]
    fn files_of_a_hub_are_its_resolve_urls_under_its_endpoint() {
        let check = |endpoint: &str, want: bool, urls: &[&str]| {
            for url in urls {
                assert_eq!(
                    resolve_url_under(url, endpoint),
                    want,
                    "{url} under {endpoint}"
                );
            }
        };
        let (hub, mirror) = ("https://huggingface.co", "https://mirror.example/hf/");
        check(
            hub,
            true,
            &[
                "https://huggingface.co/acme/tiny/resolve/main/model.safetensors",
                "https://HuggingFace.co:443/acme/tiny/resolve/main/m.safetensors",
                "https://huggingface.co/acme/tiny/resolve/refs%2Fpr%2F1/unet/m.safetensors?x=1",
                "https://huggingface.co/datasets/acme/data/resolve/v1/d.safetensors",
                "https://huggingface.co/spaces/acme/demo/resolve/main/m.safetensors",
            ],
        );
        check(
            mirror,
            true,
            &["https://mirror.example/hf/acme/tiny/resolve/main/m.safetensors"],
        );
        check(
            "http://127.0.0.1:8080",
            true,
            &["http://127.0.0.1:8080/acme/tiny/resolve/main/m.safetensors"],
        );
        // Another host, scheme, port or path; not a file's resolve URL.
        check(
            hub,
            false,
            &[
                "https://evil.example/acme/tiny/resolve/main/m.safetensors",
                "http://huggingface.co/acme/tiny/resolve/main/m.safetensors",
                "https://huggingface.co:8443/acme/tiny/resolve/main/m.safetensors",
                "s3://huggingface.co/acme/tiny/resolve/main/m.safetensors",
                "https://huggingface.co/acme/tiny/blob/main/m.safetensors",
                "https://huggingface.co/acme/tiny/resolve/main/",
                "https://huggingface.co/acme/tiny/resolve/main",
                "https://huggingface.co/datasets/acme/resolve/main/x",
                "https://huggingface.co/api/models/acme/tiny/tree/main/x",
            ],
        );
        check(
            mirror,
            false,
            &[
                "https://mirror.example/acme/tiny/resolve/main/m.safetensors",
                "https://mirror.example/hfx/acme/tiny/resolve/main/m.safetensors",
            ],
        );
        assert!(names_hub_file("hf://acme/tiny@v1/unet/m.safetensors"));
        assert!(!names_hub_file("hf://acme/tiny"));
        assert!(!names_hub_file(
            "s3://b/acme/tiny/resolve/main/m.safetensors"
        ));
    }

    #[test]
    fn hub_urls_are_checked_before_any_url_is_built() {
        let hub = |u: &str| Hub::parse(u).unwrap().unwrap();
        let h = hub("hf://acme/tiny@refs%2Fpr%2F1/unet/a%20b.safetensors");
        assert_eq!((h.kind, h.repo.as_str()), ("models", "acme/tiny"));
        assert_eq!(
            (h.revision.as_str(), h.path.as_str()),
            ("refs/pr/1", "unet/a b.safetensors")
        );
        assert!(
            h.resolve_url()
                .ends_with("/acme/tiny/resolve/refs%2Fpr%2F1/unet/a%20b.safetensors")
        );
        assert!(
            h.tree_url()
                .ends_with("/api/models/acme/tiny/tree/refs%2Fpr%2F1/unet/a%20b.safetensors")
        );
        let h = hub("hf://datasets/my-org/data.set_1@0123abcd/");
        assert_eq!(
            (h.kind, h.repo.as_str(), h.path.as_str()),
            ("datasets", "my-org/data.set_1", "")
        );
        assert!(Hub::parse("s3://b/k").unwrap().is_none());
        for (url, why) in [
            ("hf://org/repo/../../other/repo2/model.safetensors", "'..'"),
            (
                "hf://org/repo/%2e%2e/%2E%2E/other/repo2/model.safetensors",
                "'..'",
            ),
            ("hf://org/repo/sub%2f..%2f..%2fx.safetensors", "'..'"),
            ("hf://org/repo/..\\..\\other\\x.safetensors", "backslash"),
            ("hf://org/repo//etc/x.safetensors", "absolute"),
            ("hf://org/repo/x.safetensors?y", "'?'"),
            ("hf://../repo/x.safetensors", "repository id"),
            ("hf://org/../x.safetensors", "repository id"),
            ("hf://org/re..po/x.safetensors", "'..'"),
            ("hf://org/re--po/x.safetensors", "'--'"),
            ("hf://org/repo.git/x.safetensors", ".git"),
            ("hf://%2e%2e/repo/x.safetensors", "repository id"),
            ("hf://org\\x/repo/x.safetensors", "repository id"),
            ("hf://org/repo@../../other/x.safetensors", "revision"),
            ("hf://org/repo@%2e%2e/x.safetensors", "revision"),
            ("hf://org/repo@a%2F..%2Fb/x.safetensors", "revision"),
            ("hf://org/repo@/x.safetensors", "revision"),
            ("hf://org/repo@ma\\in/x.safetensors", "revision"),
            ("hf://org", "no repository"),
        ] {
            let err = Hub::parse(url)
                .err()
                .unwrap_or_else(|| panic!("{url} let through"));
            assert!(err.to_string().contains(why), "{url}: {err}");
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        }
    }
}
