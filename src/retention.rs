//! Retention: deleting outbox rows outboxd has forwarded, so the table stays small (what a polling
//! relay's cleanup worker or partition maintainer does). `[prune]` in the config runs it beside the
//! pipeline every `every`; `outboxd prune` runs one round and exits.
//!
//! # Why nothing unacknowledged is deleted
//! outboxd reads the log, not the table, so a deleted row is still forwarded from its INSERT in the
//! log. The table is what operators and `outboxd snapshot` look at, though, and a relay's users
//! expect it to hold every row not yet delivered. So a round first takes a *sample* on the server
//! (`source::prune`): the log end `L`, read after the point before which every inserting
//! transaction had ended (MySQL: the oldest open InnoDB transaction's start; Postgres: the oldest
//! running transaction id). Then it waits until the durable checkpoint (the file `run` writes only
//! after Kafka acknowledged everything before it) reaches `L`. Only then does it delete the rows
//! the sample lets go, `older_than` applied on top, in batches of `batch` rows, each its own
//! statement. While Kafka does not acknowledge, the checkpoint does not move, the round ends as
//! "waiting" and nothing is deleted. No round runs while the checkpoint is inside a snapshot (the
//! snapshot still has to read the rows).
//!
//! A row's creation time must be set by the server as its transaction runs (`DEFAULT
//! CURRENT_TIMESTAMP` / `now()`). On MySQL a time set by the application from a slow clock can let
//! a row go before it is acknowledged (it is still forwarded from the log); Postgres judges by the
//! row's transaction id and has no such caveat.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Deserialize;
use tokio::sync::watch;

use crate::checkpoint::Store;
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::preflight::Item;
use crate::source::config::{redact_url, SourceConfig, SourceKind};
use crate::source::prune::{fail_item, Ahead, Pruner};
use crate::source::{Position, SourceIdentity};

/// Time allowed for connecting, sampling and estimating: a server that goes silent fails the round
/// (transient) instead of holding it forever.
const SHORT_STEP: Duration = Duration::from_secs(60);
/// Time allowed for one DELETE batch or one table's partition drops (a batch on an unindexed column
/// scans the table).
const LONG_STEP: Duration = Duration::from_secs(300);

/// `step`, or a transient error naming `what` if it does not finish within `limit`.
async fn bounded<T>(
    what: &str,
    limit: Duration,
    step: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    match tokio::time::timeout(limit, step).await {
        Ok(result) => result,
        Err(_) => Err(Error::source(format!(
            "prune: {what} did not finish within {}",
            humantime::format_duration(limit)
        ))
        .remedy("outboxd tries again next round; check the server (a long lock, a missing index on prune.column)")
        .transient()),
    }
}

/// How often a round looks at the checkpoint while it waits for it to reach the sample.
const CHECKPOINT_POLL: Duration = Duration::from_millis(200);

#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum PruneMode {
    /// Batched `DELETE`s.
    #[default]
    Delete,
    /// Drop whole partitions (tables partitioned BY RANGE on the creation time).
    DropPartitions,
}

/// `[prune]`.
#[derive(Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PruneConfig {
    /// Time between rounds in `run`.
    #[serde(default = "default_every")]
    pub every: String,
    /// Keep forwarded rows at least this long (by `column`).
    #[serde(default = "default_older_than")]
    pub older_than: String,
    /// Rows per DELETE statement.
    #[serde(default = "default_batch")]
    pub batch: u64,
    /// The server to delete on (the primary, when `source.url` is a replica); default `source.url`.
    #[serde(default)]
    pub url: Option<String>,
    /// How rows are removed.
    #[serde(default)]
    pub mode: PruneMode,
    /// The outbox tables' creation-time column.
    #[serde(default = "default_column")]
    pub column: String,
    /// Width of each partition created ahead (`"1d"`); needed with `partitions_ahead`.
    #[serde(default)]
    pub partition_every: Option<String>,
    /// Keep partitions for this many `partition_every` past now (0: create none).
    #[serde(default)]
    pub partitions_ahead: u32,
}

