//! Amazon SQS and SNS sinks (the AWS SDK for Rust): every record goes to the queue or topic its
//! routed topic names, in `SendMessageBatch` / `PublishBatch` calls of up to 10, and counts as
//! delivered only when the reply lists its entry as successful.
//!
//! Why the ack path looks the way it does (`shared/sinks.md` has the service facts):
//! - A batch reply is 200 even when entries failed; each entry's outcome is read. On a FIFO
//!   destination (`.fifo`) the message group is the key and the de-duplication id the row id, so
//!   the service keeps each key's order and drops a resend inside its 5-minute window: a failed
//!   entry goes again with the same ids, first in line, and a crash sends again from the
//!   checkpoint (`lane.rs` says why a batch holds one message per group). A restart more than 5
//!   minutes after the first send leaves duplicates (each carries its `id`); the window of 1,000
//!   (`config.rs`) bounds how far the checkpoint falls behind.
//! - Standard queues and topics neither order nor de-duplicate: `check` warns, and a resend after
//!   a crash is a duplicate consumers drop by `id`.
//! - A routed topic no queue/topic has, a name the service cannot take, a message over the
//!   destination's size, or an entry the service refuses for good goes to `dead_letter_topic`
//!   with `outboxd.reason`, or stops outboxd naming it; throttling and server errors are retried
//!   with a backoff until `message_timeout_ms` after a message's first send, then the session
//!   starts again from the checkpoint.
//! - The queue URL (or topic ARN) and the queue's attributes are read once per session, when the
//!   first row for it comes; a queue that does not exist is asked again after 10 s.
//!
//! `config.rs` is the section, `message.rs` turns a record into a message, `service.rs` makes the
//! calls, `lane.rs` batches and settles per destination, `check.rs` writes `check`'s lines.

mod check;
pub mod config;
mod lane;
pub mod message;
mod service;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, Mutex};

pub use self::check::preflight;
use self::config::{check_name, AwsConfig, Service};
use self::lane::{DeadLetters, Entry, Lane};
use self::message::Message;
use self::service::{Client, Destination};
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::route::Record;
use crate::sink::ack::{Acks, Ticket};
use crate::sink::window::{Room, Window};

/// How long "no such queue/topic" is believed before it is asked again.
const MISSING_TTL: Duration = Duration::from_secs(10);

/// How long looking a destination up may take.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(30);

enum Route {
    Lane {
        queue: mpsc::UnboundedSender<Entry>,
        max_bytes: usize,
        fifo: bool,
    },
    Missing(Instant),
}

pub struct AwsSink {
    service: Service,
    config: AwsConfig,
    client: Arc<Client>,
    window: Window,
    routes: Mutex<HashMap<String, Route>>,
    dead_letters: Option<DeadLetters>,
    acks: Arc<dyn Acks>,
    metrics: Arc<Metrics>,
    lanes: std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

impl AwsSink {
    pub async fn new(
        service: Service,
        config: &AwsConfig,
        acks: Arc<dyn Acks>,
        metrics: Arc<Metrics>,
    ) -> Result<AwsSink> {
        let sdk = service::sdk_config(config).await?;
        let delivery = config.delivery();
        let mut sink = AwsSink {
            service,
            config: config.clone(),
            client: Arc::new(Client::new(service, &sdk)),
            window: Window::new(delivery.max_in_flight, delivery.max_in_flight_bytes),
            routes: Mutex::new(HashMap::new()),
            dead_letters: None,
            acks,
            metrics,
            lanes: std::sync::Mutex::new(Vec::new()),
        };
        // The dead-letter destination must exist before any row needs it.
        if let Some(name) = config.dead_letter_topic.clone() {
            let Some(destination) = sink.resolve(&name).await? else {
                return Err(Error::sink(format!(
                    "the dead-letter {} {name:?} does not exist",
                    service.noun()
                ))
                .remedy(format!(
                    "create it ({}), or change {}.dead_letter_topic",
                    match service {
                        Service::Sqs => format!("aws sqs create-queue --queue-name {name}"),
                        Service::Sns => format!("aws sns create-topic --name {name}"),
                    },
                    service.section()
                )));
            };
            let (max_bytes, fifo) = (destination.max_bytes, destination.fifo);
            let queue = sink.spawn_lane(destination, None);
            sink.dead_letters = Some(DeadLetters {
                name: name.clone(),
                max_bytes,
                lane: queue.clone(),
            });
            sink.routes.get_mut().insert(
                name,
                Route::Lane {
                    queue,
                    max_bytes,
                    fifo,
                },
            );
        }
        Ok(sink)
    }

    /// Waits for room in the window for `record`; held until the record is settled. Cancel-safe.
    pub async fn reserve(&self, record: &Record) -> Result<Room> {
        self.window.reserve(record).await
    }

