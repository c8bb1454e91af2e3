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
//! - **A key of another type is found before `EXEC`.** Each stream is asked its `TYPE` (on a
//!   second connection: the first one is inside `MULTI`; the answer is kept a minute), so a row
//!   whose key holds a string is dead-lettered inside the transaction or stops outboxd.
//! - **The checkpoint is stored only if every entry was.** An `XADD` can still fail inside `EXEC`
//!   (the type changed since, an ACL rule, an exhausted stream), and Redis has no rollback, so the
//!   checkpoint is written by a script queued last that first checks each stream ends with the
//!   transaction's own entry (`guard.rs`). Refused, the checkpoint stays before the transaction and
//!   outboxd stops: its entries are sent again after the fix (duplicates), none is lost.
//! - **A commit whose outcome is unknown** (a timeout, a lost connection) may land after the next
//!   session read the checkpoint: that session then finds its own earlier commit at the key, not
//!   another writer's, and starts over from it instead of stopping.
//! - **A source transaction larger than [`MAX_OPEN_FACTOR`] × `transaction_max_bytes`** stops
//!   outboxd with a remedy: Redis holds an open transaction in memory, and one that does not fit
//!   would fail (out of memory, or the client evicted) on every attempt.
//! - `redis.wait_replicas`: `WAIT` after `EXEC`; the commit is reported only then, so a Postgres
//!   slot is never confirmed past what a failover could take back.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::guard::{Newest, NOT_WRITTEN};

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

/// An open transaction may hold this many times `transaction_max_bytes` (one source transaction
/// that large stops outboxd; see the module docs).
pub(super) const MAX_OPEN_FACTOR: u64 = 4;

/// How long a stream's `TYPE` answer is trusted, and how many are kept.
const TYPE_TTL: Duration = Duration::from_secs(60);
const TYPE_CACHE: usize = 10_000;

/// What the session asks of the transaction task, in order.
pub(super) enum Step {
    /// Open a transaction (`WATCH`, `GET`, `MULTI`).
    Begin,
    Entry(Queued),
    /// Store `body` at the checkpoint key and `EXEC`, if the key still holds `expected`.
    /// `uncertain`: the body of this instance's last commit whose outcome is unknown.
    Commit {
        body: Vec<u8>,
        expected: Option<Vec<u8>>,
        uncertain: Option<Vec<u8>>,
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
    /// A second connection for `TYPE`, which inside `MULTI` would only be queued; made again
    /// when it fails (a server-side idle `timeout` closes it).
    lookup: Option<MultiplexedConnection>,
    config: RedisConfig,
    key: String,
    /// Streams asked about recently: whether they can take entries (a stream, or absent), and
    /// when Redis said so.
    streams: HashMap<String, (bool, Instant)>,
    /// While a transaction is open: what the checkpoint key held at its `WATCH`.
    seen: Option<Option<Vec<u8>>>,
    sent: Vec<Sent>,
    /// Each stream's newest entry in the open transaction, for the guard.
    newest: Newest,
    /// Bytes queued in the open transaction, and the most it may hold.
    open_bytes: u64,
    max_open_bytes: u64,
    /// Entries per stream in the open transaction (counted forwarded once it commits).
    forwarded: HashMap<String, u64>,
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
            lookup: Some(lookup),
            config: config.clone(),
            key: key.to_string(),
            streams: HashMap::new(),
            seen: None,
            sent: Vec::new(),
            newest: Newest::default(),
            open_bytes: 0,
            // Earlier source transactions of the same Redis transaction hold up to one more
            // `transaction_max_bytes`.
            max_open_bytes: config
                .transaction_max_bytes
                .saturating_mul(MAX_OPEN_FACTOR + 1),
            forwarded: HashMap::new(),
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
                    uncertain,
                    done,
                } => {
                    let result = self.commit(body, expected, uncertain).await;
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
        self.newest.clear();
        self.forwarded.clear();
        self.open_bytes = 0;
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
            self.open_bytes += super::entry::size(&fields) as u64;
            if self.open_bytes > self.max_open_bytes {
                return Err(Error::sink(format!(
                    "the open Redis transaction holds more than {} bytes of entries ({} × redis.transaction_max_bytes): a source transaction of about {MAX_OPEN_FACTOR} × or more; Redis keeps an open transaction in memory until EXEC, and one this large could fail on every attempt",
                    self.max_open_bytes,
                    MAX_OPEN_FACTOR + 1
                ))
                .remedy("raise redis.transaction_max_bytes (and Redis's maxmemory / maxmemory-clients to match), or use checkpoint.store = \"file\" (at least once) for such transactions; nothing was skipped"));
            }
            pipe.add_command(xadd(&stream, &fields, self.maxlen.filter(|_| trim)));
            self.newest.wrote(&stream, &fields);
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
        for (q, s) in entries.into_iter().zip(&sent) {
            self.metrics.acknowledged();
            self.metrics.delivered_after(q.enqueued.elapsed());
            // Where it lands (a dead letter counts under the dead-letter stream), once committed.
            *self.forwarded.entry(s.stream.clone()).or_default() += 1;
            self.acks.acked(q.ticket);
            drop(q.room);
        }
        self.sent.extend(sent);
        Ok(())
    }

