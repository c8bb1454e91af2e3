//! The binlog state machine: events in, outbox changes out. No I/O, so the live stream and binlog
//! files share one code path.
//!
//! Transactions are delimited by the server's own markers: a GTID event (MySQL 33/34/42, MariaDB 162)
//! or `BEGIN` opens one, `XID`, `COMMIT`, `ROLLBACK` or an XA prepare closes it, and a statement outside
//! any transaction (DDL) is a transaction of its own.
//!
//! XA: a prepared transaction's rows are in the log before anyone knows whether it commits. They are
//! held (never produced) until `XA COMMIT` publishes them in the commit's place in the log or `XA
//! ROLLBACK` drops them, and while one is undecided the boundaries handed out stay at the point before
//! its prepare, so a restart reads the prepare again instead of losing its rows. Each close yields a boundary whose position is the
//! end of the closing event: resuming there starts with the next transaction, never in the middle of
//! one. Table maps are matched against the configured outbox tables *before* any row is decoded, so rows
//! of other tables (whatever their types or character sets) are skipped unread.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use mysql_common::binlog::consts::BinlogChecksumAlg;
use mysql_common::binlog::events::{Event, EventData, RowsEventData, TableMapEvent};
use mysql_common::proto::MySerialize;

use super::columns::TableColumns;
use super::event_types as et;
use super::position::{BinlogPosition, MariaGtidState, MysqlGtidSet};
use crate::error::{Error, Result};
use crate::source::{Boundary, Change, Ignored, Row};

/// What the caller must do before feeding the next event.
pub enum Step {
    Continue,
    /// A table map for an outbox table: resolve its columns and call [`Decoder::map_table`].
    NeedColumns {
        table_id: u64,
        table: Arc<str>,
        tme: Box<TableMapEvent<'static>>,
    },
}

pub struct Decoder {
    watched: HashSet<String>,
    /// Table id -> columns of an outbox table, or `None` for any other table.
    tables: HashMap<u64, Option<Arc<TableColumns>>>,
    /// The last boundary: where a resumed stream starts.
    boundary: BinlogPosition,
    file: String,
    next_pos: u64,
    gtid: Option<MariaGtidState>,
    pending_gtid: Option<(u32, u32, u64)>,
    mysql_gtids: Option<MysqlGtidSet>,
    pending_mysql_gtid: Option<(String, u64)>,
    in_txn: bool,
    txn_origin: Option<Arc<str>>,
    /// The open transaction's time from its first event (ms since the Unix epoch).
    txn_committed_ms: Option<i64>,
    txn_rows: u64,
    ignored: Ignored,
    /// A compressed transaction was announced; its events (log_pos 0) must follow.
    payload_pending: bool,
    /// The group being read is an XA transaction's prepare: its rows wait in `xa_rows`.
    in_xa: bool,
    xa_rows: Vec<Row>,
    /// Prepared XA transactions with outbox rows, oldest first, until `XA COMMIT`/`XA ROLLBACK`.
    prepared: Vec<Prepared>,
}

/// A prepared, undecided XA transaction that wrote outbox rows.
///
/// Its rows are held here, never produced, until the server logs its decision. While it is
/// undecided, every boundary handed out is `hold` (the boundary before its prepare): a restart must
/// read the prepare again, or the rows would be gone when the commit arrives.
struct Prepared {
    xid: String,
    hold: BinlogPosition,
    rows: Vec<Row>,
    /// When it was prepared (event timestamp, seconds).
    prepared_at: u32,
    /// Whether the "still undecided" warning was given.
    warned: bool,
}

/// An XA transaction undecided this long (by the log's own clock) is worth a warning: it holds the
/// checkpoint, and its rows stay in memory.
const XA_UNDECIDED_WARNING_SECS: u32 = 600;

