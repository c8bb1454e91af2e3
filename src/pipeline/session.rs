//! One session: one connection to the source and one producer, from open to finish.
//!
//! [`Session::open`] creates the producer (it gets ready while the source connects), connects the
//! source after the durable checkpoint, and starts three tasks: the reader (source -> channel), the
//! checkpoint writer (the checkpointer's `flush` every `checkpoint.interval_ms`) and the delivery
//! watchdog. [`Session::run`] takes changes one [`Session::step`] at a time: a row is routed, gets
//! its ticket from the checkpointer and room in the sink's window, and is sent; a boundary goes to
//! the checkpointer. [`Session::finish`] drains what was sent, writes the final checkpoint through
//! the same `flush` and closes the producer, whatever ended the session.
//!
//! Shutdown starts one drain deadline (`kafka.drain_timeout_ms`): the open transaction is finished if
//! it can be within it, and no wait (a full window, a topic lookup, acks) outlasts it. What is cut
//! off is sent again on restart.
//!
//! Exactly-once sessions (`kafka.exactly_once`, or the checkpoint in Redis) differ in three places:
//! `open` fences every earlier Kafka producer of the pipeline *before* it reads the checkpoint (so
//! no old commit can land after the read; Redis needs no fencing step: each commit compares the
//! checkpoint it replaces with the one read here); rows go into a transaction that a boundary or a
//! timer commits together with the checkpoint ([`super::transaction`]), instead of the writer
//! task; and `finish` commits what ends at a boundary or aborts what does not.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};

use super::failure::{Failure, SessionAcks};
use super::reader::{self, Queued};
use super::records::resolve_record;
use super::transaction::{Batch, Commit};
use super::{Input, Shared};
use crate::checkpoint::Checkpointer;
use crate::config::Config;
use crate::error::{Error, Kind, Result};
use crate::metrics::Metrics;
use crate::route::Record;
use crate::sink::delivery::TransactionLimits;
use crate::sink::Sink;
use crate::source::{Boundary, Change, Position, Row, Source, SourceIdentity};

/// How long a session that lost its source waits for the acks of what it already produced.
const SOURCE_ERROR_DRAIN: Duration = Duration::from_secs(5);

/// Exactly-once: how long taking over the pipeline's transactions may take (it waits for the
/// transaction an earlier producer left open to be settled).
const INIT_TRANSACTIONS_TIMEOUT: Duration = Duration::from_secs(30);

/// Exactly-once: a source transaction committed this long ago, with more changes waiting, is a
/// backlog (the batching stretches; see `transaction`). Above MariaDB's whole-second commit times.
const BACKLOG_LAG: Duration = Duration::from_secs(2);

/// Exactly-once: how long a failed session waits for its open transaction's abort.
const ABORT_TIMEOUT: Duration = Duration::from_secs(5);

/// How a session that did not fail ended.
pub(super) enum SessionEnd {
    /// Shutdown was requested, the input was exhausted, or a replay reached its end.
    Shutdown,
}

pub(super) struct Session<'a> {
    config: &'a Config,
    shared: &'a Shared,
    checkpointer: Arc<Checkpointer>,
    failure: Arc<Failure>,
    sink: Sink,
    changes: mpsc::Receiver<Vec<Queued>>,
    /// The rest of the batch being handled.
    pending: std::vec::IntoIter<Queued>,
    reader: tokio::task::JoinHandle<()>,
    /// The checkpoint writer task; `None` in exactly-once sessions (commits write the checkpoint).
    writer: Option<tokio::task::JoinHandle<Result<()>>>,
    writer_stop: watch::Sender<bool>,
    /// Exactly-once: what the open transaction holds, and when it must commit.
    batch: Option<Batch>,
    limits: Option<TransactionLimits>,
    watchdog: Option<tokio::task::JoinHandle<()>>,
    shutdown: watch::Receiver<bool>,
    /// What this session learned about each topic it asked about (exists or not; asked once each,
    /// see `KafkaSink::topic_state`).
    topics: HashMap<String, crate::sink::kafka::TopicState>,
    /// Rows of a transaction whose boundary has not arrived yet were sent.
    open_rows: bool,
    /// Rows read of the open transaction: the next row's place in it, which with the
    /// transaction's position names a dead letter the same way on every resend.
    rows_in_transaction: u32,
    /// When stopping began (shutdown requested, input exhausted, replay end reached).
    stopping: Option<Instant>,
    drain_timeout: Duration,
    /// The deadline used while not stopping: never armed, it only spares a clock read per change.
    idle_deadline: tokio::time::Instant,
}

