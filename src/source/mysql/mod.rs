//! MySQL/MariaDB source: reads the binlog as a replica and yields outbox changes.
//!
//! ## Resumption
//! A session starts from the durable checkpoint. On MariaDB the checkpoint's GTID state is used
//! (`@slave_connect_state`), which names the last transaction applied per domain and so also works on
//! another server of the same topology; elsewhere the exact `FILE:POS` of the server that wrote it is
//! used. Checkpoints are only ever taken at transaction boundaries (see [`decoder`]), so a resumed stream
//! starts with a whole transaction. Without a checkpoint the stream starts at the server's current end
//! (`SHOW MASTER STATUS`), and says so.
//!
//! ## Liveness
//! The server is asked for heartbeats (`@master_heartbeat_period`). A stream that yields neither an
//! event nor a heartbeat for three periods is asked about on the control connection
//! (`MysqlSource::on_silence`, at most max(3 periods, 10 s)): unless the server shows its dump
//! thread still working for us (then up to 10 min of silence), or idle with what it sent perhaps
//! still crossing a slow link (then up to 30 periods), the stream is treated as dead even if its
//! socket looks alive, and the session ends with a transient error so the pipeline reconnects
//! from the checkpoint. A cut path is so noticed after 3 periods plus the probe's timeout. Before a new dump, the previous one of
//! this process on the same server is ended (`previous_dump`).

mod binlog_file;
mod cert_probe;
mod columns;
mod connect;
mod decoder;
mod event_types;
mod json_text;
mod position;
mod preflight;
mod previous_dump;
pub mod prune;
mod replica;
mod row_image;
pub mod snapshot;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use mysql_async::prelude::Queryable;
use mysql_async::{BinlogStream, BinlogStreamRequest, Conn};

pub use self::binlog_file::BinlogFileSource;
pub use self::columns::SchemaColumn;
use self::columns::TableColumns;
use self::connect::{map_err, open};
pub use self::decoder::{Decoder, Step};
pub use self::position::{BinlogPosition, MariaGtidState, MysqlGtidSet};
pub use self::preflight::preflight;
use self::replica::Stall;
use crate::error::{Error, Kind, Result};
use crate::metrics::Metrics;
use crate::source::config::{redact_url, MysqlOptions, SourceConfig, SourceKind};
use crate::source::{Change, Ignored, Position, SourceIdentity};

/// `ER_MASTER_FATAL_ERROR_READING_BINLOG`: the requested position is not (or no longer) on the server.
const ER_BINLOG_GONE: u16 = 1236;

/// Parses a position typed by a user: `FILE:POS`, `gtid:DOMAIN-SERVER-SEQ[,…]` (MariaDB) or
/// `gtid:UUID:1-100[,…]` (MySQL's executed set: the transactions already delivered).
pub fn parse_position(text: &str) -> Result<Position> {
    let text = text.trim();
    let bad = || {
        Error::config(format!("{text:?} is not a binlog position")).remedy(
            "write FILE:POS (e.g. mysql-bin.000003:1234), gtid:0-1-42 (MariaDB) or gtid:UUID:1-42 (MySQL)",
        )
    };
    let position = if let Some(gtid) = text.strip_prefix("gtid:") {
        let as_config = |e: Error| {
            let fix = e.remedy_text().unwrap_or_default().to_string();
            Error::config(e.message().to_string()).remedy(fix)
        };
        let (gtid, mysql_gtids) = if gtid.contains(':') {
            let set = MysqlGtidSet::parse(gtid).map_err(as_config)?;
            (None, (!set.is_empty()).then_some(set))
        } else {
            let state = MariaGtidState::parse(gtid).map_err(as_config)?;
            ((!state.is_empty()).then_some(state), None)
        };
        if gtid.is_none() && mysql_gtids.is_none() {
            return Err(bad());
        }
        BinlogPosition {
            file: String::new(),
            pos: 4,
            gtid,
            mysql_gtids,
        }
    } else {
        let (file, pos) = text.rsplit_once(':').ok_or_else(bad)?;
        let pos: u64 = pos.parse().map_err(|_| bad())?;
        if file.is_empty() || pos < 4 {
            return Err(bad());
        }
        BinlogPosition {
            file: file.to_string(),
            pos,
            gtid: None,
            mysql_gtids: None,
        }
    };
    Ok(position.to_position())
}

/// The server's current end, where a stream without a checkpoint starts.
pub async fn current_end_position(config: &SourceConfig) -> Result<Position> {
    let mut conn = open(config).await?;
    let info = ServerInfo::read(&mut conn)
        .await
        .map_err(|e| map_err(e, config))?;
    let end = current_end(&mut conn, &info)
        .await
        .map_err(|e| map_err(e, config))?;
    let _ = conn.disconnect().await;
    Ok(end.to_position())
}

/// How long a stream may stay silent while the server says it is still sending to it.
const MAX_BUSY_SILENCE: Duration = Duration::from_secs(600);

