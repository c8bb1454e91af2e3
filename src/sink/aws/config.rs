//! `[sqs]` and `[sns]`: the AWS sinks' keys, defaults and checks. Both sections take the same keys
//! but one: `queue_url` (SQS) or `topic_arn` (SNS), a template naming the destination directly.

use std::time::Duration;

use serde::Deserialize;

use crate::sink::delivery::{self, Delivery, Refusal};

/// Which AWS service a section publishes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Service {
    Sqs,
    Sns,
}

impl Service {
    pub fn section(self) -> &'static str {
        match self {
            Service::Sqs => "sqs",
            Service::Sns => "sns",
        }
    }

    /// What a destination is called in messages: "queue" or "topic".
    pub fn noun(self) -> &'static str {
        match self {
            Service::Sqs => "queue",
            Service::Sns => "topic",
        }
    }
}

/// `[sqs]` or `[sns]`.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AwsConfig {
    /// The AWS region (else `AWS_REGION` or the profile's, as every AWS tool reads them).
    #[serde(default)]
    pub region: Option<String>,
    /// Another endpoint than AWS's own: a VPC endpoint, LocalStack, moto's server.
    #[serde(default)]
    pub endpoint_url: Option<String>,
    /// SQS: the queue URL for a routed topic, `${topic}` standing for it
    /// (`https://sqs.eu-west-1.amazonaws.com/123456789012/${topic}`); unset, the routed topic is
    /// the queue's name and its URL is asked for once (`sqs:GetQueueUrl`).
    #[serde(default)]
    pub queue_url: Option<String>,
    /// SNS: the topic ARN for a routed topic, `${topic}` standing for it; unset, the routed topic
    /// is the topic's name, found with `sns:ListTopics`.
    #[serde(default)]
    pub topic_arn: Option<String>,
    /// Messages handed to the lanes and not yet stored; the source pauses when the window is full.
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
    /// Queue (or topic) for rows that cannot be delivered; unset: outboxd stops naming the row.
    #[serde(default)]
    pub dead_letter_topic: Option<String>,
    /// How long a message may stay unstored (retries included) before the session ends and sends
    /// again from the checkpoint. At most 4 minutes: FIFO de-duplication holds for 5.
    #[serde(default = "default_message_timeout_ms")]
    pub message_timeout_ms: u64,
    /// Records larger than this are dead-lettered as `too_large`; a queue's own
    /// `MaximumMessageSize`, read when it is first used, applies too.
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: usize,
    /// Batches (of up to 10 messages) in flight per destination. On a FIFO destination two
    /// batches in flight never share a message group, so each group keeps its order.
    #[serde(default = "default_max_batches_in_flight")]
    pub max_batches_in_flight: usize,
}

/// The default window: 1,000 messages, where the other sinks keep 2,000 or 10,000. It bounds
/// how far the checkpoint can fall behind a hot FIFO group, which goes one message per round
/// trip (tens a second on SQS, by its latency; not measured here): 1,000 of them take tens of
/// seconds. A restart sends again from the checkpoint, and only what SQS stored within the last
/// 5 minutes is dropped as a repeat. A lane keeps at most 100 messages in flight (10 batches of
/// 10), so 1,000 still keeps several destinations busy.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 1_000;

fn default_max_in_flight() -> usize {
    DEFAULT_MAX_IN_FLIGHT
}

fn default_message_timeout_ms() -> u64 {
    30_000
}

fn default_max_message_bytes() -> usize {
    MAX_MESSAGE_BYTES
}

fn default_max_batches_in_flight() -> usize {
    10
}

/// SNS's message limit, and SQS's default `MaximumMessageSize` (256 KiB).
pub const MAX_MESSAGE_BYTES: usize = 256 * 1024;

/// SQS and SNS carry at most 10 message attributes.
pub const MAX_ATTRIBUTES: usize = 10;

/// Attributes outboxd may add itself: `id`, `traceparent`, `tracestate`, `outboxd.key`,
/// `outboxd.body`, `outboxd.reason` (dead letters).
pub const OWN_ATTRIBUTES: usize = 6;

/// The longest `message_timeout_ms`: resends must land inside FIFO's 5-minute de-duplication
/// window.
const MAX_MESSAGE_TIMEOUT_MS: u64 = 240_000;

impl AwsConfig {
    pub fn delivery(&self) -> Delivery {
        Delivery {
            max_in_flight: self.max_in_flight,
            max_in_flight_bytes: self.max_in_flight_bytes,
            drain_timeout_ms: self.drain_timeout_ms,
            dead_letter_topic: self.dead_letter_topic.clone(),
            // Each lane times its messages from their first send (lane.rs): the session's
            // watchdog would count the wait of a FIFO group's backlog for its turn.
            timeout: None,
        }
    }

    pub fn message_timeout(&self) -> Duration {
        Duration::from_millis(self.message_timeout_ms)
    }

    /// The template that names a destination directly, if set.
    pub fn template(&self, service: Service) -> Option<&str> {
        match service {
            Service::Sqs => self.queue_url.as_deref(),
            Service::Sns => self.topic_arn.as_deref(),
        }
    }

