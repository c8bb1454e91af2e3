//! NATS JetStream sink (async-nats): every record is published to the subject its routed topic
//! names, with `Nats-Msg-Id` = the row id, and counts as delivered only on the stream's `PubAck`.
//!
//! Why the ack path looks the way it does (`shared/sinks.md` has the server facts):
//! - A `PubAck` means stored by the stream (replicated when the stream has replicas). async-nats
//!   hands back a future per publish whose error is lost if nobody awaits it, so every one goes to
//!   the settler (`settle.rs`), which awaits them in publish order and hands tickets back in that
//!   order: a message is never counted before every message published before it.
//! - A subject no stream captures answers "no responders" (503). That is also what a stream in a
//!   cluster answers while it elects a leader, so the settler first asks which stream captures the
//!   subject: none → the row goes to the dead-letter subject (reason `unroutable`) or stops
//!   outboxd with the `nats stream add` remedy; one → a transient error (publish again later).
//! - A missing `PubAck` (timeout, lost connection) ends the session; the next one publishes again
//!   from the checkpoint with the same `Nats-Msg-Id`s, which the stream drops as duplicates inside
//!   its duplicate window (2 minutes by default; `check` warns when it is shorter than
//!   `nats.message_timeout_ms`). So a crash leaves no duplicate in the stream unless the restart
//!   comes after that window.
//! - A message over the server's `max_payload` (read at connect) is never sent: it goes to the
//!   dead-letter subject without its payload (reason `too_large`) or stops outboxd.
//!
//! `config.rs` is the section, `connect.rs` opens connections and writes `check`'s lines,
//! `message.rs` turns a record into headers and payload.

pub mod config;
mod connect;
pub mod message;
mod settle;

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::message::PublishMessage;
use tokio::sync::mpsc;

use self::config::{check_subject, NatsConfig};
pub use self::connect::preflight;
use self::message::{Message, MSG_ID_HEADER};
use self::settle::{Published, Settler};
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::route::Record;
use crate::sink::ack::{Acks, Ticket};
use crate::sink::window::{Room, Window};

/// How long connecting may take: a server that accepts TCP but never answers must not hold the
/// pipeline.
const OPEN_TIMEOUT: Duration = Duration::from_secs(15);

/// The header of a dead letter naming why it is one (as on every sink).
pub const ERROR_HEADER: &str = "outboxd.error";
/// The header of a dead letter naming the subject it was meant for.
pub const SUBJECT_HEADER: &str = "outboxd.subject";

pub struct NatsSink {
    client: async_nats::Client,
    jetstream: async_nats::jetstream::Context,
    window: Window,
    dead_letter: Option<String>,
    /// The server's `max_payload`: headers and payload of one message.
    max_payload: usize,
    published: mpsc::UnboundedSender<Published>,
    settler: tokio::task::JoinHandle<()>,
    metrics: Arc<Metrics>,
}

impl NatsSink {
    pub async fn new(
        name: &str,
        config: &NatsConfig,
        acks: Arc<dyn Acks>,
        metrics: Arc<Metrics>,
    ) -> Result<NatsSink> {
        let client = tokio::time::timeout(
            OPEN_TIMEOUT,
            connect::connect(name, config, Some(acks.clone())),
        )
        .await
        .map_err(|_| {
            Error::sink(format!(
                "NATS at {} did not answer within {OPEN_TIMEOUT:?}",
                config::shown_url(&config.url)
            ))
            .remedy("outboxd retries; check that nats-server is up")
            .transient()
        })??;
        let delivery = config.delivery();
        let max_payload = client.server_info().max_payload;
        // The window bounds what is in flight; async-nats's own bound must never be the one that
        // waits.
        let jetstream = connect::jetstream(
            client.clone(),
            config.message_timeout(),
            delivery.max_in_flight + 1,
        );
        let (published, queue) = mpsc::unbounded_channel();
        let settler = tokio::spawn(
            Settler::new(
                jetstream.clone(),
                config.dead_letter_topic.clone(),
                acks,
                metrics.clone(),
            )
            .run(queue),
        );
        Ok(NatsSink {
            client,
            jetstream,
            window: Window::new(delivery.max_in_flight, delivery.max_in_flight_bytes),
            dead_letter: config.dead_letter_topic.clone(),
            max_payload,
            published,
            settler,
            metrics,
        })
    }

    /// Waits for room in the window for `record`; held until the record is settled. Cancel-safe.
    pub async fn reserve(&self, record: &Record) -> Result<Room> {
        self.window.reserve(record).await
    }