/// How many read timeouts a stream may stay silent after the server handed everything to the
/// network (what it sent may still be crossing a slow link).
const SENT_ALL_PERIODS: u32 = 10;

/// How long a query on the control connection may take: the read timeout, but at least 30 s, so
/// that short heartbeats over a slow or lossy link do not end a working session (a column lookup
/// timed out there on every reconnect in the slow-link test).
fn control_timeout(read_timeout: Duration) -> Duration {
    read_timeout.max(Duration::from_secs(30))
}

/// A live binlog session.
pub struct MysqlSource {
    stream: BinlogStream,
    control: Conn,
    decoder: Decoder,
    buffer: VecDeque<Change>,
    read_timeout: Duration,
    /// The connection id of the binlog dump (the server's thread for our stream).
    dump_connection: u32,
    /// Read timeouts waited on a silent stream whose dump thread was alive (for the log's rate).
    silent_waits: u64,
    identity: SourceIdentity,
    start: BinlogPosition,
    metrics: Arc<Metrics>,
    /// Whether the checkpoint came from this very server (or names none). Then a server "behind" it
    /// lost a binlog tail it had written (a crash with `sync_binlog=0`), which waiting cannot cure.
    own_checkpoint: bool,
    /// The replication status of a replica whose status is readable, read once per period.
    stall: Option<Stall>,
    /// The server, for messages (redacted).
    server: String,
}

impl MysqlSource {
    /// Connects, checks the server's binlog settings, and opens the stream after `resume` (the
    /// checkpoint's identity and position), or at the server's current end.
    pub async fn connect(
        config: &SourceConfig,
        own: &MysqlOptions,
        pipeline: &str,
        resume: Option<(&SourceIdentity, &Position)>,
        metrics: Arc<Metrics>,
    ) -> Result<MysqlSource> {
        Self::open_stream(config, own, pipeline, resume, metrics)
            .await
            .map_err(as_refusal)
    }

    async fn open_stream(
        config: &SourceConfig,
        own: &MysqlOptions,
        pipeline: &str,
        resume: Option<(&SourceIdentity, &Position)>,
        metrics: Arc<Metrics>,
    ) -> Result<MysqlSource> {
        let mut control = open(config).await?;
        let server = ServerInfo::read(&mut control)
            .await
            .map_err(|e| map_err(e, config))?;
        let watched = require_serves(&mut control, &server, config).await?;
        let identity = server.identity();
        // "Behind its own checkpoint" is told from "a replica lagging behind another server" by the
        // identity in the checkpoint. A FILE:POS position always belongs to this server (see
        // `check_identity`); a GTID position only when the checkpoint names this server (one set
        // by hand names none, and may be read on any host).
        let gtid_resume =
            resume.is_some_and(|(_, p)| p.binlog().is_ok_and(|b| server.resumes_by_gtid(b)));
        let own_checkpoint = !gtid_resume
            || resume.is_some_and(|(stored, _)| {
                stored.server_id.is_some()
                    && stored.server_id == identity.server_id
                    && (stored.server_uuid.is_none() || stored.server_uuid == identity.server_uuid)
            });
        let start = match resume {
            Some((stored, position)) => {
                let start = position.binlog()?.clone();
                check_identity(stored, &identity, &start, &server)?;
                if server.resumes_by_gtid(&start) {
                    check_mysql_set(&mut control, &start, stored.server_id.is_none(), config)
                        .await?;
                }
                start
            }
            None => {
                let end = current_end(&mut control, &server)
                    .await
                    .map_err(|e| map_err(e, config))?;
                tracing::warn!(
                    position = %end,
                    "no checkpoint: starting at the server's current end (rows committed before now are not forwarded; use `outboxd replay` for those)"
                );
                end
            }
        };
        if start.file.is_empty() && !server.resumes_by_gtid(&start) {
            let wanted = if start.gtid.is_some() {
                "MariaDB server (a domain-server-seq GTID)"
            } else {
                "MySQL server with gtid_mode = ON (a uuid:N GTID set)"
            };
            return Err(Error::checkpoint(format!(
                "position {start} needs a {wanted}; this is {}",
                server.version
            ))
            .remedy(
                "use a FILE:POS position on this server, or a GTID in this server's notation",
            ));
        }
        let heartbeat = Duration::from_millis(config.heartbeat_interval_ms);
        let mut replica = open(config).await?;
        let use_gtid = server.resumes_by_gtid(&start);
        let setup = async {
            replica
                .query_drop(format!(
                    "SET @master_heartbeat_period = {}",
                    heartbeat.as_nanos()
                ))
                .await?;
            if server.is_mariadb {
                replica
                    .query_drop("SET @mariadb_slave_capability = 4")
                    .await?;
            }
            if use_gtid && server.is_mariadb {
                let state = start
                    .gtid
                    .as_ref()
                    .map(|g| g.to_string())
                    .unwrap_or_default();
                replica
                    .exec_drop("SET @slave_connect_state = ?", (state,))
                    .await?;
                replica
                    .query_drop("SET @slave_gtid_strict_mode = 0")
                    .await?;
                replica
                    .query_drop("SET @slave_gtid_ignore_duplicates = 0")
                    .await?;
            }
            Ok::<_, mysql_async::Error>(())
        };
        setup.await.map_err(|e| map_err(e, config))?;
        let server_id = own.server_id(pipeline);
        // MySQL: COM_BINLOG_DUMP_GTID with the executed set; the server sends every transaction
        // not in it, from whichever file holds the first (the file and offset are its own).
        let mysql_sids = match &start.mysql_gtids {
            Some(set) if use_gtid && !server.is_mariadb => set.sids()?,
            _ => Vec::new(),
        };
        let request = if use_gtid && !server.is_mariadb {
            BinlogStreamRequest::new(server_id)
                .with_gtid()
                .with_gtid_set(mysql_sids)
                .with_filename(b"")
                .with_pos(4u64)
        } else if use_gtid {
            BinlogStreamRequest::new(server_id)
                .with_filename(b"")
                .with_pos(4u64)
        } else {
            BinlogStreamRequest::new(server_id)
                .with_filename(start.file.as_bytes())
                .with_pos(start.pos)
        };
        // The server holds a new dump back while the last one on this connection's replica id
        // still blocks on a lost connection (see `previous_dump`).
        let dump_key = format!(
            "{}#{:?}#{:?}",
            config.url, identity.server_id, identity.server_uuid
        );
        previous_dump::end(&mut control, &dump_key, control_timeout(heartbeat * 3)).await;
        let dump_connection = replica.id();
        let dump_host = previous_dump::own_host(&mut replica, control_timeout(heartbeat * 3)).await;
        let stream = replica
            .get_binlog_stream(request)
            .await
            .map_err(|e| map_err(e, config))?;
        if let Some(host) = dump_host {
            previous_dump::remember(&dump_key, dump_connection, host);
        }
        tracing::info!(
            server = %redact_url(&config.url),
            server_id = server.server_id,
            version = %server.version,
            position = %start,
            by = if use_gtid { "gtid" } else { "file:pos" },
            "binlog stream opened"
        );
        Ok(MysqlSource {
            stream,
            control,
            decoder: Decoder::new(start.clone(), config.tables.iter().cloned()),
            buffer: VecDeque::new(),
            read_timeout: heartbeat * 3,
            dump_connection,
            silent_waits: 0,
            identity,
            start,
            metrics,
            own_checkpoint,
            stall: watched.then(|| Stall::new(heartbeat)),
            server: redact_url(&config.url),
        })
    }

