//! The pipeline: source -> router -> sink, with acks flowing into the checkpoint.
//!
//! A *session* is one connection to the source and one producer. It reads changes from a reader task
//! (the source is not cancel-safe, so it lives in its own task and hands changes over a bounded
//! channel), routes each row, produces it through the sink's bounded window (back-pressure reaches the
//! source through the channel), and feeds boundaries to the tracker. A writer task turns the tracker's
//! safe position into a durable checkpoint at most every `checkpoint.interval_ms`.
//!
//! Any error ends the session. Transient errors (network, server restart, broker outage, delivery
//! failure) reconnect with capped exponential backoff from the durable checkpoint, so nothing is
//! skipped and the replay is bounded by what was acked but not yet checkpointed plus what was in
//! flight. Anything else stops the process with the error's remedy.
//!
//! Shutdown (SIGINT/SIGTERM) finishes the transaction being read, waits for its acks and writes the
//! final checkpoint exactly at the last acknowledged boundary.

use std::sync::Arc;
use std::time::{Duration, Instant};

use backon::{BackoffBuilder, ExponentialBuilder};
use tokio::sync::{mpsc, watch};

use crate::checkpoint::{Store, Tracker};
use crate::config::{Config, SourceKind};
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::route::{Record, Router, Unroutable};
use crate::sink::kafka::KafkaSink;
use crate::source::{Change, Position, Row, Source, SourceIdentity};

/// How long a session that lost its source waits for the acks of what it already produced.
const SOURCE_ERROR_DRAIN: Duration = Duration::from_secs(5);
/// Changes buffered between the reader task and the producer loop.
const CHANNEL_DEPTH: usize = 1024;
/// Bytes of rows buffered between the reader task and the producer loop (large rows would otherwise
/// let 1024 changes hold a gigabyte). A row larger than this takes all of it.
const CHANNEL_BYTES: u32 = 16 * 1024 * 1024;

/// A change from the reader task, with the part of the channel's byte budget it holds.
type Queued = (Result<Change>, Option<tokio::sync::OwnedSemaphorePermit>);

enum SessionEnd {
    Shutdown,
}

/// Where a pipeline's changes come from.
#[derive(Clone)]
pub enum Input {
    /// The configured server, resuming from the checkpoint.
    Live,
    /// Local binlog files, read once from `from` (or their start).
    Files {
        paths: Vec<std::path::PathBuf>,
        from: Option<Position>,
    },
}

/// Runs until `shutdown` turns true (Ok) or a fatal error (Err).
pub async fn run(config: Config, shutdown: watch::Receiver<bool>) -> Result<()> {
    let store = Arc::new(Store::open_locked(&config.checkpoint.dir, &config.name)?);
    let metrics = Metrics::new(
        &config.name,
        Duration::from_millis(config.source.heartbeat_interval_ms),
    );
    if !config.http.listen.is_empty() {
        crate::http::serve(&config.http.listen, metrics.clone()).await?;
    }
    drive(&config, store, metrics, Input::Live, None, shutdown).await
}

/// Produces the outbox rows of local binlog files (from `from`, up to the boundary at or past `to`)
/// through the normal sink, then returns how many records Kafka acknowledged. No checkpoint is kept:
/// a failed file replay is simply run again.
pub async fn replay_files(
    config: &Config,
    paths: Vec<std::path::PathBuf>,
    from: Option<Position>,
    to: Option<Position>,
    shutdown: watch::Receiver<bool>,
) -> Result<u64> {
    let scratch = tempfile::Builder::new()
        .prefix("outboxd-replay-")
        .tempdir()
        .map_err(|e| Error::checkpoint(format!("cannot create a temporary directory: {e}")))?;
    let store = Arc::new(Store::open_locked(scratch.path(), &config.name)?);
    let metrics = Metrics::new(
        &config.name,
        Duration::from_millis(config.source.heartbeat_interval_ms),
    );
    let input = Input::Files { paths, from };
    drive(config, store, metrics.clone(), input, to, shutdown).await?;
    Ok(metrics.forwarded_total())
}

