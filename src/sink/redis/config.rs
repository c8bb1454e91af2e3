//! `[redis]`: the Redis Streams sink's keys, defaults and checks.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::sink::delivery::{self, Delivery, Refusal};
use crate::source::config::redact_url;

/// Why Redis's window is smaller than Kafka's 10,000: entries go as `MULTI`/`EXEC` batches of at
/// most 1,000, one at a time (at least once), or pipelines of 1,000 into the open transaction
/// (exactly once), so a window of two batches keeps Redis as busy as ten, while each waiting entry
/// costs outboxd about 2 KB (its fields, then its command): draining a backlog, peak RSS 43 MB
/// against 57–67 MB, at the same rate (`./benches/run.sh --only redis`, BENCHMARKS.md).
pub const DEFAULT_MAX_IN_FLIGHT: usize = 2_000;

fn default_max_in_flight() -> usize {
    DEFAULT_MAX_IN_FLIGHT
}

/// `[redis]` (Streams).
#[derive(Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RedisConfig {
    /// `redis://[USER:PASSWORD@]HOST:6379/DB`, or `rediss://` for TLS (certificate verified).
    pub url: String,
    /// `rediss://`: a PEM file of the CA(s) to trust instead of the system's.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// `XADD … MAXLEN ~ N`: trim each stream to about this many entries. Trimming drops entries
    /// whether or not anyone read them; unset, streams grow until consumers `XTRIM`/`XDEL`.
    #[serde(default)]
    pub maxlen: Option<u64>,
    /// After each batch, `WAIT` until this many replicas have it (within `message_timeout_ms`);
    /// fewer is a transient error (the batch is sent again from the checkpoint).
    #[serde(default)]
    pub wait_replicas: u32,
    /// Entries sent and not yet acknowledged; the source pauses when the window is full.
    #[serde(default = "default_max_in_flight")]
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
    /// Stream for rows that cannot be delivered (the key holds another type, refused by the
    /// router); unset: outboxd stops naming the row.
    #[serde(default)]
    pub dead_letter_topic: Option<String>,
    /// How long a batch may wait for Redis's replies (and `WAIT`) before the session ends and
    /// sends again from the checkpoint.
    #[serde(default = "default_message_timeout_ms")]
    pub message_timeout_ms: u64,
    /// Records larger than this (payload, key and headers) are dead-lettered as `too_large`.
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: usize,
    /// `checkpoint.store = "redis"` (exactly-once): the longest one `MULTI`/`EXEC` stays open
    /// once it holds an entry.
    #[serde(default = "default_transaction_interval_ms")]
    pub transaction_interval_ms: u64,
    /// `checkpoint.store = "redis"`: the transaction is committed at the first source transaction
    /// boundary once it holds this many entries.
    #[serde(default = "default_transaction_max_records")]
    pub transaction_max_records: u64,
    /// `checkpoint.store = "redis"`: likewise once it holds this many bytes. Redis keeps an open
    /// transaction's commands in memory until `EXEC`.
    #[serde(default = "default_transaction_max_bytes")]
    pub transaction_max_bytes: u64,
}

fn default_transaction_interval_ms() -> u64 {
    100
}

fn default_transaction_max_records() -> u64 {
    10_000
}

fn default_transaction_max_bytes() -> u64 {
    16 * 1024 * 1024
}

fn default_message_timeout_ms() -> u64 {
    30_000
}

fn default_max_message_bytes() -> usize {
    16 * 1024 * 1024
}

impl std::fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConfig")
            .field("url", &redact_url(&self.url))
            .field("ca_file", &self.ca_file)
            .field("maxlen", &self.maxlen)
            .field("wait_replicas", &self.wait_replicas)
            .field("max_in_flight", &self.max_in_flight)
            .field("max_in_flight_bytes", &self.max_in_flight_bytes)
            .field("drain_timeout_ms", &self.drain_timeout_ms)
            .field("dead_letter_topic", &self.dead_letter_topic)
            .field("message_timeout_ms", &self.message_timeout_ms)
            .field("max_message_bytes", &self.max_message_bytes)
            .field("transaction_interval_ms", &self.transaction_interval_ms)
            .field("transaction_max_records", &self.transaction_max_records)
            .field("transaction_max_bytes", &self.transaction_max_bytes)
            .finish()
    }
}