    pub fn identity(&self) -> &SourceIdentity {
        &self.identity
    }

    /// The position the stream was opened at.
    pub fn start(&self) -> Position {
        self.start.to_position()
    }

    pub fn ignored(&self) -> Ignored {
        self.decoder.ignored()
    }

    /// The next change, in commit order.
    pub async fn next(&mut self) -> Result<Change> {
        loop {
            if let Some(change) = self.buffer.pop_front() {
                return Ok(change);
            }
            // The events of a compressed transaction payload come from memory, not the socket, so
            // nothing else would make this loop give the worker back: a large transaction on other
            // tables would hold every task (HTTP, signals, lease renewal) until its end.
            tokio::task::coop::consume_budget().await;
            if let Some(stall) = &mut self.stall {
                let limit = control_timeout(self.read_timeout);
                stall.probe(&mut self.control, &self.server, limit).await?;
            }
            let silent_since = tokio::time::Instant::now();
            let next = loop {
                match tokio::time::timeout(self.read_timeout, self.stream.next()).await {
                    Err(_) => self.on_silence(silent_since.elapsed()).await?,
                    Ok(next) => break next,
                }
            };
            let event = match next {
                None => {
                    return Err(Error::source("the server closed the binlog stream")
                        .remedy("outboxd reconnects by itself")
                        .transient())
                }
                Some(Err(e)) => {
                    return Err(map_stream_err(
                        e,
                        self.decoder.boundary(),
                        self.own_checkpoint,
                    ))
                }
                Some(Ok(event)) => event,
            };
            self.metrics.source_event();
            if event.header().event_type_raw() != event_types::HEARTBEAT {
                if let Some(stall) = &mut self.stall {
                    stall.event();
                }
            }
            crate::fault::panic_point(crate::fault::LIVE_DECODE);
            match self.decoder.on_event(&event, &mut self.buffer)? {
                Step::Continue => {}
                Step::NeedColumns {
                    table_id,
                    table,
                    tme,
                } => {
                    let columns = self.resolve_columns(table, *tme).await?;
                    self.decoder.map_table(table_id, Arc::new(columns));
                }
            }
        }
    }

