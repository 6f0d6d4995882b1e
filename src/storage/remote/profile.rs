//! AWS's shared files, as the AWS CLI and boto3 read them: the profile `AWS_PROFILE` (else
//! `default`) of `~/.aws/credentials` (`AWS_SHARED_CREDENTIALS_FILE`) and `~/.aws/config`
//! (`AWS_CONFIG_FILE`), for what the environment does not set: the key pair and session token
//! (the credentials file first, then the config file; none of them when `AWS_ACCESS_KEY_ID` is
//! set: the environment's credentials are a set), the region (unless `AWS_REGION` or
//! `AWS_DEFAULT_REGION`), the endpoint (`endpoint_url`, unless `AWS_ENDPOINT_URL`) and the
//! addressing style (`s3 =` / `addressing_style = path | virtual`).

use std::collections::HashMap;
use std::path::PathBuf;

/// A file's sections: name -> (key -> value); nested keys (`s3 =` then indented lines) as
/// `s3.addressing_style`.
type Sections = HashMap<String, Section>;
/// One section of a file: key -> value.
type Section = HashMap<String, String>;

/// How the environment is read (a variable's value, None when unset).
type Env<'a> = &'a dyn Fn(&str) -> Option<String>;

/// The settings the profile gives, as `object_store` S3 option names (`access_key_id`,
/// `secret_access_key`, `token`, `region`, `endpoint`, `virtual_hosted_style_request`), each
/// one only where the environment leaves it unset. An `AWS_PROFILE` that neither file has is an
/// error naming it and the files looked in.
pub fn settings(env: &dyn Fn(&str) -> Option<String>) -> Result<Vec<(String, String)>, String> {
    let explicit = env("AWS_PROFILE").filter(|p| !p.is_empty());
    let profile = explicit.clone().unwrap_or_else(|| "default".into());
    let (credentials_path, config_path) = shared_files(env);
    let (credentials, config) = profile_sections(&profile, &credentials_path, &config_path);
    if credentials.is_none() && config.is_none() {
        return match explicit {
            Some(name) => Err(format!(
                "AWS_PROFILE={name}: no such profile in {} or {}",
                shown(&credentials_path),
                shown(&config_path)
            )),
            None => Ok(Vec::new()),
        };
    }
    let (credentials, config) = (credentials.unwrap_or_default(), config.unwrap_or_default());
    let mut out = Vec::new();
    push_key_pair(env, &credentials, &config, &mut out);
    push_region_and_endpoint(env, &config, &mut out);
    push_addressing_style(env, &config, &mut out);
    Ok(out)
}

/// The credentials file and the config file: where the environment names them, else in
/// `~/.aws` (None without a home directory).
fn shared_files(env: Env) -> (Option<PathBuf>, Option<PathBuf>) {
    let home = env("HOME")
        .or_else(|| env("USERPROFILE"))
        .map(PathBuf::from);
    let file = |var: &str, name: &str| {
        env(var)
            .map(PathBuf::from)
            .or_else(|| home.as_ref().map(|h| h.join(".aws").join(name)))
    };
    (
        file("AWS_SHARED_CREDENTIALS_FILE", "credentials"),
        file("AWS_CONFIG_FILE", "config"),
    )
}

/// `profile`'s section of the credentials file (`[name]`) and of the config file
/// (`[profile name]`, `[default]` for the default profile); a file that cannot be read has none.
fn profile_sections(
    profile: &str,
    credentials_path: &Option<PathBuf>,
    config_path: &Option<PathBuf>,
) -> (Option<Section>, Option<Section>) {
    let read = |path: &Option<PathBuf>| {
        path.as_ref()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .map(|text| parse(&text))
            .unwrap_or_default()
    };
    let credentials = read(credentials_path).remove(profile);
    let config_section = match profile {
        "default" => "default".to_string(),
        name => format!("profile {name}"),
    };
    let mut configs = read(config_path);
    let config = configs
        .remove(&config_section)
        .or_else(|| configs.remove(&format!("profile {profile}")));
    (credentials, config)
}

