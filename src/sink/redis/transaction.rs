//! Exactly-once (`checkpoint.store = "redis"`): the entries of whole source transactions and the
//! checkpoint of their end in one `MULTI`/`EXEC`.
//!
//! Why it is built this way:
//! - **Entries stream into an open `MULTI`.** Redis queues a transaction's commands on the server
//!   and answers each with `QUEUED`; that answer frees the entry's room in the window (as a Kafka
//!   delivery report does inside a Kafka transaction), so a source transaction larger than the
//!   window still flows. Nothing is applied before `EXEC`; a connection that closes first (a crash,
//!   a kill, a network cut, Redis restarting) discards the whole transaction on the server.
//! - **The commit is a compare-and-set.** `begin` sends `WATCH key`, `GET key`, `MULTI`; the commit
//!   checks that the key held what this instance last read or wrote (the session's
//!   [`crate::sink::CommitMark`]), then sends `SET key checkpoint` and `EXEC`. A key changed before
//!   the `WATCH` shows in the `GET` (the transaction is discarded); one changed after it makes
//!   `EXEC` apply nothing. Either way this instance was superseded (another instance, or
//!   `checkpoint set`) and stops without having written a thing.
//! - **A key of another type is found before `EXEC`.** Inside `EXEC` an `XADD` to a key holding a
//!   string fails alone while the checkpoint is still stored, which would skip its row. So each
//!   stream is asked its `TYPE` once per session, on a second connection (the first one is inside
//!   `MULTI`), and such a row is dead-lettered inside the transaction or stops outboxd. Should the
//!   type change between that answer and `EXEC` anyway, the checkpoint is put back to the one
//!   before the transaction and outboxd stops: its rows are sent again (duplicates), never lost.
//! - `redis.wait_replicas`: `WAIT` after `EXEC`; the commit is reported only then, so a Postgres
//!   slot is never confirmed past what a failover could take back.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;
use redis::Value;
use tokio::sync::{mpsc, oneshot};

use super::batch::{dead_letter_copy, refused_entry, wait, xadd, Queued};
use super::config::RedisConfig;
use super::connect::{command_error, HEALING};
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::sink::ack::Acks;

/// At most this many entries go in one pipeline of `XADD`s into the open transaction.
const MAX_PIPELINE: usize = 1_000;

/// What the session asks of the transaction task, in order.
pub(super) enum Step {
    /// Open a transaction (`WATCH`, `GET`, `MULTI`).
    Begin,
    Entry(Queued),
    /// Store `body` at the checkpoint key and `EXEC`, if the key still holds `expected`.
    Commit {
        body: Vec<u8>,
        expected: Option<Vec<u8>>,
        done: oneshot::Sender<Result<()>>,
    },
}

/// An entry queued in the open transaction, for messages.
struct Sent {
    stream: String,
    id: String,
}

pub(super) struct Transactor {
    /// The transaction's connection.
    connection: MultiplexedConnection,
    /// A second connection for `TYPE`, which inside `MULTI` would only be queued.
    lookup: MultiplexedConnection,
    key: String,
    /// Streams asked about this session: whether they can take entries (a stream, or absent).
    streams: HashMap<String, bool>,
    /// While a transaction is open: what the checkpoint key held at its `WATCH`.
    seen: Option<Option<Vec<u8>>>,
    sent: Vec<Sent>,
    maxlen: Option<u64>,
    wait_replicas: u32,
    timeout: Duration,
    dead_letter: Option<String>,
    acks: Arc<dyn Acks>,
    metrics: Arc<Metrics>,
}

impl Transactor {
    pub fn new(
        connection: MultiplexedConnection,
        lookup: MultiplexedConnection,
        key: &str,
        config: &RedisConfig,
        acks: Arc<dyn Acks>,
        metrics: Arc<Metrics>,
    ) -> Transactor {
        Transactor {
            connection,
            lookup,
            key: key.to_string(),
            streams: HashMap::new(),
            seen: None,
            sent: Vec::new(),
            maxlen: config.maxlen,
            wait_replicas: config.wait_replicas,
            timeout: config.message_timeout(),
            dead_letter: config.dead_letter_topic.clone(),
            acks,
            metrics,
        }
    }

    pub async fn run(mut self, mut steps: mpsc::UnboundedReceiver<Step>) {
        let mut next = None;
        loop {
            let step = match next.take() {
                Some(step) => step,
                None => match steps.recv().await {
                    Some(step) => step,
                    None => return,
                },
            };
            let result = match step {
                Step::Begin => self.begin().await,
                Step::Entry(first) => {
                    let mut entries = vec![first];
                    while entries.len() < MAX_PIPELINE {
                        match steps.try_recv() {
                            Ok(Step::Entry(entry)) => entries.push(entry),
                            Ok(other) => {
                                next = Some(other);
                                break;
                            }
                            Err(_) => break,
                        }
                    }
                    self.queue(entries).await
                }
                Step::Commit {
                    body,
                    expected,
                    done,
                } => {
                    let result = self.commit(body, expected).await;
                    let failed = result.is_err();
                    let _ = done.send(result);
                    if failed {
                        return;
                    }
                    continue;
                }
            };
            if let Err(e) = result {
                self.metrics.delivery_error();
                self.acks.failed(e);
                return;
            }
        }
    }

