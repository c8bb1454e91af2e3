//! The settler: awaits every `PubAck` future in publish order and hands tickets back in that
//! order; sends an unroutable message to the dead-letter subject before its ticket goes back.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use async_nats::jetstream::context::{
    GetStreamByNameErrorKind, PublishAckFuture, PublishError, PublishErrorKind,
};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::publish::PublishAck;
use async_nats::jetstream::Context;
use futures_util::future::BoxFuture;
use futures_util::stream::FuturesOrdered;
use futures_util::{FutureExt, StreamExt};
use tokio::sync::mpsc;

use super::message::{self, Message};
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::sink::ack::{Acks, Ticket};
use crate::sink::window::Room;

/// Acks per subject are handed to the metrics every this many (and whenever nothing is pending).
const METRICS_BATCH: u64 = 256;

/// A message the sink published, on its way to the settler.
pub(super) struct Published {
    pub ticket: Ticket,
    pub subject: String,
    /// The stream whose last message this one was published after (`Nats-Expected-Last-Msg-Id`).
    pub stream: Option<Arc<str>>,
    pub enqueued: Instant,
    pub ack: PublishAckFuture,
    pub room: Room,
    /// What to send to the dead-letter subject if no stream captures `subject` (kept only when
    /// a dead-letter subject is set).
    pub copy: Option<Message>,
    /// Already a dead letter: unroutable stops outboxd.
    pub dead_lettered: bool,
}

struct Unsettled {
    ticket: Ticket,
    subject: String,
    stream: Option<Arc<str>>,
    enqueued: Instant,
    copy: Option<Message>,
    dead_lettered: bool,
    _room: Room,
}

type Answered = (Unsettled, std::result::Result<PublishAck, PublishError>);

pub(super) struct Settler {
    jetstream: Context,
    client: async_nats::Client,
    dead_letter: Option<String>,
    acks: Arc<dyn Acks>,
    metrics: Arc<Metrics>,
    forwarded: HashMap<String, u64>,
    counted: u64,
    /// Subjects the server said no stream captures, and when: a burst of rows for one of them
    /// asks once (a stream added meanwhile is seen within [`NO_STREAM_TTL`]).
    no_stream: HashMap<String, Instant>,
    /// `PubAck`s that said "duplicate" in this session.
    duplicates: u64,
}

/// How long "no stream captures this subject" is believed.
const NO_STREAM_TTL: std::time::Duration = std::time::Duration::from_secs(10);

impl Settler {
    pub fn new(
        jetstream: Context,
        client: async_nats::Client,
        dead_letter: Option<String>,
        acks: Arc<dyn Acks>,
        metrics: Arc<Metrics>,
    ) -> Settler {
        Settler {
            jetstream,
            client,
            dead_letter,
            acks,
            metrics,
            forwarded: HashMap::new(),
            counted: 0,
            no_stream: HashMap::new(),
            duplicates: 0,
        }
    }

    pub async fn run(mut self, mut queue: mpsc::UnboundedReceiver<Published>) {
        let mut pending: FuturesOrdered<BoxFuture<'static, Answered>> = FuturesOrdered::new();
        loop {
            tokio::select! {
                published = queue.recv() => match published {
                    Some(p) => pending.push_back(answer(p)),
                    None => return,
                },
                Some((entry, answer)) = pending.next(), if !pending.is_empty() => {
                    if let Err(e) = self.settle(entry, answer).await {
                        self.metrics.delivery_error();
                        self.acks.failed(e);
                        return;
                    }
                    if pending.is_empty() || self.counted >= METRICS_BATCH {
                        self.flush_metrics();
                    }
                }
            }
        }
    }

    async fn settle(
        &mut self,
        entry: Unsettled,
        answer: std::result::Result<PublishAck, PublishError>,
    ) -> Result<()> {
        match answer {
            // A PubAck names the stream and the sequence it stored the message at; anything else
            // on the reply subject is not one.
            Ok(ack) if ack.stream.is_empty() || ack.sequence == 0 => Err(Error::sink(format!(
                "a reply to a publish to {:?} is not a PubAck (no stream or sequence)",
                entry.subject
            ))
            .remedy("outboxd publishes again from the checkpoint; make sure nothing but JetStream answers on the subject (a core subscriber with a reply)")
            .transient()),
            Ok(ack) => {
                if ack.duplicate {
                    self.duplicate(&entry.subject, &ack);
                }
                self.done(entry);
                Ok(())
            }
            Err(e) if entry.stream.is_some() && wrong_last_msg_id(&e) => {
                Err(self.overtaken(&entry, &e))
            }
            // "No responders", or no answer at all because something that is not a stream
            // listens on the subject: unroutable if no stream captures it.
            Err(e)
                if matches!(
                    e.kind(),
                    PublishErrorKind::StreamNotFound | PublishErrorKind::TimedOut
                ) =>
            {
                if !self.no_stream(&entry.subject).await? {
                    return Err(publish_error(&entry.subject, &e));
                }
                let why = format!("unroutable: no stream captures subject {:?}", entry.subject);
                self.dead_letter(entry, why, true).await
            }
            Err(e) if matches!(jetstream_code(&e), Some(10054 | 10097)) => {
                let why = format!(
                    "too_large: the stream refused a message to {:?}: {e}",
                    entry.subject
                );
                self.dead_letter(entry, why, false).await
            }
            Err(e) => Err(publish_error(&entry.subject, &e)),
        }
    }

