//! Sources turn a database's log into committed outbox rows, in commit order, with positions.
//!
//! A source yields [`Change`]s: the outbox rows of a transaction as they are decoded (streamed, so a
//! million-row transaction never sits in memory), then `Commit` with the position just after that
//! transaction, or `Idle` with a boundary position when transactions without outbox rows (or heartbeats)
//! pass. Everything between two boundaries belongs to the transaction the second one closes. Positions
//! are typed values ([`Position`]): the pipeline compares them (`--to`), stores them in the checkpoint
//! and hands them back on restart. Protocol bytes never leave this module.

pub mod config;
pub mod mysql;
mod position;
pub mod postgres;
pub mod prune;
pub mod snapshot;
pub mod tls;
mod value;

use std::sync::Arc;

use tokio::sync::watch;

use self::config::{SourceConfig, SourceDb, SourceKind};
use crate::error::Result;
use crate::metrics::Metrics;

pub use position::Position;
pub use value::Value;

/// One INSERT into an outbox table, decoded.
#[derive(Debug, Clone)]
pub struct Row {
    /// `schema.table`.
    pub table: Arc<str>,
    /// Column names, shared by every row of the same table version.
    pub names: Arc<[Arc<str>]>,
    pub values: Vec<Value>,
    /// Where the row's transaction starts in the log (`FILE:POS`, or `gtid:…`), for audits.
    pub origin: Arc<str>,
    /// When its transaction committed, in milliseconds since the Unix epoch, as the log says
    /// (Postgres: the commit time; MySQL 8: the GTID event's commit time; MariaDB and older MySQL:
    /// the transaction's first event, whole seconds). The record timestamp by default.
    pub committed_ms: Option<i64>,
}

impl Row {
    /// Approximate bytes the row holds (its values plus a small per-value overhead), for byte budgets.
    pub fn size(&self) -> usize {
        self.values.iter().map(|v| 16 + v.size()).sum()
    }

    /// The value of column `name`, if the table has it.
    pub fn get(&self, name: &str) -> Option<&Value> {
        self.names
            .iter()
            .position(|n| &**n == name)
            .map(|i| &self.values[i])
    }
}

/// What a source hands the pipeline.
#[derive(Debug, Clone)]
pub enum Change {
    /// An outbox row of the transaction in progress.
    Row(Row),
    /// The transaction holding the rows since the last boundary committed; resuming at its position
    /// starts after it.
    Commit(Boundary),
    /// A boundary with no rows since the last one (other tables' transactions, heartbeats).
    Idle(Boundary),
    /// A bounded source (binlog files) has nothing more.
    Exhausted,
}

impl Change {
    /// The change that closes a transaction: `Commit` if it carried outbox rows, else `Idle`.
    pub fn closing(boundary: Boundary, had_rows: bool) -> Change {
        if had_rows {
            Change::Commit(boundary)
        } else {
            Change::Idle(boundary)
        }
    }
}

/// A transaction boundary: where a resumed stream would start, and when that transaction committed.
#[derive(Debug, Clone, PartialEq)]
pub struct Boundary {
    pub position: Position,
    /// Commit time from the log; `None` for a heartbeat (the source is caught up).
    pub committed_at: Option<std::time::SystemTime>,
}

/// Counters of row events on outbox tables that were seen but deliberately not forwarded.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Ignored {
    pub updates: u64,
    pub deletes: u64,
}

/// What a source may confirm to its server (a Postgres slot's `confirmed_flush_lsn`): the newest
/// position the checkpoint holds durably. The checkpoint owns it; a source only asks, without
/// waiting, so nothing newer than what is on disk is ever confirmed. It also says whether the
/// checkpoint store fenced every earlier instance of the pipeline before this session (the Kafka
/// store's lease): then a connection still holding the source's slot is a fenced instance's.
#[derive(Clone)]
pub struct Durable {
    rx: watch::Receiver<Option<Position>>,
    lead: Option<watch::Receiver<bool>>,
}

impl Durable {
    pub(crate) fn new(
        rx: watch::Receiver<Option<Position>>,
        lead: Option<watch::Receiver<bool>>,
    ) -> Self {
        Durable { rx, lead }
    }

    /// The durable position, if it moved since the last call.
    pub fn newer(&mut self) -> Option<Position> {
        match self.rx.has_changed() {
            Ok(true) => self.rx.borrow_and_update().clone(),
            _ => None,
        }
    }

    /// Whether every earlier instance of the pipeline was fenced when this one took the lead, and
    /// this one still holds it (asked right before acting on it: a leader that lost the lead and
    /// has not noticed yet must not end the new leader's connection).
    pub fn fenced_earlier(&self) -> bool {
        self.lead.as_ref().is_some_and(|held| *held.borrow())
    }
}

/// Which server a position belongs to; stored beside it so a checkpoint is never applied to the wrong
/// server silently.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SourceIdentity {
    pub kind: SourceKind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_id: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_uuid: Option<String>,
    /// Postgres: the cluster's system identifier (from IDENTIFY_SYSTEM).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_identifier: Option<String>,
    /// Postgres: the replication slot the position belongs to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slot: Option<String>,
    /// Postgres: the timeline the server was on (a promotion starts a new one), from IDENTIFY_SYSTEM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeline: Option<u32>,
}

