//! The keys every sink section shares (`max_in_flight`, `max_in_flight_bytes`, `drain_timeout_ms`,
//! `dead_letter_topic`), their defaults and their checks, so that `[kafka]`, `[rabbitmq]` and the
//! sinks after them say the same thing about them. Each sink's config struct declares the keys
//! (serde's `flatten` cannot be combined with `deny_unknown_fields`, which names typos) and hands
//! them here as a [`Delivery`].

use std::time::Duration;

/// What the pipeline needs to know of any sink: the window, the drain deadline, where unroutable
/// rows go, and how long an acknowledgement may take.
#[derive(Debug, Clone, PartialEq)]
pub struct Delivery {
    /// Records sent but not yet acknowledged; the source pauses when the window is full.
    pub max_in_flight: usize,
    /// Bytes (keys, values, headers) sent but not yet acknowledged.
    pub max_in_flight_bytes: u64,
    /// On SIGTERM/SIGINT: how long, in all, outboxd waits for acknowledgements before it writes
    /// the final checkpoint and exits.
    pub drain_timeout_ms: u64,
    /// Where rows that cannot be delivered go; `None` stops outboxd naming the row instead.
    pub dead_letter_topic: Option<String>,
    /// How long a record may wait for its acknowledgement before the session ends and resends
    /// from the checkpoint; `None` waits forever.
    pub timeout: Option<Duration>,
}

pub fn default_max_in_flight() -> usize {
    10_000
}

pub fn default_max_in_flight_bytes() -> u64 {
    64 * 1024 * 1024
}

pub fn default_drain_timeout_ms() -> u64 {
    30_000
}

/// A refused key: its full name, what is wrong, and the fix.
pub type Refusal = (String, String, String);

impl Delivery {
    /// Checks the shared keys of the sink section `section` (`kafka`, `rabbitmq`, …).
    pub fn validate(&self, section: &str) -> Result<(), Refusal> {
        let refuse = |key: &str, why: String, fix: &str| {
            Err((format!("{section}.{key}"), why, fix.to_string()))
        };
        if self.max_in_flight == 0 || self.max_in_flight > 1_000_000 {
            return refuse(
                "max_in_flight",
                format!("{} is out of range", self.max_in_flight),
                "use 1..=1000000 (default 10000; 2000 under [rabbitmq] and [redis])",
            );
        }
        if self.max_in_flight_bytes < 1024 * 1024 || self.max_in_flight_bytes > u32::MAX as u64 {
            return refuse(
                "max_in_flight_bytes",
                format!("{} is out of range", self.max_in_flight_bytes),
                "use 1 MiB ..= 4 GiB - 1 (default 64 MiB = 67108864)",
            );
        }
        if self.drain_timeout_ms == 0 || self.drain_timeout_ms > 600_000 {
            return refuse(
                "drain_timeout_ms",
                format!("{} is out of range", self.drain_timeout_ms),
                "use 1..=600000 milliseconds (default 30000), below the orchestrator's stop grace period",
            );
        }
        Ok(())
    }
}

/// When a sink that commits atomically (Kafka with `exactly_once`, Redis with the checkpoint in
/// Redis) closes a transaction: at the first source transaction boundary past one of these.
#[derive(Debug, Clone, PartialEq)]
pub struct TransactionLimits {
    /// `transaction_interval_ms`: the longest a transaction stays open once it holds a change.
    pub interval: Duration,
    /// `transaction_max_records`.
    pub max_records: u64,
    /// `transaction_max_bytes` (keys, values, headers).
    pub max_bytes: u64,
    /// The broker aborts a transaction open longer than this (Kafka's `transaction.timeout.ms`);
    /// `None`: the broker keeps it until the connection closes (Redis).
    pub broker_timeout: Option<Duration>,
    /// How long a commit may take when the broker sets no timeout.
    pub commit_timeout: Duration,
}

/// Checks `transaction_interval_ms`, `transaction_max_records` and `transaction_max_bytes` of the
/// sink section `section`.
pub fn validate_transactions(section: &str, limits: &TransactionLimits) -> Result<(), Refusal> {
    let refuse =
        |key: &str, why: String, fix: &str| Err((format!("{section}.{key}"), why, fix.to_string()));
    let interval = limits.interval.as_millis();
    if !(10..=600_000).contains(&interval) {
        return refuse(
            "transaction_interval_ms",
            format!("{interval} is out of range"),
            "use 10..=600000 milliseconds",
        );
    }
    if limits.max_records == 0 {
        return refuse(
            "transaction_max_records",
            "0 would never let a transaction hold a record".into(),
            "use a positive number",
        );
    }
    if limits.max_bytes < 1024 {
        return refuse(
            "transaction_max_bytes",
            format!("{} is out of range", limits.max_bytes),
            "use at least 1024 bytes",
        );
    }
    Ok(())
}