    /// Publishes `record` and hands its `PubAck` future to the settler, which gives `ticket` back
    /// through the session's [`Acks`] once the stream stored it (or its dead letter). Waits only
    /// for the client to take the message.
    pub async fn send(&self, room: Room, record: &Record, ticket: Ticket) -> Result<()> {
        check_subject(&record.topic).map_err(|why| {
            Error::unroutable(format!("a row cannot be published: {why}"))
                .remedy("route rows to valid subjects (route.topic), then restart outboxd (nothing was skipped)")
        })?;
        let is_dead_letter = self.dead_letter.as_deref() == Some(record.topic.as_str());
        let mut message = message::message(record);
        let mut subject = record.topic.clone();
        if wire_size(&message) > self.max_payload {
            (subject, message) = self.too_large(record, message, is_dead_letter)?;
        }
        // A message that is a dead letter already has nowhere further to go.
        let is_dead_letter = is_dead_letter || subject != record.topic;
        let copy = (self.dead_letter.is_some() && !is_dead_letter).then(|| message.clone());
        let ack = self
            .jetstream
            .send_publish(
                subject.clone(),
                PublishMessage::build()
                    .headers(message.headers)
                    .payload(message.payload),
            )
            .await
            .map_err(|e| match e.kind() {
                PublishErrorKind::MaxPayloadExceeded => Error::unroutable(format!(
                    "a message for subject {subject:?} is larger than the server's max_payload: {e}"
                ))
                .remedy("raise max_payload in nats-server's config, or keep header columns smaller; nothing was skipped"),
                _ => Error::sink(format!("cannot publish to NATS: {e}"))
                    .remedy("outboxd reconnects and publishes again from the checkpoint")
                    .transient(),
            })?;
        self.metrics.produced();
        crate::fault::crash_point(crate::fault::AFTER_PRODUCE_BEFORE_ACK);
        self.published
            .send(Published {
                ticket,
                subject,
                enqueued: Instant::now(),
                ack,
                room,
                copy,
                dead_lettered: is_dead_letter,
            })
            .map_err(|_| Error::sink("the NATS acknowledgement task ended").transient())
    }

    /// A message over the server's `max_payload`: its dead letter (headers that name it, no
    /// payload), or the error that stops outboxd.
    fn too_large(
        &self,
        record: &Record,
        message: Message,
        is_dead_letter: bool,
    ) -> Result<(String, Message)> {
        let why = format!(
            "too_large: a message of {} bytes for subject {:?} exceeds the server's max_payload ({} bytes)",
            wire_size(&message),
            record.topic,
            self.max_payload
        );
        let Some(dead_letter) = self.dead_letter.clone().filter(|_| !is_dead_letter) else {
            return Err(Error::unroutable(format!("a row cannot be published: {why}"))
                .remedy("set nats.max_message_bytes below max_payload (larger rows are then dead-lettered), raise max_payload in nats-server's config, or set nats.dead_letter_topic; nothing was skipped"));
        };
        let mut headers = async_nats::HeaderMap::new();
        for name in [MSG_ID_HEADER, crate::route::ID_HEADER, message::KEY_HEADER] {
            if let Some(value) = message.headers.get(name) {
                headers.insert(name, value.clone());
            }
        }
        headers.insert(ERROR_HEADER, why.as_str());
        headers.insert(SUBJECT_HEADER, record.topic.as_str());
        let copy = Message {
            headers,
            payload: bytes::Bytes::new(),
        };
        if wire_size(&copy) > self.max_payload {
            return Err(Error::unroutable(format!(
                "a row cannot be published, nor its dead letter: {why}"
            ))
            .remedy("raise max_payload in nats-server's config; nothing was skipped"));
        }
        tracing::warn!(subject = %record.topic, dead_letter = %dead_letter, "message over the server's max_payload sent to the dead-letter subject");
        self.metrics.dead_letter("too_large");
        Ok((dead_letter, copy))
    }

    /// Ends the session: what is not acknowledged is published again by the next one from the
    /// checkpoint.
    pub async fn close(self) {
        self.settler.abort();
        drop(self.jetstream);
        // Bounded: a frozen server never answers.
        let _ = tokio::time::timeout(Duration::from_secs(1), self.client.drain()).await;
    }
}

/// A message's size as the server counts it against `max_payload`: the header block and the
/// payload.
fn wire_size(message: &Message) -> usize {
    let headers: usize = message
        .headers
        .iter()
        .map(|(name, values)| {
            values
                .iter()
                .map(|v| AsRef::<str>::as_ref(name).len() + v.as_str().len() + 4)
                .sum::<usize>()
        })
        .sum();
    "NATS/1.0\r\n\r\n".len() + headers + message.payload.len()
}
