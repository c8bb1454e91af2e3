//! `[kafka]`: the Kafka sink's keys, defaults and checks (librdkafka properties included).

use std::collections::BTreeMap;

use std::time::Duration;

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::secrets::is_secret_key;
use crate::sink::delivery::{self, Delivery, Refusal};

/// librdkafka's default `message.timeout.ms`.
const DEFAULT_DELIVERY_TIMEOUT: Duration = Duration::from_secs(300);

#[derive(Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KafkaConfig {
    /// The bootstrap brokers, `host:port` separated by commas.
    pub brokers: String,
    /// The topic (it must exist) for rows that cannot be delivered (unroutable, too large, refused
    /// by the router); unset: outboxd stops naming the row.
    #[serde(default)]
    pub dead_letter_topic: Option<String>,
    /// Records produced but not yet acknowledged; the source pauses when the window is full.
    #[serde(default = "delivery::default_max_in_flight")]
    pub max_in_flight: usize,
    /// Bytes (keys, values, headers) produced but not yet acknowledged; the source pauses when they
    /// would exceed it. With large payloads this, not `max_in_flight`, bounds memory.
    #[serde(default = "delivery::default_max_in_flight_bytes")]
    pub max_in_flight_bytes: u64,
    /// On SIGTERM/SIGINT: how long, in all, outboxd waits for the open transaction and Kafka's acks
    /// before it writes the final checkpoint and exits (keep it under the orchestrator's grace period).
    #[serde(default = "delivery::default_drain_timeout_ms")]
    pub drain_timeout_ms: u64,
    /// Exactly-once delivery: records and the checkpoint of their end position are committed in one
    /// Kafka transaction (needs `checkpoint.store = "kafka"`; consumers read with
    /// `isolation.level=read_committed`).
    #[serde(default)]
    pub exactly_once: bool,
    /// `exactly_once`: the longest a Kafka transaction stays open once it holds a change.
    #[serde(default = "default_transaction_interval_ms")]
    pub transaction_interval_ms: u64,
    /// `exactly_once`: a Kafka transaction is committed at the first source transaction boundary
    /// once it holds this many records.
    #[serde(default = "default_transaction_max_records")]
    pub transaction_max_records: u64,
    /// `exactly_once`: likewise once it holds this many bytes (keys, values, headers).
    #[serde(default = "default_transaction_max_bytes")]
    pub transaction_max_bytes: u64,
    /// A record timestamp (the commit time, or `route.timestamp`'s column) more than this far ahead
    /// of outboxd's clock goes out stamped with outboxd's clock instead: Kafka 4 refuses records
    /// more than `message.timestamp.after.max.ms` (1 h by default) ahead of the broker's clock.
    #[serde(default = "default_max_timestamp_ahead_ms")]
    pub max_timestamp_ahead_ms: u64,
    /// librdkafka properties (`"security.protocol" = "SASL_SSL"`, `"compression.type" = "zstd"`),
    /// passed verbatim. outboxd sets `acks = all`, `enable.idempotence = true` and the brokers
    /// itself, and refuses other values for them.
    #[serde(default)]
    pub properties: BTreeMap<String, String>,
}

impl std::fmt::Debug for KafkaConfig {
    /// librdkafka properties may hold credentials (`sasl.password`, `ssl.key.password`, …).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let properties: BTreeMap<&str, &str> = self
            .properties
            .iter()
            .map(|(k, v)| {
                let secret = is_secret_key(k) || k.contains("key");
                (k.as_str(), if secret { "***" } else { v.as_str() })
            })
            .collect();
        f.debug_struct("KafkaConfig")
            .field("brokers", &self.brokers)
            .field("dead_letter_topic", &self.dead_letter_topic)
            .field("max_in_flight", &self.max_in_flight)
            .field("max_in_flight_bytes", &self.max_in_flight_bytes)
            .field("drain_timeout_ms", &self.drain_timeout_ms)
            .field("exactly_once", &self.exactly_once)
            .field("transaction_interval_ms", &self.transaction_interval_ms)
            .field("transaction_max_records", &self.transaction_max_records)
            .field("transaction_max_bytes", &self.transaction_max_bytes)
            .field("max_timestamp_ahead_ms", &self.max_timestamp_ahead_ms)
            .field("properties", &properties)
            .finish()
    }
}