    /// The stream said nothing for three heartbeats. A server sends heartbeats only while it has
    /// nothing to send, and they queue behind whatever it sent before, so silence alone does not
    /// tell a dead stream from one event that takes long to arrive (a large row over a slow link:
    /// giving up reconnects into the same row, again and again, as the soak's slow-network fault
    /// showed) or a server scanning its binlog for our start. So ask the server about our dump
    /// thread on the control connection (another connection over the same path):
    /// - no answer, or no such thread: dead;
    /// - still working (sending an event, reading the binlog): wait another period. A thread
    ///   blocked writing to a lost connection ends at the server's `net_write_timeout`, and then
    ///   the case above applies; past [`MAX_BUSY_SILENCE`] it is dead regardless;
    /// - it has handed everything to the network: what it sent may still be crossing a slow link,
    ///   or the connection died where the server cannot see it. Wait up to [`SENT_ALL_PERIODS`]
    ///   read timeouts of silence, then dead.
    async fn on_silence(&mut self, silent: Duration) -> Result<()> {
        let dead = |why: String| {
            Err(Error::source(format!(
                "no binlog event or heartbeat for {silent:?}; {why}; the stream is treated as dead"
            ))
            .remedy("outboxd reconnects by itself; if this repeats, check the network path to the server")
            .transient())
        };
        if silent >= MAX_BUSY_SILENCE {
            return dead("the server has been busy for longer than outboxd waits".into());
        }
        let query = self.control.exec_first::<(String, Option<String>), _, _>(
            "SELECT COMMAND, STATE FROM information_schema.PROCESSLIST WHERE ID = ?",
            (self.dump_connection,),
        );
        let probe = self.read_timeout.max(Duration::from_secs(10));
        let (command, state) = match tokio::time::timeout(probe, query).await {
            Ok(Ok(Some((command, state)))) => (command, state.unwrap_or_default()),
            Ok(Ok(None)) => return dead("the server shows no dump thread for it".into()),
            Ok(Err(e)) => return dead(format!("asking the server about it failed: {e}")),
            Err(_) => {
                return dead("the server did not answer on the control connection either".into())
            }
        };
        if !command.starts_with("Binlog Dump") {
            // `Killed`: ended by someone, perhaps still blocked on its socket.
            return dead(format!("the server's thread for it is \"{command}\""));
        }
        // Idle (or no state shown): what it sent may still be crossing the network.
        let sent_all = state.is_empty() || state.contains("has sent all binlog");
        if sent_all && silent >= self.read_timeout * SENT_ALL_PERIODS {
            return dead(format!(
                "the server's dump thread says \"{state}\" and nothing arrived since"
            ));
        }
        self.silent_waits += 1;
        // One line, then one per ten waits (a wait is one read timeout).
        if self.silent_waits % 10 == 1 {
            tracing::info!(
                silent = ?silent,
                state = %state,
                "the binlog stream is silent, but the server's dump thread for it is alive (a large event crossing a slow link, or a binlog scan): waiting"
            );
        }
        Ok(())
    }

    async fn resolve_columns(
        &mut self,
        table: Arc<str>,
        tme: mysql_common::binlog::events::TableMapEvent<'static>,
    ) -> Result<TableColumns> {
        let tme = match TableColumns::from_metadata(table.clone(), tme.clone()) {
            Ok(Some(columns)) => return Ok(columns),
            Ok(None) => tme,
            Err(e) => {
                return Err(Error::source(format!(
                    "cannot read the column metadata of {table}'s table map: {e}"
                )))
            }
        };
        let (schema, name) = table.split_once('.').unwrap_or(("", &table));
        let query = self.control.exec(
            "SELECT COLUMN_NAME, DATA_TYPE, CHARACTER_SET_NAME, COLUMN_TYPE \
             FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = ? AND TABLE_NAME = ? \
             ORDER BY ORDINAL_POSITION",
            (schema, name),
        );
        let rows: Vec<(String, String, Option<String>, String)> =
            match tokio::time::timeout(control_timeout(self.read_timeout), query).await {
                Ok(Ok(rows)) => rows,
                Ok(Err(e)) => {
                    return Err(Error::source(format!(
                        "cannot read the columns of {table} from information_schema: {e}"
                    ))
                    .transient())
                }
                Err(_) => {
                    return Err(Error::source(format!(
                        "reading the columns of {table} from information_schema timed out"
                    ))
                    .transient())
                }
            };
        let columns: Vec<SchemaColumn> = rows
            .into_iter()
            .map(|(name, data_type, charset, column_type)| SchemaColumn {
                name,
                data_type,
                charset,
                column_type,
            })
            .collect();
        TableColumns::from_schema(table, tme, &columns).map_err(|why| {
            Error::source(why).remedy(
                "run SET GLOBAL binlog_row_metadata = FULL (MySQL 8.0+/MariaDB 10.5+) so the binlog carries column names, then restart outboxd",
            )
        })
    }
}

