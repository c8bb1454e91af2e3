//! The initial snapshot: rows already in the outbox tables, sent before the log is streamed.
//!
//! A log-tailing relay starts at the log's end, so rows a polling relay left unsent would be lost at
//! the switch. A snapshot reads them from the tables in primary-key order, in chunks of
//! `source.snapshot_chunk` rows (the table is never held whole), and hands them to the pipeline as
//! ordinary [`Change`]s: each chunk is one "transaction" whose boundary is a
//! [`Position::Snapshot`] (table, last key, rows so far, and the log position streaming starts at).
//! The checkpoint stores that position like any other, so a crash resumes after the last
//! acknowledged chunk instead of from the first row. When the last table is read, the boundary is
//! the log position itself, and the same source goes on streaming from there.
//!
//! ## Why nothing is lost or skipped between the two
//! The stream start and the read are taken together (`begin` in each database's module): MariaDB's
//! consistent snapshot names its own binlog position; MySQL pairs them under a short `LOCK TABLES
//! … READ` on the outbox tables (no outbox writer is mid-commit while the position is read); Postgres
//! reads in the snapshot the new replication slot exports. Every transaction committed before the
//! stream start is then in the read, every later one is in the stream, none is in both.
//!
//! A snapshot resumed after a crash reads with a new view (the old one died with the connection),
//! which also shows rows committed after the stream start: those rows (with keys after the resume
//! point) arrive twice, once from each side, with the same `id`. So does a Postgres slot that
//! existed before the snapshot (its position is older than the read). Nothing is ever missing.

use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine;
use serde::{Deserialize, Serialize};

use super::config::{SourceConfig, SourceDb};
use super::{Boundary, Change, Durable, Ignored, Position, Row, Source, SourceIdentity};
use crate::error::{Error, Result};
use crate::metrics::Metrics;

/// How often a running snapshot says how far it got.
const PROGRESS_EVERY: Duration = Duration::from_secs(10);
/// The longest one chunk read may take before the server counts as gone (a predicate without an
/// index may scan far for one chunk; a silent server must still not hang the pipeline).
const CHUNK_READ_LIMIT: Duration = Duration::from_secs(300);

/// A place in a snapshot, as the checkpoint stores it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotPosition {
    /// The table being read (`schema.table`); the tables before it in `source.tables` are done.
    pub table: String,
    /// The primary key of the last row sent from `table`; `None` before its first row.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<Vec<KeyValue>>,
    /// Rows the snapshot has sent so far, all tables.
    pub rows: u64,
    /// The predicate choosing the rows (`snapshot_where`), kept so a resumed snapshot reads the same.
    #[serde(default, rename = "where", skip_serializing_if = "Option::is_none")]
    pub predicate: Option<String>,
    /// Where the log is streamed from once the snapshot is done.
    pub then: Position,
}

impl fmt::Display for SnapshotPosition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "snapshot of {}", self.table)?;
        if let Some(key) = &self.after {
            let shown: Vec<String> = key.iter().map(KeyValue::to_string).collect();
            write!(f, " after key ({})", shown.join(", "))?;
        }
        write!(
            f,
            ", {} rows sent, then streaming from {}",
            self.rows, self.then
        )
    }
}

/// One primary-key column's value, in a form the database compares exactly.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum KeyValue {
    Int(i64),
    UInt(u64),
    Text(String),
    Bytes { base64: String },
}

impl KeyValue {
    pub fn bytes(bytes: &[u8]) -> KeyValue {
        KeyValue::Bytes {
            base64: base64::engine::general_purpose::STANDARD.encode(bytes),
        }
    }

    /// The value's bytes (text as UTF-8, numbers as their decimal text).
    pub fn to_bytes(&self) -> Vec<u8> {
        match self {
            KeyValue::Int(v) => v.to_string().into_bytes(),
            KeyValue::UInt(v) => v.to_string().into_bytes(),
            KeyValue::Text(s) => s.clone().into_bytes(),
            KeyValue::Bytes { base64 } => base64::engine::general_purpose::STANDARD
                .decode(base64)
                .unwrap_or_default(),
        }
    }
}

impl fmt::Display for KeyValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyValue::Int(v) => v.fmt(f),
            KeyValue::UInt(v) => v.fmt(f),
            KeyValue::Text(s) => write!(f, "{s:?}"),
            KeyValue::Bytes { base64 } => write!(f, "base64:{base64}"),
        }
    }
}

/// A row read by a snapshot, with its primary key.
pub struct KeyedRow {
    pub row: Row,
    pub key: Vec<KeyValue>,
}

