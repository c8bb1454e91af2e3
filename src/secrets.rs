//! Secret values (passwords, SASL and OAUTHBEARER settings, private-key passphrases) never leave the
//! process in text: not in a log line, an error or `check` output.
//!
//! Messages are written so that they never format a secret in the first place (URLs go through
//! [`crate::source::config::redact_url`], property maps through the redacting `Debug`). But the text of
//! third-party errors (librdkafka, the database drivers) is not ours to write, and an error may quote a
//! value back. So every secret the configuration holds is registered here once the configuration is
//! loaded, and everything outboxd prints passes through [`scrub`]: the log writer ([`Scrubbing`]), the
//! final error line and the `check` report. A secret is replaced by `***` in its plain, URL-encoded and
//! JSON-escaped forms.

use std::borrow::Cow;
use std::io::Write;
use std::sync::RwLock;

/// Values shorter than this are not treated as secrets: scrubbing a one-letter "password" would
/// garble every message while protecting nothing.
const MIN_LEN: usize = 3;

static SECRETS: RwLock<Vec<String>> = RwLock::new(Vec::new());

/// Adds secret values (and their encoded forms) to the set [`scrub`] hides.
pub fn register(values: impl IntoIterator<Item = String>) {
    let mut secrets = SECRETS.write().unwrap_or_else(|e| e.into_inner());
    for value in values {
        if value.chars().count() < MIN_LEN {
            continue;
        }
        let json = serde_json::to_string(&value).unwrap_or_default();
        let json = json.trim_matches('"').to_string();
        let encoded: String = url::form_urlencoded::byte_serialize(value.as_bytes()).collect();
        let percent = encoded.replace('+', "%20");
        for form in [value, json, encoded, percent] {
            if !form.is_empty() && !secrets.contains(&form) {
                secrets.push(form);
            }
        }
    }
    // Longest first, so a secret that contains another is hidden whole.
    secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
}

/// `text` with every registered secret replaced by `***`.
pub fn scrub(text: &str) -> Cow<'_, str> {
    let secrets = SECRETS.read().unwrap_or_else(|e| e.into_inner());
    if !secrets.iter().any(|s| text.contains(s.as_str())) {
        return Cow::Borrowed(text);
    }
    let mut out = text.to_string();
    for secret in secrets.iter() {
        if out.contains(secret.as_str()) {
            out = out.replace(secret.as_str(), "***");
        }
    }
    Cow::Owned(out)
}

/// A log writer that scrubs each write (tracing's formatter hands over one whole line at a time).
pub struct Scrubbing<W>(pub W);

impl<W: Write> Write for Scrubbing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match std::str::from_utf8(buf) {
            Ok(text) => self.0.write_all(scrub(text).as_bytes())?,
            Err(_) => self
                .0
                .write_all(scrub(&String::from_utf8_lossy(buf)).as_bytes())?,
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

/// For `tracing_subscriber::fmt().with_writer(...)`: stderr, scrubbed.
pub fn stderr() -> Scrubbing<std::io::Stderr> {
    Scrubbing(std::io::stderr())
}

/// Whether a librdkafka property or URL parameter named `key` holds a credential.
pub fn is_secret_key(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    ["password", "secret", "passphrase", "token", "credential"]
        .iter()
        .any(|s| key.contains(s))
        || key == "sasl.oauthbearer.config"
        || key.ends_with("key.pem")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_form_of_a_registered_secret_is_hidden() {
        register(["p@ss w\"rd".to_string(), "ab".to_string()]);
        assert_eq!(scrub("login p@ss w\"rd failed"), "login *** failed");
        assert_eq!(scrub(r#"{"e":"p@ss w\"rd"}"#), r#"{"e":"***"}"#);
        assert_eq!(scrub("mysql://u:p%40ss+w%22rd@h"), "mysql://u:***@h");
        assert_eq!(scrub("mysql://u:p%40ss%20w%22rd@h"), "mysql://u:***@h");
        // Too short to be a secret worth garbling output for.
        assert_eq!(scrub("ab cd"), "ab cd");
        let mut out = Scrubbing(Vec::new());
        out.write_all(b"x p@ss w\"rd y\n").unwrap();
        assert_eq!(out.0, b"x *** y\n");
    }
}