struct ServerInfo {
    version: String,
    is_mariadb: bool,
    server_id: u32,
    server_uuid: Option<String>,
    /// MySQL's `gtid_mode` is ON: only then does the server take a GTID dump (OFF_PERMISSIVE and
    /// ON_PERMISSIVE refuse it). Always false on MariaDB, whose GTIDs are always on.
    mysql_gtid_mode_on: bool,
    log_bin: bool,
    binlog_format: String,
    row_image: String,
}

impl ServerInfo {
    async fn read(conn: &mut Conn) -> mysql_async::Result<ServerInfo> {
        let (version, server_id, log_bin, binlog_format, row_image): (
            String,
            u32,
            u8,
            String,
            String,
        ) = conn
            .query_first(
                "SELECT VERSION(), @@server_id, @@log_bin, @@binlog_format, @@binlog_row_image",
            )
            .await?
            .unwrap_or_default();
        let is_mariadb = version.to_ascii_lowercase().contains("mariadb");
        let (server_uuid, mysql_gtid_mode_on) = if is_mariadb {
            (None, false)
        } else {
            let uuid = conn
                .query_first::<String, _>("SELECT @@server_uuid")
                .await
                .ok()
                .flatten();
            // MySQL 5.6 and later have gtid_mode; a server without it has no GTIDs.
            let mode = conn
                .query_first::<String, _>("SELECT @@GLOBAL.gtid_mode")
                .await
                .ok()
                .flatten();
            (uuid, mode.as_deref() == Some("ON"))
        };
        Ok(ServerInfo {
            version,
            is_mariadb,
            server_id,
            server_uuid,
            mysql_gtid_mode_on,
            log_bin: log_bin == 1,
            binlog_format,
            row_image,
        })
    }

    /// Whether a stream from `start` asks this server by GTID: MariaDB's state, or MySQL's set
    /// when the server's gtid_mode is ON (otherwise by FILE:POS, which only this server's own
    /// checkpoint has).
    fn resumes_by_gtid(&self, start: &BinlogPosition) -> bool {
        start.resumes_by_gtid(self.is_mariadb) && (self.is_mariadb || self.mysql_gtid_mode_on)
    }

    /// The binlog settings outboxd depends on, judged once for both `run` (which refuses the first
    /// bad one) and `check` (which lists them all).
    pub(super) fn binlog_settings(&self) -> [Setting; 3] {
        [
            Setting {
                ok: self.log_bin,
                shown: "log_bin = ON".into(),
                problem: "log_bin = OFF: the server writes no binary log".into(),
                remedy: "start the server with log-bin (and binlog_format=ROW, binlog_row_image=FULL) in its config file",
            },
            Setting {
                ok: self.binlog_format.eq_ignore_ascii_case("ROW"),
                shown: "binlog_format = ROW".into(),
                problem: format!(
                    "binlog_format = {}: outbox rows written as statements are invisible",
                    self.binlog_format
                ),
                remedy: "SET GLOBAL binlog_format = 'ROW'; and binlog_format=ROW in the server's config file",
            },
            Setting {
                ok: self.row_image.eq_ignore_ascii_case("FULL"),
                shown: "binlog_row_image = FULL".into(),
                problem: format!(
                    "binlog_row_image = {}: inserted rows may lack columns",
                    self.row_image
                ),
                remedy: "SET GLOBAL binlog_row_image = 'FULL'; and binlog_row_image=FULL in the server's config file",
            },
        ]
    }

    /// The identity a checkpoint written against this server names.
    fn identity(&self) -> SourceIdentity {
        SourceIdentity {
            kind: SourceKind::Mysql,
            server_id: Some(self.server_id),
            server_uuid: self.server_uuid.clone(),
            system_identifier: None,
            slot: None,
            timeline: None,
        }
    }

    fn require_row_binlog(&self) -> Result<()> {
        match self.binlog_settings().into_iter().find(|s| !s.ok) {
            Some(bad) => Err(Error::source(bad.problem).remedy(bad.remedy)),
            None => Ok(()),
        }
    }
}

/// Whatever stops a connect for good is about this host (its login, TLS, settings, grants): another
/// host of the list may serve (see `pipeline::hosts`).
fn as_refusal(e: Error) -> Error {
    match e.kind() == Kind::Source && !e.is_transient() {
        true => e.refused_by_host(),
        false => e,
    }
}

/// What every session (stream or snapshot) asks of the server before it reads: row-based binlog,
/// uncompressed (MariaDB), and on a replica the replicated rows logged. Whether the replica's
/// status can be watched ([`Stall`]).
async fn require_serves(
    control: &mut Conn,
    server: &ServerInfo,
    config: &SourceConfig,
) -> Result<bool> {
    server.require_row_binlog()?;
    let shown = redact_url(&config.url);
    if server.is_mariadb {
        let compress: Option<u8> = control
            .query_first("SELECT @@log_bin_compress")
            .await
            .ok()
            .flatten();
        if compress == Some(1) {
            return Err(Error::source(format!(
                "{shown}: log_bin_compress = ON: compressed row events cannot be decoded"
            ))
            .remedy("SET GLOBAL log_bin_compress = OFF; and in the server's config file"));
        }
    }
    replica::require_replicated_rows(control, &shown, server.is_mariadb).await
}