fn default_transaction_interval_ms() -> u64 {
    100
}

fn default_transaction_max_records() -> u64 {
    200_000
}

fn default_transaction_max_bytes() -> u64 {
    128 * 1024 * 1024
}

/// 55 minutes: under Kafka's default hour by five minutes, for the clocks of two machines.
fn default_max_timestamp_ahead_ms() -> u64 {
    55 * 60 * 1000
}

impl KafkaConfig {
    /// The keys every sink shares, with `message.timeout.ms` as the acknowledgement deadline.
    pub fn delivery(&self) -> Delivery {
        Delivery {
            max_in_flight: self.max_in_flight,
            max_in_flight_bytes: self.max_in_flight_bytes,
            drain_timeout_ms: self.drain_timeout_ms,
            dead_letter_topic: self.dead_letter_topic.clone(),
            timeout: self.delivery_timeout(),
        }
    }

    /// `exactly_once`: when a Kafka transaction commits, and how long the brokers let it live.
    pub fn transaction_limits(&self) -> delivery::TransactionLimits {
        let broker_timeout = crate::sink::kafka::KafkaSink::transaction_timeout(self);
        delivery::TransactionLimits {
            interval: Duration::from_millis(self.transaction_interval_ms),
            max_records: self.transaction_max_records,
            max_bytes: self.transaction_max_bytes,
            broker_timeout: Some(broker_timeout),
            commit_timeout: broker_timeout,
        }
    }

    /// How long a record may wait for its acknowledgement before the session ends and resends:
    /// the configured `message.timeout.ms` (validated as milliseconds), librdkafka's 300 s by
    /// default; `None` for 0 (wait forever).
    pub fn delivery_timeout(&self) -> Option<Duration> {
        let configured = self
            .properties
            .get("message.timeout.ms")
            .and_then(|v| v.trim().parse::<u64>().ok());
        match configured {
            Some(0) => None,
            Some(ms) => Some(Duration::from_millis(ms)),
            None => Some(DEFAULT_DELIVERY_TIMEOUT),
        }
    }