/// Field names outboxd writes itself; a header of the same name would be ambiguous.
pub const OWN_FIELDS: [&str; 3] = ["key", "payload", "timestamp"];

impl RedisConfig {
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

    /// `checkpoint.store = "redis"`: when a `MULTI`/`EXEC` commits (Redis keeps an open one
    /// until the connection closes; a commit waits at most `message_timeout_ms`).
    pub fn transaction_limits(&self) -> delivery::TransactionLimits {
        delivery::TransactionLimits {
            interval: Duration::from_millis(self.transaction_interval_ms),
            max_records: self.transaction_max_records,
            max_bytes: self.transaction_max_bytes,
            broker_timeout: None,
            commit_timeout: self.message_timeout(),
        }
    }

    pub fn validate(&self) -> Result<(), Refusal> {
        let bad =
            |key: &str, why: String, fix: &str| Err((format!("redis.{key}"), why, fix.to_string()));
        self.delivery().validate("redis")?;
        match url::Url::parse(&self.url) {
            // A fragment is refused: redis-rs reads `#insecure` as "do not verify the certificate".
            Ok(url)
                if matches!(url.scheme(), "redis" | "rediss")
                    && url.host().is_some()
                    && url.fragment().is_none() => {}
            _ => {
                return bad(
                    "url",
                    format!(
                        "{} is not a redis:// or rediss:// URL",
                        redact_url(&self.url)
                    ),
                    "write url = \"redis://[user:password@]host:6379/0\" (rediss:// for TLS)",
                )
            }
        }
        if self.ca_file.is_some() && !self.url.starts_with("rediss://") {
            return bad(
                "ca_file",
                "a CA file is only used with TLS".into(),
                "use a rediss:// URL, or remove ca_file",
            );
        }
        if self.maxlen == Some(0) {
            return bad(
                "maxlen",
                "0 would trim every entry at once".into(),
                "remove maxlen (streams grow until consumers trim them) or set how many entries to keep",
            );
        }
        if self.dead_letter_topic.as_deref() == Some("") {
            return bad(
                "dead_letter_topic",
                "an empty stream key".into(),
                "name the stream for dead letters, or remove the key",
            );
        }
        if !(1_000..=600_000).contains(&self.message_timeout_ms) {
            return bad(
                "message_timeout_ms",
                format!("{} is out of range", self.message_timeout_ms),
                "use 1000..=600000 milliseconds (default 30000)",
            );
        }
        delivery::validate_transactions("redis", &self.transaction_limits())?;
        if !(1024..=512 * 1024 * 1024).contains(&self.max_message_bytes) {
            return bad(
                "max_message_bytes",
                format!("{} is out of range", self.max_message_bytes),
                "use 1024 ..= 536870912 (default 16777216 = 16 MiB)",
            );
        }
        Ok(())
    }

    /// Header names that do not collide with the fields outboxd writes.
    pub fn validate_header_name(name: &str) -> Result<(), String> {
        if OWN_FIELDS.contains(&name) {
            return Err(format!("outboxd writes the stream field {name:?} itself"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_defaults_to_two_batches_and_can_be_raised() {
        let parse = |text: &str| toml::from_str::<RedisConfig>(text).unwrap().delivery();
        let base = "url = \"redis://localhost\"\n";
        assert_eq!(parse(base).max_in_flight, 2_000);
        assert_eq!(
            parse(&format!("{base}max_in_flight = 10000\n")).max_in_flight,
            10_000
        );
    }
}
