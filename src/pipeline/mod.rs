//! The pipeline: source -> router -> sink, with acks flowing into the checkpoint.
//!
//! [`drive`] is the reconnect loop shared by `run`, `replay` and file replays; each turn runs one
//! [`session::Session`] (one source connection, one producer; see there for how a change travels).
//! The session owns its parts: the reader task ([`reader`]), the checkpointer (tickets, boundaries,
//! the one checkpoint write), the sink and the failure signal ([`failure`]) that its background
//! parts report to. What a routed row becomes when its topic is new or missing is [`records`].
//!
//! Any error ends the session. Transient errors (network, server restart, broker outage, delivery
//! failure) reconnect with capped exponential backoff from the durable checkpoint, so nothing is
//! skipped and the replay is bounded by what was acked but not yet checkpointed plus what was in
//! flight. Anything else stops the process with the error's remedy.
//!
//! Shutdown (SIGINT/SIGTERM) finishes the transaction being read, waits for its acks and writes the
//! final checkpoint exactly at the last acknowledged boundary.

mod failure;
mod hosts;
pub mod progress;
mod reader;
mod records;
mod session;
mod transaction;

use std::sync::Arc;
use std::time::{Duration, Instant};

use backon::{BackoffBuilder, ExponentialBuilder};
use tokio::sync::watch;

use self::hosts::Hosts;
use self::session::{Session, SessionEnd};
use crate::checkpoint::{Access, KafkaStore, Lease, Store};
use crate::config::{Config, SourceDb, SourceKind};
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::route::Router;
use crate::source::snapshot::Plan;
use crate::source::{Position, SourceIdentity};

/// How long a stopping leader tries to release its lead (and to close its checkpoint writer).
const RELEASE_TIMEOUT: Duration = Duration::from_secs(5);

/// Where a pipeline's changes come from.
#[derive(Clone)]
pub enum Input {
    /// The configured server, resuming from the checkpoint. `lead`: this instance took the
    /// pipeline's lead (`checkpoint.store = "kafka"`), which fenced every earlier instance; true
    /// while it still holds it. A connection still holding the source's replication slot is then
    /// a fenced instance's, and is ended.
    Live { lead: Option<watch::Receiver<bool>> },
    /// Local binlog files, read once from `from` (or their start).
    Files {
        paths: Vec<std::path::PathBuf>,
        from: Option<Position>,
    },
}

/// What outlives a session: the checkpoint store, the router, the metrics, the input and the end.
pub(crate) struct Shared {
    store: Arc<Store>,
    router: Router,
    metrics: Arc<Metrics>,
    input: Input,
    until: Option<Position>,
    /// When sessions read the outbox tables first (see `source::snapshot`).
    snapshot: Plan,
}

/// Runs until `shutdown` turns true (Ok) or a fatal error (Err). With `progress`, a line for people
/// goes to stderr every [`progress::EVERY`] (a terminal with text logs).
pub async fn run(config: Config, shutdown: watch::Receiver<bool>, progress: bool) -> Result<()> {
    for unused in config.source.unused_keys() {
        tracing::warn!("{unused}; remove it, or check source.kind");
    }
    let store = Arc::new(Store::open(&config, &config.name, Access::Run)?);
    let metrics = new_metrics(&config);
    if !config.http.listen.is_empty() {
        crate::http::serve(&config.http.listen, metrics.clone()).await?;
    }
    let progress = progress.then(|| tokio::spawn(progress::report(metrics.clone())));
    let prune = match &config.prune {
        Some(settings) => Some(tokio::spawn(crate::retention::run(
            settings.settings(&config.source)?,
            store.clone(),
            metrics.clone(),
            shutdown.clone(),
        ))),
        None => None,
    };
    let result = match store.kafka().cloned() {
        None => {
            metrics.set_single();
            drive(
                &config,
                store,
                metrics,
                Input::Live { lead: None },
                None,
                Plan::FirstStart,
                shutdown,
            )
            .await
        }
        Some(kafka) => lead(&config, store, kafka, metrics, shutdown).await,
    };
    if let Some(task) = progress {
        task.abort();
    }
    if let Some(task) = prune {
        task.abort();
    }
    result
}