impl Decoder {
    /// `start` is where the stream was requested from; `watched` holds `schema.table` names.
    pub fn new(start: BinlogPosition, watched: impl IntoIterator<Item = String>) -> Self {
        Decoder {
            watched: watched.into_iter().collect(),
            tables: HashMap::new(),
            file: start.file.clone(),
            next_pos: start.pos,
            gtid: start.gtid.clone(),
            mysql_gtids: start.mysql_gtids.clone(),
            pending_mysql_gtid: None,
            boundary: start,
            pending_gtid: None,
            in_txn: false,
            txn_origin: None,
            txn_committed_ms: None,
            txn_rows: 0,
            ignored: Ignored::default(),
            payload_pending: false,
            in_xa: false,
            xa_rows: Vec::new(),
            prepared: Vec::new(),
        }
    }

    /// Where a resumed stream must start: the last boundary, or, while an XA transaction with outbox
    /// rows is prepared but undecided, the boundary before the oldest such prepare.
    fn resume_position(&self) -> &BinlogPosition {
        self.prepared
            .first()
            .map(|p| &p.hold)
            .unwrap_or(&self.boundary)
    }

    /// The last transaction boundary a resumed stream may start at.
    pub fn boundary(&self) -> &BinlogPosition {
        self.resume_position()
    }

    pub fn ignored(&self) -> Ignored {
        self.ignored
    }

    /// Registers the resolved columns of an outbox table map.
    pub fn map_table(&mut self, table_id: u64, columns: Arc<TableColumns>) {
        self.tables.insert(table_id, Some(columns));
    }