    fn duplicate(&mut self, subject: &str, ack: &PublishAck) {
        self.duplicates += 1;
        if self.duplicates == 1 {
            tracing::warn!(subject = %subject, stream = %ack.stream, sequence = ack.sequence, "the stream holds a message with this Nats-Msg-Id already: a resend after a restart (expected, and dropped), or two rows sharing an id inside the duplicate window (ids must be unique per stream); later ones in this session are logged at debug level");
        } else {
            tracing::debug!(subject = %subject, stream = %ack.stream, sequence = ack.sequence, "duplicate Nats-Msg-Id");
        }
    }

    /// `entry` was refused because its stream's last message is not the one published before it
    /// (with nothing refused before it in this session, or the session would have ended there):
    /// another publisher wrote in between, the one before was a "duplicate" of an earlier
    /// message (the stream's last stays that other one), a dead letter went in between, a stream
    /// leader lost the last id, or the stream was purged or given a subject outboxd found
    /// uncaptured. Transient whatever the cause, and the next session publishes without the
    /// condition ([`super::skip_next_chain`]), so that nothing loops and nothing stops for it;
    /// a publisher that keeps writing there ends a session each time, which the WARN names.
    fn overtaken(&self, entry: &Unsettled, e: &PublishError) -> Error {
        let stream = entry.stream.as_deref().unwrap_or_default();
        super::skip_next_chain();
        tracing::warn!(stream = %stream, subject = %entry.subject, error = %e, "the stream's last message is not the one outboxd published before this one (another publisher writes to the stream, a repeated id, a dead letter in between, or a purge): this session ends, and the next one publishes without the order condition; if another publisher writes to the stream, give outboxd a stream of its own or set nats.ordered = false");
        Error::sink(format!(
            "stream {stream:?} did not store a message to {:?} after outboxd's previous one ({e})",
            entry.subject
        ))
        .remedy("outboxd publishes again from the checkpoint, once without the order condition; if another publisher writes to the stream, give outboxd a stream of its own or set nats.ordered = false")
        .transient()
    }

    fn done(&mut self, entry: Unsettled) {
        self.metrics.acknowledged();
        self.metrics.delivered_after(entry.enqueued.elapsed());
        *self.forwarded.entry(entry.subject).or_default() += 1;
        self.counted += 1;
        self.acks.acked(entry.ticket);
    }

    fn flush_metrics(&mut self) {
        for (subject, n) in self.forwarded.drain() {
            self.metrics.forwarded_n(&subject, n);
        }
        self.counted = 0;
    }

    /// Whether no stream captures `subject`, asked of the server ("no responders" is also what a
    /// clustered stream answers while it elects a leader). An error asking is transient.
    async fn no_stream(&mut self, subject: &str) -> Result<bool> {
        if let Some(since) = self.no_stream.get(subject) {
            if since.elapsed() < NO_STREAM_TTL {
                return Ok(true);
            }
        }
        // Bounded: after a PubAck timeout the server may be the one not answering.
        let asked = tokio::time::timeout(
            std::time::Duration::from_secs(5),
            self.jetstream.stream_by_subject(subject),
        )
        .await
        .map_err(|_| {
            Error::sink(format!(
                "no PubAck for a message to {subject:?}, and the server did not say which stream captures it"
            ))
            .remedy("outboxd publishes again from the checkpoint; check the server's health")
            .transient()
        })?;
        match asked {
            Err(e) if e.kind() == GetStreamByNameErrorKind::NotFound => {
                self.no_stream.insert(subject.to_string(), Instant::now());
                Ok(true)
            }
            Ok(_) => Ok(false),
            Err(e) => Err(Error::sink(format!(
                "no stream answered a publish to {subject:?}, and asking which stream captures it failed: {e}"
            ))
            .remedy("outboxd publishes again from the checkpoint; check that JetStream is enabled")
            .transient()),
        }
    }