impl KeyedRow {
    /// A row of `table` (columns `names`) read by a snapshot. Its origin (the `outboxd.position`
    /// header) is `snapshot:<table>:<primary key>`: a snapshot has no log position, and the key
    /// names the row the same way on every resend (a dead letter is told apart by it).
    pub fn new(
        table: &Arc<str>,
        names: &Arc<[Arc<str>]>,
        values: Vec<super::Value>,
        key: Vec<KeyValue>,
    ) -> KeyedRow {
        KeyedRow {
            row: Row {
                table: table.clone(),
                names: names.clone(),
                values,
                origin: Arc::from(format!("{SNAPSHOT_ORIGIN}{table}:{}", key_text(&key))),
                committed_ms: None,
            },
            key,
        }
    }
}

/// What every snapshot row's origin starts with.
const SNAPSHOT_ORIGIN: &str = "snapshot:";

/// Whether `origin` is a snapshot row's (it names the row itself, by its primary key).
pub fn is_snapshot_origin(origin: &str) -> bool {
    origin.starts_with(SNAPSHOT_ORIGIN)
}

/// Longer key texts are hashed: the origin rides in a header of every snapshot record.
const MAX_KEY_TEXT: usize = 200;

/// A primary key as text: its columns' values, comma-separated, or `sha256:<hex>` of that text
/// when it is longer than [`MAX_KEY_TEXT`].
fn key_text(key: &[KeyValue]) -> String {
    let text = key
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",");
    if text.len() <= MAX_KEY_TEXT {
        return text;
    }
    let digest = openssl::sha::sha256(text.as_bytes());
    let mut hashed = String::with_capacity(7 + 64);
    hashed.push_str("sha256:");
    for byte in digest {
        hashed.push_str(&format!("{byte:02x}"));
    }
    hashed
}

/// A resumed snapshot's key must have as many columns as the table's primary key has now.
pub fn check_key_width(table: &str, after: Option<&[KeyValue]>, keys: usize) -> Result<()> {
    match after {
        Some(key) if key.len() != keys => Err(Error::checkpoint(format!(
            "the checkpoint's snapshot key has {} columns, but {table}'s primary key has {keys}",
            key.len()
        ))
        .remedy("the table's primary key changed during the snapshot: start it again (`outboxd checkpoint reset`; for `outboxd snapshot`, delete NAME.snapshot.json in checkpoint.dir)")),
        _ => Ok(()),
    }
}

/// A database's snapshot reader: key-ordered chunks of one table.
pub enum TableReader {
    Mysql(super::mysql::snapshot::Reader),
    Postgres(super::postgres::snapshot::Reader),
}

impl TableReader {
    pub(crate) async fn chunk(
        &mut self,
        table: &str,
        after: Option<&[KeyValue]>,
        predicate: Option<&str>,
        limit: usize,
    ) -> Result<Vec<KeyedRow>> {
        match self {
            TableReader::Mysql(r) => r.chunk(table, after, predicate, limit).await,
            TableReader::Postgres(r) => r.chunk(table, after, predicate, limit).await,
        }
    }

    pub(crate) async fn close(self) {
        match self {
            TableReader::Mysql(r) => r.close().await,
            TableReader::Postgres(r) => r.close().await,
        }
    }
}

/// What a database's `begin` returns: the reader, and for a fresh snapshot the server's identity
/// and the log position streaming starts at.
pub struct Begun {
    pub reader: TableReader,
    pub identity: SourceIdentity,
    pub then: Position,
}

/// When a session runs a snapshot.
#[derive(Debug, Clone)]
pub enum Plan {
    /// `run`: on a first start as `source.snapshot` says, and to finish one a checkpoint holds.
    FirstStart,
    /// `outboxd snapshot`: send the tables' rows (those matching `predicate`) once, then stop.
    OnDemand { predicate: Option<String> },
}

/// What follows the last table.
enum Then {
    /// Stream the log from the snapshot's `then` (a first start).
    Stream(Box<StreamSetup>),
    /// The input is exhausted (`outboxd snapshot`).
    Stop,
}

/// What opening the stream needs.
struct StreamSetup {
    config: SourceConfig,
    pipeline: String,
    metrics: Arc<Metrics>,
    durable: Durable,
}

/// A source that reads the outbox tables, then (on a first start) streams the log.
pub struct SnapshotSource {
    reader: Option<TableReader>,
    tables: Vec<String>,
    index: usize,
    at: SnapshotPosition,
    chunk: usize,
    buffer: VecDeque<Change>,
    then: Option<Then>,
    /// The boundary at the stream start was handed out.
    finished: bool,
    identity: SourceIdentity,
    start: Position,
    metrics: Arc<Metrics>,
    began: Instant,
    rows_at_begin: u64,
    last_report: Instant,
    connect_timeout: Duration,
}

