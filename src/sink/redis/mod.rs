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
//! - With `checkpoint.store = "redis"` entries go instead into one `MULTI`/`EXEC` per group of
//!   whole source transactions, committed with the checkpoint (exactly-once; `transaction.rs`).
//!
//! `config.rs` is the section, `connect.rs` connects and writes `check`'s lines, `entry.rs` turns
//! a record into fields.

mod batch;
pub mod config;
mod connect;
pub mod entry;
mod guard;
mod transaction;

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use self::batch::{Batcher, Queued};
use self::config::RedisConfig;
pub use self::connect::{client, preflight};
use self::transaction::{Step, Transactor};
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::route::Record;
use crate::sink::ack::{Acks, Ticket};
use crate::sink::window::{Room, Window};
use crate::source::config::redact_url;

/// How long connecting may take.
const OPEN_TIMEOUT: Duration = Duration::from_secs(15);

/// Keys of the Redis checkpoint store (`checkpoint.store = "redis"`) start with this; the sink
/// never writes a stream there (such a row is unroutable).
pub const CHECKPOINT_KEY_PREFIX: &str = "outboxd:checkpoint:";

fn task_ended() -> Error {
    Error::sink("the Redis task ended").transient()
}

/// A connection to `redis.url`, bounded by [`OPEN_TIMEOUT`].
async fn open(config: &RedisConfig) -> Result<redis::aio::MultiplexedConnection> {
    tokio::time::timeout(OPEN_TIMEOUT, connect::connect(config))
        .await
        .map_err(|_| {
            Error::sink(format!(
                "Redis at {} did not answer within {OPEN_TIMEOUT:?}",
                redact_url(&config.url)
            ))
            .remedy("outboxd retries; check that redis-server is up")
            .transient()
        })?
}

pub struct RedisSink {
    window: Window,
    lane: Lane,
    task: tokio::task::JoinHandle<()>,
    dead_letter: Option<String>,
    metrics: Arc<Metrics>,
}

/// Where entries go: batches of their own (at least once), or the open transaction.
enum Lane {
    Batches(mpsc::UnboundedSender<Queued>),
    Transaction(mpsc::UnboundedSender<Step>),
}

impl RedisSink {
    /// The session's sink; with `checkpoint_key` (the checkpoint lives in Redis) entries are
    /// committed with it (see `transaction.rs`).
    pub async fn new(
        config: &RedisConfig,
        checkpoint_key: Option<&str>,
        acks: Arc<dyn Acks>,
        metrics: Arc<Metrics>,
    ) -> Result<RedisSink> {
        let mut connection = open(config).await?;
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
        let (lane, task) = match checkpoint_key {
            None => {
                let (queued, queue) = mpsc::unbounded_channel();
                let batcher = Batcher::new(connection, config, acks, metrics.clone());
                (Lane::Batches(queued), tokio::spawn(batcher.run(queue)))
            }
            Some(key) => {
                let lookup = open(config).await?;
                let (steps, queue) = mpsc::unbounded_channel();
                let transactor =
                    Transactor::new(connection, lookup, key, config, acks, metrics.clone());
                (
                    Lane::Transaction(steps),
                    tokio::spawn(transactor.run(queue)),
                )
            }
        };
        Ok(RedisSink {
            window: Window::new(delivery.max_in_flight, delivery.max_in_flight_bytes),
            lane,
            task,
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
        let mut fields = entry::fields(record);
        let mut stream = record.topic.clone();
        let mut dead_lettered = self.dead_letter.as_deref() == Some(record.topic.as_str());
        // A stream at a checkpoint's key would break that pipeline's store: such a row is
        // unroutable.
        if stream.starts_with(CHECKPOINT_KEY_PREFIX) {
            let why = format!("the key {stream:?} is reserved for outboxd's checkpoints");
            let Some(dead_letter) = self.dead_letter.clone().filter(|_| !dead_lettered) else {
                return Err(Error::unroutable(format!("a row cannot be delivered: {why}"))
                    .remedy("route rows to other keys (route.topic), or set redis.dead_letter_topic to park them; nothing was skipped"));
            };
            tracing::warn!(stream = %stream, dead_letter = %dead_letter, "unroutable entry sent to the dead-letter stream");
            self.metrics.dead_letter("unroutable");
            fields.push((
                "outboxd.error".into(),
                format!("unroutable: {why}").into_bytes(),
            ));
            fields.push(("outboxd.stream".into(), stream.into_bytes()));
            stream = dead_letter;
            dead_lettered = true;
        }
        if fields.is_empty() {
            return Err(Error::unroutable(format!(
                "a record for stream {:?} has no field to write",
                record.topic
            ))
            .remedy("give rows an id (route.id); nothing was skipped"));
        }
        self.metrics.produced();
        crate::fault::crash_point(crate::fault::AFTER_PRODUCE_BEFORE_ACK);
        let queued = Queued {
            ticket,
            stream,
            fields,
            dead_lettered,
            enqueued: Instant::now(),
            room,
        };
        let sent = match &self.lane {
            Lane::Batches(batches) => batches.send(queued).is_ok(),
            Lane::Transaction(steps) => steps.send(Step::Entry(queued)).is_ok(),
        };
        if sent {
            Ok(())
        } else {
            Err(task_ended())
        }
    }

    /// Opens a transaction (`checkpoint.store = "redis"` only).
    pub fn begin(&self) -> Result<()> {
        match &self.lane {
            Lane::Transaction(steps) => steps.send(Step::Begin).map_err(|_| task_ended()),
            Lane::Batches(_) => Err(Error::sink(
                "a Redis transaction without checkpoint.store = \"redis\" (a bug)",
            )),
        }
    }

    /// Commits the open transaction with the checkpoint `body`, if the checkpoint key still
    /// holds `expected`; waits at most `limit`.
    pub async fn commit(
        &self,
        body: Vec<u8>,
        expected: Option<Vec<u8>>,
        uncertain: Option<Vec<u8>>,
        limit: Duration,
    ) -> Result<()> {
        let Lane::Transaction(steps) = &self.lane else {
            return Err(Error::sink(
                "a Redis commit without checkpoint.store = \"redis\" (a bug)",
            ));
        };
        let (done, result) = oneshot::channel();
        steps
            .send(Step::Commit {
                body,
                expected,
                uncertain,
                done,
            })
            .map_err(|_| task_ended())?;
        crate::fault::crash_point(crate::fault::BEFORE_TRANSACTION_COMMIT);
        match tokio::time::timeout(limit, result).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(task_ended()),
            Err(_) => Err(Error::sink(format!(
                "the Redis transaction did not commit within {limit:?}"
            ))
            .remedy("outboxd sends it again from the checkpoint (if Redis applied it after all, the checkpoint moved with it)")
            .transient()),
        }
    }

    /// Ends the session: what is not acknowledged (or committed) is sent again by the next one
    /// from the checkpoint; an open transaction dies with its connection.
    pub async fn close(self) {
        self.task.abort();
    }
}