    /// `entry` cannot be stored where it was meant to go (`why`): publish its copy to the
    /// dead-letter subject and wait for that `PubAck` before its ticket goes back, or stop.
    async fn dead_letter(
        &mut self,
        entry: Unsettled,
        why: String,
        keep_payload: bool,
    ) -> Result<()> {
        let stream_add = |subject: &str| {
            format!(
                "add a stream for it (nats stream add OUTBOX --subjects \"{subject}\" --storage file --dupe-window 2m), then restart outboxd (nothing was skipped)"
            )
        };
        let (dead_letter, copy) = match (&self.dead_letter, &entry.copy) {
            (Some(topic), Some(copy)) if !entry.dead_lettered => (topic.clone(), copy),
            (Some(topic), _) if entry.dead_lettered => {
                return Err(Error::unroutable(format!(
                    "the dead-letter subject {topic:?} cannot take a row either: {why}"
                ))
                .remedy(stream_add(topic)))
            }
            _ => {
                return Err(
                    Error::unroutable(format!("a row cannot be delivered: {why}")).remedy(format!(
                        "{}; or set nats.dead_letter_topic to park such rows",
                        stream_add(&entry.subject)
                    )),
                )
            }
        };
        tracing::warn!(subject = %entry.subject, dead_letter = %dead_letter, "a message no stream took sent to the dead-letter subject");
        let copy = message::dead_letter(
            copy,
            &entry.subject,
            &why,
            keep_payload,
            self.client.max_payload(),
        );
        let ack = self
            .jetstream
            .send_publish(
                dead_letter.clone(),
                PublishMessage::build()
                    .headers(copy.headers)
                    .payload(copy.payload),
            )
            .await
            .map_err(|e| publish_error(&dead_letter, &e))?;
        let refused = match ack.await {
            Ok(ack) if !ack.stream.is_empty() && ack.sequence > 0 => {
                self.metrics
                    .dead_letter(why.split(':').next().unwrap_or("unroutable"));
                self.done(Unsettled {
                    subject: dead_letter,
                    ..entry
                });
                return Ok(());
            }
            Ok(_) => {
                return Err(
                    Error::sink("a reply to a dead-letter publish is not a PubAck")
                        .remedy("outboxd publishes again from the checkpoint")
                        .transient(),
                )
            }
            Err(e) => e,
        };
        let unroutable = matches!(
            refused.kind(),
            PublishErrorKind::StreamNotFound | PublishErrorKind::TimedOut
        ) && self.no_stream(&dead_letter).await?;
        if unroutable || matches!(jetstream_code(&refused), Some(10054 | 10097)) {
            return Err(Error::unroutable(format!(
                "the dead-letter subject {dead_letter:?} cannot take a row either ({refused}): {why}"
            ))
            .remedy(stream_add(&dead_letter)));
        }
        Err(publish_error(&dead_letter, &refused))
    }
}

fn answer(p: Published) -> BoxFuture<'static, Answered> {
    let Published {
        ticket,
        subject,
        stream,
        enqueued,
        ack,
        room,
        copy,
        dead_lettered,
    } = p;
    let entry = Unsettled {
        ticket,
        subject,
        stream,
        enqueued,
        copy,
        dead_lettered,
        _room: room,
    };
    std::future::IntoFuture::into_future(ack)
        .map(move |answer| (entry, answer))
        .boxed()
}

/// A publish that got no `PubAck`, or an error instead. The stream's refusals that time or an
/// operator heals while outboxd runs (storage full, a stream at its limits with `discard: new`)
/// are retried from the checkpoint; the others stop outboxd naming the stream's answer.
fn publish_error(subject: &str, e: &PublishError) -> Error {
    match e.kind() {
        PublishErrorKind::TimedOut => Error::sink(format!(
            "no PubAck for a message to {subject:?} within nats.message_timeout_ms"
        ))
        .remedy("outboxd publishes again from the checkpoint (the stream drops repeated Nats-Msg-Ids); check the server's health and the stream's storage")
        .transient(),
        PublishErrorKind::BrokenPipe => Error::sink(format!(
            "the connection to NATS was lost while a message to {subject:?} waited for its PubAck"
        ))
        .remedy("outboxd reconnects and publishes again from the checkpoint")
        .transient(),
        _ => {
            let text = e.to_string();
            // 10023 insufficient resources, 10077 store failed (a limit reached with discard:
            // new): time or an operator heals them while outboxd waits.
            // 10158: a resend whose id a clustered stream still holds as in process (an earlier
            // attempt refused after its proposal); it clears with the leader's next steps.
            if matches!(jetstream_code(e), Some(10023 | 10077 | 10158)) {
                Error::sink(format!("the stream refused a message to {subject:?}: {text}"))
                    .remedy("outboxd retries from the checkpoint; free storage or raise the stream's limits (nats stream info)")
                    .transient()
            } else {
                Error::sink(format!("the stream refused a message to {subject:?}: {text}"))
                    .remedy("fix what the server names (nats stream info), then restart outboxd; nothing was skipped")
            }
        }
    }
}

fn jetstream_code(e: &PublishError) -> Option<u64> {
    let source = std::error::Error::source(e)?;
    let js = source.downcast_ref::<async_nats::jetstream::Error>()?;
    Some(js.error_code().0)
}

/// The stream refused a message whose `Nats-Expected-Last-Msg-Id` is not its last message's id
/// (code 10070; servers before 2.9 answer the text alone).
fn wrong_last_msg_id(e: &PublishError) -> bool {
    jetstream_code(e) == Some(10070) || e.to_string().contains("wrong last msg ID")
}
