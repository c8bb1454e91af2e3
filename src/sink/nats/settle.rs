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

use super::message::Message;
use super::{ERROR_HEADER, SUBJECT_HEADER};
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
    enqueued: Instant,
    copy: Option<Message>,
    dead_lettered: bool,
    _room: Room,
}

type Answered = (Unsettled, std::result::Result<PublishAck, PublishError>);

pub(super) struct Settler {
    jetstream: Context,
    dead_letter: Option<String>,
    acks: Arc<dyn Acks>,
    metrics: Arc<Metrics>,
    forwarded: HashMap<String, u64>,
    counted: u64,
}

impl Settler {
    pub fn new(
        jetstream: Context,
        dead_letter: Option<String>,
        acks: Arc<dyn Acks>,
        metrics: Arc<Metrics>,
    ) -> Settler {
        Settler {
            jetstream,
            dead_letter,
            acks,
            metrics,
            forwarded: HashMap::new(),
            counted: 0,
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
            Ok(ack) => {
                if ack.duplicate {
                    tracing::debug!(subject = %entry.subject, stream = %ack.stream, sequence = ack.sequence, "the stream had this message already (same Nats-Msg-Id)");
                }
                self.done(entry);
                Ok(())
            }
            Err(e) if e.kind() == PublishErrorKind::StreamNotFound => {
                self.no_stream(&entry.subject).await?;
                self.unroutable(entry).await
            }
            Err(e) => Err(publish_error(&entry.subject, &e)),
        }
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

    /// "No responders" is also what a clustered stream answers while it elects a leader: only
    /// when the server says that no stream captures `subject` is the message unroutable.
    async fn no_stream(&self, subject: &str) -> Result<()> {
        match self.jetstream.stream_by_subject(subject).await {
            Err(e) if e.kind() == GetStreamByNameErrorKind::NotFound => Ok(()),
            Ok(stream) => Err(Error::sink(format!(
                "stream {stream:?} captures subject {subject:?} but did not answer a publish (no responders)"
            ))
            .remedy("outboxd publishes again from the checkpoint; check the stream's health (nats stream info)")
            .transient()),
            Err(e) => Err(Error::sink(format!(
                "no stream answered a publish to {subject:?}, and asking which stream captures it failed: {e}"
            ))
            .remedy("outboxd publishes again from the checkpoint; check that JetStream is enabled")
            .transient()),
        }
    }

    /// No stream captures the message's subject: publish its copy to the dead-letter subject and
    /// wait for that `PubAck` before its ticket goes back, or stop.
    async fn unroutable(&mut self, entry: Unsettled) -> Result<()> {
        let why = format!("no stream captures subject {:?}", entry.subject);
        let remedy = |subject: &str| {
            format!(
                "add a stream for it (nats stream add OUTBOX --subjects \"{subject}\" --storage file --dupe-window 2m), then restart outboxd (nothing was skipped)"
            )
        };
        let (dead_letter, copy) = match (&self.dead_letter, entry.dead_lettered, &entry.copy) {
            (Some(topic), false, Some(copy)) => (topic.clone(), copy.clone()),
            (Some(topic), _, _) if entry.dead_lettered => {
                return Err(Error::unroutable(format!(
                    "the dead-letter subject {topic:?} is unroutable too: {why}"
                ))
                .remedy(remedy(topic)))
            }
            _ => {
                return Err(
                    Error::unroutable(format!("a row cannot be delivered: {why}")).remedy(format!(
                        "{}; or set nats.dead_letter_topic to park such rows",
                        remedy(&entry.subject)
                    )),
                )
            }
        };
        tracing::warn!(subject = %entry.subject, dead_letter = %dead_letter, "unroutable message sent to the dead-letter subject");
        let mut headers = copy.headers;
        headers.insert(ERROR_HEADER, format!("unroutable: {why}"));
        headers.insert(SUBJECT_HEADER, entry.subject.as_str());
        let ack = self
            .jetstream
            .send_publish(
                dead_letter.clone(),
                PublishMessage::build()
                    .headers(headers)
                    .payload(copy.payload),
            )
            .await
            .map_err(|e| publish_error(&dead_letter, &e))?;
        match ack.await {
            Ok(_) => {
                self.metrics.dead_letter("unroutable");
                self.done(Unsettled {
                    subject: dead_letter,
                    ..entry
                });
                Ok(())
            }
            Err(e) if e.kind() == PublishErrorKind::StreamNotFound => {
                self.no_stream(&dead_letter).await?;
                Err(Error::unroutable(format!(
                    "the dead-letter subject {dead_letter:?} is unroutable too: {why}"
                ))
                .remedy(remedy(&dead_letter)))
            }
            Err(e) => Err(publish_error(&dead_letter, &e)),
        }
    }
}

fn answer(p: Published) -> BoxFuture<'static, Answered> {
    let Published {
        ticket,
        subject,
        enqueued,
        ack,
        room,
        copy,
        dead_lettered,
    } = p;
    let entry = Unsettled {
        ticket,
        subject,
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
            let code = jetstream_code(e);
            let text = e.to_string();
            // 10023 insufficient resources, 10077 store failed (a limit reached with discard new).
            if matches!(code, Some(10023 | 10077)) || text.contains("maximum") {
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