/// What a step decided.
type Step = Option<Result<SessionEnd>>;

/// What woke the main loop while it waited.
enum Wake {
    Queued(Option<Queued>),
    Shutdown,
    /// Exactly-once: the open transaction's interval passed while the source was quiet.
    Commit,
}

impl<'a> Session<'a> {
    /// Connects the source (after the durable checkpoint) and the producer, and starts the tasks.
    pub async fn open(
        config: &'a Config,
        shared: &'a Shared,
        shutdown: watch::Receiver<bool>,
    ) -> Result<Session<'a>> {
        let checkpointer = Checkpointer::new(shared.store.clone());
        let failure = Arc::new(Failure::default());
        let acks = Arc::new(SessionAcks {
            checkpointer: checkpointer.clone(),
            failure: failure.clone(),
        });
        // Exactly-once needs the checkpoint in the sink's broker (the config insists; replays,
        // whose progress is a scratch file, send at least once).
        let transactional = shared.store.transactional(config);
        // The producer is created first so that it gets ready while the source connects.
        let sink = Sink::open(
            &config.name,
            config.sink(),
            transactional.as_ref(),
            acks,
            shared.metrics.clone(),
        )
        .await?;
        let opened = async {
            if transactional.is_some() {
                // Before the checkpoint is read: from here no earlier producer can commit.
                sink.init_transactions(INIT_TRANSACTIONS_TIMEOUT).await?;
            }
            let resume = checkpointer.load().await?.map(|c| (c.source, c.position));
            let source = open_source(config, shared, resume.as_ref(), &checkpointer).await?;
            let identity = source.identity().clone();
            checkpointer.begin(identity, &source.start()).await?;
            Ok::<_, Error>(source)
        };
        let (opened, ()) = tokio::join!(opened, sink.warm_up());
        let source = match opened {
            Ok(source) => source,
            Err(e) => {
                sink.close().await;
                return Err(e);
            }
        };
        let metrics = &shared.metrics;
        let delivery = config.delivery();
        let watchdog = Some(tokio::spawn(watch_deliveries(
            checkpointer.clone(),
            failure.clone(),
            metrics.clone(),
            delivery.timeout,
        )));
        let (changes, reader) =
            reader::spawn(source, config.route.on_update_delete, metrics.clone());
        let (writer_stop, writer_stopped) = watch::channel(false);
        let limits = transactional
            .is_some()
            .then(|| config.sink().transaction_limits())
            .flatten();
        let batch = limits.as_ref().map(Batch::new);
        let writer = batch.is_none().then(|| {
            tokio::spawn(write_checkpoints(
                checkpointer.clone(),
                failure.clone(),
                metrics.clone(),
                Duration::from_millis(config.checkpoint.interval_ms),
                writer_stopped,
            ))
        });
        let drain_timeout = Duration::from_millis(delivery.drain_timeout_ms);
        Ok(Session {
            config,
            shared,
            checkpointer,
            failure,
            sink,
            changes,
            pending: Vec::new().into_iter(),
            reader,
            writer,
            writer_stop,
            batch,
            limits,
            watchdog,
            shutdown,
            topics: HashMap::new(),
            open_rows: false,
            rows_in_transaction: 0,
            stopping: None,
            drain_timeout,
            idle_deadline: tokio::time::Instant::now() + drain_timeout,
        })
    }

    /// How long the brokers let one transaction stay open (Kafka's `transaction.timeout.ms`);
    /// `None` when they keep it as long as the connection lives (Redis) or outside exactly-once.
    fn broker_timeout(&self) -> Option<Duration> {
        self.limits.as_ref().and_then(|l| l.broker_timeout)
    }

    /// While stopping, no wait may outlast the drain deadline (a broker outage must not hold a
    /// shutdown past the orchestrator's grace period).
    fn deadline(&self) -> tokio::time::Instant {
        match self.stopping {
            Some(since) => tokio::time::Instant::from_std(since + self.drain_timeout),
            None => self.idle_deadline,
        }
    }

    fn stop(&mut self, why: &str) {
        if self.stopping.is_none() {
            tracing::info!("{why}");
            self.stopping = Some(Instant::now());
        }
    }

    /// Takes changes until the session ends.
    pub async fn run(&mut self) -> Result<SessionEnd> {
        loop {
            if let Some(since) = self.stopping {
                if !self.open_rows || since.elapsed() > self.drain_timeout {
                    return Ok(SessionEnd::Shutdown);
                }
            }
            // Fast path while changes are queued: nothing to wait for, so no futures to build. The
            // select below still sees a shutdown or failure first whenever one is pending.
            let ready = if self.stopping.is_none()
                && !self.shutdown.has_changed().unwrap_or(true)
                && !self.failure.is_set()
            {
                reader::try_next_queued(&mut self.pending, &mut self.changes)
            } else {
                None
            };
            let queued = match ready {
                Some(queued) => Some(queued),
                None => {
                    let deadline = self.deadline();
                    let stopping = self.stopping.is_some();
                    // Exactly-once: a quiet source's last boundary is committed at the interval.
                    let commit_at = match &self.batch {
                        Some(batch) if !stopping => batch.due(),
                        _ => None,
                    };
                    let wake = tokio::select! {
                        biased;
                        _ = self.shutdown.wait_for(|stop| *stop), if !stopping => Wake::Shutdown,
                        e = self.failure.wait() => return Err(e),
                        queued = reader::next_queued(&mut self.pending, &mut self.changes) => Wake::Queued(queued),
                        _ = tokio::time::sleep_until(deadline), if stopping => {
                            tracing::warn!("the open transaction did not finish within the drain deadline; it is sent again on restart");
                            return Ok(SessionEnd::Shutdown);
                        }
                        _ = sleep_until_some(commit_at), if commit_at.is_some() => Wake::Commit,
                    };
                    match wake {
                        Wake::Queued(queued) => queued,
                        Wake::Shutdown => {
                            self.stop("shutdown requested: finishing the open transaction, then draining acks");
                            continue;
                        }
                        Wake::Commit => {
                            self.commit().await?;
                            continue;
                        }
                    }
                }
            };
            // The row's share of the reader's byte budget is held while it is routed and handed to
            // the producer (under the sink's own byte budget from then on), and released at the end
            // of this step: holding it longer could leave the reader waiting for room that only the
            // next change (stuck behind it) would free.
            let Some((change, _queued_bytes, read_at)) = queued else {
                let error = Error::source("the source reader stopped");
                // A file replay that broke cannot be cured by reading the files again.
                return Err(match self.shared.input {
                    Input::Live { .. } => error.transient(),
                    Input::Files { .. } => error,
                });
            };
            if let Some(end) = self.step(change?, read_at).await {
                return end;
            }
        }
    }

    /// Handles one change (a row read from the source at `read_at`); `Some` ends the session.
    async fn step(&mut self, change: Change, read_at: Option<Instant>) -> Step {
        match change {
            Change::Row(row) => {
                self.open_rows = true;
                let index = self.rows_in_transaction;
                self.rows_in_transaction = index.saturating_add(1);
                self.forward(row, index, read_at.unwrap_or_else(Instant::now))
                    .await
            }
            Change::Exhausted => {
                self.open_rows = false;
                self.rows_in_transaction = 0;
                self.stop("the input is exhausted");
                None
            }
            Change::Commit(boundary) | Change::Idle(boundary) => {
                self.open_rows = false;
                self.rows_in_transaction = 0;
                self.boundary(boundary).await
            }
        }
    }

    async fn boundary(&mut self, boundary: Boundary) -> Step {
        self.shared.metrics.source_time(boundary.committed_at);
        let done = self
            .shared
            .until
            .as_ref()
            .is_some_and(|to| boundary.position.reached(to));
        let commit = match &mut self.batch {
            Some(batch) => {
                // Behind (the transaction committed a while ago), with more already waiting.
                let lagging = boundary
                    .committed_at
                    .map(|at| at.elapsed().is_ok_and(|age| age > BACKLOG_LAG));
                let queued = self.pending.len() > 0 || !self.changes.is_empty();
                batch.boundary(boundary.position.clone(), Instant::now(), lagging, queued)
            }
            None => false,
        };
        self.checkpointer.boundary(boundary.position);
        if done {
            self.stop("replay reached its end position");
        }
        if commit {
            if let Err(e) = self.commit().await {
                return Some(Err(e));
            }
        }
        None
    }

    /// Exactly-once: commits the open Kafka transaction with the checkpoint of its last boundary
    /// (a transaction holding the checkpoint alone when only boundaries came). A shutdown request
    /// meanwhile starts the drain clock; a commit that outlasts the drain deadline ends the session
    /// (whatever the broker then decides, records and checkpoint go together).
    async fn commit(&mut self) -> Result<bool> {
        let Some(batch) = &mut self.batch else {
            return Ok(false);
        };
        let Some(Commit { end, open }) = batch.take() else {
            return Ok(false);
        };
        let result = self.commit_to(end, open).await;
        if let Err(e) = result {
            // The transaction may still be open: the session ends, and `finish` aborts it.
            if let Some(batch) = &mut self.batch {
                batch.failed();
            }
            // A record refused for good is why the commit failed: stop with its remedy.
            return Err(self.failure.get().cloned().unwrap_or(e));
        }
        result
    }

    async fn commit_to(&mut self, end: Position, open: bool) -> Result<bool> {
        if !open {
            if self.checkpointer.is_durable(&end) {
                // Nothing to store; the checkpoint is as new as it can be.
                self.shared.metrics.checkpoint_current();
                return Ok(false);
            }
            if let Some(batch) = &mut self.batch {
                batch.begin_checkpoint_only(Instant::now());
            }
            self.sink.begin()?;
        }
        let mark = self.checkpointer.mark(&end)?;
        // Bounded by what is left of the transaction's own timeout (past it the brokers abort it,
        // which the producer would report as a fence) or the sink's commit timeout, and while
        // stopping by the drain deadline.
        let left = match self.broker_timeout() {
            Some(timeout) => timeout.saturating_sub(
                self.batch
                    .as_ref()
                    .and_then(|b| b.began())
                    .filter(|_| open)
                    .map_or(Duration::ZERO, |b| b.elapsed()),
            ),
            None => self
                .limits
                .as_ref()
                .map_or(Duration::from_secs(30), |l| l.commit_timeout),
        };
        let limit = match self.stopping {
            Some(_) => self
                .deadline()
                .saturating_duration_since(tokio::time::Instant::now()),
            None => left.max(Duration::from_secs(1)),
        };
        let committed = {
            let mut committing = std::pin::pin!(self.sink.commit(mark, limit));
            loop {
                let deadline = self.deadline();
                let stopping = self.stopping.is_some();
                tokio::select! {
                    result = committing.as_mut() => break result,
                    _ = self.shutdown.wait_for(|stop| *stop), if !stopping => {
                        tracing::info!("shutdown requested while a transaction commits: waiting for it until the drain deadline");
                        self.stopping = Some(Instant::now());
                    }
                    _ = tokio::time::sleep_until(deadline), if stopping => {
                        break Err(Error::sink("the transaction did not commit within the drain deadline; if the broker still commits it, its records and checkpoint become visible together, else both are sent again on restart").transient());
                    }
                }
            }
        };
        committed?;
        self.checkpointer.committed(end);
        self.shared.metrics.transaction("committed");
        self.shared.metrics.checkpoint_current();
        Ok(true)
    }

    /// Exactly-once: the brokers abort a transaction open longer than `transaction.timeout.ms`
    /// and report that to the producer as a fence, the same error another instance's takeover
    /// gives. Only a fence of a transaction that old can be the brokers' own. If this instance
    /// still held its lead when it heard of it (renewals kept working: it was neither frozen nor
    /// cut off, so no standby took over), the source transaction did not fit in one Kafka
    /// transaction, and standing by to time out again would loop forever: a definite error. If
    /// the lead was lost too, the instance stands by as after any takeover, and the message says
    /// what else it may have been.
    fn explain_fence(&self, e: Error) -> Error {
        let Some(limit) = self.broker_timeout() else {
            return e;
        };
        if !e.is_superseded() || !self.aged() {
            return e;
        }
        let lead_held = !*self.shutdown.borrow();
        let error = Error::sink(format!(
            "{} The open Kafka transaction was older than transaction.timeout.ms ({} ms){}",
            e.message(),
            limit.as_millis(),
            if lead_held {
                ", and this instance still led: the brokers aborted it for its age; the source transaction being sent does not fit in one Kafka transaction"
            } else {
                ": unless this instance was frozen or cut off that long, the brokers aborted it for its age"
            }
        ))
        .remedy("raise kafka.properties.\"transaction.timeout.ms\" (up to the brokers' transaction.max.timeout.ms, 15 min by default); nothing was committed, nothing was skipped");
        if lead_held {
            error
        } else {
            error.superseded()
        }
    }

    /// Whether the open transaction has outlived the brokers' `transaction.timeout.ms` (they
    /// abort it, which fences this producer as another instance would).
    fn aged(&self) -> bool {
        let (Some(batch), Some(limit)) = (&self.batch, self.broker_timeout()) else {
            return false;
        };
        batch.began().is_some_and(|b| b.elapsed() >= limit)
    }

    /// A fence librdkafka reported only as `Fatal` on the records in flight means another
    /// instance took over (see `KafkaSink::explain_fatal`), unless the open transaction outlived
    /// `transaction.timeout.ms`: then the brokers aborted it (a partition stalled while the
    /// window was full, say), nobody took over, and reconnecting, as for any passing delivery
    /// failure, is right.
    fn fenced_in_flight(&self, e: Error) -> Error {
        if self.aged() {
            return e;
        }
        self.sink.explain_fatal(e)
    }

    /// Routes `row` (read at `read_at`), takes its ticket and room in the window, and sends it.
    /// Routes and sends `row`, the `index`-th row of its transaction.
    async fn forward(&mut self, row: Row, index: u32, read_at: Instant) -> Step {
        let mut record = match self.shared.router.route(&row) {
            // The hot path: a topic this session already knows to exist.
            Ok(record) if known_fit(self.topics.get(&record.topic), record.partition) => record,
            // A new topic (asked about once), or a dead letter: may wait on the broker, so a
            // shutdown request or the drain deadline interrupts it (the open transaction is then
            // sent again on restart).
            routed => match self.resolve(&row, index, routed).await {
                Ok(record) => record,
                Err(end) => return Some(end),
            },
        };
        // A row whose id is empty (a dead letter has none): the sinks that de-duplicate by id
        // name it by its row instead, or every such row of a window would share one id.
        if crate::route::lacks_row_id(&record)
            && !record
                .headers
                .iter()
                .any(|(n, _)| n == crate::route::ROW_HEADER)
        {
            let identity = crate::route::row_identity(&self.config.name, &row, index);
            record
                .headers
                .push((crate::route::ROW_HEADER.into(), Some(identity.into_bytes())));
        }
        // Usually the window has room and the first poll takes it; only a full window waits, and
        // then a failure, a shutdown request (which starts the drain clock: a frozen broker must not
        // hold the exit until the message timeout) or the drain deadline can interrupt it.
        let room = {
            let mut reserve = std::pin::pin!(self.sink.reserve(&record));
            match futures_util::poll!(reserve.as_mut()) {
                std::task::Poll::Ready(room) => room,
                std::task::Poll::Pending => loop {
                    let deadline = self.deadline();
                    let stopping = self.stopping.is_some();
                    tokio::select! {
                        room = reserve.as_mut() => break room,
                        e = self.failure.wait() => return Some(Err(e)),
                        _ = self.shutdown.wait_for(|stop| *stop), if !stopping => {
                            tracing::info!("shutdown requested while the in-flight window is full: waiting for acks until the drain deadline");
                            self.stopping = Some(Instant::now());
                        }
                        _ = tokio::time::sleep_until(deadline), if stopping => {
                            tracing::warn!("the in-flight window did not drain within the drain deadline; the open transaction is sent again on restart");
                            return Some(Ok(SessionEnd::Shutdown));
                        }
                    }
                },
            }
        };
        let room = match room {
            Ok(room) => room,
            Err(e) => return Some(Err(e)),
        };
        // Exactly-once: the first record after a commit opens the next Kafka transaction.
        if let Some(batch) = &mut self.batch {
            if batch.record(record.size(), Instant::now()) {
                if let Err(e) = self.sink.begin() {
                    return Some(Err(e));
                }
            }
        }
        // The ticket is issued only once the record has room: every ticket is then sent (a send
        // that fails ends the session), so a drain never waits for a record that was never sent.
        let ticket = self.checkpointer.issue();
        // A send waits for the client's own buffer only (librdkafka's queue, RabbitMQ's socket),
        // but a broker that stops reading (a RabbitMQ memory alarm) fills it: then, as for a full
        // window, a failure, a shutdown request or the drain deadline interrupts it. The ticket
        // is then never acknowledged, so no checkpoint passes it.
        let sent = {
            let mut send = std::pin::pin!(self.sink.send(room, &record, ticket));
            match futures_util::poll!(send.as_mut()) {
                std::task::Poll::Ready(sent) => sent,
                std::task::Poll::Pending => loop {
                    let deadline = self.deadline();
                    let stopping = self.stopping.is_some();
                    tokio::select! {
                        sent = send.as_mut() => break sent,
                        e = self.failure.wait() => return Some(Err(e)),
                        _ = self.shutdown.wait_for(|stop| *stop), if !stopping => {
                            tracing::info!("shutdown requested while the broker is not taking records: waiting until the drain deadline");
                            self.stopping = Some(Instant::now());
                        }
                        _ = tokio::time::sleep_until(deadline), if stopping => {
                            tracing::warn!("the broker took no record within the drain deadline; the open transaction is sent again on restart");
                            return Some(Ok(SessionEnd::Shutdown));
                        }
                    }
                },
            }
        };
        match sent {
            Ok(()) => {
                self.shared.metrics.handed_off_after(read_at.elapsed());
                None
            }
            // A sink that reported a failure (a message refused for good) stops taking records:
            // the failure, not the refusal of this send, says why the session ends.
            Err(e) => Some(Err(self.failure.get().cloned().unwrap_or(e))),
        }
    }

    /// The record for a row whose topic is not known yet, or its dead letter; interruptible by a
    /// failure, a shutdown request or the drain deadline (then `Err` holds how the session ends).
    async fn resolve(
        &mut self,
        row: &Row,
        index: u32,
        routed: std::result::Result<Record, crate::route::Unroutable>,
    ) -> std::result::Result<Record, Result<SessionEnd>> {
        let deadline = self.deadline();
        let stopping = self.stopping.is_some();
        let Session {
            config,
            shared,
            sink,
            topics,
            failure,
            shutdown,
            ..
        } = self;
        let resolved = resolve_record(
            config,
            &shared.router,
            sink,
            topics,
            &shared.metrics,
            (row, index),
            routed,
        );
        tokio::select! {
            resolved = resolved => resolved.map_err(Err),
            e = failure.wait() => Err(Err(e)),
            _ = shutdown.wait_for(|stop| *stop), if !stopping => {
                tracing::info!("shutdown requested while asking the broker about a topic; the open transaction is sent again on restart");
                Err(Ok(SessionEnd::Shutdown))
            }
            _ = tokio::time::sleep_until(deadline), if stopping => Err(Ok(SessionEnd::Shutdown)),
        }
    }

    /// Ends the session however `result` says it ended: stops the tasks, waits for the acks worth
    /// waiting for, writes the final checkpoint and closes the producer.
    pub async fn finish(mut self, result: Result<SessionEnd>) -> Result<SessionEnd> {
        crate::fault::hang_point(crate::fault::SHUTDOWN_HANGS);
        if let Some(watchdog) = &self.watchdog {
            watchdog.abort();
        }
        self.reader.abort();
        // A reader that panicked (third-party decoding code fed a malformed event) would panic again
        // on the same event after a reconnect: stop instead of looping.
        let result = match (&mut self.reader).await {
            Err(e) if e.is_panic() => Err(Error::source(format!(
                "the source reader panicked while decoding the log: {}",
                panic_text(e.into_panic())
            ))
            .remedy("this is a bug or a malformed event; outboxd stops rather than skip it. Report it with the log line above, and check the event at the checkpoint's position with mariadb-binlog/mysqlbinlog")),
            _ => result,
        };
        let (result, written) = if self.batch.is_some() {
            let result = result
                .map_err(|e| self.fenced_in_flight(e))
                .map_err(|e| self.explain_fence(e));
            let written = self.finish_transaction(&result).await;
            (result, written)
        } else {
            let written = self.drain_and_write(&result).await;
            (result, written)
        };
        self.sink.close().await;
        self.shared.metrics.abandon_inflight();
        written?;
        result
    }

    /// At least once: waits for the acks worth waiting for, stops the writer and writes the final
    /// checkpoint.
    async fn drain_and_write(&mut self, result: &Result<SessionEnd>) -> Result<()> {
        // Records already handed to Kafka are worth waiting for: every ack that lands before the
        // final write shrinks what the next session sends again. Not after a delivery failure (the
        // producer is the problem), and only briefly when the source broke.
        let drain_for = match result {
            // What is left of the one drain deadline.
            Ok(SessionEnd::Shutdown) => Some(match self.stopping {
                Some(since) => {
                    (since + self.drain_timeout).saturating_duration_since(Instant::now())
                }
                None => self.drain_timeout,
            }),
            Err(e) if e.kind() != Kind::Sink && !self.failure.is_set() => Some(SOURCE_ERROR_DRAIN),
            Err(_) => None,
        };
        if let Some(limit) = drain_for {
            let tracker = self.checkpointer.tracker();
            let drained = async {
                tokio::select! {
                    () = tracker.drained() => Ok(()),
                    e = self.failure.wait() => Err(e),
                }
            };
            match tokio::time::timeout(limit, drained).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "a delivery failed while draining"),
                Err(_) => tracing::warn!(
                    in_flight = tracker.in_flight(),
                    "acks did not arrive in time; unacknowledged records will be sent again on restart"
                ),
            }
        }
        let _ = self.writer_stop.send(true);
        let written = match self.writer.take() {
            Some(writer) => writer
                .await
                .unwrap_or_else(|e| Err(Error::checkpoint(format!("checkpoint writer died: {e}")))),
            None => Ok(()),
        };
        // Whatever became safe since the writer's last write is still safe after a failure.
        let final_write = self.checkpointer.flush().await.map(|written| {
            if let Some(position) = written {
                tracing::info!(%position, "final checkpoint written");
            }
        });
        written?;
        final_write
    }

    /// Exactly-once: a clean end commits what ends at a boundary (within the drain deadline); any
    /// other end aborts the open transaction, whose records the next session sends again.
    async fn finish_transaction(&mut self, result: &Result<SessionEnd>) -> Result<()> {
        let clean = matches!(result, Ok(SessionEnd::Shutdown))
            && self.batch.as_ref().is_some_and(|b| !b.partial())
            && !self.failure.is_set();
        if clean {
            self.stop("committing the last transaction");
            match self.commit().await {
                Ok(committed) => {
                    if committed {
                        tracing::info!("final transaction committed with its checkpoint");
                    }
                    return Ok(());
                }
                Err(e) if e.is_transient() || e.is_superseded() => {
                    tracing::warn!(error = %e, "the last transaction did not commit; it is sent again on restart")
                }
                Err(e) => {
                    self.abort().await;
                    return Err(e);
                }
            }
        }
        self.abort().await;
        Ok(())
    }

    /// Exactly-once: aborts the open Kafka transaction, if any (bounded, best effort).
    async fn abort(&mut self) {
        if self.batch.as_ref().is_some_and(|b| b.open()) {
            let limit = ABORT_TIMEOUT.min(match self.stopping {
                Some(_) => self
                    .deadline()
                    .saturating_duration_since(tokio::time::Instant::now()),
                None => ABORT_TIMEOUT,
            });
            self.sink.abort(limit).await;
            self.shared.metrics.transaction("aborted");
        }
    }
}

