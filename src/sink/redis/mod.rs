//! Redis Streams sink (redis-rs): every record is one `XADD` to the stream its routed topic names,
//! counted as delivered only on Redis's reply.
//!
//! Why the ack path looks the way it does (`shared/sinks.md` has the server facts):
//! - One task (`batch.rs`) sends the queued entries in batches, each batch one `MULTI`/`EXEC`
//!   pipeline, one batch at a time, and hands tickets back in order once `EXEC` answers. A batch
//!   is all or nothing against the two refusals that can come mid-way: a full server (`OOM`,
//!   refused while queuing, so `EXEC` aborts the whole batch) is sent again from the checkpoint in
//!   order, never with later entries ahead of it (the reordering Debezium's Redis sink shows).
//! - A command that fails inside `EXEC` does not undo the others (Redis has no rollback): that is
//!   a key holding another type (`WRONGTYPE`), which is the row's fault, so that row goes to the
//!   dead-letter stream (reason `unroutable`) or stops outboxd naming the key.
//! - `redis.wait_replicas`: after each batch `WAIT n timeout`; fewer replicas is a transient error
//!   (sent again from the checkpoint: duplicates, never a loss).
//! - No timeout or lost connection is retried inside a session: the session ends and the next one
//!   sends again from the checkpoint (a batch that was applied before its reply was lost is then
//!   in the stream twice: at least once, like every sink without transactions).
//!
//! `config.rs` is the section, `connect.rs` connects and writes `check`'s lines, `entry.rs` turns
//! a record into fields.

mod batch;
pub mod config;
mod connect;
pub mod entry;

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use self::batch::{Batcher, Queued};
use self::config::RedisConfig;
pub use self::connect::preflight;
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::route::Record;
use crate::sink::ack::{Acks, Ticket};
use crate::sink::window::{Room, Window};
use crate::source::config::redact_url;

/// How long connecting may take.
const OPEN_TIMEOUT: Duration = Duration::from_secs(15);

pub struct RedisSink {
    window: Window,
    queued: mpsc::UnboundedSender<Queued>,
    batcher: tokio::task::JoinHandle<()>,
    dead_letter: Option<String>,
    metrics: Arc<Metrics>,
}

impl RedisSink {
    pub async fn new(
        config: &RedisConfig,
        acks: Arc<dyn Acks>,
        metrics: Arc<Metrics>,
    ) -> Result<RedisSink> {
        let connection = tokio::time::timeout(OPEN_TIMEOUT, connect::connect(config))
            .await
            .map_err(|_| {
                Error::sink(format!(
                    "Redis at {} did not answer within {OPEN_TIMEOUT:?}",
                    redact_url(&config.url)
                ))
                .remedy("outboxd retries; check that redis-server is up")
                .transient()
            })??;
        let mut connection = connection;
        match tokio::time::timeout(OPEN_TIMEOUT, connect::probe_multi(&mut connection)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) if e.code().is_some() => {
                return Err(Error::sink(format!("Redis refused MULTI: {e}")).remedy(
                    "grant the user +multi +exec (every batch is one MULTI/EXEC transaction), then restart outboxd (nothing was skipped)",
                ))
            }
            Ok(Err(e)) => return Err(connect::command_error("opening a transaction", &e)),
            Err(_) => {
                return Err(Error::sink("Redis did not answer MULTI")
                    .remedy("outboxd retries; check the server")
                    .transient())
            }
        }
        let delivery = config.delivery();
        let (queued, queue) = mpsc::unbounded_channel();
        let batcher =
            tokio::spawn(Batcher::new(connection, config, acks, metrics.clone()).run(queue));
        Ok(RedisSink {
            window: Window::new(delivery.max_in_flight, delivery.max_in_flight_bytes),
            queued,
            batcher,
            dead_letter: config.dead_letter_topic.clone(),
            metrics,
        })
    }

    /// Waits for room in the window for `record`; held until the record is settled. Cancel-safe.
    pub async fn reserve(&self, record: &Record) -> Result<Room> {
        self.window.reserve(record).await
    }

    /// Queues `record` for the next batch; its ticket goes back through the session's [`Acks`]
    /// once `EXEC` answered for it. Does not wait.
    pub async fn send(&self, room: Room, record: &Record, ticket: Ticket) -> Result<()> {
        let fields = entry::fields(record);
        if fields.is_empty() {
            return Err(Error::unroutable(format!(
                "a record for stream {:?} has no field to write",
                record.topic
            ))
            .remedy("give rows an id (route.id); nothing was skipped"));
        }
        self.metrics.produced();
        crate::fault::crash_point(crate::fault::AFTER_PRODUCE_BEFORE_ACK);
        self.queued
            .send(Queued {
                ticket,
                stream: record.topic.clone(),
                fields,
                dead_lettered: self.dead_letter.as_deref() == Some(record.topic.as_str()),
                enqueued: Instant::now(),
                room,
            })
            .map_err(|_| Error::sink("the Redis batch task ended").transient())
    }

    /// Ends the session: what is not acknowledged is sent again by the next one from the
    /// checkpoint.
    pub async fn close(self) {
        self.batcher.abort();
    }
}