    pub fn validate(&self, service: Service, header_columns: usize) -> Result<(), Refusal> {
        let section = service.section();
        let bad = |key: &str, why: String, fix: &str| {
            Err((format!("{section}.{key}"), why, fix.to_string()))
        };
        self.delivery().validate(section)?;
        match (service, &self.queue_url, &self.topic_arn) {
            (Service::Sqs, _, Some(_)) => {
                return bad(
                    "topic_arn",
                    "is a [sns] key".into(),
                    "use queue_url in [sqs]",
                )
            }
            (Service::Sns, Some(_), _) => {
                return bad(
                    "queue_url",
                    "is a [sqs] key".into(),
                    "use topic_arn in [sns]",
                )
            }
            _ => {}
        }
        if let Some(template) = self.template(service) {
            let key = if service == Service::Sqs {
                "queue_url"
            } else {
                "topic_arn"
            };
            let (ok, example) = match service {
                Service::Sqs => (
                    template.starts_with("https://") || template.starts_with("http://"),
                    "https://sqs.eu-west-1.amazonaws.com/123456789012/${topic}",
                ),
                Service::Sns => (
                    template.starts_with("arn:"),
                    "arn:aws:sns:eu-west-1:123456789012:${topic}",
                ),
            };
            if !ok || !template.contains("${topic}") {
                return bad(
                    key,
                    format!("{template:?} is not a template with ${{topic}}"),
                    &format!("write it as \"{example}\", or leave it out to look destinations up by name"),
                );
            }
        }
        if let Some(endpoint) = &self.endpoint_url {
            let parsed = url::Url::parse(endpoint);
            if !matches!(parsed.as_ref().map(url::Url::scheme), Ok("http" | "https")) {
                return bad(
                    "endpoint_url",
                    "is not an http:// or https:// URL".into(),
                    "write it as \"https://sqs.eu-west-1.amazonaws.com\" (or leave it out for AWS's own)",
                );
            }
        }
        if let Some(region) = &self.region {
            if region.is_empty()
                || !region
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-')
            {
                return bad(
                    "region",
                    format!("{region:?} is not a region name"),
                    "write it as \"eu-west-1\"",
                );
            }
        }
        if let Some(topic) = &self.dead_letter_topic {
            if let Err(why) = check_name(service, topic) {
                return bad(
                    "dead_letter_topic",
                    why,
                    &format!("name a {} that exists", service.noun()),
                );
            }
        }
        if !(1_000..=MAX_MESSAGE_TIMEOUT_MS).contains(&self.message_timeout_ms) {
            return bad(
                "message_timeout_ms",
                format!("{} is out of range", self.message_timeout_ms),
                "use 1000..=240000 milliseconds (default 30000): resends must land inside FIFO's 5-minute de-duplication window",
            );
        }
        if !(1024..=1024 * 1024).contains(&self.max_message_bytes) {
            return bad(
                "max_message_bytes",
                format!("{} is out of range", self.max_message_bytes),
                "use 1024 ..= 1048576 (default 262144, SNS's limit and SQS's default)",
            );
        }
        if !(1..=100).contains(&self.max_batches_in_flight) {
            return bad(
                "max_batches_in_flight",
                format!("{} is out of range", self.max_batches_in_flight),
                "use 1..=100 (default 10)",
            );
        }
        if header_columns + OWN_ATTRIBUTES > MAX_ATTRIBUTES {
            return Err((
                "route.headers".into(),
                format!(
                    "the route writes {header_columns} header(s) from columns; {} carries at most {MAX_ATTRIBUTES} message attributes and outboxd may add {OWN_ATTRIBUTES} (id, traceparent, tracestate, outboxd.key, outboxd.body, outboxd.reason)",
                    section.to_uppercase()
                ),
                format!(
                    "keep at most {} header columns; place the others in the envelope (route.additional placement = \"envelope\")",
                    MAX_ATTRIBUTES - OWN_ATTRIBUTES
                ),
            ));
        }
        Ok(())
    }

    /// Message attribute names SQS and SNS take: letters, digits, `-`, `_`, `.`; no `..`, no
    /// leading or trailing `.`, not `AWS.`/`Amazon.`; at most 256 characters.
    pub fn validate_header_name(name: &str) -> Result<(), String> {
        let lower = name.to_ascii_lowercase();
        if name.is_empty()
            || name.len() > 256
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            || name.contains("..")
            || name.starts_with('.')
            || name.ends_with('.')
            || lower.starts_with("aws.")
            || lower.starts_with("amazon.")
        {
            return Err("SQS and SNS message attribute names are letters, digits, '-', '_' and single inner '.', at most 256, not starting with AWS. or Amazon.".into());
        }
        if lower.starts_with("outboxd.") {
            return Err(format!("{name:?}: outboxd.* attributes are outboxd's own"));
        }
        Ok(())
    }

    /// The AWS secrets outboxd can read (the standard environment variables), for the scrubber.
    pub fn secret_values(&self) -> Vec<String> {
        let mut secrets: Vec<String> = ["AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"]
            .into_iter()
            .filter_map(|name| std::env::var(name).ok())
            .collect();
        if let Some(endpoint) = &self.endpoint_url {
            secrets.extend(crate::source::config::url_secrets(endpoint));
        }
        secrets
    }
}

/// A destination name the service takes: SQS queue names are 1–80 letters, digits, `-`, `_`
/// (`.fifo` at the end for FIFO); SNS topic names 1–256 of the same.
pub fn check_name(service: Service, name: &str) -> Result<(), String> {
    let (stem, max) = match service {
        Service::Sqs => (name.strip_suffix(".fifo").unwrap_or(name), 80),
        Service::Sns => (name.strip_suffix(".fifo").unwrap_or(name), 256),
    };
    if stem.is_empty()
        || name.len() > max
        || !stem
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_'))
    {
        return Err(format!(
            "{name:?} is not an {} {} name (1-{max} letters, digits, '-' and '_', optionally ending in .fifo)",
            service.section().to_uppercase(),
            service.noun()
        ));
    }
    Ok(())
}