    /// Whether `stream` can take entries (a stream, or no key yet; never a key reserved for
    /// checkpoints); asked again after [`TYPE_TTL`].
    async fn can_take(&mut self, stream: &str) -> Result<bool> {
        if stream.starts_with(super::CHECKPOINT_KEY_PREFIX) {
            return Ok(false);
        }
        if let Some((takes, at)) = self.streams.get(stream) {
            if at.elapsed() < TYPE_TTL {
                return Ok(*takes);
            }
        }
        if self.streams.len() >= TYPE_CACHE {
            self.streams.clear();
        }
        let kind = match self.ask_type(stream).await {
            Ok(kind) => kind,
            // The lookup connection may have been closed for idling: once more on a new one.
            Err(_) => {
                self.lookup = Some(super::open(&self.config).await?);
                self.ask_type(stream).await?
            }
        };
        let takes = matches!(kind.as_str(), "stream" | "none");
        self.streams
            .insert(stream.to_string(), (takes, Instant::now()));
        Ok(takes)
    }

    async fn ask_type(&mut self, stream: &str) -> Result<String> {
        let Some(lookup) = self.lookup.as_mut() else {
            return Err(timed_out("asking a key's type"));
        };
        let mut cmd = redis::cmd("TYPE");
        cmd.arg(stream);
        let asking = cmd.query_async::<String>(lookup);
        let answer = tokio::time::timeout(self.timeout, asking)
            .await
            .map_err(|_| timed_out("asking a key's type"))
            .and_then(|r| r.map_err(|e| command_error("asking a key's type", &e)));
        if answer.is_err() {
            self.lookup = None;
        }
        answer
    }