    /// Feeds one event; decoded changes are appended to `out`.
    pub fn on_event(&mut self, event: &Event, out: &mut VecDeque<Change>) -> Result<Step> {
        let header = event.header();
        let t = header.event_type_raw();
        let event_start = self.next_pos;
        if !checksum_ok(event) {
            return Err(self.corrupt(event_start, "CRC32 checksum mismatch"));
        }
        // The events of a compressed transaction carry log_pos 0. A top-level event right after the
        // payload means its events never arrived (the client library drops a payload it cannot
        // decompress): stop instead of losing the transaction.
        if std::mem::take(&mut self.payload_pending) && header.log_pos() != 0 {
            return Err(self.corrupt(
                event_start,
                "a compressed transaction (TRANSACTION_PAYLOAD) was not expanded into its events",
            ));
        }
        if t == et::TRANSACTION_PAYLOAD {
            self.payload_pending = true;
        }
        // Artificial and out-of-stream events (fake rotate, re-sent format description) carry 0.
        if header.log_pos() != 0 && t != et::HEARTBEAT {
            self.next_pos = header.log_pos() as u64;
        }
        match t {
            et::ROTATE => {
                let (file, pos) = rotate_target(event)
                    .ok_or_else(|| self.corrupt(event_start, "short rotate event"))?;
                self.file = file;
                self.next_pos = pos;
                if !self.in_txn {
                    self.boundary.file = self.file.clone();
                    self.boundary.pos = self.next_pos;
                }
                self.tables.clear();
            }
            et::HEARTBEAT if !self.in_txn => {
                out.push_back(Change::Idle(Boundary {
                    position: self.resume_position().to_position(),
                    committed_at: None,
                }));
            }
            et::MARIADB_GTID => {
                let g = et::MariaGtid::parse(event.data())
                    .ok_or_else(|| self.corrupt(event_start, "short MariaDB GTID event"))?;
                self.pending_gtid = Some((g.domain, header.server_id(), g.seq));
                self.gtid.get_or_insert_with(MariaGtidState::default);
                self.txn_origin =
                    Some(format!("gtid:{}-{}-{}", g.domain, header.server_id(), g.seq).into());
                self.txn_committed_ms = Some(i64::from(header.timestamp()) * 1000);
                self.in_txn = !g.standalone;
                self.in_xa = g.prepared_xa;
            }
            et::GTID | et::GTID_TAGGED => {
                if let Ok(Some(EventData::GtidEvent(g))) = event.read_data() {
                    let sid = uuid::Uuid::from_bytes(g.sid());
                    let tag = g
                        .tag()
                        .map(|t| format!(":{}", t.as_str()))
                        .unwrap_or_default();
                    self.txn_origin = Some(format!("gtid:{sid}{tag}:{}", g.gno()).into());
                    self.pending_mysql_gtid = Some((format!("{sid}{tag}"), g.gno()));
                    // MySQL 8 writes the commit time (µs) into the GTID event.
                    let commit_us = g.immediate_commit_timestamp();
                    self.txn_committed_ms = Some(if commit_us > 0 {
                        (commit_us / 1000) as i64
                    } else {
                        i64::from(header.timestamp()) * 1000
                    });
                }
            }
            // The GTIDs executed before this file: the base of the set we keep (files only; a live
            // stream started from FILE:POS does not know it).
            et::PREVIOUS_GTIDS if self.mysql_gtids.is_none() => {
                if let Ok(Some(EventData::PreviousGtidsEvent(p))) = event.read_data() {
                    let mut set = MysqlGtidSet::default();
                    for sid in p.sids() {
                        let uuid = uuid::Uuid::from_bytes(sid.uuid());
                        let tag = sid
                            .tag()
                            .map(|t| format!(":{}", t.as_str()))
                            .unwrap_or_default();
                        for interval in sid.intervals() {
                            // Stored half-open: [start, end).
                            if interval.end() > interval.start() {
                                set.add_interval(
                                    &format!("{uuid}{tag}"),
                                    interval.start(),
                                    interval.end() - 1,
                                );
                            }
                        }
                    }
                    self.mysql_gtids = Some(set);
                }
            }
            // MariaDB: the GTID state at the start of this file.
            et::MARIADB_GTID_LIST if self.gtid.is_none() => {
                self.gtid = et::parse_gtid_list(event.data());
            }
            et::ANONYMOUS_GTID => {
                self.txn_origin = Some(format!("{}:{event_start}", self.file).into());
                // MySQL 8 with gtid_mode=OFF: the same event layout, commit time included.
                if let Ok(Some(EventData::AnonymousGtidEvent(g))) = event.read_data() {
                    let commit_us = g.0.immediate_commit_timestamp();
                    if commit_us > 0 {
                        self.txn_committed_ms = Some((commit_us / 1000) as i64);
                    }
                }
            }
            et::QUERY => {
                let data = event
                    .read_data()
                    .map_err(|e| self.corrupt(event_start, &e.to_string()))?;
                if let Some(EventData::QueryEvent(q)) = data {
                    self.on_query(
                        &q.query(),
                        &q.schema(),
                        event_start,
                        header.timestamp(),
                        out,
                    )?;
                }
            }
            // Only long statements get compressed: never BEGIN/COMMIT, so DDL (a boundary) or, inside a
            // transaction, a statement with no rows of its own.
            et::MARIADB_QUERY_COMPRESSED if !self.in_txn => self.close(header.timestamp(), out),
            et::XID => self.close(header.timestamp(), out),
            et::XA_PREPARE => {
                let (one_phase, xid) = et::parse_xa_prepare(event.data())
                    .ok_or_else(|| self.corrupt(event_start, "short XA_PREPARE event"))?;
                let rows = std::mem::take(&mut self.xa_rows);
                if one_phase {
                    // `XA COMMIT … ONE PHASE`: committed here.
                    self.txn_rows += rows.len() as u64;
                    out.extend(rows.into_iter().map(Change::Row));
                } else if !rows.is_empty() {
                    // The boundary before this group: resuming there reads the prepare again.
                    self.prepared.push(Prepared {
                        xid,
                        hold: self.boundary.clone(),
                        rows,
                        prepared_at: header.timestamp(),
                        warned: false,
                    });
                }
                self.close(header.timestamp(), out);
            }
            et::TABLE_MAP => {
                let tme = event
                    .read_event::<TableMapEvent<'_>>()
                    .map_err(|e| self.corrupt(event_start, &format!("table map: {e}")))?;
                let table = format!("{}.{}", tme.database_name(), tme.table_name());
                if self.watched.contains(&table) {
                    if let Some(Some(known)) = self.tables.get(&tme.table_id()) {
                        if *known.table == *table && same_shape(&known.tme, &tme) {
                            return Ok(Step::Continue);
                        }
                    }
                    return Ok(Step::NeedColumns {
                        table_id: tme.table_id(),
                        table: table.into(),
                        tme: Box::new(tme.into_owned()),
                    });
                }
                self.tables.insert(tme.table_id(), None);
            }
            t if et::is_rows_event(t) => self.on_rows(event, t, event_start, out)?,
            _ => {}
        }
        Ok(Step::Continue)
    }