/// Forwards the outbox rows after `from` up to the boundary at or past `to` (default: the server's
/// end when the replay starts), then returns how many records Kafka acknowledged. Progress lives in a
/// temporary checkpoint: the live one is never read or written, and the replay registers with its own
/// replica server id (`server_id` with the high bit flipped) so a running `outboxd run` is undisturbed.
pub async fn replay(
    config: &Config,
    from: (SourceIdentity, Position),
    to: Option<Position>,
    shutdown: watch::Receiver<bool>,
) -> Result<u64> {
    if config.source.kind == SourceKind::Postgres {
        return Err(Error::config(
            "replay is not possible for Postgres: a replication slot only moves forward, so the server cannot send WAL before its position again",
        )
        .remedy("to re-send rows, re-insert them or use pg_logical_emit_message; to skip ahead, use `outboxd checkpoint set LSN`"));
    }
    let mut config = config.clone();
    config.source.server_id = Some(config.server_id() ^ 0x8000_0000);
    config.http.listen.clear();
    let to = match to {
        Some(to) => to,
        None => crate::source::current_end_position(&config).await?,
    };
    let scratch = tempfile::Builder::new()
        .prefix("outboxd-replay-")
        .tempdir()
        .map_err(|e| Error::checkpoint(format!("cannot create a temporary directory: {e}")))?;
    let store = Arc::new(Store::open_locked(scratch.path(), &config.name)?);
    store.write(&from.0, &from.1)?;
    tracing::info!(from = %from.1, to = %to, "replaying");
    let metrics = Metrics::new(
        &config.name,
        Duration::from_millis(config.source.heartbeat_interval_ms),
    );
    drive(
        &config,
        store,
        metrics.clone(),
        Input::Live,
        Some(to),
        shutdown,
    )
    .await?;
    Ok(metrics.forwarded_total())
}

/// The reconnect loop shared by `run` and `replay`.
async fn drive(
    config: &Config,
    store: Arc<Store>,
    metrics: Arc<Metrics>,
    input: Input,
    until: Option<Position>,
    mut shutdown: watch::Receiver<bool>,
) -> Result<()> {
    let router = Router::new(
        config.route.clone(),
        KafkaSink::max_message_bytes(&config.kafka),
    );
    let mut backoff = new_backoff();
    // Several hosts (replicas of one topology): one per session, the next after a failure.
    let urls = crate::config::source_urls(&config.source.url);
    let mut host = 0;
    loop {
        let started = Instant::now();
        let mut session_config;
        let config = if urls.len() > 1 {
            session_config = config.clone();
            session_config.source.url = urls[host].clone();
            &session_config
        } else {
            config
        };
        match run_session(
            config,
            &store,
            &router,
            &metrics,
            &input,
            until.as_ref(),
            &mut shutdown,
        )
        .await
        {
            Ok(SessionEnd::Shutdown) => return Ok(()),
            Err(e) if e.is_transient() => {
                if started.elapsed() > Duration::from_secs(60) {
                    backoff = new_backoff();
                }
                let delay = backoff.next().unwrap_or(Duration::from_secs(30));
                metrics.reconnect();
                if urls.len() > 1 {
                    host = (host + 1) % urls.len();
                    tracing::warn!(next = %crate::config::redact_url(&urls[host]), "moving to the next source host");
                }
                tracing::warn!(error = %e, retry_in = ?delay, "session ended; reconnecting from the last checkpoint");
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = shutdown.wait_for(|stop| *stop) => return Ok(()),
                }
            }
            Err(e) => return Err(e),
        }
    }
}

/// A server that accepts TCP but never answers (hung, or frozen) must not hang the reconnect loop.
fn connect_timeout(config: &Config) -> Duration {
    Duration::from_millis(config.source.heartbeat_interval_ms * 3).max(Duration::from_secs(10))
}

fn new_backoff() -> impl Iterator<Item = Duration> {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(200))
        .with_max_delay(Duration::from_secs(30))
        .with_factor(2.0)
        .with_jitter()
        .without_max_times()
        .build()
}