/// A server setting as [`ServerInfo::binlog_settings`] judged it.
pub(super) struct Setting {
    pub ok: bool,
    /// What a good value looks like in `check`.
    pub shown: String,
    pub problem: String,
    pub remedy: &'static str,
}

/// The checkpoint must come from this server, unless MariaDB GTIDs make the position portable.
fn check_identity(
    stored: &SourceIdentity,
    current: &SourceIdentity,
    start: &BinlogPosition,
    server: &ServerInfo,
) -> Result<()> {
    if stored.kind != current.kind {
        return Err(Error::checkpoint(format!(
            "the checkpoint belongs to a {} source, but source.kind is {}",
            stored.kind.as_str(),
            current.kind.as_str()
        ))
        .remedy("point checkpoint.dir or name at this source's checkpoint, or remove the file to start at the server's current end"));
    }
    if stored.server_id.is_none() {
        tracing::info!("the checkpoint names no server (set by hand): using it on this server");
        return Ok(());
    }
    let same_server = stored.server_id == current.server_id
        && (stored.server_uuid.is_none() || stored.server_uuid == current.server_uuid);
    if same_server {
        return Ok(());
    }
    if server.resumes_by_gtid(start) {
        tracing::warn!(
            checkpoint_server = ?stored.server_id,
            server = ?current.server_id,
            "checkpoint was written against another server: resuming by GTID"
        );
        return Ok(());
    }
    // A source error: of a multi-host `source.url`, this host cannot serve the checkpoint (the
    // next one may: see `pipeline::hosts`).
    Err(Error::source(format!(
        "the checkpoint was written against server_id {:?} (uuid {:?}), but this server is server_id {:?} (uuid {:?}), and its position {start} is a file offset that only means something on the server that wrote it",
        stored.server_id, stored.server_uuid, current.server_id, current.server_uuid
    ))
    .remedy("point source.url back at that server, or set a position valid on this one with `outboxd checkpoint set FILE:POS`"))
}

/// A MySQL set is sent as it is, and the server sends every transaction not in it. A set typed by
/// hand that names transactions this server has not executed would skip them when they come: it
/// is refused. A server holding transactions of a server uuid the set never saw (a replica's own
/// writes, or a wrong host) sends that uuid's whole history: outboxd says so before it reads.
async fn check_mysql_set(
    conn: &mut Conn,
    start: &BinlogPosition,
    typed: bool,
    config: &SourceConfig,
) -> Result<()> {
    let Some(set) = start.mysql_gtids.as_ref().filter(|s| !s.is_empty()) else {
        return Ok(());
    };
    let text = set.to_string();
    // One read of gtid_executed for all three answers.
    let row: Option<(String, String, String)> = conn
        .exec_first(
            "SELECT GTID_SUBTRACT(?, e.s), GTID_SUBTRACT(e.s, ?), e.s FROM (SELECT @@GLOBAL.gtid_executed AS s) e",
            (text.clone(), text.clone()),
        )
        .await
        .map_err(|e| map_err(e, config))?;
    let (ahead, unseen, executed) = row.unwrap_or_default();
    let ahead: String = ahead.split_whitespace().collect();
    if typed && !ahead.is_empty() {
        return Err(Error::checkpoint(format!(
            "the position gtid:{text} names transactions this server has not executed ({ahead}): outboxd would skip them when they come"
        ))
        .remedy("set the GTID set of the last transaction delivered, a part of this server's SELECT @@GLOBAL.gtid_executed: `outboxd checkpoint set gtid:SET`"));
    }
    // Nothing in common: not a server of the checkpoint's topology (a wrong host in source.url),
    // whose whole history would be sent. The next host may be the right one.
    let executed: String = executed.split_whitespace().collect();
    let executed = MysqlGtidSet::parse(&executed)?;
    if !executed.is_empty() && !executed.sources().any(|s| set.has_source(s)) {
        return Err(Error::source(format!(
            "this server's transactions ({executed}) share no server uuid with the checkpoint's GTID set {text}: it is not a server of the topology the checkpoint was read from"
        ))
        .remedy("point source.url at a server of that topology, or set a position valid on this server deliberately with `outboxd checkpoint set`")
        .refused_by_host());
    }
    let unseen: String = unseen.split_whitespace().collect();
    if unseen.is_empty() {
        return Ok(());
    }
    let unseen = MysqlGtidSet::parse(&unseen)?;
    let strangers: Vec<&str> = unseen.sources().filter(|s| !set.has_source(s)).collect();
    if !strangers.is_empty() {
        tracing::warn!(
            sources = %strangers.join(","),
            transactions = %unseen,
            "this server holds transactions of server uuids the checkpoint never saw: outboxd sends every outbox row among them (if they are a replica's own writes or another database's, stop outboxd and add them to the position with `outboxd checkpoint set`)"
        );
    }
    Ok(())
}