    fn on_query(
        &mut self,
        query: &str,
        schema: &str,
        event_start: u64,
        timestamp: u32,
        out: &mut VecDeque<Change>,
    ) -> Result<()> {
        let head: String = query
            .trim_start()
            .chars()
            .take(16)
            .collect::<String>()
            .to_ascii_uppercase();
        let closes = head.starts_with("COMMIT")
            || (head.starts_with("ROLLBACK") && !head.starts_with("ROLLBACK TO"));
        if head.starts_with("XA COMMIT") || head.starts_with("XA ROLLBACK") {
            let commit = head.starts_with("XA COMMIT");
            let rest = query.trim_start()[if commit { 9 } else { 11 }..].trim();
            // `XA COMMIT xid ONE PHASE` (MySQL logs it after the rows): the rows were read in
            // this very group.
            if commit && rest.to_ascii_uppercase().ends_with("ONE PHASE") {
                let rows = std::mem::take(&mut self.xa_rows);
                self.txn_rows += rows.len() as u64;
                out.extend(rows.into_iter().map(Change::Row));
            } else {
                let xid = et::xid_key(rest);
                match self.prepared.iter().position(|p| p.xid == xid) {
                    Some(i) => {
                        let prepared = self.prepared.remove(i);
                        if commit {
                            self.txn_rows += prepared.rows.len() as u64;
                            // Committed now, not when prepared (the XA COMMIT group's own GTID
                            // event may give milliseconds).
                            let committed_ms =
                                self.txn_committed_ms.or(Some(i64::from(timestamp) * 1000));
                            out.extend(prepared.rows.into_iter().map(|mut row| {
                                row.committed_ms = committed_ms;
                                Change::Row(row)
                            }));
                        } else {
                            tracing::debug!(xid = %rest, rows = prepared.rows.len(), "XA ROLLBACK: the prepared outbox rows are dropped");
                        }
                    }
                    None => {
                        tracing::debug!(xid = %rest, "XA decision for a transaction that wrote no outbox rows after the start position")
                    }
                }
            }
            self.close(timestamp, out);
            return Ok(());
        }
        if head.starts_with("BEGIN") || head.starts_with("XA START") || head.starts_with("XA BEGIN")
        {
            if head.starts_with("XA") {
                self.in_xa = true;
            }
            self.in_txn = true;
            if self.txn_origin.is_none() {
                self.txn_origin = Some(format!("{}:{event_start}", self.file).into());
            }
        } else if closes || !self.in_txn {
            self.close(timestamp, out);
        } else if let Some(table) = insert_target(query, schema) {
            // An outbox INSERT written as a statement (a session with binlog_format=STATEMENT or
            // MIXED) carries no row image: stop rather than lose it.
            if self.watched.contains(&table) {
                return Err(Error::source(format!(
                    "the outbox INSERT into {table} at {}:{event_start} was logged as a statement, not as a row",
                    self.file
                ))
                .remedy("the writing session used binlog_format=STATEMENT or MIXED: set binlog_format=ROW globally and for every session writing the outbox, then re-send that transaction's rows"));
            }
        }
        Ok(())
    }