impl std::fmt::Debug for PruneConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PruneConfig")
            .field("every", &self.every)
            .field("older_than", &self.older_than)
            .field("batch", &self.batch)
            .field("url", &self.url.as_deref().map(redact_url))
            .field("mode", &self.mode)
            .field("column", &self.column)
            .field("partition_every", &self.partition_every)
            .field("partitions_ahead", &self.partitions_ahead)
            .finish()
    }
}

impl Default for PruneConfig {
    fn default() -> Self {
        PruneConfig {
            every: default_every(),
            older_than: default_older_than(),
            batch: default_batch(),
            url: None,
            mode: PruneMode::Delete,
            column: default_column(),
            partition_every: None,
            partitions_ahead: 0,
        }
    }
}

fn default_every() -> String {
    "1m".into()
}
fn default_older_than() -> String {
    "1h".into()
}
fn default_batch() -> u64 {
    1000
}
fn default_column() -> String {
    "created_at".into()
}

/// Checked `[prune]` settings with the connection they use.
#[derive(Clone)]
pub struct Prune {
    pub every: Duration,
    pub older_than: Duration,
    pub batch: u64,
    pub mode: PruneMode,
    pub column: String,
    /// Partitions to keep created ahead, if any.
    pub ahead: Option<Ahead>,
    pub tables: Vec<String>,
    /// `source` with `prune.url` in place of its URL.
    server: SourceConfig,
    /// Whether `server` is another server than the one the stream reads.
    elsewhere: bool,
}

fn duration(key: &str, text: &str) -> Result<Duration> {
    humantime::parse_duration(text.trim()).map_err(|e| {
        Error::config(format!(
            "key `prune.{key}`: {text:?} is not a duration: {e}"
        ))
        .remedy("write a duration like \"30s\", \"15m\", \"1h\" or \"7d\"")
    })
}

impl PruneConfig {
    /// Checks the settings against the source they prune.
    pub fn settings(&self, source: &SourceConfig) -> Result<Prune> {
        let every = duration("every", &self.every)?;
        let older_than = duration("older_than", &self.older_than)?;
        if every < Duration::from_secs(1) {
            return Err(Error::config(format!(
                "key `prune.every`: {:?} is shorter than a second",
                self.every
            ))
            .remedy("use at least \"1s\" (default \"1m\")"));
        }
        if self.batch == 0 || self.batch > 100_000 {
            return Err(Error::config(format!(
                "key `prune.batch`: {} is out of range",
                self.batch
            ))
            .remedy("use 1..=100000 rows per statement (default 1000)"));
        }
        if self.column.trim().is_empty() {
            return Err(Error::config("key `prune.column`: empty column name")
                .remedy("name the outbox table's creation-time column (default created_at)"));
        }
        let ahead = match (&self.partition_every, self.partitions_ahead) {
            (_, 0) => None,
            (None, _) => {
                return Err(Error::config(
                    "key `prune.partitions_ahead`: set, but `prune.partition_every` (the width of each new partition) is not",
                )
                .remedy("add partition_every = \"1d\" (or the width your partitions have), or remove partitions_ahead"))
            }
            (Some(every), count) => {
                let width = duration("partition_every", every)?;
                if width < Duration::from_secs(60) || count > 1000 {
                    return Err(Error::config(format!(
                        "keys `prune.partition_every` / `prune.partitions_ahead`: {every:?} x {count} is out of range"
                    ))
                    .remedy("use partitions of at least \"1m\" and at most 1000 ahead (for example \"1d\" x 7)"));
                }
                Some(Ahead {
                    every: width.as_secs() as i64,
                    count,
                })
            }
        };
        if self.url.is_none() && source.urls().len() > 1 {
            return Err(Error::config(
                "key `prune.url`: source.url lists several servers, and prune must delete on the primary",
            )
            .remedy("set prune.url to the primary (with MariaDB GTIDs, so its position can be compared with the checkpoint)"));
        }
        let mut server = source.clone();
        let mut elsewhere = false;
        if let Some(url) = &self.url {
            let expected = match source.kind() {
                SourceKind::Mysql => ["mysql://", "mariadb://"],
                SourceKind::Postgres => ["postgres://", "postgresql://"],
            };
            if !expected.iter().any(|p| url.starts_with(p)) {
                return Err(Error::config(format!(
                    "key `prune.url`: {} is not a {} URL like source.url",
                    redact_url(url),
                    source.kind().as_str()
                ))
                .remedy("point prune.url at the primary of the server source.url reads"));
            }
            if url::Url::parse(url).is_ok_and(|u| u.password().is_some()) {
                // The URL's own password, not source.password.
                server.password = None;
                server.password_file = None;
            }
            elsewhere = *url != source.url;
            server.url = url.clone();
        }
        Ok(Prune {
            every,
            older_than,
            batch: self.batch,
            mode: self.mode,
            column: self.column.clone(),
            ahead,
            tables: source.tables.clone(),
            server,
            elsewhere,
        })
    }
}