    /// `WATCH key`, `GET key`, `MULTI`.
    async fn begin(&mut self) -> Result<()> {
        if self.seen.is_some() {
            return Err(Error::sink(
                "a Redis transaction began inside another (a bug)",
            ));
        }
        let mut pipe = redis::pipe();
        pipe.cmd("WATCH")
            .arg(&self.key)
            .ignore()
            .cmd("GET")
            .arg(&self.key)
            .cmd("MULTI")
            .ignore();
        let (seen,): (Option<Vec<u8>>,) = self.query(&pipe, "opening a transaction").await?;
        self.seen = Some(seen);
        self.sent.clear();
        Ok(())
    }

    /// Queues `entries` in the open transaction (dead-lettering those whose key holds another
    /// type), then hands their tickets back.
    async fn queue(&mut self, entries: Vec<Queued>) -> Result<()> {
        if self.seen.is_none() {
            return Err(Error::sink("an entry outside a Redis transaction (a bug)"));
        }
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        let mut sent = Vec::with_capacity(entries.len());
        for q in &entries {
            let (stream, fields, trim) = if self.can_take(&q.stream).await? {
                (q.stream.clone(), q.fields.clone(), !q.dead_lettered)
            } else {
                let (dead_letter, fields) = dead_letter_copy(
                    self.dead_letter.as_deref(),
                    &q.stream,
                    &q.fields,
                    q.dead_lettered,
                )?;
                if !self.can_take(&dead_letter).await? {
                    return Err(Error::unroutable(format!(
                        "the dead-letter stream {dead_letter:?} holds another type than a stream"
                    ))
                    .remedy("make redis.dead_letter_topic name a stream (or a key that does not exist), then restart outboxd (nothing was skipped)"));
                }
                self.metrics.dead_letter("unroutable");
                (dead_letter, fields, false)
            };
            pipe.add_command(xadd(&stream, &fields, self.maxlen.filter(|_| trim)));
            let id = fields
                .iter()
                .find(|(name, _)| name == crate::route::ID_HEADER)
                .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
                .unwrap_or_default();
            sent.push(Sent { stream, id });
        }
        let replies: Vec<Value> = self.query(&pipe, "queuing entries").await?;
        for (s, reply) in sent.iter().zip(&replies) {
            match reply {
                Value::ServerError(e) => return Err(refused_entry(&s.stream, e)),
                Value::SimpleString(queued) if queued == "QUEUED" => {}
                other => {
                    return Err(Error::sink(format!(
                        "Redis answered {other:?} to an entry queued in a transaction"
                    ))
                    .remedy("outboxd sends again from the checkpoint")
                    .transient())
                }
            }
        }
        if replies.len() != entries.len() {
            return Err(
                Error::sink("Redis answered fewer replies than entries queued")
                    .remedy("outboxd sends again from the checkpoint")
                    .transient(),
            );
        }
        let mut forwarded: HashMap<String, u64> = HashMap::new();
        for (q, s) in entries.into_iter().zip(&sent) {
            self.metrics.acknowledged();
            self.metrics.delivered_after(q.enqueued.elapsed());
            // Where it lands (a dead letter counts under the dead-letter stream).
            *forwarded.entry(s.stream.clone()).or_default() += 1;
            self.acks.acked(q.ticket);
            drop(q.room);
        }
        for (stream, n) in forwarded {
            self.metrics.forwarded_n(&stream, n);
        }
        self.sent.extend(sent);
        Ok(())
    }

    /// Whether `stream` can take entries (a stream, or no key yet); asked once per session.
    async fn can_take(&mut self, stream: &str) -> Result<bool> {
        if let Some(known) = self.streams.get(stream) {
            return Ok(*known);
        }
        let mut cmd = redis::cmd("TYPE");
        cmd.arg(stream);
        let asking = cmd.query_async::<String>(&mut self.lookup);
        let kind = tokio::time::timeout(self.timeout, asking)
            .await
            .map_err(|_| timed_out("asking a key's type"))?
            .map_err(|e| command_error("asking a key's type", &e))?;
        let takes = matches!(kind.as_str(), "stream" | "none");
        self.streams.insert(stream.to_string(), takes);
        Ok(takes)
    }

