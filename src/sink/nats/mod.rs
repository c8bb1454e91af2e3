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
//! - Publishes are pipelined, so a message the stream refuses or loses (a limit, an election, a
//!   socket that died with it in it) could be overtaken by the ones behind it, already stored
//!   when the session ends; the resend would then land after them. So each message names the
//!   previous one published to its stream as that stream's expected last message
//!   (`Nats-Expected-Last-Msg-Id`, checked after the duplicate check): everything behind a failed
//!   message is refused too. A refusal of the condition itself (another publisher, a repeated
//!   id, a dead letter in between) ends the session, and the next one publishes without it once,
//!   so nothing loops on it.
//! - A message over the server's `max_payload` (as the client last heard it) is never sent: it
//!   goes to the dead-letter subject without its payload (reason `too_large`) or stops outboxd;
//!   so does a subject NATS cannot take (`a..b` is a valid Kafka topic), with its payload
//!   (reason `invalid_topic`). A stream's own size limits (`max_msg_size`, 64 KiB of headers)
//!   are answered per message and dead-lettered as `too_large` by the settler.
//! - The `Nats-Msg-Id` is the row id as it is: two rows sharing an id inside a stream's duplicate
//!   window are one message to JetStream (ids must be unique per stream, as outbox ids are). The
//!   first duplicate a session meets is logged with that reason.
//!
//! `config.rs` is the section, `connect.rs` opens connections and writes `check`'s lines,
//! `message.rs` turns a record into headers and payload.

pub mod config;
mod connect;
pub mod message;
mod settle;
pub mod stream;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use async_nats::jetstream::message::PublishMessage;
use tokio::sync::mpsc;

use self::config::{check_subject, NatsConfig};
pub use self::connect::preflight;

/// A client for `config` that reports to no session (`outboxd audit`).
pub async fn connect_client(name: &str, config: &NatsConfig) -> Result<async_nats::Client> {
    connect::connect(name, config, None).await
}
use self::settle::{Published, Settler};
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::route::Record;
use crate::sink::ack::{Acks, Ticket};
use crate::sink::kafka::TopicState;
use crate::sink::window::{Room, Window};

/// How long connecting may take: a server that accepts TCP but never answers must not hold the
/// pipeline.
const OPEN_TIMEOUT: Duration = Duration::from_secs(15);

/// The longest previous id a message names as its stream's expected last one.
const MAX_EXPECTED_ID: usize = 1024;

/// Set when a session ended because a stream's last message was not outboxd's previous one:
/// the next session (of this process's one pipeline) publishes without the order condition, so
/// that a cause that would meet every session (a repeated id, a dead letter in the same stream)
/// cannot loop. Taken by that session's sink.
static SKIP_NEXT_CHAIN: AtomicBool = AtomicBool::new(false);

fn skip_next_chain() {
    SKIP_NEXT_CHAIN.store(true, Ordering::Relaxed);
}