    fn on_rows(
        &mut self,
        event: &Event,
        t: u8,
        event_start: u64,
        out: &mut VecDeque<Change>,
    ) -> Result<()> {
        let table_id = et::rows_event_table_id(event.data())
            .ok_or_else(|| self.corrupt(event_start, "short rows event"))?;
        let columns = match self.tables.get(&table_id) {
            Some(None) => return Ok(()),
            Some(Some(c)) => c.clone(),
            None => {
                return Err(self.corrupt(
                    event_start,
                    &format!("rows event for table id {table_id} without a preceding table map"),
                ))
            }
        };
        if et::MARIADB_COMPRESSED_ROWS.contains(&t) {
            return Err(Error::source(format!(
                "MariaDB wrote a compressed row event (type {t}) for outbox table {} at {}:{event_start}; outboxd cannot decode compressed row events, and it never skips outbox rows",
                columns.table, self.file
            ))
            .remedy(format!(
                "run SET GLOBAL log_bin_compress=OFF on the server; the transaction at {}:{event_start} must then be re-inserted by the application (or replayed from a copy written without compression), and the checkpoint moved past it with `outboxd checkpoint set`",
                self.file
            )));
        }
        match t {
            et::UPDATE_ROWS_V1 | et::UPDATE_ROWS | et::PARTIAL_UPDATE_ROWS => {
                self.ignored.updates += 1;
                return Ok(());
            }
            et::DELETE_ROWS_V1 | et::DELETE_ROWS => {
                self.ignored.deletes += 1;
                return Ok(());
            }
            _ => {}
        }
        let data = event
            .read_data()
            .map_err(|e| self.corrupt(event_start, &format!("rows event: {e}")))?;
        let Some(EventData::RowsEvent(rows)) = data else {
            return Err(self.corrupt(event_start, "rows event did not decode as one"));
        };
        let origin: Arc<str> = self
            .txn_origin
            .get_or_insert_with(|| format!("{}:{event_start}", self.file).into())
            .clone();
        let committed_ms = *self
            .txn_committed_ms
            .get_or_insert(i64::from(event.header().timestamp()) * 1000);
        let (present, data) = match &rows {
            RowsEventData::WriteRowsEvent(e) => (e.columns_after_image(), e.rows_data()),
            RowsEventData::WriteRowsEventV1(e) => (e.columns_after_image(), e.rows_data()),
            _ => return Ok(()),
        };
        let present: Vec<bool> = present.iter().map(|bit| *bit).collect();
        let mut rows_read = 0;
        let in_xa = self.in_xa;
        let xa_rows = &mut self.xa_rows;
        let read = super::row_image::read_after_images(&columns, &present, data, |values| {
            let row = Row {
                table: columns.table.clone(),
                names: columns.names.clone(),
                values,
                origin: origin.clone(),
                committed_ms: Some(committed_ms),
            };
            if in_xa {
                // Not committed yet: held until the XA decision (or this group's one-phase end).
                xa_rows.push(row);
            } else {
                rows_read += 1;
                out.push_back(Change::Row(row));
            }
        });
        read.map_err(|e| self.corrupt(event_start, &format!("row of {}: {e}", columns.table)))?;
        self.txn_rows += rows_read;
        Ok(())
    }

    /// Closes the current transaction (or standalone statement) and records the boundary.
    fn close(&mut self, timestamp: u32, out: &mut VecDeque<Change>) {
        if let Some(oldest) = self.prepared.first_mut() {
            let undecided = timestamp.saturating_sub(oldest.prepared_at);
            if undecided >= XA_UNDECIDED_WARNING_SECS && !oldest.warned {
                oldest.warned = true;
                tracing::warn!(
                    xid = %oldest.xid,
                    rows = oldest.rows.len(),
                    undecided_secs = undecided,
                    checkpoint = %oldest.hold,
                    "an XA transaction with outbox rows is still prepared: the checkpoint stays before it (a restart re-reads the log from there) until XA COMMIT or XA ROLLBACK; decide it (XA RECOVER lists it)"
                );
            }
        }
        if let Some((domain, server, seq)) = self.pending_gtid.take() {
            if let Some(g) = self.gtid.as_mut() {
                g.apply(domain, server, seq);
            }
        }
        if let Some((source, gno)) = self.pending_mysql_gtid.take() {
            if let Some(set) = self.mysql_gtids.as_mut() {
                set.add(&source, gno);
            }
        }
        self.boundary = BinlogPosition {
            file: self.file.clone(),
            pos: self.next_pos,
            gtid: self.gtid.clone(),
            mysql_gtids: self.mysql_gtids.clone(),
        };
        let boundary = Boundary {
            position: self.resume_position().to_position(),
            committed_at: Some(
                std::time::UNIX_EPOCH + std::time::Duration::from_secs(timestamp as u64),
            ),
        };
        out.push_back(Change::closing(boundary, self.txn_rows > 0));
        self.in_txn = false;
        self.txn_rows = 0;
        self.txn_origin = None;
        self.txn_committed_ms = None;
        self.in_xa = false;
        // Rows of an XA group that closed without a prepare (never the case in a real log).
        self.xa_rows.clear();
    }