async fn run_session(
    config: &Config,
    store: &Arc<Store>,
    router: &Router,
    metrics: &Arc<Metrics>,
    input: &Input,
    until: Option<&Position>,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<SessionEnd> {
    let stored = store.load()?;
    let resume = stored
        .as_ref()
        .map(|c| (c.source.clone(), c.position.clone()));
    // The resumed position is durable already; the writer publishes every newer one.
    let (durable_tx, durable_rx) = watch::channel(resume.as_ref().map(|(_, p)| p.clone()));
    // The producer is created first so that it gets ready while the source connects.
    let tracker = Arc::new(Tracker::new());
    let sink = KafkaSink::new(
        &config.name,
        &config.kafka,
        tracker.clone(),
        metrics.clone(),
    )?;
    let opened = async {
        let source = open_source(config, input, resume.as_ref(), metrics, durable_rx).await?;
        let identity = source.identity().clone();
        if stored.is_none() {
            // Record where we start, so a restart before the first transaction does not move the start.
            store.write(&identity, &source.start())?;
        }
        Ok::<_, Error>((source, identity))
    };
    let (opened, ()) = tokio::join!(opened, sink.warm_up());
    let (source, identity) = match opened {
        Ok(opened) => opened,
        Err(e) => {
            sink.close().await;
            return Err(e);
        }
    };

    let watchdog = KafkaSink::delivery_timeout(&config.kafka)
        .map(|limit| tokio::spawn(watch_deliveries(tracker.clone(), metrics.clone(), limit)));
    let (tx, mut rx) = mpsc::channel::<Queued>(CHANNEL_DEPTH);
    let budget = Arc::new(tokio::sync::Semaphore::new(CHANNEL_BYTES as usize));
    let reader = tokio::spawn(read_changes(source, tx, budget, metrics.clone()));
    let (writer_stop, writer_stopped) = watch::channel(false);
    let writer = tokio::spawn(write_checkpoints(
        store.clone(),
        identity.clone(),
        tracker.clone(),
        metrics.clone(),
        durable_tx,
        Duration::from_millis(config.checkpoint.interval_ms),
        writer_stopped,
    ));

    let mut open_rows = false;
    // What this session learned about each topic it asked about (exists or not; asked once each,
    // see `KafkaSink::topic_exists`).
    let mut topics: std::collections::HashMap<String, bool> = std::collections::HashMap::new();
    // One deadline for the whole drain (open transaction, then acks), from the moment stopping began.
    let drain_timeout = Duration::from_millis(config.kafka.drain_timeout_ms);
    let mut stopping: Option<Instant> = None;
    let idle_deadline = tokio::time::Instant::now() + drain_timeout;
    let result: Result<SessionEnd> = 'session: loop {
        if let Some(since) = stopping {
            if !open_rows || since.elapsed() > drain_timeout {
                break Ok(SessionEnd::Shutdown);
            }
        }
        // While stopping, no wait may outlast the drain deadline (a broker outage must not hold a
        // shutdown past the orchestrator's grace period).
        // (Not stopping: the deadline is never armed; `idle_deadline` spares a clock read per change.)
        let deadline = match stopping {
            Some(since) => tokio::time::Instant::from_std(since + drain_timeout),
            None => idle_deadline,
        };
        // Fast path while changes are queued: nothing to wait for, so no futures to build. The
        // select below still sees a shutdown or failure first whenever one is pending.
        let ready = if stopping.is_none()
            && !shutdown.has_changed().unwrap_or(true)
            && !tracker.has_failed()
        {
            rx.try_recv().ok()
        } else {
            None
        };
        let change = if let Some(change) = ready {
            Some(change)
        } else {
            tokio::select! {
                biased;
                _ = shutdown.wait_for(|stop| *stop), if stopping.is_none() => {
                    tracing::info!("shutdown requested: finishing the open transaction, then draining acks");
                    stopping = Some(Instant::now());
                    continue;
                }
                e = tracker.failed() => break Err(e),
                change = rx.recv() => change,
                _ = tokio::time::sleep_until(deadline), if stopping.is_some() => {
                    tracing::warn!("the open transaction did not finish within the drain deadline; it is sent again on restart");
                    break Ok(SessionEnd::Shutdown);
                }
            }
        };
        // The row's share of the reader's byte budget is held while it is routed and handed to the
        // producer (under the sink's own byte budget from then on), and released at the end of
        // this iteration: holding it longer could leave the reader waiting for room that only the
        // next change (stuck behind it) would free.
        let (change, _queued_bytes) = match change {
            Some((change, permit)) => (Some(change), permit),
            None => (None, None),
        };
        match change {
            None => {
                let error = Error::source("the source reader stopped");
                // A file replay that broke cannot be cured by reading the files again.
                break Err(match input {
                    Input::Live => error.transient(),
                    Input::Files { .. } => error,
                });
            }
            Some(Err(e)) => break Err(e),
            Some(Ok(Change::Row(row))) => {
                open_rows = true;
                let record = match router.route(&row) {
                    // The hot path: a topic this session already knows to exist.
                    Ok(record) if topics.get(&record.topic) == Some(&true) => record,
                    // A new topic (asked about once), or a dead letter: may wait on the broker, so
                    // a shutdown request or the drain deadline interrupts it (the open transaction
                    // is then sent again on restart).
                    routed => {
                        let resolved = resolve_record(
                            config,
                            router,
                            &sink,
                            &mut topics,
                            metrics,
                            &row,
                            routed,
                        );
                        tokio::select! {
                            resolved = resolved => match resolved {
                                Ok(record) => record,
                                Err(e) => break Err(e),
                            },
                            e = tracker.failed() => break Err(e),
                            _ = shutdown.wait_for(|stop| *stop), if stopping.is_none() => {
                                tracing::info!("shutdown requested while asking the broker about a topic; the open transaction is sent again on restart");
                                break Ok(SessionEnd::Shutdown);
                            }
                            _ = tokio::time::sleep_until(deadline), if stopping.is_some() => {
                                break Ok(SessionEnd::Shutdown);
                            }
                        }
                    }
                };
                // Usually the window has room and the record is enqueued on the first poll; only a
                // full window waits, and then a failure, a shutdown request (which starts the drain
                // clock: a frozen broker must not hold the exit until librdkafka's message timeout)
                // or the drain deadline can interrupt it.
                let mut send = std::pin::pin!(sink.send(&record));
                let sent = match futures_util::poll!(send.as_mut()) {
                    std::task::Poll::Ready(sent) => sent,
                    std::task::Poll::Pending => loop {
                        let deadline = match stopping {
                            Some(since) => tokio::time::Instant::from_std(since + drain_timeout),
                            None => idle_deadline,
                        };
                        tokio::select! {
                            sent = send.as_mut() => break sent,
                            e = tracker.failed() => break Err(e),
                            _ = shutdown.wait_for(|stop| *stop), if stopping.is_none() => {
                                tracing::info!("shutdown requested while the in-flight window is full: waiting for acks until the drain deadline");
                                stopping = Some(Instant::now());
                            }
                            _ = tokio::time::sleep_until(deadline), if stopping.is_some() => {
                                tracing::warn!("the in-flight window did not drain within the drain deadline; the open transaction is sent again on restart");
                                break 'session Ok(SessionEnd::Shutdown);
                            }
                        }
                    },
                };
                if let Err(e) = sent {
                    break Err(e);
                }
            }
            Some(Ok(Change::Exhausted)) => {
                open_rows = false;
                if stopping.is_none() {
                    tracing::info!("the input is exhausted");
                    stopping = Some(Instant::now());
                }
            }
            Some(Ok(Change::Commit(boundary) | Change::Idle(boundary))) => {
                open_rows = false;
                metrics.source_time(boundary.committed_at);
                let done = until.is_some_and(|to| boundary.position.reached(to));
                tracker.boundary(boundary.position);
                if done && stopping.is_none() {
                    tracing::info!("replay reached its end position");
                    stopping = Some(Instant::now());
                }
            }
        }
    };
    if let Some(watchdog) = watchdog {
        watchdog.abort();
    }
    reader.abort();
    // A reader that panicked (third-party decoding code fed a malformed event) would panic again on
    // the same event after a reconnect: stop instead of looping.
    let result = match reader.await {
        Err(e) if e.is_panic() => Err(Error::source(format!(
            "the source reader panicked while decoding the log: {}",
            panic_text(e.into_panic())
        ))
        .remedy("this is a bug or a malformed event; outboxd stops rather than skip it. Report it with the log line above, and check the event at the checkpoint's position with mariadb-binlog/mysqlbinlog")),
        _ => result,
    };
    // Records already handed to Kafka are worth waiting for: every ack that lands before the final
    // write shrinks what the next session sends again. Not after a delivery failure (the producer is
    // the problem), and only briefly when the source broke.
    let drain_for = match &result {
        // What is left of the one drain deadline.
        Ok(SessionEnd::Shutdown) => Some(match stopping {
            Some(since) => (since + drain_timeout).saturating_duration_since(Instant::now()),
            None => drain_timeout,
        }),
        Err(e) if e.kind() != crate::error::Kind::Sink && tracker.failure().is_none() => {
            Some(SOURCE_ERROR_DRAIN)
        }
        Err(_) => None,
    };
    if let Some(limit) = drain_for {
        match tokio::time::timeout(limit, tracker.drained()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "a delivery failed while draining"),
            Err(_) => tracing::warn!(
                in_flight = tracker.in_flight(),
                "acks did not arrive in time; unacknowledged records will be sent again on restart"
            ),
        }
    }
    let _ = writer_stop.send(true);
    let written = writer
        .await
        .unwrap_or_else(|e| Err(Error::checkpoint(format!("checkpoint writer died: {e}"))));
    // Whatever became safe since the writer's last write is still safe after a failure.
    let final_write = match tracker.take_safe() {
        Some(position) => {
            let store = store.clone();
            let identity = identity.clone();
            let shown = position.to_string();
            tokio::task::spawn_blocking(move || store.advance(&identity, &position))
                .await
                .map_err(|e| Error::checkpoint(format!("checkpoint write task died: {e}")))
                .and_then(|written| written)
                .map(|_| tracing::info!(position = %shown, "final checkpoint written"))
        }
        None => Ok(()),
    };
    sink.close().await;
    metrics.abandon_inflight();
    written?;
    final_write?;
    result
}