/// Whether none of `vars` is set to a value.
fn unset(env: Env, vars: &[&str]) -> bool {
    vars.iter().all(|v| env(v).is_none_or(|s| s.is_empty()))
}

/// The key pair and session token, from the credentials file first, then the config file; none
/// when the environment has credentials (they are a set).
fn push_key_pair(
    env: Env,
    credentials: &Section,
    config: &Section,
    out: &mut Vec<(String, String)>,
) {
    if !unset(env, &["AWS_ACCESS_KEY_ID"]) {
        return;
    }
    let get = |key: &str| credentials.get(key).or_else(|| config.get(key)).cloned();
    for (file_key, option) in [
        ("aws_access_key_id", "access_key_id"),
        ("aws_secret_access_key", "secret_access_key"),
        ("aws_session_token", "token"),
    ] {
        if let Some(value) = get(file_key) {
            out.push((option.to_string(), value));
        }
    }
}

/// The config file's region and endpoint, each unless the environment sets it.
fn push_region_and_endpoint(env: Env, config: &Section, out: &mut Vec<(String, String)>) {
    let settings = [
        (
            &["AWS_REGION", "AWS_DEFAULT_REGION"][..],
            "region",
            "region",
        ),
        (
            &["AWS_ENDPOINT_URL", "AWS_ENDPOINT"][..],
            "endpoint_url",
            "endpoint",
        ),
    ];
    for (vars, file_key, option) in settings {
        if let Some(value) = config.get(file_key).filter(|_| unset(env, vars)) {
            out.push((option.to_string(), value.clone()));
        }
    }
}

/// The config file's `s3 = addressing_style` (`path` or `virtual`; `auto` is `object_store`'s
/// default), unless the environment chooses the style.
fn push_addressing_style(env: Env, config: &Section, out: &mut Vec<(String, String)>) {
    let style = config
        .get("s3.addressing_style")
        .map(|s| s.to_ascii_lowercase());
    let style_unset = unset(
        env,
        &[
            "AWS_VIRTUAL_HOSTED_STYLE_REQUEST",
            "AWS_S3_FORCE_PATH_STYLE",
        ],
    );
    if let Some(virtual_hosted) = style.and_then(|s| match s.as_str() {
        "path" => Some(false),
        "virtual" => Some(true),
        _ => None, // "auto": object_store's default
    }) && style_unset
    {
        out.push((
            "virtual_hosted_style_request".into(),
            virtual_hosted.to_string(),
        ));
    }
}

fn shown(path: &Option<PathBuf>) -> String {
    path.as_ref()
        .map_or("(no home directory)".into(), |p| p.display().to_string())
}