impl SnapshotSource {
    /// Opens a snapshot: a fresh one (`resume` is not a snapshot place) or the continuation of the
    /// one the checkpoint holds. `None` when there is nothing to snapshot (a checkpoint of a log
    /// position on a first start, or `source.snapshot = never`).
    pub async fn open(
        config: &SourceConfig,
        plan: &Plan,
        pipeline: &str,
        resume: Option<(&SourceIdentity, &Position)>,
        metrics: Arc<Metrics>,
        durable: Durable,
    ) -> Result<Option<SnapshotSource>> {
        let then = |config: &SourceConfig, metrics: &Arc<Metrics>, durable: Durable| match plan {
            Plan::FirstStart => Then::Stream(Box::new(StreamSetup {
                config: config.clone(),
                pipeline: pipeline.to_string(),
                metrics: metrics.clone(),
                durable,
            })),
            Plan::OnDemand { .. } => Then::Stop,
        };
        let (reader, identity, at) = match (resume, plan) {
            // `outboxd snapshot --where` with another predicate than the interrupted one: a new run.
            (Some((_, Position::Snapshot(at))), Plan::OnDemand { predicate })
                if at.predicate != *predicate =>
            {
                tracing::info!(previous = %at, "the interrupted on-demand snapshot chose other rows: starting a new one");
                Self::fresh(config, plan).await?
            }
            (Some((identity, Position::Snapshot(at))), _) => {
                let at = (**at).clone();
                if !config.tables.contains(&at.table) {
                    return Err(Error::checkpoint(format!(
                        "the checkpoint holds a snapshot of {}, which is not in source.tables",
                        at.table
                    ))
                    .remedy("add the table back to source.tables to finish the snapshot (for `outboxd snapshot`, or delete NAME.snapshot.json in checkpoint.dir to start anew)"));
                }
                let begun = begin(config, false).await?;
                tracing::info!(position = %at, "resuming the snapshot");
                (begun.reader, identity.clone(), at)
            }
            (Some(_), Plan::FirstStart) => return Ok(None),
            (None, Plan::FirstStart) if config.snapshot == super::config::SnapshotMode::Never => {
                return Ok(None)
            }
            (_, plan) => Self::fresh(config, plan).await?,
        };
        let index = config
            .tables
            .iter()
            .position(|t| *t == at.table)
            .unwrap_or(0);
        let start = Position::Snapshot(Arc::new(at.clone()));
        let connect_timeout =
            Duration::from_millis(config.heartbeat_interval_ms * 3).max(Duration::from_secs(10));
        Ok(Some(SnapshotSource {
            reader: Some(reader),
            tables: config.tables.clone(),
            index,
            rows_at_begin: at.rows,
            at,
            chunk: config.snapshot_chunk,
            buffer: VecDeque::new(),
            then: Some(then(config, &metrics, durable)),
            finished: false,
            identity,
            start,
            metrics,
            began: Instant::now(),
            last_report: Instant::now(),
            connect_timeout,
        }))
    }

    /// A new snapshot: its reader, the identity its checkpoint names and its first place.
    async fn fresh(
        config: &SourceConfig,
        plan: &Plan,
    ) -> Result<(TableReader, SourceIdentity, SnapshotPosition)> {
        let (on_demand, predicate) = match plan {
            Plan::OnDemand { predicate } => (true, predicate.clone()),
            Plan::FirstStart => (false, config.snapshot_where.clone()),
        };
        let begun = begin(config, !on_demand).await?;
        let at = SnapshotPosition {
            table: config.tables[0].clone(),
            after: None,
            rows: 0,
            predicate,
            then: begun.then,
        };
        tracing::info!(
            tables = ?config.tables,
            then = %at.then,
            predicate = at.predicate.as_deref().unwrap_or("(all rows)"),
            "snapshot started: sending the rows already in the outbox tables"
        );
        // An on-demand snapshot's checkpoint is its own and never streams: it names no server.
        let identity = if on_demand {
            SourceIdentity::anonymous(config.kind())
        } else {
            begun.identity
        };
        Ok((begun.reader, identity, at))
    }

    pub fn identity(&self) -> &SourceIdentity {
        &self.identity
    }

    pub fn start(&self) -> Position {
        self.start.clone()
    }

    pub fn ignored(&self) -> Ignored {
        Ignored::default()
    }

