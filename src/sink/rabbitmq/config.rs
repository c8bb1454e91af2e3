//! `[rabbitmq]`: the RabbitMQ sink's keys, defaults and checks.

use std::time::Duration;

use serde::Deserialize;

use crate::sink::delivery::{self, Delivery, Refusal};
use crate::source::config::redact_url;

/// The most bytes of key, id and headers a record may carry: AMQP sends a message's properties
/// in one frame, and RabbitMQ's `frame_max` is 128 KiB by default. Larger ones are dead-lettered
/// as `too_large` by the router.
pub const MAX_HEADER_BYTES: usize = 64 * 1024;

/// `[rabbitmq]` (AMQP 0.9.1).
#[derive(Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RabbitMqConfig {
    /// `amqp://user:password@host:5672/vhost` or `amqps://…` (TLS, certificate verified).
    pub url: String,
    /// The exchange every record is published to; the routed topic is the routing key. It must
    /// exist (outboxd declares nothing). `""` is the default exchange (routing key = queue name).
    pub exchange: String,
    /// `amqps://`: a PEM file of the CA(s) to trust instead of the system's.
    #[serde(default)]
    pub ca_file: Option<std::path::PathBuf>,
    /// Messages published and not yet confirmed; the source pauses when the window is full.
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
    /// Routing key (on `exchange`) for rows that cannot be delivered (returned as unroutable,
    /// refused by the router); unset: outboxd stops naming the row.
    #[serde(default)]
    pub dead_letter_topic: Option<String>,
    /// How long a message may wait for its publisher confirm before the session ends and resends
    /// from the checkpoint (0 waits forever).
    #[serde(default = "default_message_timeout_ms")]
    pub message_timeout_ms: u64,
    /// Records larger than this (payload, key and headers) are dead-lettered as `too_large`
    /// instead of published. Set it to the broker's `max_message_size` (AMQP does not tell
    /// clients); a larger message is refused by the broker, which stops outboxd.
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: usize,
}

/// Why RabbitMQ's window is smaller than the other sinks' 10,000: the broker confirms persistent
/// messages at its disk's pace (about 11–17k/s on the benchmark's machine), so 2,000 unconfirmed
/// messages drain within the run-to-run spread of 10,000 (0.89 against 0.97 × lapin alone), while each one costs
/// about 3 KB of outboxd's memory (lapin's frames and confirm, the settler's entry): peak RSS 58 MB
/// against 80 MB draining a backlog (`./benches/run.sh --only rabbitmq`, BENCHMARKS.md).
pub const DEFAULT_MAX_IN_FLIGHT: usize = 2_000;

fn default_max_in_flight() -> usize {
    DEFAULT_MAX_IN_FLIGHT
}

fn default_max_message_bytes() -> usize {
    MAX_MESSAGE_BYTES
}

fn default_message_timeout_ms() -> u64 {
    60_000
}

/// RabbitMQ 4's default `max_message_size` (16 MiB; 3.8 to 3.13 allowed 128 MiB): a row larger
/// than what the broker takes is dead-lettered rather than stopping outboxd.
pub const MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;

impl std::fmt::Debug for RabbitMqConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitMqConfig")
            .field("url", &redact_url(&self.url))
            .field("exchange", &self.exchange)
            .field("ca_file", &self.ca_file)
            .field("max_in_flight", &self.max_in_flight)
            .field("max_in_flight_bytes", &self.max_in_flight_bytes)
            .field("drain_timeout_ms", &self.drain_timeout_ms)
            .field("dead_letter_topic", &self.dead_letter_topic)
            .field("message_timeout_ms", &self.message_timeout_ms)
            .field("max_message_bytes", &self.max_message_bytes)
            .finish()
    }
}

impl RabbitMqConfig {
    pub fn delivery(&self) -> Delivery {
        Delivery {
            max_in_flight: self.max_in_flight,
            max_in_flight_bytes: self.max_in_flight_bytes,
            drain_timeout_ms: self.drain_timeout_ms,
            dead_letter_topic: self.dead_letter_topic.clone(),
            timeout: (self.message_timeout_ms > 0)
                .then(|| Duration::from_millis(self.message_timeout_ms)),
        }
    }

    pub fn validate(&self) -> Result<(), Refusal> {
        let bad = |key: &str, why: String, fix: &str| {
            Err((format!("rabbitmq.{key}"), why, fix.to_string()))
        };
        self.delivery().validate("rabbitmq")?;
        match url::Url::parse(&self.url) {
            Ok(url) if matches!(url.scheme(), "amqp" | "amqps") && url.host().is_some() => {}
            Ok(_) | Err(_) => {
                return bad(
                    "url",
                    format!("{} is not an amqp:// or amqps:// URL", redact_url(&self.url)),
                    "write url = \"amqp://user:password@host:5672/vhost\" (amqps:// for TLS; %2f is the vhost /)",
                )
            }
        }
        if self.ca_file.is_some() && !self.url.starts_with("amqps://") {
            return bad(
                "ca_file",
                "a CA file is only used with TLS".into(),
                "use an amqps:// URL, or remove ca_file",
            );
        }
        for (key, name) in [
            ("exchange", Some(&self.exchange)),
            ("dead_letter_topic", self.dead_letter_topic.as_ref()),
        ] {
            if let Some(name) = name {
                if name.len() > 255 || name.chars().any(char::is_control) {
                    return bad(
                        key,
                        format!("{name:?} is not a valid AMQP name"),
                        "use at most 255 bytes without control characters",
                    );
                }
            }
        }
        if !(1024..=512 * 1024 * 1024).contains(&self.max_message_bytes) {
            return bad(
                "max_message_bytes",
                format!("{} is out of range", self.max_message_bytes),
                "use the broker's max_message_size: 1024 ..= 536870912 (default 16777216 = 16 MiB)",
            );
        }
        if self.dead_letter_topic.as_deref() == Some("") {
            return bad(
                "dead_letter_topic",
                "an empty routing key".into(),
                "name the routing key that reaches your dead-letter queue, or remove the key",
            );
        }
        Ok(())
    }

    /// Header names an AMQP field table can carry (short strings).
    pub fn validate_header_name(name: &str) -> Result<(), String> {
        if name.len() > 255 {
            return Err("AMQP header names are at most 255 bytes".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_defaults_to_two_thousand_messages_and_can_be_raised() {
        let parse = |text: &str| toml::from_str::<RabbitMqConfig>(text).unwrap().delivery();
        let base = "url = \"amqp://localhost\"\nexchange = \"outbox\"\n";
        assert_eq!(parse(base).max_in_flight, 2_000);
        assert_eq!(
            parse(&format!("{base}max_in_flight = 10000\n")).max_in_flight,
            10_000
        );
    }
}