    /// The guard storing `body` (see `guard.rs`), then `EXEC`, if the key held `expected` at
    /// `begin`. A key holding `uncertain` (this instance's own earlier commit, which landed late)
    /// is not another writer: the session starts over from it.
    async fn commit(
        &mut self,
        body: Vec<u8>,
        expected: Option<Vec<u8>>,
        uncertain: Option<Vec<u8>>,
    ) -> Result<()> {
        let Some(seen) = self.seen.take() else {
            return Err(Error::sink("a Redis commit without a transaction (a bug)"));
        };
        if seen != expected {
            // Nothing queued is applied: the connection is given up with the session.
            if seen.is_some() && seen == uncertain {
                return Err(Error::sink(
                    "an earlier commit of this instance, whose answer was lost, reached Redis after this session read the checkpoint",
                )
                .remedy("outboxd starts again from the checkpoint it stored then; nothing of this transaction was applied")
                .transient());
            }
            return Err(superseded(&self.key));
        }
        let started = Instant::now();
        let mut pipe = redis::pipe();
        pipe.ignore_errors()
            .add_command(self.newest.store(&self.key, &body))
            .cmd("EXEC");
        let replies: Vec<Value> = self.query(&pipe, "committing a transaction").await?;
        let [guard, exec] = replies.as_slice() else {
            return Err(
                Error::sink("Redis answered a commit with the wrong number of replies")
                    .remedy("outboxd sends again from the checkpoint")
                    .transient(),
            );
        };
        if let Value::ServerError(e) = guard {
            return Err(if HEALING.contains(&e.code()) {
                Error::sink(format!("Redis refused the checkpoint: {e:?}"))
                    .remedy("outboxd sends the transaction again from the checkpoint; check the server (INFO)")
                    .transient()
            } else {
                Error::sink(format!("Redis refused the checkpoint: {e:?}")).remedy(
                    "grant the user +eval +xrevrange +set on ~outboxd:checkpoint:* and the stream keys, then restart outboxd (nothing was skipped)",
                )
            });
        }
        let applied = match exec {
            // Changed after the WATCH: by another writer, or by this instance's own earlier
            // commit landing late.
            Value::Nil => return Err(self.changed_under(uncertain.as_deref()).await),
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
        self.refused_inside(applied)?;
        if self.wait_replicas > 0 {
            wait(&mut self.connection, self.wait_replicas, self.timeout).await?;
        }
        for (stream, n) in self.forwarded.drain() {
            self.metrics.forwarded_n(&stream, n);
        }
        tracing::debug!(entries = self.sent.len(), took = ?started.elapsed(), "Redis transaction committed");
        self.sent.clear();
        Ok(())
    }

    /// The error for a checkpoint key that changed after the `WATCH`: transient when it now holds
    /// this instance's own earlier commit (`uncertain`), which landed late; else superseded.
    async fn changed_under(&mut self, uncertain: Option<&[u8]>) -> Error {
        let mut get = redis::cmd("GET");
        get.arg(&self.key);
        let now = tokio::time::timeout(
            self.timeout,
            get.query_async::<Option<Vec<u8>>>(&mut self.connection),
        )
        .await;
        match now {
            Ok(Ok(Some(body))) if Some(body.as_slice()) == uncertain => Error::sink(
                "an earlier commit of this instance, whose answer was lost, reached Redis during this transaction",
            )
            .remedy("outboxd starts again from the checkpoint it stored then; nothing of this transaction was applied")
            .transient(),
            Ok(Ok(_)) => superseded(&self.key),
            _ => timed_out("reading the checkpoint after a refused commit"),
        }
    }

    /// Entries refused inside `EXEC`. The guard (the last reply) kept the checkpoint where it
    /// was unless every stream ends with its entry; either way outboxd stops naming them.
    fn refused_inside(&self, applied: &[Value]) -> Result<()> {
        let refused: Vec<String> = self
            .sent
            .iter()
            .zip(applied)
            .filter_map(|(s, reply)| match reply {
                Value::ServerError(e) => Some(format!("row {:?} for {:?}: {e:?}", s.id, s.stream)),
                _ => None,
            })
            .collect();
        let guarded = match applied.last() {
            Some(Value::ServerError(e)) if e.code() == NOT_WRITTEN => true,
            Some(Value::ServerError(e)) => {
                return Err(Error::sink(format!(
                    "Redis refused the checkpoint inside the transaction: {e:?}"
                ))
                .remedy("the checkpoint did not move; grant the user +eval +xrevrange +set (on ~outboxd:checkpoint:* and the stream keys), then restart outboxd: the transaction's rows are sent again"))
            }
            _ => false,
        };
        if refused.is_empty() && !guarded {
            return Ok(());
        }
        let shown = if refused.is_empty() {
            "a stream does not end with the transaction's entry".to_string()
        } else {
            refused.join("; ")
        };
        if guarded {
            return Err(Error::unroutable(format!(
                "Redis refused entries inside a transaction ({shown}); the checkpoint did not move"
            ))
            .remedy("a key changed type, an ACL rule or a stream's IDs (XSETID) refused them while outboxd wrote: fix it, then restart outboxd; the transaction's other rows are sent again (duplicates), none is lost"));
        }
        Err(Error::unroutable(format!(
            "Redis refused entries inside a committed transaction ({shown}) although each stream ends with its entry"
        ))
        .remedy("these rows are not in Redis and the checkpoint is past them: set it back with `outboxd checkpoint set` (see `outboxd checkpoint list`) or re-send them, then restart outboxd"))
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