/// `SHOW BINARY LOG STATUS` replaced `SHOW MASTER STATUS` in MySQL 8.4 (8.2 added it, 8.4 removed
/// the old one); MariaDB keeps `SHOW MASTER STATUS`.
fn binlog_status_statement(version: &str, is_mariadb: bool) -> &'static str {
    let mut numbers = version
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|n| n.parse::<u32>().ok());
    let (major, minor) = (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0));
    if !is_mariadb && (major, minor) >= (8, 2) {
        "SHOW BINARY LOG STATUS"
    } else {
        "SHOW MASTER STATUS"
    }
}

async fn current_end(conn: &mut Conn, info: &ServerInfo) -> mysql_async::Result<BinlogPosition> {
    let is_mariadb = info.is_mariadb;
    let statement = binlog_status_statement(&info.version, is_mariadb);
    let row: Option<mysql_async::Row> = conn.query_first(statement).await?;
    let row = row.ok_or_else(|| {
        mysql_async::Error::Other(format!("{statement} returned nothing: is log_bin on?").into())
    })?;
    let file: String = row.get(0).unwrap_or_default();
    let pos: u64 = row.get(1).unwrap_or(4);
    // MySQL prints the executed set beside the file and offset. The server reads the set first
    // and the offset after it, and a GTID joins the set only once its transaction is in the
    // binlog: every transaction in the set lies before the offset, so a GTID resume from it
    // skips nothing. (A commit racing the statement may lie before the offset without being in
    // the set: a GTID resume then also sends that row from before the start.) None with
    // gtid_mode OFF.
    let mysql_gtids = if is_mariadb {
        None
    } else {
        let text: String = row
            .get::<Option<String>, _>(4)
            .flatten()
            .unwrap_or_default();
        let text: String = text.split_whitespace().collect();
        if info.mysql_gtid_mode_on {
            Some(
                MysqlGtidSet::parse(&text)
                    .map_err(|e| mysql_async::Error::Other(e.message().to_string().into()))?,
            )
        } else {
            None
        }
    };
    let gtid = if is_mariadb {
        let text: Option<String> = conn
            .exec_first("SELECT BINLOG_GTID_POS(?, ?)", (file.clone(), pos))
            .await?;
        Some(
            MariaGtidState::parse(&text.unwrap_or_default())
                .map_err(|e| mysql_async::Error::Other(e.message().to_string().into()))?,
        )
    } else {
        None
    };
    Ok(BinlogPosition {
        file,
        pos,
        gtid,
        mysql_gtids,
    })
}

fn map_stream_err(e: mysql_async::Error, at: &BinlogPosition, own_checkpoint: bool) -> Error {
    match e {
        // The server has not written what the checkpoint says was read. On the server that wrote
        // the checkpoint, that means it lost a binlog tail in a crash (`sync_binlog=0`): its crash
        // recovery rolled those transactions back, new ones reuse their positions and GTIDs, and
        // waiting would resume after the new ones (skipping them) or never. Stop and say where to
        // resume. MySQL's "more GTIDs than the source" says the same of its own uuid's
        // transactions, whichever server wrote the checkpoint (a lagging replica lacks another
        // server's, and MySQL waits for those).
        mysql_async::Error::Server(se)
            if se.code == ER_BINLOG_GONE
                && (lost_own_gtids(&se.message)
                    || (server_is_behind(&se.message) && own_checkpoint)) =>
        {
            Error::source(format!(
                "the server is behind the checkpoint {at} in transactions it wrote itself: its binlog lost events outboxd had already read (a crash with sync_binlog=0?): {}",
                se.message
            ))
            .remedy("those transactions were rolled back by the server's crash recovery, and new ones may reuse their GTIDs/positions. Resume where the binlog continues after the restart: `outboxd checkpoint set FILE:4` with the first binlog file the server opened after the crash (SHOW BINARY LOGS)")
        }
        // A replica that lags behind the server outboxd read before: waiting (or the next host)
        // is the cure; moving the checkpoint would skip rows.
        mysql_async::Error::Server(se) if se.code == ER_BINLOG_GONE && server_is_behind(&se.message) => {
            Error::source(format!(
                "the server is behind the checkpoint {at}: {}",
                se.message
            ))
            .remedy("outboxd waits and retries (or moves to the next host in source.url) until the server has caught up; check the replica's replication if this lasts")
            .transient()
        }
        mysql_async::Error::Server(se) if se.code == ER_BINLOG_GONE => Error::source(format!(
            "the server cannot send the binlog from {at}: {}",
            se.message
        ))
        .remedy("the binlog the checkpoint needs was purged or never existed here: restore it (outboxd replay from a binlog backup) or move the checkpoint deliberately with `outboxd checkpoint set`; outboxd never restarts from zero by itself")
        .refused_by_host(),
        mysql_async::Error::Server(se) => Error::source(format!(
            "binlog stream error {} at {at}: {}",
            se.code, se.message
        ))
        .transient(),
        other => Error::source(format!("binlog stream broke at {at}: {other}"))
            .remedy("outboxd reconnects by itself")
            .transient(),
    }
}