    /// Hands `record` to its destination's lane, which gives `ticket` back through the session's
    /// [`Acks`] once the service stored it (or its dead letter). Waits only to look the
    /// destination up the first time.
    pub async fn send(&self, room: Room, record: &Record, ticket: Ticket) -> Result<()> {
        let message = Message::new(record);
        let entry = Entry::new(ticket, record.topic.clone(), message, room);
        if let Err(why) = check_name(self.service, &record.topic) {
            return self.dead_letter(entry, &format!("invalid_topic: {why}"), true);
        }
        let mut routes = self.routes.lock().await;
        let stale = match routes.get(&record.topic) {
            None => true,
            Some(Route::Missing(since)) => since.elapsed() >= MISSING_TTL,
            Some(Route::Lane { .. }) => false,
        };
        if stale {
            let route = match self.resolve(&record.topic).await? {
                Some(destination) => {
                    let (max_bytes, fifo) = (destination.max_bytes, destination.fifo);
                    let queue = self.spawn_lane(destination, self.dead_letters.clone());
                    Route::Lane {
                        queue,
                        max_bytes,
                        fifo,
                    }
                }
                None => Route::Missing(Instant::now()),
            };
            routes.insert(record.topic.clone(), route);
        }
        match routes.get(&record.topic) {
            Some(Route::Lane { fifo: true, .. }) if entry.message.no_id => {
                drop(routes);
                let why =
                    "invalid_id: the row id is empty, and a FIFO destination de-duplicates by it";
                self.dead_letter(entry, why, true)
            }
            Some(Route::Lane {
                queue, max_bytes, ..
            }) => {
                if entry.size > *max_bytes {
                    let why = format!(
                        "too_large: a message of {} bytes exceeds the {}'s limit ({max_bytes} bytes)",
                        entry.size,
                        self.service.noun()
                    );
                    drop(routes);
                    return self.dead_letter(entry, &why, false);
                }
                queue
                    .send(entry)
                    .map_err(|_| Error::sink("a destination's lane ended").transient())
            }
            _ => {
                drop(routes);
                let why = format!(
                    "unroutable: no {} named {:?}",
                    self.service.noun(),
                    record.topic
                );
                self.dead_letter(entry, &why, true)
            }
        }
    }

    /// Looks `name` up, bounded in time.
    async fn resolve(&self, name: &str) -> Result<Option<Destination>> {
        let template = self.config.template(self.service);
        // Bounded: the row waiting for it holds a ticket already, and the lanes' clocks start
        // only once it is sent.
        let limit = RESOLVE_TIMEOUT.min(self.config.message_timeout() / 2);
        let looked = tokio::time::timeout(limit, self.client.resolve(name, template, &self.config))
            .await
            .map_err(|_| {
                Error::sink(format!(
                    "looking up the {} {name:?} took longer than {limit:?}",
                    self.service.noun()
                ))
                .remedy("outboxd retries; check the endpoint and the network")
                .transient()
            })?;
        looked.map_err(|failure| {
            let grant = match self.service {
                Service::Sqs => "sqs:GetQueueUrl and sqs:GetQueueAttributes",
                Service::Sns => "sns:ListTopics and sns:GetTopicAttributes",
            };
            failure.error(
                self.service,
                name,
                &format!("give the credentials outboxd runs with (the AWS chain: env, profile, web identity, instance role) {grant}, check region and endpoint_url; then restart outboxd"),
            )
        })
    }

    fn spawn_lane(
        &self,
        destination: Destination,
        dead_letters: Option<DeadLetters>,
    ) -> mpsc::UnboundedSender<Entry> {
        let (queue, entries) = mpsc::unbounded_channel();
        let lane = Lane {
            destination,
            client: self.client.clone(),
            dead_letters,
            acks: self.acks.clone(),
            metrics: self.metrics.clone(),
            max_batches: self.config.max_batches_in_flight,
            timeout: self.config.message_timeout(),
        };
        // A lane that panics must end the session (its messages would otherwise wait unacked,
        // and no watchdog counts the time: the lanes time their own messages).
        let acks = self.acks.clone();
        let task = tokio::spawn(async move {
            use futures_util::FutureExt;
            if std::panic::AssertUnwindSafe(lane.run(entries))
                .catch_unwind()
                .await
                .is_err()
            {
                acks.failed(
                    Error::sink("a destination's lane panicked")
                        .remedy("outboxd sends again from the checkpoint; please report the panic above")
                        .transient(),
                );
            }
        });
        self.lanes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(task);
        queue
    }

    /// `entry` cannot go where it was routed (`why`): to the dead-letter lane, or the error
    /// that stops outboxd.
    fn dead_letter(&self, entry: Entry, why: &str, keep_body: bool) -> Result<()> {
        let Some(dead_letters) = &self.dead_letters else {
            return Err(Error::unroutable(format!(
                "a row for {} {:?} cannot be delivered: {why}",
                self.service.noun(),
                entry.topic
            ))
            .remedy(format!(
                "create the {} (or route the row elsewhere), then restart outboxd; or set {}.dead_letter_topic to park such rows; nothing was skipped",
                self.service.noun(),
                self.service.section()
            )));
        };
        tracing::warn!(topic = %entry.topic, dead_letter = %dead_letters.name, reason = %why, "a row that cannot be delivered sent to the dead-letter destination");
        self.metrics
            .dead_letter(why.split(':').next().unwrap_or("unroutable"));
        dead_letters
            .lane
            .send(entry.into_dead_letter(why, keep_body, dead_letters.max_bytes))
            .map_err(|_| Error::sink("the dead-letter lane ended").transient())
    }

    /// Ends the session: what is not stored is sent again by the next one from the checkpoint.
    pub async fn close(self) {
        for lane in self
            .lanes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            lane.abort();
        }
    }
}