/// `checkpoint.store = "kafka"`: stands by until the pipeline's lead is vacant (see
/// `checkpoint::lease`), takes over the checkpoint writer (fencing any earlier leader), forwards
/// while it holds the lead, then stands by again. A clean stop releases the lead.
async fn lead(
    config: &Config,
    store: Arc<Store>,
    kafka: Arc<KafkaStore>,
    metrics: Arc<Metrics>,
    mut shutdown: watch::Receiver<bool>,
) -> Result<()> {
    let takeover = Duration::from_millis(config.checkpoint.takeover_timeout_ms);
    let listening = kafka.clone();
    let lease = tokio::task::spawn_blocking(move || Lease::listen(listening, takeover))
        .await
        .map_err(|e| Error::checkpoint(format!("lease task died: {e}")))??;
    let mut backoff = new_backoff();
    loop {
        metrics.set_leader(false);
        tracing::info!(
            timeout = ?takeover,
            "standing by: this instance takes over when no other instance of the pipeline has renewed its lead for the takeover timeout"
        );
        tokio::select! {
            () = lease.vacant() => {}
            _ = shutdown.wait_for(|stop| *stop) => return Ok(()),
        }
        let since = Instant::now();
        let taking = kafka.clone();
        let taken = tokio::task::spawn_blocking(move || taking.take_over())
            .await
            .map_err(|e| Error::checkpoint(format!("take-over task died: {e}")))?;
        if let Err(e) = taken {
            if !e.is_transient() {
                return Err(e);
            }
            let delay = backoff.next().unwrap_or(Duration::from_secs(30));
            tracing::warn!(error = %e, retry_in = ?delay, "could not take over the checkpoint writer");
            tokio::select! {
                _ = tokio::time::sleep(delay) => continue,
                _ = shutdown.wait_for(|stop| *stop) => return Ok(()),
            }
        }
        let holding = lease.hold();
        store.forget_last_written();
        if lease.reset_heard() {
            store.forget_unwritten_first();
        }
        metrics.set_leader(true);
        tracing::info!(took = ?since.elapsed(), "leading the pipeline: this instance forwards");
        // The session ends when the lead is lost as it does on SIGTERM (the writer is fenced by
        // then, or the lead could not be renewed: nothing it writes can move the checkpoint past
        // the new leader's start), and this instance stands by again.
        let (stop_session, session_shutdown) = watch::channel(false);
        let mut held = holding.watch();
        let mut outer = shutdown.clone();
        let relay = tokio::spawn(async move {
            tokio::select! {
                _ = held.wait_for(|held| !*held) => tracing::warn!("lost the pipeline's lead; stopping this instance's session"),
                _ = outer.wait_for(|stop| *stop) => {}
            }
            let _ = stop_session.send(true);
        });
        let result = drive(
            config,
            store.clone(),
            metrics.clone(),
            Input::Live {
                lead: Some(holding.watch()),
            },
            None,
            Plan::FirstStart,
            session_shutdown,
        )
        .await;
        relay.abort();
        let still_held = *holding.watch().borrow();
        drop(holding);
        if *shutdown.borrow() && still_held {
            // Bounded: behind a frozen broker the exit must not wait for the release's own
            // timeouts (a standby then takes over after the takeover timeout instead).
            let releasing = kafka.clone();
            let release = tokio::task::spawn_blocking(move || releasing.release());
            match tokio::time::timeout(RELEASE_TIMEOUT, release).await {
                Ok(Ok(Ok(()))) => tracing::info!("released the pipeline's lead"),
                Ok(Ok(Err(e))) => {
                    tracing::warn!(error = %e, "could not release the lead; a standby takes over after the takeover timeout")
                }
                Ok(Err(_)) => {}
                Err(_) => tracing::warn!(
                    "releasing the lead took longer than {RELEASE_TIMEOUT:?}; a standby takes over after the takeover timeout"
                ),
            }
        }
        // Off the async workers: a renewal in flight holds the writer until its own timeout. A
        // stopping process does not wait for it; one that stands by again does (a late step-down
        // must not drop the writer of its next lead).
        let stepping = kafka.clone();
        let stepped = tokio::task::spawn_blocking(move || stepping.step_down());
        if !*shutdown.borrow() {
            tokio::select! {
                _ = stepped => {}
                _ = shutdown.wait_for(|stop| *stop) => {}
            }
        }
        metrics.set_leader(false);
        if *shutdown.borrow() {
            return result;
        }
        match result {
            Ok(()) => {}
            Err(e) if e.is_superseded() => tracing::warn!(error = %e, "giving up the lead"),
            Err(e) => return Err(e),
        }
        backoff = new_backoff();
    }
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
    let store = Arc::new(Store::file_locked(scratch.path(), &config.name)?);
    let metrics = new_metrics(config);
    let input = Input::Files { paths, from };
    drive(
        config,
        store,
        metrics.clone(),
        input,
        to,
        Plan::FirstStart,
        shutdown,
    )
    .await?;
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
    if config.source.kind() == SourceKind::Postgres {
        return Err(Error::config(
            "replay is not possible for Postgres: a replication slot only moves forward, so the server cannot send WAL before its position again",
        )
        .remedy("to re-send rows, re-insert them or use pg_logical_emit_message; to skip ahead, use `outboxd checkpoint set LSN`"));
    }
    let mut config = config.clone();
    if let SourceDb::Mysql(own) = &mut config.source.db {
        own.server_id = Some(own.server_id(&config.name) ^ 0x8000_0000);
    }
    config.http.listen.clear();
    let to = match to {
        Some(to) => to,
        None => crate::source::current_end_position(&config.source).await?,
    };
    let scratch = tempfile::Builder::new()
        .prefix("outboxd-replay-")
        .tempdir()
        .map_err(|e| Error::checkpoint(format!("cannot create a temporary directory: {e}")))?;
    let store = Arc::new(Store::file_locked(scratch.path(), &config.name)?);
    store.write(&from.0, &from.1)?;
    tracing::info!(from = %from.1, to = %to, "replaying");
    let metrics = new_metrics(&config);
    drive(
        &config,
        store,
        metrics.clone(),
        Input::Live { lead: None },
        Some(to),
        Plan::FirstStart,
        shutdown,
    )
    .await?;
    Ok(metrics.forwarded_total())
}