pub struct NatsSink {
    client: async_nats::Client,
    jetstream: async_nats::jetstream::Context,
    window: Window,
    dead_letter: Option<String>,
    published: mpsc::UnboundedSender<Published>,
    settler: tokio::task::JoinHandle<()>,
    metrics: Arc<Metrics>,
    /// `nats.allow_lossy_streams`.
    allow_lossy_streams: bool,
    /// `nats.ordered`.
    ordered: bool,
    /// Subjects asked about in this session, and the stream that captures each (`None`: none
    /// does, or the server did not say): asked once each, whatever asks.
    streams: Mutex<HashMap<String, Option<Arc<str>>>>,
    /// Per stream, the `Nats-Msg-Id` of the last message published there in this session: the
    /// next one's `Nats-Expected-Last-Msg-Id` (see [`NatsSink::send`]).
    chain: Mutex<HashMap<Arc<str>, String>>,
    /// No message carries the order condition this session: a subject's stream could not be
    /// told (its messages may land in a stream others are chained in), or the last session
    /// ended on the condition ([`SKIP_NEXT_CHAIN`]).
    unchained: AtomicBool,
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
                client.clone(),
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
            published,
            settler,
            metrics,
            allow_lossy_streams: config.allow_lossy_streams,
            ordered: config.ordered,
            streams: Mutex::new(HashMap::new()),
            chain: Mutex::new(HashMap::new()),
            unchained: AtomicBool::new(SKIP_NEXT_CHAIN.swap(false, Ordering::Relaxed)),
        })
    }

    /// Asked before the first record for `subject` in a session: the stream that captures it is
    /// judged as `check` judges the streams it knows of ([`stream::costs`]), so a templated
    /// `route.topic` cannot lead into a stream that never acknowledges, or that loses what it
    /// acknowledged (unless `nats.allow_lossy_streams`): outboxd stops before publishing there.
    /// No stream, or no answer within a few seconds: the subject counts as usable (the settler
    /// handles an uncaptured subject, and a server that does not answer shows at publish), and
    /// its messages go without the order condition. Each subject is asked about once a session
    /// (a stream changed meanwhile is seen by the next one).
    pub async fn topic_state(&self, subject: &str) -> Result<TopicState> {
        let usable = Ok(TopicState::Exists { partitions: None });
        if check_subject(subject).is_err() || lock(&self.streams).contains_key(subject) {
            return usable;
        }
        lock(&self.streams).insert(subject.to_string(), None);
        let lookup = tokio::time::timeout(Duration::from_secs(5), async {
            let name = match self.jetstream.stream_by_subject(subject).await {
                Ok(name) => name,
                Err(e)
                    if e.kind()
                        == async_nats::jetstream::context::GetStreamByNameErrorKind::NotFound =>
                {
                    return Ok(None)
                }
                Err(e) => return Err(e.to_string()),
            };
            let mut stream = self
                .jetstream
                .get_stream(&name)
                .await
                .map_err(|e| e.to_string())?;
            let info = stream.info().await.map_err(|e| e.to_string())?.clone();
            Ok(Some((name, info)))
        })
        .await
        .unwrap_or_else(|_| Err("no answer within 5 s".into()));
        let (name, info) = match lookup {
            Ok(Some(found)) => found,
            Ok(None) => return usable,
            Err(why) => {
                tracing::warn!(subject = %subject, error = %why, "cannot tell which stream captures this subject, or its settings: they go unjudged this session, and messages without the order condition (the user may lack $JS.API.STREAM.NAMES / STREAM.INFO)");
                self.unchained.store(true, Ordering::Relaxed);
                return usable;
            }
        };
        self.judge(subject, &name, &info)?;
        lock(&self.streams).insert(subject.to_string(), Some(Arc::from(name)));
        usable
    }

    /// Stops outboxd before it publishes into stream `name` (capturing `subject`) when its
    /// settings never acknowledge, or lose what they acknowledged; warns about the rest.
    fn judge(
        &self,
        subject: &str,
        name: &str,
        info: &async_nats::jetstream::stream::Info,
    ) -> Result<()> {
        for cost in stream::costs(info) {
            let stop = match &cost {
                stream::Cost::Broken(_) => true,
                stream::Cost::Loses(_) => !self.allow_lossy_streams,
                stream::Cost::Drops(_) => false,
            };
            let (stream::Cost::Broken(why) | stream::Cost::Loses(why) | stream::Cost::Drops(why)) =
                &cost;
            if stop {
                return Err(Error::sink(format!(
                    "subject {subject:?} is captured by stream {name:?}, and {why}"
                ))
                .remedy(format!(
                    "{}{}. Nothing was published there; restart outboxd after the fix",
                    stream::remedy(name, subject),
                    if matches!(cost, stream::Cost::Loses(_)) {
                        "; or set nats.allow_lossy_streams = true to accept the loss"
                    } else {
                        ""
                    }
                )));
            }
            tracing::warn!(subject = %subject, stream = %name, "the stream capturing this subject: {why}");
        }
        Ok(())
    }

    /// The stream that captures `subject`, as [`NatsSink::topic_state`] found it (asking now if
    /// nothing asked yet: a dead-letter subject the sink chose).
    async fn stream_of(&self, subject: &str) -> Result<Option<Arc<str>>> {
        let known = lock(&self.streams).get(subject).cloned();
        if let Some(stream) = known {
            return Ok(stream);
        }
        self.topic_state(subject).await?;
        Ok(lock(&self.streams).get(subject).cloned().flatten())
    }

    /// Waits for room in the window for `record`; held until the record is settled. Cancel-safe.
    pub async fn reserve(&self, record: &Record) -> Result<Room> {
        self.window.reserve(record).await
    }

    /// Publishes `record` and hands its `PubAck` future to the settler, which gives `ticket` back
    /// through the session's [`Acks`] once the stream stored it (or its dead letter). Waits only
    /// for the client to take the message.
    ///
    /// With `nats.ordered`, a message carries `Nats-Expected-Last-Msg-Id` = the `Nats-Msg-Id` of
    /// the message published before it to the same stream in this session (the session's first
    /// one there carries none). The stream checks it after its duplicate check and before it
    /// stores, in the order messages reach it: when it refuses or loses message N (a limit, a
    /// leader election, a socket that died with N in it), every message behind N in that stream
    /// is refused too, so the resend of N from the checkpoint is never overtaken by N+1. A resend
    /// the stream answers "duplicate" is checked no further, so a restart's resends pass. A
    /// dead letter goes without the condition and ends the chain of its stream (pipelines may
    /// share a dead-letter stream).
    pub async fn send(&self, room: Room, record: &Record, ticket: Ticket) -> Result<()> {
        let is_dead_letter = self.dead_letter.as_deref() == Some(record.topic.as_str());
        let mut message = message::message(record);
        let mut subject = record.topic.clone();
        // Without the condition no message needs its stream.
        let routed_stream = match self.ordered {
            true => self.stream_of(&subject).await?,
            false => None,
        };
        let expected = self.expected_last(&routed_stream, is_dead_letter);
        if let Some((why, keep_payload)) = self.refusal(record, &message, expected.as_deref()) {
            let Some(dead_letter) = self.dead_letter.clone().filter(|_| !is_dead_letter) else {
                return Err(Error::unroutable(format!("a row for subject {:?} cannot be published: {why}", record.topic))
                    .remedy("route rows to valid subjects below max_payload (nats.max_message_bytes dead-letters larger ones), or set nats.dead_letter_topic; nothing was skipped"));
            };
            tracing::warn!(subject = %record.topic, dead_letter = %dead_letter, "a message NATS cannot take sent to the dead-letter subject");
            self.metrics
                .dead_letter(why.split(':').next().unwrap_or("unroutable"));
            message = message::dead_letter(
                &message,
                &record.topic,
                &why,
                keep_payload,
                self.client.max_payload(),
            );
            subject = dead_letter;
        }
        // A message that is a dead letter already has nowhere further to go.
        let is_dead_letter = is_dead_letter || subject != record.topic;
        let stream = if is_dead_letter && self.ordered {
            self.stream_of(&subject).await?
        } else {
            routed_stream
        };
        let copy = (self.dead_letter.is_some() && !is_dead_letter).then(|| message.clone());
        let msg_id = stream.as_ref().and_then(|_| message::msg_id(&message));
        let mut headers = message.headers;
        if let (false, Some(last)) = (is_dead_letter, &expected) {
            headers.insert(message::EXPECTED_LAST_HEADER, last.as_str());
        }
        let ack = self
            .jetstream
            .send_publish(
                subject.clone(),
                PublishMessage::build()
                    .headers(headers)
                    .payload(message.payload),
            )
            .await
            .map_err(|e| {
                Error::sink(format!("cannot publish to NATS subject {subject:?}: {e}"))
                    .remedy("outboxd reconnects and publishes again from the checkpoint (a server whose max_payload changed is read again)")
                    .transient()
            })?;
        if let Some(stream) = &stream {
            let mut chain = lock(&self.chain);
            match msg_id.filter(|_| self.ordered && !is_dead_letter) {
                Some(id) => chain.insert(stream.clone(), id),
                None => chain.remove(stream),
            };
        }
        self.metrics.produced();
        crate::fault::crash_point(crate::fault::AFTER_PRODUCE_BEFORE_ACK);
        self.published
            .send(Published {
                ticket,
                subject,
                stream: stream.filter(|_| expected.is_some() && !is_dead_letter),
                enqueued: Instant::now(),
                ack,
                room,
                copy,
                dead_lettered: is_dead_letter,
            })
            .map_err(|_| Error::sink("the NATS acknowledgement task ended").transient())
    }

    /// The `Nats-Expected-Last-Msg-Id` a message routed into `stream` carries: none for a dead
    /// letter, without `nats.ordered`, or for the session's first message there.
    fn expected_last(&self, stream: &Option<Arc<str>>, is_dead_letter: bool) -> Option<String> {
        if !self.ordered || is_dead_letter || self.unchained.load(Ordering::Relaxed) {
            return None;
        }
        // A long id would crowd the header block (JetStream refuses one over 64 KiB): such a
        // message goes without the condition.
        lock(&self.chain)
            .get(stream.as_ref()?)
            .filter(|id| id.len() <= MAX_EXPECTED_ID)
            .cloned()
    }

    /// Why `message` (for `record`, with the order condition `expected`) cannot be published
    /// where it is routed, and whether its dead letter keeps the payload: a subject NATS cannot
    /// take (the router knows Kafka's rules only: `a..b` passes there), or a message over the
    /// server's limit.
    fn refusal(
        &self,
        record: &Record,
        message: &message::Message,
        expected: Option<&str>,
    ) -> Option<(String, bool)> {
        let max_payload = self.client.max_payload();
        let size = message::wire_size(message)
            + expected.map_or(0, |id| message::EXPECTED_LAST_HEADER.len() + id.len() + 4);
        match check_subject(&record.topic) {
            Err(why) => Some((format!("invalid_topic: {why}"), true)),
            Ok(()) if size > max_payload => Some((
                format!(
                    "too_large: a message of {size} bytes exceeds the server's max_payload ({max_payload} bytes)"
                ),
                false,
            )),
            Ok(()) => None,
        }
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

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}