/// Sleeps until `at`, or forever without it.
async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(tokio::time::Instant::from_std(at)).await,
        None => std::future::pending().await,
    }
}

/// Connects to the configured server (resuming after `resume`), or opens the binlog files.
async fn open_source(
    config: &Config,
    shared: &Shared,
    resume: Option<&(SourceIdentity, Position)>,
    checkpointer: &Checkpointer,
) -> Result<Source> {
    Ok(match &shared.input {
        Input::Live { lead } => {
            let timeout = connect_timeout(config);
            let connect = Source::connect(
                &config.source,
                &shared.snapshot,
                &config.name,
                resume.map(|(i, p)| (i, p)),
                shared.metrics.clone(),
                checkpointer.durable(lead.clone()),
            );
            tokio::time::timeout(timeout, connect).await.map_err(|_| {
                Error::source(format!(
                    "connecting to the source took longer than {timeout:?}"
                ))
                .remedy("outboxd retries; check that the server is up and answering")
                .transient()
            })??
        }
        // After a failed session, continue from the scratch checkpoint rather than from the top.
        Input::Files { paths, from } => {
            Source::BinlogFiles(crate::source::mysql::BinlogFileSource::open(
                paths.clone(),
                config.source.tables.iter().cloned(),
                resume.map(|(_, p)| p).or(from.as_ref()),
            )?)
        }
    })
}