/// `outboxd snapshot`: sends the rows in the outbox tables (those matching `predicate`) once, then
/// returns how many records Kafka acknowledged. The live pipeline is undisturbed: progress lives in
/// its own checkpoint (`NAME.snapshot.json` beside the pipeline's), so an interrupted run resumes
/// where it stopped, and a finished one is started afresh next time.
pub async fn snapshot(
    config: &Config,
    predicate: Option<String>,
    shutdown: watch::Receiver<bool>,
) -> Result<u64> {
    let mut config = config.clone();
    config.http.listen.clear();
    let name = format!("{}.snapshot", config.name);
    let store = Arc::new(Store::open(&config, &name, Access::Run)?);
    if let Some(kafka) = store.kafka() {
        // A snapshot's checkpoint is its own (`NAME.snapshot`): this run is its only writer.
        kafka.take_over()?;
    }
    let metrics = new_metrics(&config);
    drive(
        &config,
        store,
        metrics.clone(),
        Input::Live { lead: None },
        None,
        Plan::OnDemand { predicate },
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
    snapshot: Plan,
    mut shutdown: watch::Receiver<bool>,
) -> Result<()> {
    let shared = Shared {
        store,
        router: config.sink().router(&config.route),
        metrics,
        input,
        until,
        snapshot,
    };
    let metrics = &shared.metrics;
    let mut backoff = new_backoff();
    let mut hosts = Hosts::new(config.source.urls());
    loop {
        let started = Instant::now();
        let forwarded = metrics.forwarded_total();
        let mut session_config;
        let config = match hosts.url() {
            Some(url) => {
                session_config = config.clone();
                session_config.source = config.source.with_url(url.to_string());
                &session_config
            }
            None => config,
        };
        let ended = match Session::open(config, &shared, shutdown.clone()).await {
            Ok(mut session) => {
                let result = session.run().await;
                session.finish(result).await
            }
            Err(e) => Err(e),
        };
        let e = match ended {
            Ok(SessionEnd::Shutdown) => return Ok(()),
            Err(e) => e,
        };
        let lasted = started.elapsed() > Duration::from_secs(60);
        if lasted {
            backoff = new_backoff();
        }
        let shown = e.to_string();
        hosts.after(e, lasted || metrics.forwarded_total() > forwarded)?;
        let delay = backoff.next().unwrap_or(Duration::from_secs(30));
        metrics.reconnect();
        tracing::warn!(error = %shown, retry_in = ?delay, "session ended; reconnecting from the last checkpoint");
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = shutdown.wait_for(|stop| *stop) => return Ok(()),
        }
    }
}

/// The metrics of a run of `config`'s pipeline (readiness judged by its heartbeat interval).
fn new_metrics(config: &Config) -> Arc<Metrics> {
    Metrics::new(
        &config.name,
        config.sink().name(),
        Duration::from_millis(config.source.heartbeat_interval_ms),
    )
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