/// `check`'s lines for `[prune]`: the settings, then (connected to the server prune deletes on)
/// the sample, the column and the privileges the settings need.
pub async fn preflight(config: &PruneConfig, source: &SourceConfig) -> Vec<Item> {
    let prune = match config.settings(source) {
        Ok(p) => p,
        Err(e) => return vec![fail_item(&e)],
    };
    let mut pruner = match bounded("connecting", SHORT_STEP, Pruner::connect(&prune.server)).await {
        Ok(p) => p,
        Err(e) => return vec![fail_item(&e)],
    };
    let deletes = prune.mode == PruneMode::Delete;
    let partitions = prune.mode == PruneMode::DropPartitions || prune.ahead.is_some();
    let look = pruner.preflight(
        &prune.tables,
        &prune.column,
        deletes,
        partitions,
        prune.mode == PruneMode::DropPartitions,
        prune.ahead.is_some(),
    );
    let items = match tokio::time::timeout(SHORT_STEP, look).await {
        Ok(items) => items,
        Err(_) => vec![Item::unreachable(
            "prune",
            "the server did not answer within a minute",
            "check prune.url (or source.url)",
        )],
    };
    let _ = tokio::time::timeout(SHORT_STEP, pruner.close()).await;
    items
}

/// How a round ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The checkpoint covered the sample; `deleted` rows and `dropped` partitions are gone, and
    /// the partitions `created` ahead are new.
    Pruned {
        deleted: u64,
        dropped: Vec<String>,
        created: Vec<String>,
    },
    /// The checkpoint did not reach the sample in time (Kafka not acknowledging, the pipeline
    /// stopped or behind, a snapshot in progress): nothing was deleted (partitions ahead were
    /// still created: they hold no row).
    Waiting {
        reason: String,
        created: Vec<String>,
    },
}

/// One round: sample, wait up to `wait` for the checkpoint to cover it, delete.
pub async fn round(
    prune: &Prune,
    store: &Store,
    metrics: &Metrics,
    wait: Duration,
) -> Result<Outcome> {
    // A round that cannot even connect (a wrong password, a host down) counts as failed too.
    let result = match bounded("connecting", SHORT_STEP, Pruner::connect(&prune.server)).await {
        Ok(mut pruner) => {
            let result = round_on(&mut pruner, prune, store, metrics, wait).await;
            let _ = tokio::time::timeout(SHORT_STEP, pruner.close()).await;
            result
        }
        Err(e) => Err(e),
    };
    metrics.prune_run(match &result {
        Ok(Outcome::Pruned { .. }) => "pruned",
        Ok(Outcome::Waiting { .. }) => "waiting",
        Err(_) => "failed",
    });
    result
}

