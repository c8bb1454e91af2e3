//! `[nats]`: the NATS JetStream sink's keys, defaults and checks.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::sink::delivery::{self, Delivery, Refusal};

/// The most bytes of key, id and headers a record may carry: JetStream refuses a header block
/// over 64 KiB, and outboxd repeats the id (`Nats-Msg-Id`) and may base64 values (4/3). Larger
/// ones are dead-lettered as `too_large` by the router.
pub const MAX_HEADER_BYTES: usize = 16 * 1024;

/// `[nats]` (JetStream).
#[derive(Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NatsConfig {
    /// `nats://host:4222` (TLS when the server asks for it), `tls://host:4222` (TLS always);
    /// several servers separated by commas. Credentials may ride in it: `nats://user:password@…`
    /// or `nats://token@…`.
    pub url: String,
    /// A token (or `OUTBOXD_NATS__TOKEN`), instead of one in the URL.
    #[serde(default)]
    pub token: Option<String>,
    /// A `.creds` file (a user JWT and its NKey seed), as `nats context` and `nsc` write them.
    #[serde(default)]
    pub credentials_file: Option<PathBuf>,
    /// A PEM file of the CA(s) to trust for TLS instead of the system's; TLS becomes required.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// Messages published and not yet acknowledged (`PubAck`); the source pauses when the window
    /// is full.
    #[serde(default = "delivery::default_max_in_flight")]
    pub max_in_flight: usize,
    /// Bytes (keys, values, headers) handed to the broker and not yet acknowledged; the source
    /// pauses when they would exceed it. With large payloads this, not `max_in_flight`, bounds
    /// memory.
    #[serde(default = "delivery::default_max_in_flight_bytes")]
    pub max_in_flight_bytes: u64,
    /// On SIGTERM/SIGINT: how long, in all, outboxd waits for the open acknowledgements before it
    /// writes the final checkpoint and exits (keep it under the orchestrator's grace period).
    #[serde(default = "delivery::default_drain_timeout_ms")]
    pub drain_timeout_ms: u64,
    /// Subject for rows that cannot be delivered (no stream captures their subject, refused by
    /// the router); unset: outboxd stops naming the row.
    #[serde(default)]
    pub dead_letter_topic: Option<String>,
    /// How long a message may wait for its `PubAck` before the session ends and publishes again
    /// from the checkpoint (same `Nats-Msg-Id`s: the stream drops the repeats inside its
    /// duplicate window).
    #[serde(default = "default_message_timeout_ms")]
    pub message_timeout_ms: u64,
    /// Records larger than this (payload, key and headers) are dead-lettered as `too_large`. It
    /// must stay below the server's `max_payload` (1 MiB by default), which outboxd reads at
    /// connect and refuses to run under.
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: usize,
    /// Accept streams whose settings lose acknowledged messages (interest retention without a
    /// consumer, memory storage): `check` then warns about them instead of failing, and `run`
    /// publishes into them. Only for streams whose loss you have decided to accept.
    #[serde(default)]
    pub allow_lossy_streams: bool,
    /// Publish each message on the condition that its stream's last message is the one outboxd
    /// published there before it (`Nats-Expected-Last-Msg-Id`). A message the stream refuses or
    /// loses mid-window is then never overtaken by the rows behind it: per-key order holds
    /// through every failure. Another publisher's message between two of outboxd's ends the
    /// session (the next one publishes once without the condition): set `false` for streams that
    /// other publishers write to, and a failed publish can then leave a later row of a key ahead
    /// of an earlier one.
    #[serde(default = "default_ordered")]
    pub ordered: bool,
}

fn default_ordered() -> bool {
    true
}

fn default_message_timeout_ms() -> u64 {
    30_000
}

fn default_max_message_bytes() -> usize {
    MAX_MESSAGE_BYTES
}

/// The default `max_message_bytes`: the server's default `max_payload` (1 MiB) less room for the
/// headers outboxd adds (`Nats-Msg-Id`, `outboxd.*`).
pub const MAX_MESSAGE_BYTES: usize = 1024 * 1024 - 32 * 1024;

impl std::fmt::Debug for NatsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsConfig")
            .field("url", &shown_url(&self.url))
            .field("token", &self.token.as_ref().map(|_| "***"))
            .field("credentials_file", &self.credentials_file)
            .field("ca_file", &self.ca_file)
            .field("max_in_flight", &self.max_in_flight)
            .field("max_in_flight_bytes", &self.max_in_flight_bytes)
            .field("drain_timeout_ms", &self.drain_timeout_ms)
            .field("dead_letter_topic", &self.dead_letter_topic)
            .field("message_timeout_ms", &self.message_timeout_ms)
            .field("max_message_bytes", &self.max_message_bytes)
            .field("allow_lossy_streams", &self.allow_lossy_streams)
            .field("ordered", &self.ordered)
            .finish()
    }
}

impl NatsConfig {
    pub fn delivery(&self) -> Delivery {
        Delivery {
            max_in_flight: self.max_in_flight,
            max_in_flight_bytes: self.max_in_flight_bytes,
            drain_timeout_ms: self.drain_timeout_ms,
            dead_letter_topic: self.dead_letter_topic.clone(),
            timeout: Some(self.message_timeout()),
        }
    }

    pub fn message_timeout(&self) -> Duration {
        Duration::from_millis(self.message_timeout_ms)
    }