    /// `SET key body`, `EXEC`, if the key held `expected` at `begin`.
    async fn commit(&mut self, body: Vec<u8>, expected: Option<Vec<u8>>) -> Result<()> {
        let Some(seen) = self.seen.take() else {
            return Err(Error::sink("a Redis commit without a transaction (a bug)"));
        };
        if seen != expected {
            // Nothing queued is applied: the connection is given up with the session.
            return Err(superseded(&self.key));
        }
        let started = Instant::now();
        let mut pipe = redis::pipe();
        pipe.ignore_errors()
            .cmd("SET")
            .arg(&self.key)
            .arg(body)
            .cmd("EXEC");
        let replies: Vec<Value> = self.query(&pipe, "committing a transaction").await?;
        let [set, exec] = replies.as_slice() else {
            return Err(
                Error::sink("Redis answered a commit with the wrong number of replies")
                    .remedy("outboxd sends again from the checkpoint")
                    .transient(),
            );
        };
        if let Value::ServerError(e) = set {
            return Err(if HEALING.contains(&e.code()) {
                Error::sink(format!("Redis refused the checkpoint: {e:?}"))
                    .remedy("outboxd sends the transaction again from the checkpoint; check the server (INFO)")
                    .transient()
            } else {
                Error::sink(format!("Redis refused the checkpoint: {e:?}")).remedy(
                    "grant the user +set on ~outboxd:checkpoint:*, then restart outboxd (nothing was skipped)",
                )
            });
        }
        let applied = match exec {
            Value::Nil => return Err(superseded(&self.key)),
            Value::Array(applied) => applied,
            Value::ServerError(e) => return Err(Error::sink(format!(
                "Redis refused the transaction: {e:?}"
            ))
            .remedy(
                "outboxd sends the transaction again from the checkpoint; check the server (INFO)",
            )
            .transient()),
            other => {
                return Err(Error::sink(format!("Redis answered EXEC with {other:?}"))
                    .remedy("outboxd sends again from the checkpoint")
                    .transient())
            }
        };
        self.refused_inside(applied, expected).await?;
        if self.wait_replicas > 0 {
            wait(&mut self.connection, self.wait_replicas, self.timeout).await?;
        }
        tracing::debug!(entries = self.sent.len(), took = ?started.elapsed(), "Redis transaction committed");
        self.sent.clear();
        Ok(())
    }

    /// Entries that failed inside `EXEC` (the checkpoint after them was stored): the checkpoint
    /// is put back to `expected`, and outboxd stops naming them.
    async fn refused_inside(&mut self, applied: &[Value], expected: Option<Vec<u8>>) -> Result<()> {
        let refused: Vec<String> = self
            .sent
            .iter()
            .zip(applied)
            .filter_map(|(s, reply)| match reply {
                Value::ServerError(e) => Some(format!("row {:?} for {:?}: {e:?}", s.id, s.stream)),
                _ => None,
            })
            .collect();
        if refused.is_empty() {
            return Ok(());
        }
        let put_back = match &expected {
            Some(previous) => {
                let mut cmd = redis::cmd("SET");
                cmd.arg(&self.key).arg(previous.as_slice());
                cmd
            }
            None => {
                let mut cmd = redis::cmd("DEL");
                cmd.arg(&self.key);
                cmd
            }
        };
        let restored = tokio::time::timeout(
            self.timeout,
            put_back.query_async::<()>(&mut self.connection),
        )
        .await;
        let shown = refused.join("; ");
        match restored {
            Ok(Ok(())) => Err(Error::unroutable(format!(
                "Redis refused entries inside a committed transaction ({shown}); the checkpoint was put back to before the transaction"
            ))
            .remedy("a key changed type while outboxd wrote to it: fix it, then restart outboxd; the transaction's other rows are sent again (duplicates), none is lost")),
            _ => Err(Error::unroutable(format!(
                "Redis refused entries inside a committed transaction ({shown}), and the checkpoint could not be put back"
            ))
            .remedy(format!(
                "these rows are not in Redis and the checkpoint at {} is past them: set it back with `outboxd checkpoint set` (see `outboxd checkpoint list`) or re-send them, then restart outboxd",
                self.key
            ))),
        }
    }

    async fn query<T: redis::FromRedisValue>(
        &mut self,
        pipe: &redis::Pipeline,
        doing: &str,
    ) -> Result<T> {
        tokio::time::timeout(self.timeout, pipe.query_async(&mut self.connection))
            .await
            .map_err(|_| timed_out(doing))?
            .map_err(|e| command_error(doing, &e))
    }
}

fn timed_out(doing: &str) -> Error {
    Error::sink(format!(
        "Redis did not answer within redis.message_timeout_ms while {doing}"
    ))
    .remedy("outboxd sends the transaction again from the checkpoint; check the server")
    .transient()
}

fn superseded(key: &str) -> Error {
    Error::sink(format!(
        "the checkpoint in Redis changed under this instance ({key}): another instance of the pipeline, or `outboxd checkpoint set`, wrote it; this instance applied nothing of its open transaction"
    ))
    .remedy("run one instance per pipeline (standbys need checkpoint.store = \"kafka\"); restart this one to resume from the checkpoint now stored")
    .superseded()
}
