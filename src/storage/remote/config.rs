//! What the store (`store`) and its HTTP client (`connector`, `tls`) both read: how many times
//! and for how long a failed request is retried, and how an option says yes. A leaf: it uses
//! nothing of theirs, so neither reaches into the other for it.

use std::time::Duration;

/// Retries of failed requests (and of bodies cut short, from the byte where they stopped):
/// 5 within 2 minutes, 0.1-2 s apart, so a server that keeps failing is reported in seconds.
/// Retries of a failed request (after its first try), and the time they may take in all.
pub const MAX_RETRIES: usize = 5;
pub const RETRY_TIMEOUT: Duration = Duration::from_secs(120);

/// Whether an option's value says yes ("1", "true", "yes", any case).
pub fn is_true(value: &str) -> bool {
    matches!(value.to_ascii_lowercase().as_str(), "1" | "true" | "yes")
}