/// Connects to the configured server (resuming after `resume`), or opens the binlog files.
async fn open_source(
    config: &Config,
    input: &Input,
    resume: Option<&(SourceIdentity, Position)>,
    metrics: &Arc<Metrics>,
    durable_rx: watch::Receiver<Option<Position>>,
) -> Result<Source> {
    Ok(match input {
        Input::Live => {
            let connect = Source::connect(
                config,
                resume.map(|(i, p)| (i, p)),
                metrics.clone(),
                durable_rx,
            );
            tokio::time::timeout(connect_timeout(config), connect)
                .await
                .map_err(|_| {
                    Error::source(format!(
                        "connecting to the source took longer than {:?}",
                        connect_timeout(config)
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

/// Ends the session when a record waits longer than `limit` (the configured `message.timeout.ms`)
/// for its acknowledgement: the session's producer is then purged and closed, and the next
/// session resends from the checkpoint (librdkafka itself never times a record out; see the sink).
async fn watch_deliveries(tracker: Arc<Tracker>, metrics: Arc<Metrics>, limit: Duration) {
    let mut tick = tokio::time::interval(Duration::from_millis(250).min(limit));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if let Some(age) = tracker.oldest_unacked_since().map(|since| since.elapsed()) {
            if age > limit {
                metrics.delivery_error();
                tracker.fail(
                    Error::sink(format!(
                        "a record has waited {age:?} for Kafka's acknowledgement ({} in flight; message.timeout.ms = {})",
                        tracker.in_flight(),
                        limit.as_millis()
                    ))
                    .remedy("outboxd purges what this session produced and resends from the last checkpoint; check the broker")
                    .transient(),
                );
                return;
            }
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

/// The reader task: pulls changes until the source fails or the channel closes. Rows take their size
/// from the channel's byte budget before they are queued.
async fn read_changes(
    mut source: Source,
    tx: mpsc::Sender<Queued>,
    budget: Arc<tokio::sync::Semaphore>,
    metrics: Arc<Metrics>,
) {
    let mut reported = source.ignored();
    loop {
        let change = source.next().await;
        let ended = matches!(change, Ok(Change::Exhausted));
        let ignored = source.ignored();
        metrics.ignored("update", ignored.updates - reported.updates);
        metrics.ignored("delete", ignored.deletes - reported.deletes);
        reported = ignored;
        let failed = change.is_err();
        let permit = match &change {
            Ok(Change::Row(row)) => {
                let cost = u32::try_from(row.size())
                    .unwrap_or(u32::MAX)
                    .clamp(1, CHANNEL_BYTES);
                match budget.clone().acquire_many_owned(cost).await {
                    Ok(permit) => Some(permit),
                    Err(_) => return,
                }
            }
            _ => None,
        };
        if tx.send((change, permit)).await.is_err() || failed || ended {
            return;
        }
    }
}

/// The writer task: group-commits the tracker's safe position every `interval` until stopped.
async fn write_checkpoints(
    store: Arc<Store>,
    identity: SourceIdentity,
    tracker: Arc<Tracker>,
    metrics: Arc<Metrics>,
    durable: watch::Sender<Option<Position>>,
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
        if let Some(position) = tracker.take_safe() {
            crate::fault::crash_point(crate::fault::AFTER_ACK_BEFORE_CHECKPOINT);
            let store = store.clone();
            let identity = identity.clone();
            let durable_position = position.clone();
            let written = tokio::task::spawn_blocking(move || store.advance(&identity, &position))
                .await
                .map_err(|e| Error::checkpoint(format!("checkpoint write task died: {e}")))?;
            if let Err(e) = written {
                tracker.fail(e.clone());
                return Err(e);
            }
            // Only now may the source confirm it to the server (Postgres: the slot).
            let _ = durable.send(Some(durable_position));
        }
        // Either just written, or nothing newer was safe: the checkpoint is as new as the acks allow.
        metrics.checkpoint_current();
    }
}

/// The record for `row` given what the router made of it (`routed`): the record, once its topic is
/// known to exist, or its dead-letter record when it cannot be delivered (the router refuses it, or
/// its topic does not exist and the broker does not create it), or the error that stops the
/// pipeline. Each topic is asked about once per session (`topics` remembers the answer, so rows for
/// a missing topic do not wait for the broker again).
async fn resolve_record(
    config: &Config,
    router: &Router,
    sink: &KafkaSink,
    topics: &mut std::collections::HashMap<String, bool>,
    metrics: &Metrics,
    row: &Row,
    routed: std::result::Result<Record, Unroutable>,
) -> Result<Record> {
    let why = match routed {
        Ok(record) => {
            let exists = match topics.get(&record.topic) {
                Some(known) => *known,
                None => {
                    let exists = sink.topic_exists(&record.topic).await?;
                    topics.insert(record.topic.clone(), exists);
                    exists
                }
            };
            if exists {
                return Ok(record);
            }
            Unroutable {
                reason: "unknown_topic",
                detail: format!(
                    "topic {} does not exist and the broker did not create it",
                    record.topic
                ),
            }
        }
        Err(why) => why,
    };
    let record = dead_letter(config, router, row, &why)?;
    if topics.get(&record.topic) != Some(&true) {
        if !sink.topic_exists(&record.topic).await? {
            return Err(Error::unroutable(format!(
                "row of {} at {} cannot be routed ({}: {}), and the dead-letter topic {} does not exist",
                row.table, row.origin, why.reason, why.detail, record.topic
            ))
            .remedy(format!(
                "create the dead-letter topic {}, then restart outboxd (nothing was skipped)",
                record.topic
            )));
        }
        topics.insert(record.topic.clone(), true);
    }
    metrics.dead_letter(why.reason);
    Ok(record)
}

/// The dead-letter record for an unroutable row, or the error that stops the pipeline without one.
fn dead_letter(config: &Config, router: &Router, row: &Row, why: &Unroutable) -> Result<Record> {
    let Some(topic) = &config.kafka.dead_letter_topic else {
        if why.reason == "unknown_topic" {
            return Err(Error::unroutable(format!(
                "row of {} at {} cannot be delivered: {}",
                row.table, row.origin, why.detail
            ))
            .remedy("create the topic (or let the broker auto-create topics), or change route.topic; or set kafka.dead_letter_topic to park such rows and continue. Nothing was skipped: restart outboxd after the fix"));
        }
        return Err(Error::unroutable(format!(
            "row of {} at {} cannot be routed ({}): {}",
            row.table, row.origin, why.reason, why.detail
        ))
        .remedy(
            "fix the row's producer, or set kafka.dead_letter_topic to park such rows and continue",
        ));
    };
    tracing::warn!(table = %row.table, position = %row.origin, reason = why.reason, detail = %why.detail, topic = %topic, "unroutable row sent to the dead-letter topic");
    Ok(router.dead_letter(row, why, topic))
}