/// A server that accepts TCP but never answers (hung, or frozen) must not hang the reconnect loop.
fn connect_timeout(config: &Config) -> Duration {
    Duration::from_millis(config.source.heartbeat_interval_ms * 3).max(Duration::from_secs(10))
}

/// The writer task: the checkpointer's `flush` every `interval` until stopped (group commit).
async fn write_checkpoints(
    checkpointer: Arc<Checkpointer>,
    failure: Arc<Failure>,
    metrics: Arc<Metrics>,
    interval: Duration,
    mut stop: watch::Receiver<bool>,
) -> Result<()> {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => return Ok(()),
        }
        if let Err(e) = checkpointer.flush().await {
            failure.fail(e.clone());
            return Err(e);
        }
        // Either just written, or nothing newer was safe: the checkpoint is as new as the acks allow.
        metrics.checkpoint_current();
    }
}

/// How long the oldest record may wait for its acknowledgement before outboxd says so (half the
/// delivery timeout when that is shorter), and how often it says so again while it waits.
const QUIET_BROKER: Duration = Duration::from_secs(30);

/// Says when the broker has acknowledged nothing for a while ([`QUIET_BROKER`]; a broker can go
/// silent without an error: a partition without a leader, a frozen node, and librdkafka retries
/// without a word), and ends the session when a record waits longer than `limit` (the configured
/// `message.timeout.ms`; `None`: wait forever) for its acknowledgement: the session's producer is
/// then purged and closed, and the next session resends from the checkpoint (librdkafka itself
/// never times a record out; see the sink).
async fn watch_deliveries(
    checkpointer: Arc<Checkpointer>,
    failure: Arc<Failure>,
    metrics: Arc<Metrics>,
    limit: Option<Duration>,
) {
    let tracker = checkpointer.tracker();
    let every = Duration::from_millis(250).min(limit.unwrap_or(Duration::MAX));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let warn_after = limit.map_or(QUIET_BROKER, |l| QUIET_BROKER.min(l / 2));
    let mut warned: Option<tokio::time::Instant> = None;
    loop {
        tick.tick().await;
        let Some(age) = tracker.oldest_unacked_since().map(|since| since.elapsed()) else {
            warned = None;
            continue;
        };
        if let Some(limit) = limit.filter(|limit| age > *limit) {
            metrics.delivery_error();
            failure.fail(
                Error::sink(format!(
                    "a record has waited {age:?} for the broker's acknowledgement ({} in flight; the delivery timeout, kafka.properties.\"message.timeout.ms\" or the sink's message_timeout_ms, is {} ms)",
                    tracker.in_flight(),
                    limit.as_millis()
                ))
                .remedy("outboxd purges what this session produced and resends from the last checkpoint; check the broker")
                .transient(),
            );
            return;
        }
        if age >= warn_after && warned.is_none_or(|at| at.elapsed() >= QUIET_BROKER) {
            warned = Some(tokio::time::Instant::now());
            let then = match limit {
                Some(limit) => {
                    format!("if one waits {limit:?}, outboxd resends from the last checkpoint")
                }
                None => {
                    "the delivery timeout is 0: outboxd waits for as long as it takes".to_string()
                }
            };
            tracing::warn!(
                in_flight = tracker.in_flight(),
                "no acknowledgement from the broker for {:.1?}: the oldest record still waits ({then}); check that the broker is up (on Kafka: that every destination partition has a leader)",
                age
            );
        }
    }
}

/// The message of a panic payload.
fn panic_text(payload: Box<dyn std::any::Any + Send>) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".to_string())
}

/// Whether a record may skip the topic check: its topic is known to exist and a fixed partition
/// is known to be in range.
fn known_fit(state: Option<&crate::sink::kafka::TopicState>, partition: Option<i32>) -> bool {
    use crate::sink::kafka::TopicState;
    match (state, partition) {
        (Some(TopicState::Exists { .. }), None) => true,
        (
            Some(TopicState::Exists {
                partitions: Some(n),
            }),
            Some(p),
        ) => (p as usize) < *n,
        _ => false,
    }
}