    fn corrupt(&self, at: u64, what: &str) -> Error {
        Error::source(format!("cannot decode the binlog event at {}:{at}: {what}", self.file)).remedy(
            "check the server's binlog with mariadb-binlog/mysqlbinlog at that position; outboxd stops rather than skip it",
        )
    }
}

/// The file and offset a rotate event points at. The rotate a server sends first (before its format
/// description tells us checksums are on) still carries its CRC32, which must not become part of the
/// file name: strip it when it verifies.
fn rotate_target(event: &Event) -> Option<(String, u64)> {
    let data = event.data();
    let pos = u64::from_le_bytes(data.get(..8)?.try_into().ok()?);
    let mut name = &data[8..];
    let stripped = matches!(
        event.footer().get_checksum_alg(),
        Ok(Some(BinlogChecksumAlg::BINLOG_CHECKSUM_ALG_CRC32))
    );
    if !stripped && name.len() > 4 {
        let (body, sum) = data.split_at(data.len() - 4);
        let mut header = Vec::with_capacity(19);
        event.header().serialize(&mut header);
        let mut hasher = crc32fast::Hasher::new();
        hasher.update(&header);
        hasher.update(body);
        if hasher.finalize().to_le_bytes() == sum {
            name = &name[..name.len() - 4];
        }
    }
    Some((String::from_utf8_lossy(name).into_owned(), pos))
}

fn checksum_ok(event: &Event) -> bool {
    let footer = event.footer();
    if !footer.get_checksum_enabled() {
        return true;
    }
    match (footer.get_checksum_alg(), event.checksum()) {
        (Ok(Some(alg @ BinlogChecksumAlg::BINLOG_CHECKSUM_ALG_CRC32)), Some(sum)) => {
            u32::from_le_bytes(sum) == event.calc_checksum(alg)
        }
        _ => true,
    }
}

/// `schema.table` an `INSERT`/`REPLACE` statement writes to (unqualified names take `schema`).
fn insert_target(query: &str, schema: &str) -> Option<String> {
    let mut words = query.split_whitespace();
    let verb = words.next()?.to_ascii_uppercase();
    if verb != "INSERT" && verb != "REPLACE" {
        return None;
    }
    let target = words.find(|w| {
        !matches!(
            w.to_ascii_uppercase().as_str(),
            "LOW_PRIORITY" | "DELAYED" | "HIGH_PRIORITY" | "IGNORE" | "INTO"
        )
    })?;
    let name: String = target
        .split('(')
        .next()?
        .chars()
        .filter(|c| *c != '`')
        .collect();
    Some(if name.contains('.') {
        name
    } else {
        format!("{schema}.{name}")
    })
}

/// Same column count, types and type metadata: the cached column names still apply.
fn same_shape(a: &TableMapEvent<'_>, b: &TableMapEvent<'_>) -> bool {
    let n = a.columns_count();
    n == b.columns_count()
        && (0..n as usize).all(|i| {
            a.get_raw_column_type(i).ok() == b.get_raw_column_type(i).ok()
                && a.get_column_metadata(i) == b.get_column_metadata(i)
        })
}

#[cfg(test)]
mod tests {
    use super::insert_target;

    #[test]
    fn finds_the_table_a_statement_inserts_into() {
        assert_eq!(
            insert_target("INSERT INTO outbox (a) VALUES (1)", "app").as_deref(),
            Some("app.outbox")
        );
        assert_eq!(
            insert_target("insert ignore into `app`.`outbox`(a) values (1)", "x").as_deref(),
            Some("app.outbox")
        );
        assert_eq!(
            insert_target("REPLACE LOW_PRIORITY app.outbox SET a=1", "x").as_deref(),
            Some("app.outbox")
        );
        assert_eq!(insert_target("UPDATE app.outbox SET a=1", "x"), None);
    }
}