async fn round_on(
    pruner: &mut Pruner,
    prune: &Prune,
    store: &Store,
    metrics: &Metrics,
    wait: Duration,
) -> Result<Outcome> {
    // Partitions ahead first, whatever the checkpoint says: new rows need them, and they hold none.
    // A failure here is reported every round and keeps nothing else from running.
    let mut created = Vec::new();
    if let Some(ahead) = &prune.ahead {
        for table in &prune.tables {
            let create = pruner.create_partitions(table, &prune.column, ahead);
            let what = format!("creating partitions of {table}");
            match bounded(&what, LONG_STEP, create).await {
                Ok(new) => {
                    metrics.pruned(0, 0, new.len() as u64);
                    created.extend(new);
                }
                Err(e) => {
                    metrics.prune_create_failed();
                    tracing::error!(
                        error = %e.message(),
                        remedy = e.remedy_text().unwrap_or_default(),
                        "prune could not create partitions ahead (tried again next round; deleting goes on)"
                    );
                }
            }
        }
        if !created.is_empty() {
            tracing::info!(created = ?created, "prune created partitions ahead");
        }
    }
    let (log_end, what, sampled) = bounded(
        "sampling the server",
        SHORT_STEP,
        pruner.sample(prune.older_than.as_secs()),
    )
    .await?;
    if prune.elsewhere && !has_gtids(&log_end) {
        return Err(Error::config(
            "prune.url names another server, and its binlog position cannot be compared with the checkpoint's without GTIDs",
        )
        .remedy("leave prune.url unset (prune where outboxd reads), or use GTIDs (MariaDB's, or MySQL's with gtid_mode = ON)"));
    }
    let compare = Compare {
        elsewhere: prune.elsewhere,
        who: Waiter::Prune,
        sampled: &sampled,
    };
    let started = Instant::now();
    if let Some(reason) = wait_for_checkpoint(store, &log_end, wait, compare).await? {
        return Ok(Outcome::Waiting { reason, created });
    }
    if !prune.elsewhere {
        // The server's own record of what the stream confirmed must agree (Postgres: the slot,
        // confirmed about once a second after the checkpoint file is written).
        loop {
            let confirms = bounded(
                "reading the slot",
                SHORT_STEP,
                pruner.server_confirms(&log_end),
            );
            let reason = match confirms.await? {
                Some(true) => break,
                None => format!(
                    "the replication slot {:?} does not exist on this server: the checkpoint was not written against it",
                    pruner.slot().unwrap_or_default()
                ),
                Some(false) => format!(
                    "the slot {:?} has not confirmed the log end sampled before deleting ({log_end})",
                    pruner.slot().unwrap_or_default()
                ),
            };
            if started.elapsed() >= wait {
                return Ok(Outcome::Waiting { reason, created });
            }
            tokio::time::sleep(CHECKPOINT_POLL).await;
        }
    }
    let mut deleted = 0;
    let mut dropped = Vec::new();
    for table in &prune.tables {
        match prune.mode {
            PruneMode::Delete => loop {
                let batch = pruner.delete_batch(table, &prune.column, prune.batch);
                let n = bounded(&format!("deleting from {table}"), LONG_STEP, batch).await?;
                metrics.pruned(n, 0, 0);
                deleted += n;
                if n < prune.batch {
                    break;
                }
            },
            PruneMode::DropPartitions => {
                let drop = pruner.drop_partitions(table, &prune.column);
                let gone =
                    bounded(&format!("dropping partitions of {table}"), LONG_STEP, drop).await?;
                metrics.pruned(0, gone.len() as u64, 0);
                dropped.extend(gone);
            }
        }
    }
    let estimate = pruner.estimate_rows(&prune.tables);
    if let Ok(rows) = bounded("estimating the rows", SHORT_STEP, estimate).await {
        metrics.outbox_rows(rows);
    }
    tracing::info!(deleted, dropped = ?dropped, cutoff = %what, "prune round done");
    Ok(Outcome::Pruned {
        deleted,
        dropped,
        created,
    })
}