impl SourceIdentity {
    /// An identity naming no server: a position typed by hand, valid wherever it is used.
    pub fn anonymous(kind: SourceKind) -> Self {
        SourceIdentity {
            kind,
            server_id: None,
            server_uuid: None,
            system_identifier: None,
            slot: None,
            timeline: None,
        }
    }
}

/// Binlog files belong to no running server.
static FILES_IDENTITY: SourceIdentity = SourceIdentity {
    kind: SourceKind::Mysql,
    server_id: None,
    server_uuid: None,
    system_identifier: None,
    slot: None,
    timeline: None,
};

/// A connected source of either kind. Adding a database means one module and one arm here.
pub enum Source {
    Mysql(mysql::MysqlSource),
    Postgres(postgres::PostgresSource),
    BinlogFiles(mysql::BinlogFileSource),
    /// The outbox tables' rows, then (on a first start) the log.
    Snapshot(Box<snapshot::SnapshotSource>),
}

impl Source {
    /// Opens a session after `resume` (or at the source's start point, after a snapshot when `plan`
    /// asks for one). `durable` tells the newest position written to the local checkpoint, for
    /// sources that confirm progress to the server. `pipeline` names the pipeline (MySQL derives its
    /// replica server id from it).
    pub async fn connect(
        source: &SourceConfig,
        plan: &snapshot::Plan,
        pipeline: &str,
        resume: Option<(&SourceIdentity, &Position)>,
        metrics: Arc<Metrics>,
        durable: Durable,
    ) -> Result<Source> {
        if let Some(snapshot) = snapshot::SnapshotSource::open(
            source,
            plan,
            pipeline,
            resume,
            metrics.clone(),
            durable.clone(),
        )
        .await?
        {
            return Ok(Source::Snapshot(Box::new(snapshot)));
        }
        Source::connect_stream(source, pipeline, resume, metrics, durable).await
    }

    /// Opens the log stream after `resume` (a log position), or at the server's end.
    pub async fn connect_stream(
        source: &SourceConfig,
        pipeline: &str,
        resume: Option<(&SourceIdentity, &Position)>,
        metrics: Arc<Metrics>,
        durable: Durable,
    ) -> Result<Source> {
        Ok(match &source.db {
            SourceDb::Mysql(own) => Source::Mysql(
                mysql::MysqlSource::connect(source, own, pipeline, resume, metrics).await?,
            ),
            SourceDb::Postgres(own) => Source::Postgres(
                postgres::PostgresSource::connect(source, own, resume, metrics, durable).await?,
            ),
        })
    }

    pub async fn next(&mut self) -> Result<Change> {
        loop {
            return match self {
                Source::Mysql(s) => s.next().await,
                Source::Postgres(s) => s.next().await,
                Source::BinlogFiles(s) => s.next_change(),
                Source::Snapshot(s) => match s.next().await? {
                    snapshot::Next::Change(change) => Ok(change),
                    snapshot::Next::Stream(stream) => {
                        *self = *stream;
                        continue;
                    }
                },
            };
        }
    }

    /// Whether the rows' commit times are finer than a second, so that commit → read can be timed
    /// (`outboxd_source_delay_seconds`): Postgres gives microseconds. MariaDB's binlog gives whole
    /// seconds (MySQL 8's GTID events carry microseconds, not timed yet), and a replay of files is
    /// as late as the files are old.
    pub fn commit_times_precise(&self) -> bool {
        !matches!(self, Source::BinlogFiles(_)) && self.identity().kind == SourceKind::Postgres
    }

    pub fn identity(&self) -> &SourceIdentity {
        match self {
            Source::Mysql(s) => s.identity(),
            Source::Postgres(s) => s.identity(),
            Source::BinlogFiles(_) => &FILES_IDENTITY,
            Source::Snapshot(s) => s.identity(),
        }
    }

    /// The position the session started at.
    pub fn start(&self) -> Position {
        match self {
            Source::Mysql(s) => s.start(),
            Source::Postgres(s) => s.start(),
            Source::BinlogFiles(s) => s.start(),
            Source::Snapshot(s) => s.start(),
        }
    }

    pub fn ignored(&self) -> Ignored {
        match self {
            Source::Mysql(s) => s.ignored(),
            Source::Postgres(s) => s.ignored(),
            Source::BinlogFiles(s) => s.ignored(),
            Source::Snapshot(s) => s.ignored(),
        }
    }
}

/// Parses a position typed by a user, in the notation of `kind`.
pub fn parse_position(kind: SourceKind, text: &str) -> Result<Position> {
    match kind {
        SourceKind::Mysql => mysql::parse_position(text),
        SourceKind::Postgres => postgres::parse_position(text),
    }
}

/// The source's current end (where a stream without a checkpoint would start).
pub async fn current_end_position(source: &SourceConfig) -> Result<Position> {
    match &source.db {
        SourceDb::Mysql(_) => mysql::current_end_position(source).await,
        SourceDb::Postgres(_) => postgres::current_end_position(source).await,
    }
}