/// The INI dialect of AWS's files: `[section]`, `key = value`, `#` and `;` comments on lines of
/// their own, and a key with no value opening indented `sub_key = value` lines.
fn parse(text: &str) -> Sections {
    let mut sections = Sections::new();
    let mut section: Option<String> = None;
    let mut nested: Option<String> = None;
    for raw in text.lines() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            let name = name.split_whitespace().collect::<Vec<_>>().join(" ");
            sections.entry(name.clone()).or_default();
            section = Some(name);
            nested = None;
            continue;
        }
        let (Some(name), Some((key, value))) = (&section, line.split_once('=')) else {
            continue;
        };
        let (key, value) = (key.trim().to_ascii_lowercase(), value.trim().to_string());
        let indented = raw.starts_with([' ', '\t']);
        let entries = sections.entry(name.clone()).or_default();
        match &nested {
            Some(parent) if indented => {
                entries.insert(format!("{parent}.{key}"), value);
            }
            _ if value.is_empty() => nested = Some(key),
            _ => {
                nested = None;
                entries.insert(key, value);
            }
        }
    }
    sections
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(tag: &str, credentials: &str, config: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("safeload-aws-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(d.join(".aws")).unwrap();
        std::fs::write(d.join(".aws").join("credentials"), credentials).unwrap();
        std::fs::write(d.join(".aws").join("config"), config).unwrap();
        d
    }

    fn with<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    const CREDENTIALS: &str = "# keys\n[default]\naws_access_key_id = AKDEFAULT\n\
        aws_secret_access_key = sdefault\n\n[dev]\naws_access_key_id=AKDEV\n\
        aws_secret_access_key=sdev\naws_session_token = tdev\n";
    const CONFIG: &str = "[default]\nregion = eu-west-1\n\n[profile  dev]\nregion = us-west-2\n\
        ; local MinIO\nendpoint_url = http://127.0.0.1:9000\ns3 =\n  addressing_style = path\n\
        output = json\n[profile onlyconfig]\naws_access_key_id = AKCFG\naws_secret_access_key = scfg\n";

    #[test]
    fn profiles_as_the_aws_cli_reads_them() {
        let d = dir("profiles", CREDENTIALS, CONFIG);
        let home = d.to_str().unwrap();
        let pairs = |v: Vec<(String, String)>| -> Vec<(String, String)> { v };
        let got = pairs(settings(&with(&[("HOME", home)])).unwrap());
        let want = |items: &[(&str, &str)]| -> Vec<(String, String)> {
            items
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        assert_eq!(
            got,
            want(&[
                ("access_key_id", "AKDEFAULT"),
                ("secret_access_key", "sdefault"),
                ("region", "eu-west-1")
            ])
        );
        let dev = settings(&with(&[("HOME", home), ("AWS_PROFILE", "dev")])).unwrap();
        assert_eq!(
            dev,
            want(&[
                ("access_key_id", "AKDEV"),
                ("secret_access_key", "sdev"),
                ("token", "tdev"),
                ("region", "us-west-2"),
                ("endpoint", "http://127.0.0.1:9000"),
                ("virtual_hosted_style_request", "false"),
            ])
        );
        // Keys in the config file alone serve too.
        let cfg = settings(&with(&[("HOME", home), ("AWS_PROFILE", "onlyconfig")])).unwrap();
        assert_eq!(
            cfg,
            want(&[("access_key_id", "AKCFG"), ("secret_access_key", "scfg")])
        );
        // The environment wins, credentials as a set (no token from the file beside env keys).
        let env = settings(&with(&[
            ("HOME", home),
            ("AWS_PROFILE", "dev"),
            ("AWS_ACCESS_KEY_ID", "AKENV"),
            ("AWS_DEFAULT_REGION", "ap-south-1"),
            ("AWS_ENDPOINT_URL", "http://elsewhere"),
            ("AWS_S3_FORCE_PATH_STYLE", "true"),
        ]))
        .unwrap();
        assert_eq!(env, want(&[]));
        std::fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn files_named_by_the_environment_and_a_missing_profile() {
        let d = dir("named", "", "");
        let creds = d.join("creds");
        std::fs::write(
            &creds,
            "[x]\naws_access_key_id = AKX\naws_secret_access_key = sx\n",
        )
        .unwrap();
        let creds = creds.to_str().unwrap();
        let home = d.to_str().unwrap();
        let got = settings(&with(&[
            ("HOME", home),
            ("AWS_SHARED_CREDENTIALS_FILE", creds),
            ("AWS_PROFILE", "x"),
        ]))
        .unwrap();
        assert_eq!(got.len(), 2);
        let err = settings(&with(&[("HOME", home), ("AWS_PROFILE", "nope")])).unwrap_err();
        assert!(
            err.contains("AWS_PROFILE=nope") && err.contains(".aws"),
            "{err}"
        );
        // No files and no AWS_PROFILE: nothing, no error.
        assert_eq!(
            settings(&with(&[("HOME", "/nonexistent")])).unwrap(),
            vec![]
        );
        std::fs::remove_dir_all(d).unwrap();
    }
}