/// Whether comparing `stored` with `log_end` means something only on the server that wrote it:
/// neither a snapshot's (no server) nor two GTID sets (any server of the topology).
fn server_bound(stored: &Position, log_end: &Position) -> bool {
    let comparable_anywhere =
        matches!(stored, Position::Snapshot(_)) || (gtid_set(stored) && gtid_set(log_end));
    !comparable_anywhere
}

/// Whether `position` is a GTID set, which any server of the replication topology can compare.
fn gtid_set(position: &Position) -> bool {
    matches!(position, Position::Binlog(b) if b.gtid_text().is_some_and(|g| !g.is_empty()))
}

fn has_gtids(position: &Position) -> bool {
    match position {
        Position::Binlog(b) => b.gtid_text().is_some_and(|g| !g.is_empty()),
        _ => true,
    }
}

/// What a checkpoint is compared with: the server sampled, and whether it is another server than
/// the one the stream reads.
#[derive(Clone, Copy)]
struct Compare<'a> {
    elsewhere: bool,
    who: Waiter,
    sampled: &'a SourceIdentity,
}

/// Whether `stored` (a checkpoint's server) is known to be another server than `sampled`.
fn another_server(stored: &SourceIdentity, sampled: &SourceIdentity) -> bool {
    fn differ<T: PartialEq>(a: &Option<T>, b: &Option<T>) -> bool {
        a.is_some() && b.is_some() && a != b
    }
    differ(&stored.server_id, &sampled.server_id)
        || differ(&stored.server_uuid, &sampled.server_uuid)
        || differ(&stored.system_identifier, &sampled.system_identifier)
}

/// Waits until the durable checkpoint of the server outboxd reads reaches `log_end`; Some(reason)
/// if it did not within `wait` (`outboxd audit`).
pub async fn wait_for_checkpoint_to(
    store: &Store,
    log_end: &Position,
    sampled: &SourceIdentity,
    wait: Duration,
) -> Result<Option<String>> {
    let compare = Compare {
        elsewhere: false,
        who: Waiter::Audit,
        sampled,
    };
    wait_for_checkpoint(store, log_end, wait, compare).await
}

/// Who waits for the checkpoint, for its messages.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Waiter {
    Prune,
    Audit,
}

impl Waiter {
    fn name(self) -> &'static str {
        match self {
            Waiter::Prune => "prune",
            Waiter::Audit => "audit",
        }
    }

    /// What it sampled the log end before.
    fn before(self) -> &'static str {
        match self {
            Waiter::Prune => "deleting",
            Waiter::Audit => "reading the tables",
        }
    }
}

/// Waits until the durable checkpoint reaches `log_end`; Some(reason) if it did not within `wait`.
async fn wait_for_checkpoint(
    store: &Store,
    log_end: &Position,
    wait: Duration,
    compare: Compare<'_>,
) -> Result<Option<String>> {
    let elsewhere = compare.elsewhere;
    let started = Instant::now();
    loop {
        let checkpoint = store.load_from_async()?;
        let reason = match &checkpoint {
            // Positions of two servers compare by GTID only; a file position means nothing there.
            Some(c) if elsewhere && !has_gtids(&c.position) => {
                return Ok(Some(format!(
                    "the checkpoint ({}) has no GTID state to compare with prune.url's server",
                    c.position
                )))
            }
            // A file offset or an LSN means something only on the server that wrote it (a
            // Postgres cluster: its standbys share its system identifier).
            Some(c)
                if server_bound(&c.position, log_end)
                    && another_server(&c.source, compare.sampled) =>
            {
                return Ok(Some(format!(
                    "the checkpoint was written against another server ({:?}) than the one {} samples ({:?}); its position cannot be compared there",
                    c.source,
                    compare.who.name(),
                    compare.sampled
                )))
            }
            Some(c) if c.position.reached(log_end) => return Ok(None),
            Some(c) if matches!(c.position, Position::Snapshot(_)) => {
                return Ok(Some(format!(
                    "a snapshot is in progress ({}): {} waits until it has finished",
                    c.position,
                    compare.who.name()
                )))
            }
            Some(c) => format!(
                "the checkpoint ({}) has not reached the log end sampled before {} ({log_end}) within {}",
                c.position,
                compare.who.before(),
                humantime::format_duration(wait)
            ),
            None => format!(
                "there is no checkpoint yet at {}: nothing has been forwarded",
                store.describe()
            ),
        };
        if started.elapsed() >= wait || checkpoint.is_none() {
            return Ok(Some(reason));
        }
        tokio::time::sleep(CHECKPOINT_POLL).await;
    }
}