    /// The server URLs, each with any credentials in it removed, and those credentials.
    pub fn servers(&self) -> Result<(Vec<url::Url>, Option<UrlAuth>), String> {
        let mut servers = Vec::new();
        let mut auth = None;
        for part in self.url.split(',').map(str::trim) {
            let (scheme, userinfo, rest) = split_url(part);
            let mut url = url::Url::parse(&format!("{scheme}://{rest}"))
                .map_err(|e| format!("{}: {e}", shown_url(part)))?;
            if !matches!(url.scheme(), "nats" | "tls")
                || url.host().is_none()
                || !matches!(url.path(), "" | "/")
                || url.query().is_some()
                || url.fragment().is_some()
            {
                return Err(format!(
                    "{} is not a nats:// or tls:// URL",
                    shown_url(part)
                ));
            }
            let decode = |s: &str| {
                percent_encoding::percent_decode_str(s)
                    .decode_utf8_lossy()
                    .into_owned()
            };
            if let (Some(userinfo), None) = (userinfo, &auth) {
                auth = Some(match userinfo.split_once(':') {
                    Some((user, password)) => UrlAuth::User(decode(user), decode(password)),
                    None => UrlAuth::Token(decode(userinfo)),
                });
            }
            if url.port().is_none() {
                let _ = url.set_port(Some(4222));
            }
            servers.push(url);
        }
        Ok((servers, auth))
    }

    pub fn validate(&self) -> Result<(), Refusal> {
        let bad =
            |key: &str, why: String, fix: &str| Err((format!("nats.{key}"), why, fix.to_string()));
        self.delivery().validate("nats")?;
        if let Err(why) = self.servers() {
            return bad(
                "url",
                why,
                "write url = \"nats://host:4222\" (tls:// for TLS always; several servers separated by commas; credentials as nats://user:password@host or nats://token@host)",
            );
        }
        if self.token.is_some() && self.credentials_file.is_some() {
            return bad(
                "token",
                "both a token and a credentials file".into(),
                "keep the one your server's accounts use",
            );
        }
        if let Some(topic) = &self.dead_letter_topic {
            if let Err(why) = check_subject(topic) {
                return bad(
                    "dead_letter_topic",
                    why,
                    "name a subject a stream captures, e.g. \"outbox.dead-letter\"",
                );
            }
        }
        if !(1_000..=600_000).contains(&self.message_timeout_ms) {
            return bad(
                "message_timeout_ms",
                format!("{} is out of range", self.message_timeout_ms),
                "use 1000..=600000 milliseconds (default 30000), shorter than the streams' duplicate window",
            );
        }
        if !(1024..=64 * 1024 * 1024).contains(&self.max_message_bytes) {
            return bad(
                "max_message_bytes",
                format!("{} is out of range", self.max_message_bytes),
                "use 1024 ..= 67108864, below the server's max_payload (default 1015808)",
            );
        }
        Ok(())
    }

    /// Header names a NATS message can carry (printable ASCII without `:`), and not JetStream's
    /// own (`Nats-*`: a column must not set the de-duplication id, a rollup or an expectation).
    pub fn validate_header_name(name: &str) -> Result<(), String> {
        if name.is_empty() || name.chars().any(|c| !c.is_ascii_graphic() || c == ':') {
            return Err("NATS header names are printable ASCII without spaces or ':'".into());
        }
        if name.to_ascii_lowercase().starts_with("nats-") {
            return Err(format!(
                "{name:?}: headers named Nats-* are JetStream's instructions, not data"
            ));
        }
        Ok(())
    }
}

/// `scheme://userinfo@rest` split by hand: the userinfo is everything up to the last `@` (a
/// token may hold `/`, `?` or `#`, which a URL parser would take for a path, query or fragment,
/// and then print).
fn split_url(part: &str) -> (&str, Option<&str>, &str) {
    let (scheme, rest) = part.split_once("://").unwrap_or(("", part));
    match rest.rsplit_once('@') {
        Some((userinfo, rest)) => (scheme, Some(userinfo), rest),
        None => (scheme, None, rest),
    }
}

/// `nats.url` as it may be shown: passwords and tokens (a user name without a password is a
/// token) replaced by `***`.
pub fn shown_url(raw: &str) -> String {
    raw.split(',')
        .map(|part| {
            let (scheme, userinfo, rest) = split_url(part.trim());
            match userinfo.map(|u| u.split_once(':')) {
                Some(Some((user, _))) => format!("{scheme}://{user}:***@{rest}"),
                Some(None) => format!("{scheme}://***@{rest}"),
                None => format!("{scheme}://{rest}"),
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// The secrets in `nats.url`: passwords and tokens, as written and decoded.
pub fn url_secrets(raw: &str) -> Vec<String> {
    let mut secrets = Vec::new();
    for part in raw.split(',') {
        let (_, userinfo, _) = split_url(part.trim());
        let secret = match userinfo.map(|u| u.split_once(':')) {
            Some(Some((_, password))) => password,
            Some(None) => userinfo.unwrap_or_default(),
            None => continue,
        };
        if secret.is_empty() {
            continue;
        }
        secrets.push(secret.to_string());
        secrets.push(
            percent_encoding::percent_decode_str(secret)
                .decode_utf8_lossy()
                .into_owned(),
        );
    }
    secrets
}

/// Credentials found in `nats.url`.
pub enum UrlAuth {
    User(String, String),
    Token(String),
}

/// A subject outboxd may publish to: dot-separated non-empty tokens, no wildcards, no spaces.
pub fn check_subject(subject: &str) -> Result<(), String> {
    if subject.is_empty()
        || subject
            .split('.')
            .any(|token| token.is_empty() || token == "*" || token == ">")
        || subject.chars().any(|c| c.is_whitespace() || c.is_control())
    {
        return Err(format!(
            "{subject:?} is not a NATS subject to publish to (dot-separated tokens, none empty, no wildcards or spaces)"
        ));
    }
    Ok(())
}