/// Whether an error 1236 is MySQL's "Replica has more GTIDs than the source has, using the
/// source's SERVER_UUID" (older: "Slave … master"): the server lost transactions it wrote itself.
fn lost_own_gtids(message: &str) -> bool {
    message.to_ascii_lowercase().contains("more gtids than the")
}

/// Whether an error 1236 says the server's binlog has not reached the requested position (as opposed
/// to having purged it, or having diverged from it).
fn server_is_behind(message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    let diverged = m.contains("diverged") || m.contains("higher sequence");
    let purged = m.contains("purged") || m.contains("could not find");
    !diverged
        && !purged
        && (m.contains("not in the master's binlog")
            || m.contains("impossible position")
            || m.contains("position > file size")
            || m.contains("beyond the end"))
}

#[cfg(test)]
mod tests {
    use super::{binlog_status_statement, lost_own_gtids, parse_position, server_is_behind};

    #[test]
    fn a_typed_gtid_position_is_read_in_the_notation_it_is_written_in() {
        let mysql = parse_position("gtid:3E11FA47-71CA-11E1-9E33-C80AA9429562:1-5:7").unwrap();
        let mysql = mysql.binlog().unwrap();
        assert!(mysql.resumes_by_gtid(false) && !mysql.resumes_by_gtid(true));
        assert_eq!(
            mysql.gtid_text().unwrap(),
            "3e11fa47-71ca-11e1-9e33-c80aa9429562:1-5:7"
        );
        let maria = parse_position("gtid:0-1-42").unwrap();
        assert!(maria.binlog().unwrap().resumes_by_gtid(true));
        for bad in [
            "gtid:",
            "gtid:nonsense:1-5",
            "gtid:3e11fa47-71ca-11e1-9e33-c80aa9429562:0",
            "gtid:3e11fa47-71ca-11e1-9e33-c80aa9429562:1-9223372036854775807",
            "gtid:3e11fa47-71ca-11e1-9e33-c80aa9429562:bad-tag:1",
            "gtid:3e11fa47-71ca-11e1-9e33-c80aa9429562:9tag:1",
        ] {
            let e = parse_position(bad).unwrap_err();
            assert!(e.remedy_text().is_some(), "{bad}: {e}");
        }
    }

    #[test]
    fn a_server_behind_the_checkpoint_is_told_apart_from_a_purged_or_diverged_binlog() {
        // MariaDB 10.11's texts for error 1236.
        assert!(server_is_behind("Error: connecting slave requested to start from GTID 0-1-57, which is not in the master's binlog"));
        assert!(server_is_behind("Client requested master to start replication from impossible position; the first event 'mariadb-bin.000001' at 9999"));
        // MySQL's text for the same case.
        assert!(server_is_behind(
            "Client requested master to start replication from position > file size"
        ));
        // MySQL 8.0.26+ and the older wording: a lost tail of the server's own, not a lag.
        assert!(lost_own_gtids("Replica has more GTIDs than the source has, using the source's SERVER_UUID. This may indicate that the end of the binary log was truncated or that the last binary log file was lost, e.g., after a power or disk failure when sync_binlog != 1. The source may or may not have rolled back transactions that were already replicated to the replica."));
        assert!(lost_own_gtids(
            "Slave has more GTIDs than the master has, using the master's SERVER_UUID."
        ));
        assert!(!lost_own_gtids(
            "Cannot replicate because the source purged required binary logs."
        ));
        assert!(!server_is_behind("Cannot replicate because the source purged required binary logs. Replicate the missing transactions from elsewhere, or provision a new replica from backup. Consider increasing the source's binary log expiration period. The GTID set sent by the replica is 'x:1-5', and the missing transactions are 'x:6-9'"));
        assert!(!server_is_behind("Error: connecting slave requested to start from GTID 0-1-57, which is not in the master's binlog. Since the master's binlog contains GTIDs with higher sequence numbers, it probably means that the slave has diverged due to executing extra erroneous transactions"));
        assert!(!server_is_behind("Could not find GTID state requested by slave in any binlog files. Probably the slave state is too old and required binlog files have been purged."));
        assert!(!server_is_behind(
            "Could not find first log file name in binary log index file"
        ));
    }

    #[test]
    fn binlog_status_statement_follows_the_server_version() {
        assert_eq!(
            binlog_status_statement("8.0.36", false),
            "SHOW MASTER STATUS"
        );
        assert_eq!(
            binlog_status_statement("8.4.2", false),
            "SHOW BINARY LOG STATUS"
        );
        assert_eq!(
            binlog_status_statement("9.1.0", false),
            "SHOW BINARY LOG STATUS"
        );
        assert_eq!(
            binlog_status_statement("10.11.19-MariaDB-0+deb12u1-log", true),
            "SHOW MASTER STATUS"
        );
    }
}