/// A failing round logs its error and remedy again only this often while the error stays the same
/// (the rounds themselves go on every `prune.every`, each counted `failed`).
const REPEAT_FAILURE_LOG: Duration = Duration::from_secs(600);

/// Runs a round every `prune.every` until `shutdown`. A failed round (a missing grant, a lock, a
/// server restart, a column the table lacks) is logged with its fix, counted, and the next round
/// tries again: granting the privilege heals pruning without a restart, and forwarding never waits
/// for it. The same failure is logged again at most every [`REPEAT_FAILURE_LOG`].
pub async fn run(
    prune: Prune,
    store: Arc<Store>,
    metrics: Arc<Metrics>,
    mut shutdown: watch::Receiver<bool>,
) {
    // The first round waits one period, so the session has checked the checkpoint against the
    // server before anything is compared with it.
    let mut ticks =
        tokio::time::interval_at(tokio::time::Instant::now() + prune.every, prune.every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Every result at 0 from the start, so the first failed round is an increase to alert on.
    metrics.prune_runs_declared();
    let mut failing = Failing::default();
    loop {
        tokio::select! {
            _ = ticks.tick() => {}
            _ = shutdown.changed() => return,
        }
        if *shutdown.borrow() {
            return;
        }
        let round = round(&prune, &store, &metrics, prune.every);
        let result = tokio::select! {
            r = round => r,
            _ = shutdown.changed() => return,
        };
        match result {
            Ok(outcome) => {
                failing.healed();
                if let Outcome::Waiting { reason, .. } = outcome {
                    tracing::info!("prune: nothing deleted: {reason}")
                }
            }
            Err(e) => failing.failed(&e, prune.every),
        }
    }
}

/// The failures of consecutive rounds, for logging them without flooding the log.
#[derive(Default)]
struct Failing {
    rounds: u64,
    /// The message last logged, and when.
    logged: Option<(String, Instant)>,
}

impl Failing {
    fn failed(&mut self, e: &Error, every: Duration) {
        self.rounds += 1;
        let repeat = self
            .logged
            .as_ref()
            .is_some_and(|(m, at)| m == e.message() && at.elapsed() < REPEAT_FAILURE_LOG);
        if repeat {
            tracing::debug!(error = %e.message(), rounds = self.rounds, "prune: the same failure again");
            return;
        }
        let every = humantime::format_duration(every).to_string();
        let remedy = e.remedy_text().unwrap_or_default();
        if e.is_transient() {
            tracing::warn!(error = %e.message(), remedy, failed_rounds = self.rounds, "prune round failed; trying again every {every} (forwarding goes on)");
        } else {
            tracing::error!(error = %e.message(), remedy, failed_rounds = self.rounds, "prune round failed; trying again every {every} (forwarding goes on)");
        }
        self.logged = Some((e.message().to_string(), Instant::now()));
    }

    fn healed(&mut self) {
        if self.rounds > 0 {
            tracing::info!(
                failed_rounds = self.rounds,
                "prune works again after failed rounds"
            );
        }
        *self = Failing::default();
    }
}