    /// The next change, or (once the boundary at the stream start was handed out) the log stream
    /// that takes this source's place.
    pub async fn next(&mut self) -> Result<Next> {
        loop {
            if let Some(change) = self.buffer.pop_front() {
                return Ok(Next::Change(change));
            }
            if self.index < self.tables.len() {
                self.read_chunk().await?;
                continue;
            }
            if !self.finished {
                // Every table is read: the boundary at the stream start comes first (checkpointed
                // once every snapshot row is acknowledged), then the stream or the end.
                self.finished = true;
                if let Some(reader) = self.reader.take() {
                    reader.close().await;
                }
                tracing::info!(
                    rows = self.at.rows,
                    this_run = self.at.rows - self.rows_at_begin,
                    seconds = self.began.elapsed().as_secs(),
                    then = %self.at.then,
                    "snapshot read every table"
                );
                return Ok(Next::Change(Change::Idle(Boundary {
                    position: self.at.then.clone(),
                    committed_at: None,
                })));
            }
            return match self.then.take() {
                Some(Then::Stream(setup)) => {
                    let StreamSetup {
                        config,
                        pipeline,
                        metrics,
                        durable,
                    } = *setup;
                    let resume = (self.identity.clone(), self.at.then.clone());
                    open_stream(
                        config,
                        pipeline,
                        resume,
                        metrics,
                        durable,
                        self.connect_timeout,
                    )
                    .await
                    .map(|source| Next::Stream(Box::new(source)))
                }
                Some(Then::Stop) | None => Ok(Next::Change(Change::Exhausted)),
            };
        }
    }

    /// Reads the next chunk of the current table, or moves to the next table.
    async fn read_chunk(&mut self) -> Result<()> {
        let reader = self
            .reader
            .as_mut()
            .ok_or_else(|| Error::source("the snapshot reader is closed").transient())?;
        let table = self.tables[self.index].clone();
        let read = reader.chunk(
            &table,
            self.at.after.as_deref(),
            self.at.predicate.as_deref(),
            self.chunk,
        );
        let rows = tokio::time::timeout(CHUNK_READ_LIMIT, read)
            .await
            .map_err(|_| {
                Error::source(format!(
                    "the server did not answer a snapshot read of {table} within {CHUNK_READ_LIMIT:?}"
                ))
                .remedy("outboxd reconnects and resumes the snapshot from its checkpoint; if the server is healthy, index the snapshot_where columns or lower source.snapshot_chunk")
                .transient()
            })??;
        if rows.is_empty() {
            tracing::info!(table = %table, rows = self.at.rows, "snapshot finished a table");
            self.index += 1;
            if let Some(next) = self.tables.get(self.index) {
                self.at.table = next.clone();
                self.at.after = None;
            }
            return Ok(());
        }
        // Keys only grow: a chunk that ends where the last one did would be read forever (a
        // predicate that escapes its parentheses, a key the database orders differently).
        if rows.last().map(|r| &r.key) == self.at.after.as_ref() {
            return Err(Error::config(format!(
                "the snapshot of {table} made no progress: a chunk ended at the key it started after"
            ))
            .remedy("check source.snapshot_where (or --where): it must be one condition, ANDed with outboxd's key range"));
        }
        let count = rows.len() as u64;
        let mut last = None;
        for KeyedRow { row, key } in rows {
            self.buffer.push_back(Change::Row(row));
            last = Some(key);
        }
        self.at.after = last;
        self.at.rows += count;
        self.metrics.snapshot_rows(count);
        self.buffer.push_back(Change::Commit(Boundary {
            position: Position::Snapshot(Arc::new(self.at.clone())),
            committed_at: None,
        }));
        if self.last_report.elapsed() >= PROGRESS_EVERY {
            self.last_report = Instant::now();
            let run = self.at.rows - self.rows_at_begin;
            let rate = run as f64 / self.began.elapsed().as_secs_f64().max(0.001);
            tracing::info!(
                table = %table,
                rows = self.at.rows,
                rows_per_second = rate as u64,
                "snapshot in progress"
            );
        }
        Ok(())
    }
}

/// What [`SnapshotSource::next`] gives.
pub enum Next {
    Change(Change),
    /// The snapshot is done and checkpointed up to here: this stream replaces it.
    Stream(Box<Source>),
}

/// The log stream from the snapshot's stream start (`resume`).
async fn open_stream(
    config: SourceConfig,
    pipeline: String,
    resume: (SourceIdentity, Position),
    metrics: Arc<Metrics>,
    durable: Durable,
    limit: Duration,
) -> Result<Source> {
    let connect = Box::pin(Source::connect_stream(
        &config,
        &pipeline,
        Some((&resume.0, &resume.1)),
        metrics,
        durable,
    ));
    let source = tokio::time::timeout(limit, connect).await.map_err(|_| {
        Error::source(format!(
            "opening the log stream after the snapshot took longer than {limit:?}"
        ))
        .remedy("outboxd retries from the checkpoint; check that the server is up and answering")
        .transient()
    })??;
    tracing::info!(position = %resume.1, "snapshot done: streaming the log");
    Ok(source)
}

/// Opens the database's snapshot reader; `exact` pairs the read with the stream start (a first
/// start), otherwise the read is any fresh view and `then` the log's current end.
pub(crate) async fn begin(config: &SourceConfig, exact: bool) -> Result<Begun> {
    match &config.db {
        SourceDb::Mysql(_) => super::mysql::snapshot::begin(config, exact).await,
        SourceDb::Postgres(own) => super::postgres::snapshot::begin(config, own, exact).await,
    }
}