    /// Checks the section (`checkpoint_in_kafka`: `checkpoint.store = "kafka"`, which exactly-once
    /// needs).
    pub fn validate(&self, checkpoint_in_kafka: bool) -> std::result::Result<(), Refusal> {
        let bad = |key: &str, why: String, fix: &str| Err((key.to_string(), why, fix.to_string()));
        self.delivery().validate("kafka")?;
        if self.brokers.trim().is_empty() {
            return bad(
                "kafka.brokers",
                "no broker listed".into(),
                "set brokers = \"host:9092[,host2:9092]\"",
            );
        }
        if self.exactly_once && !checkpoint_in_kafka {
            return bad(
                "kafka.exactly_once",
                "exactly-once commits the checkpoint in the same Kafka transaction as the records, so the checkpoint must live in Kafka".into(),
                "set checkpoint.store = \"kafka\" (docs/guides/exactly-once.md), or remove exactly_once",
            );
        }
        delivery::validate_transactions("kafka", &self.transaction_limits())?;
        if self.max_timestamp_ahead_ms == 0 || self.max_timestamp_ahead_ms > i64::MAX as u64 / 2 {
            return bad(
                "kafka.max_timestamp_ahead_ms",
                format!("{} is not a usable limit", self.max_timestamp_ahead_ms),
                "set a number of milliseconds below the topics' message.timestamp.after.max.ms (outboxd's default 3300000 suits Kafka's default of one hour)",
            );
        }
        let transaction_timeout = self
            .properties
            .get("transaction.timeout.ms")
            .map(|v| v.trim().parse::<u64>());
        match transaction_timeout.filter(|_| self.exactly_once) {
            Some(Err(_)) => {
                return bad(
                    "kafka.properties.transaction.timeout.ms",
                    "not a number of milliseconds".into(),
                    "write a whole number of milliseconds, e.g. \"60000\"",
                )
            }
            Some(Ok(timeout)) if self.transaction_interval_ms * 2 > timeout => {
                return bad(
                    "kafka.transaction_interval_ms",
                    format!(
                        "{} ms is more than half of transaction.timeout.ms ({timeout} ms): the brokers would abort transactions before they commit",
                        self.transaction_interval_ms
                    ),
                    "lower kafka.transaction_interval_ms, or raise kafka.properties.\"transaction.timeout.ms\"",
                )
            }
            None if self.exactly_once && self.transaction_interval_ms > 30_000 => {
                return bad(
                    "kafka.transaction_interval_ms",
                    format!(
                        "{} ms is more than half of transaction.timeout.ms (60000 ms, outboxd's default): the brokers would abort transactions before they commit",
                        self.transaction_interval_ms
                    ),
                    "lower kafka.transaction_interval_ms, or raise kafka.properties.\"transaction.timeout.ms\"",
                )
            }
            _ => {}
        }
        for (key, value) in &self.properties {
            let refuse = match key.as_str() {
                "enable.idempotence" => value != "true",
                "acks" | "request.required.acks" => value != "all" && value != "-1",
                "bootstrap.servers" | "metadata.broker.list" => true,
                "transactional.id" => true,
                // Without success reports no ack ever arrives and the checkpoint never moves.
                "delivery.report.only.error" => value != "false",
                // Same key, same partition: per-key order depends on it.
                "partitioner" => value.trim().eq_ignore_ascii_case("random"),
                // outboxd enforces message.timeout.ms itself (librdkafka gets 0); the alias would
                // race with that setting inside librdkafka.
                "delivery.timeout.ms" => true,
                "message.timeout.ms" => value.trim().parse::<u64>().is_err(),
                _ => false,
            };
            if refuse && key == "delivery.timeout.ms" {
                return bad(
                    &format!("kafka.properties.{key}"),
                    "delivery.timeout.ms is an alias of message.timeout.ms".into(),
                    "set message.timeout.ms instead (outboxd's deadline for acknowledgements, in milliseconds)",
                );
            }
            if refuse && key == "message.timeout.ms" {
                return bad(
                    &format!("kafka.properties.{key}"),
                    format!("{value:?} is not a number of milliseconds"),
                    "write a whole number of milliseconds, e.g. \"300000\" (0 waits forever)",
                );
            }
            if refuse && key == "partitioner" {
                return bad(
                    &format!("kafka.properties.{key}"),
                    "partitioner = random sends records of one key to different partitions, which breaks per-key order".into(),
                    "remove it, or use a keyed partitioner (murmur2_random, consistent_random, fnv1a_random)",
                );
            }
            if refuse {
                return bad(
                    &format!("kafka.properties.{key}"),
                    format!("outboxd sets {key} itself (ordering and no-loss depend on it)"),
                    "remove it; brokers go in kafka.brokers",
                );
            }
        }
        if let Some(t) = &self.dead_letter_topic {
            if let Err(why) = crate::route::validate_topic_name(t) {
                return bad(
                    "kafka.dead_letter_topic",
                    why,
                    "use a valid Kafka topic name",
                );
            }
        }
        Ok(())
    }

    /// librdkafka's property names are lower case (see [`lowercase_properties`]).
    pub fn normalize(&mut self) -> Result<()> {
        self.properties = lowercase_properties(std::mem::take(&mut self.properties))?;
        Ok(())
    }

    /// The values of librdkafka properties that carry credentials.
    pub fn secret_values(&self) -> Vec<String> {
        self.properties
            .iter()
            .filter(|(key, _)| is_secret_key(key))
            .map(|(_, value)| value.clone())
            .collect()
    }
}

/// librdkafka's property names are lower case; `SASL.PASSWORD` (as an environment variable spells
/// it) means `sasl.password`. Two spellings of one property are refused rather than one picked.
fn lowercase_properties(properties: BTreeMap<String, String>) -> Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for (key, value) in properties {
        let lower = key.to_ascii_lowercase();
        if out.insert(lower.clone(), value).is_some() {
            return Err(Error::config(format!(
                "kafka.properties sets {lower} twice (in different letter cases)"
            ))
            .remedy("keep one of them (property names are case-insensitive)"));
        }
    }
    Ok(out)
}
