//! The Postgres state machine: replication events in, outbox changes out. No I/O.
//!
//! pgoutput sends each transaction whole, after it committed: `Begin`, relation layouts and row changes,
//! `Commit`. A commit's *end LSN* is the boundary: resuming there starts with the next transaction.
//! Relation messages are matched against the configured outbox tables, so other tables' rows are
//! never converted. Logical decoding messages (`pg_logical_emit_message`) with a configured prefix are
//! the table-less outbox: their content is a JSON envelope whose keys act as columns. A non-transactional
//! message is a unit of its own, checkpointed at its own LSN. Keepalives outside a transaction are
//! boundaries too, so a quiet outbox on a busy database still moves the checkpoint and the slot.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::stream::Frame;

use super::lsn::{lsn_to_string, Lsn};
use super::pgoutput::{self, Message, TupleValue};
use super::values;
use crate::error::{Error, Result};
use crate::source::{Boundary, Change, Ignored, Position, Row, Value};

/// Prefix of the messages outboxd's own heartbeat emits.
pub const HEARTBEAT_PREFIX: &str = "outboxd.heartbeat";

struct Table {
    name: Arc<str>,
    names: Arc<[Arc<str>]>,
    types: Vec<u32>,
}

/// What the caller must do before feeding the next event.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    Continue,
    /// A relation that is not a configured table arrived: it may be a partition of one (a
    /// publication without `publish_via_partition_root` sends leaf names). Look up its ancestors and
    /// call [`Decoder::resolve_relation`].
    NeedAncestors {
        relation_id: u32,
        name: String,
    },
}

pub struct Decoder {
    watched: HashSet<String>,
    /// Layouts of relations waiting for [`Decoder::resolve_relation`].
    unresolved: HashMap<u32, Table>,
    /// Partitions of the configured tables by relation OID (known at session start), with the
    /// configured table each belongs to.
    partitions: HashMap<u32, Arc<str>>,
    prefixes: HashSet<String>,
    /// Relation id -> its layout if it is an outbox table, `None` for any other table.
    relations: HashMap<u32, Option<Table>>,
    in_txn: bool,
    /// The open transaction's final LSN (its Begin carries it).
    txn_final_lsn: Option<u64>,
    /// `txn_final_lsn` as text, made for the transaction's first outbox row (most transactions
    /// have none).
    txn_origin: Option<Arc<str>>,
    /// The open transaction's commit time (its Begin carries it), ms since the Unix epoch.
    txn_committed_ms: Option<i64>,
    txn_rows: u64,
    /// The last boundary handed out (never moves backwards).
    last: u64,
    ignored: Ignored,
}

/// The position of a boundary at WAL position `lsn`.
pub fn position(lsn: u64) -> Position {
    Position::Lsn(Lsn(lsn))
}

fn pg_time(micros: i64) -> Option<SystemTime> {
    let unix = pgoutput::pg_time_to_unix_micros(micros)?;
    Some(UNIX_EPOCH + Duration::from_micros(u64::try_from(unix).ok()?))
}

impl Decoder {
    pub fn new(
        start_lsn: u64,
        watched: impl IntoIterator<Item = String>,
        prefixes: impl IntoIterator<Item = String>,
    ) -> Self {
        Decoder {
            watched: watched.into_iter().collect(),
            unresolved: HashMap::new(),
            partitions: HashMap::new(),
            prefixes: prefixes.into_iter().collect(),
            relations: HashMap::new(),
            in_txn: false,
            txn_final_lsn: None,
            txn_origin: None,
            txn_committed_ms: None,
            txn_rows: 0,
            last: start_lsn,
            ignored: Ignored::default(),
        }
    }

    pub fn ignored(&self) -> Ignored {
        self.ignored
    }

    /// The partitions of the configured tables, by OID (see `Control::outbox_partitions`).
    pub fn set_partitions(&mut self, partitions: impl IntoIterator<Item = (u32, String)>) {
        self.partitions = partitions
            .into_iter()
            .map(|(oid, root)| (oid, Arc::from(root.as_str())))
            .collect();
    }

    /// Takes one message of the stream: a pgoutput message (decoded here, where its bytes are) or a
    /// keepalive.
    pub fn on_frame(&mut self, frame: Frame<'_>, out: &mut VecDeque<Change>) -> Result<Step> {
        let data = match frame {
            // Nothing open: everything before the walsender's position was sent, so it is a boundary.
            Frame::KeepAlive { wal_end } => {
                if !self.in_txn && wal_end > self.last {
                    self.last = wal_end;
                    out.push_back(Change::Idle(Boundary {
                        position: position(wal_end),
                        committed_at: None,
                    }));
                }
                return Ok(Step::Continue);
            }
            Frame::XLogData { data } => data,
        };
        let message = pgoutput::decode(data).map_err(|e| {
            Error::source(format!("cannot decode a pgoutput message: {e}")).remedy(
                "this is a bug or an unsupported server version; outboxd stops rather than skip it",
            )
        })?;
        match message {
            Message::Begin {
                final_lsn,
                commit_time_us,
                ..
            } => {
                self.in_txn = true;
                self.txn_rows = 0;
                self.txn_final_lsn = Some(final_lsn);
                self.txn_origin = None;
                self.txn_committed_ms =
                    pgoutput::pg_time_to_unix_micros(commit_time_us).map(|us| us / 1000);
            }
            Message::Commit {
                end_lsn,
                commit_time_us,
                ..
            } => self.close(end_lsn, pg_time(commit_time_us), out),
            Message::Logical {
                transactional,
                lsn,
                prefix,
                content,
            } => self.on_message(transactional, lsn, &prefix, &content, out),
            other => return self.on_pgoutput(other, out),
        }
        Ok(Step::Continue)
    }

    /// Settles a relation announced by [`Step::NeedAncestors`]: `ancestors` are its partition
    /// ancestors from the leaf up (empty for a table that is no partition), `None` if the relation no
    /// longer exists. A partition of a configured table takes that table's name; nothing else is
    /// forwarded. A vanished relation cannot be told apart, so it stops the stream rather than risk
    /// skipping an outbox row.
    pub fn resolve_relation(
        &mut self,
        relation_id: u32,
        ancestors: Option<Vec<String>>,
    ) -> Result<()> {
        let Some(mut table) = self.unresolved.remove(&relation_id) else {
            return Ok(());
        };
        let known = self.partitions.get(&relation_id).cloned();
        let Some(ancestors) = ancestors else {
            // Dropped since; a partition of an outbox at session start keeps its OID.
            if let Some(root) = known {
                table.name = root;
                self.relations.insert(relation_id, Some(table));
                return Ok(());
            }
            return Err(Error::source(format!(
                "rows of relation {} (oid {relation_id}) arrived, but the relation no longer exists, so outboxd cannot tell whether it was a partition of an outbox table",
                table.name
            ))
            .remedy("set publish_via_partition_root = true on the publication (then partitions' rows arrive under the outbox's own name); if that relation was not part of the outbox, move the checkpoint past this transaction with `outboxd checkpoint set`"));
        };
        let root = ancestors.into_iter().find(|a| self.watched.contains(a));
        if root.is_none() {
            if let Some(outbox) = known {
                // Detached since the session started. With publish_via_partition_root (which
                // outboxd requires) its rows from before arrived under the outbox's own name; what
                // arrives under its own name was written after it left the outbox.
                tracing::warn!(relation = %table.name, outbox = %outbox, "a former partition of the outbox publishes rows of its own: not forwarded");
            }
        }
        let entry = root.map(|root| {
            table.name = root.into();
            table
        });
        self.relations.insert(relation_id, entry);
        Ok(())
    }

    fn on_pgoutput(&mut self, message: Message, out: &mut VecDeque<Change>) -> Result<Step> {
        match message {
            Message::Relation(r) => {
                let name = r.qualified_name();
                let table = Table {
                    name: name.as_str().into(),
                    names: r
                        .columns
                        .iter()
                        .map(|c| Arc::from(c.name.as_str()))
                        .collect::<Vec<_>>()
                        .into(),
                    types: r.columns.iter().map(|c| c.type_oid).collect(),
                };
                if self.watched.contains(&name) {
                    self.relations.insert(r.id, Some(table));
                } else {
                    // Not ours by name; until its ancestors are known, no row of it is decided.
                    self.relations.remove(&r.id);
                    self.unresolved.insert(r.id, table);
                    return Ok(Step::NeedAncestors {
                        relation_id: r.id,
                        name,
                    });
                }
            }
            Message::Insert { relation_id, tuple } => {
                let table = match self.relations.get(&relation_id) {
                    Some(Some(t)) => t,
                    Some(None) => return Ok(Step::Continue),
                    None => {
                        return Err(Error::source(format!(
                            "insert into relation {relation_id} arrived before its layout"
                        ))
                        .transient())
                    }
                };
                if tuple.len() != table.names.len() {
                    return Err(Error::source(format!(
                        "insert into {} has {} values for {} columns",
                        table.name,
                        tuple.len(),
                        table.names.len()
                    ))
                    .transient());
                }
                // Consumed: a text value's bytes become its String without a copy.
                let values = tuple
                    .into_iter()
                    .zip(&table.types)
                    .map(|(v, oid)| match v {
                        TupleValue::Null | TupleValue::UnchangedToast => Value::Null,
                        TupleValue::Text(b) => values::from_text_owned(*oid, b),
                        TupleValue::Binary(b) => Value::Binary(b),
                    })
                    .collect();
                self.txn_rows += 1;
                out.push_back(Change::Row(Row {
                    table: table.name.clone(),
                    names: table.names.clone(),
                    values,
                    origin: self.origin(),
                    committed_ms: self.txn_committed_ms,
                }));
            }
            Message::Update { relation_id, .. } => {
                if matches!(self.relations.get(&relation_id), Some(Some(_))) {
                    self.ignored.updates += 1;
                }
            }
            Message::Delete { relation_id, .. } => {
                if matches!(self.relations.get(&relation_id), Some(Some(_))) {
                    self.ignored.deletes += 1;
                }
            }
            // Begin, Commit and Logical are taken by `on_frame`; the rest needs nothing.
            _ => {}
        }
        Ok(Step::Continue)
    }

    fn on_message(
        &mut self,
        transactional: bool,
        lsn: u64,
        prefix: &str,
        content: &[u8],
        out: &mut VecDeque<Change>,
    ) {
        if prefix == HEARTBEAT_PREFIX {
            if !transactional && !self.in_txn && lsn > self.last {
                self.last = lsn;
                out.push_back(Change::Idle(Boundary {
                    position: position(lsn),
                    committed_at: None,
                }));
            }
            return;
        }
        if !self.prefixes.contains(prefix) {
            return;
        }
        let (origin, committed_ms): (Arc<str>, _) = if transactional {
            (self.origin(), self.txn_committed_ms)
        } else {
            // Not part of a transaction: it happened when it was logged, which is about now.
            let now = std::time::SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .ok()
                .map(|d| d.as_millis() as i64);
            (lsn_to_string(lsn).into(), now)
        };
        let mut row = envelope_row(prefix, lsn, content, origin);
        row.committed_ms = committed_ms;
        out.push_back(Change::Row(row));
        if transactional {
            self.txn_rows += 1;
        } else if !self.in_txn {
            // A message of its own: commit it at its own LSN (a resumed stream starts after it).
            self.last = self.last.max(lsn);
            out.push_back(Change::Commit(Boundary {
                position: position(lsn),
                committed_at: Some(SystemTime::now()),
            }));
        }
    }

    fn origin(&mut self) -> Arc<str> {
        let lsn = self.txn_final_lsn.unwrap_or(self.last);
        self.txn_origin
            .get_or_insert_with(|| lsn_to_string(lsn).into())
            .clone()
    }

    fn close(
        &mut self,
        end_lsn: u64,
        committed_at: Option<SystemTime>,
        out: &mut VecDeque<Change>,
    ) {
        self.last = self.last.max(end_lsn);
        let boundary = Boundary {
            position: position(end_lsn),
            committed_at,
        };
        out.push_back(Change::closing(boundary, self.txn_rows > 0));
        self.in_txn = false;
        self.txn_rows = 0;
        self.txn_final_lsn = None;
        self.txn_origin = None;
    }
}

/// A logical message as a row: the JSON envelope's keys are its columns (strings as text, other JSON as
/// JSON text); `id` defaults to the message's LSN, which is stable across replays.
fn envelope_row(prefix: &str, lsn: u64, content: &[u8], origin: Arc<str>) -> Row {
    let mut names: Vec<Arc<str>> = Vec::new();
    let mut values = Vec::new();
    match serde_json::from_slice::<serde_json::Value>(content) {
        Ok(serde_json::Value::Object(map)) => {
            for (key, value) in map {
                names.push(key.as_str().into());
                values.push(match value {
                    serde_json::Value::Null => Value::Null,
                    serde_json::Value::String(s) => Value::Text(s),
                    other => Value::Json(other.to_string()),
                });
            }
        }
        _ => {
            names.push("payload".into());
            values.push(match std::str::from_utf8(content) {
                Ok(s) => Value::Text(s.to_string()),
                Err(_) => Value::Binary(content.to_vec()),
            });
        }
    }
    if !names.iter().any(|n| &**n == "id") {
        names.push("id".into());
        values.push(Value::Text(lsn_to_string(lsn)));
    }
    Row {
        table: format!("message:{prefix}").into(),
        names: names.into(),
        values,
        origin,
        committed_ms: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RELATION_OUTBOX: &[u8] =
        include_bytes!("../../../tests/data/pgoutput/relation_outbox.bin");
    const INSERT_OUTBOX: &[u8] = include_bytes!("../../../tests/data/pgoutput/insert_outbox.bin");

    fn xlog(bytes: &[u8]) -> Frame<'_> {
        Frame::XLogData { data: bytes }
    }

    /// pgoutput 'B' for a transaction whose commit record is at `final_lsn`.
    fn begin(final_lsn: u64) -> Vec<u8> {
        let mut b = vec![b'B'];
        b.extend(final_lsn.to_be_bytes());
        b.extend(0i64.to_be_bytes());
        b.extend(730u32.to_be_bytes());
        b
    }

    /// pgoutput 'C' ending at `end_lsn`.
    fn commit(lsn: u64, end_lsn: u64) -> Vec<u8> {
        let mut b = vec![b'C', 0];
        b.extend(lsn.to_be_bytes());
        b.extend(end_lsn.to_be_bytes());
        b.extend(0i64.to_be_bytes());
        b
    }

    /// pgoutput 'M' (a `pg_logical_emit_message`).
    fn message(transactional: bool, lsn: u64, prefix: &str, content: &[u8]) -> Vec<u8> {
        let mut b = vec![b'M', u8::from(transactional)];
        b.extend(lsn.to_be_bytes());
        b.extend(prefix.as_bytes());
        b.push(0);
        b.extend((content.len() as u32).to_be_bytes());
        b.extend(content);
        b
    }

    fn decoder() -> Decoder {
        Decoder::new(0, ["public.outbox".to_string()], ["outbox".to_string()])
    }

    #[test]
    fn a_captured_insert_becomes_a_row_and_the_commit_a_boundary() {
        let mut d = decoder();
        let mut out = VecDeque::new();
        d.on_frame(xlog(&begin(0x1531B08)), &mut out).unwrap();
        d.on_frame(xlog(RELATION_OUTBOX), &mut out).unwrap();
        d.on_frame(xlog(INSERT_OUTBOX), &mut out).unwrap();
        d.on_frame(xlog(&commit(0x1531B08, 0x1531B38)), &mut out)
            .unwrap();
        let Some(Change::Row(row)) = out.pop_front() else {
            panic!("{out:?}")
        };
        assert_eq!(&*row.table, "public.outbox");
        assert_eq!(&*row.origin, "0/1531B08");
        assert!(row.get("id").is_some() && row.get("payload").is_some());
        assert!(
            matches!(row.get("payload"), Some(Value::Json(_))),
            "{row:?}"
        );
        let Some(Change::Commit(b)) = out.pop_front() else {
            panic!("{out:?}")
        };
        assert_eq!(b.position.to_string(), "0/1531B38");
        assert_eq!(b.position.lsn().unwrap(), super::Lsn(0x1531B38));
    }

    #[test]
    fn each_transaction_gives_its_rows_and_messages_its_own_origin() {
        let mut d = decoder();
        let mut out = VecDeque::new();
        d.on_frame(xlog(&begin(0x100)), &mut out).unwrap();
        d.on_frame(xlog(RELATION_OUTBOX), &mut out).unwrap();
        d.on_frame(xlog(INSERT_OUTBOX), &mut out).unwrap();
        d.on_frame(xlog(&message(true, 0xF0, "outbox", b"{}")), &mut out)
            .unwrap();
        d.on_frame(xlog(&commit(0x100, 0x130)), &mut out).unwrap();
        // A transaction without outbox rows, then one with a message only.
        d.on_frame(xlog(&begin(0x200)), &mut out).unwrap();
        d.on_frame(xlog(&commit(0x200, 0x230)), &mut out).unwrap();
        d.on_frame(xlog(&begin(0x300)), &mut out).unwrap();
        d.on_frame(xlog(&message(true, 0x2F0, "outbox", b"{}")), &mut out)
            .unwrap();
        d.on_frame(xlog(&commit(0x300, 0x330)), &mut out).unwrap();
        // A message of its own, outside any transaction: its own LSN.
        d.on_frame(xlog(&message(false, 0x400, "outbox", b"{}")), &mut out)
            .unwrap();
        let origins: Vec<String> = out
            .iter()
            .filter_map(|c| match c {
                Change::Row(row) => Some(row.origin.to_string()),
                _ => None,
            })
            .collect();
        assert_eq!(origins, ["0/100", "0/100", "0/300", "0/400"]);
    }

    #[test]
    fn other_tables_and_unknown_prefixes_are_skipped_and_keepalives_move_the_boundary() {
        let mut d = Decoder::new(0, ["public.other".to_string()], Vec::<String>::new());
        let mut out = VecDeque::new();
        let step = d.on_frame(xlog(RELATION_OUTBOX), &mut out).unwrap();
        let Step::NeedAncestors { relation_id, name } = step else {
            panic!("{step:?}")
        };
        assert_eq!(name, "public.outbox");
        // Not a partition of anything.
        d.resolve_relation(relation_id, Some(vec![])).unwrap();
        d.on_frame(xlog(INSERT_OUTBOX), &mut out).unwrap();
        d.on_frame(xlog(&message(false, 50, "outbox", b"{}")), &mut out)
            .unwrap();
        assert!(out.is_empty(), "{out:?}");
        d.on_frame(Frame::KeepAlive { wal_end: 100 }, &mut out)
            .unwrap();
        assert!(
            matches!(out.pop_front(), Some(Change::Idle(b)) if b.position.to_string() == "0/64")
        );
        d.on_frame(Frame::KeepAlive { wal_end: 90 }, &mut out)
            .unwrap();
        assert!(
            out.is_empty(),
            "a keepalive never moves the boundary backwards"
        );
    }

    #[test]
    fn a_non_transactional_message_is_a_row_committed_at_its_own_lsn() {
        let mut d = decoder();
        let mut out = VecDeque::new();
        d.on_frame(
            xlog(&message(
                false,
                0x200,
                "outbox",
                br#"{"aggregatetype":"order","aggregateid":"7","payload":{"x":1}}"#,
            )),
            &mut out,
        )
        .unwrap();
        let Some(Change::Row(row)) = out.pop_front() else {
            panic!()
        };
        assert_eq!(row.get("aggregatetype"), Some(&Value::Text("order".into())));
        assert_eq!(row.get("payload"), Some(&Value::Json(r#"{"x":1}"#.into())));
        assert_eq!(row.get("id"), Some(&Value::Text("0/200".into())));
        assert!(
            matches!(out.pop_front(), Some(Change::Commit(b)) if b.position.to_string() == "0/200")
        );
    }

    #[test]
    fn a_partition_known_by_oid_at_session_start_is_the_outbox_even_once_dropped() {
        let mut d = Decoder::new(0, ["public.events".to_string()], Vec::<String>::new());
        let mut out = VecDeque::new();
        let Step::NeedAncestors { relation_id, .. } =
            Decoder::new(0, ["public.events".to_string()], Vec::<String>::new())
                .on_frame(xlog(RELATION_OUTBOX), &mut out)
                .unwrap()
        else {
            panic!()
        };
        d.set_partitions([(relation_id, "public.events".to_string())]);
        assert!(matches!(
            d.on_frame(xlog(RELATION_OUTBOX), &mut out).unwrap(),
            Step::NeedAncestors { .. }
        ));
        // Dropped since the session started: still the outbox's, by its OID.
        d.resolve_relation(relation_id, None).unwrap();
        d.on_frame(xlog(INSERT_OUTBOX), &mut out).unwrap();
        let Some(Change::Row(row)) = out.pop_front() else {
            panic!("{out:?}")
        };
        assert_eq!(&*row.table, "public.events");
    }

    #[test]
    fn a_partition_of_an_outbox_takes_the_outbox_name_and_a_vanished_relation_stops() {
        // The captured relation is `public.outbox`; here it plays a leaf of `public.events`.
        let mut d = Decoder::new(0, ["public.events".to_string()], Vec::<String>::new());
        let mut out = VecDeque::new();
        let Step::NeedAncestors { relation_id, .. } =
            d.on_frame(xlog(RELATION_OUTBOX), &mut out).unwrap()
        else {
            panic!()
        };
        let ancestors = vec!["public.outbox".to_string(), "public.events".to_string()];
        d.resolve_relation(relation_id, Some(ancestors)).unwrap();
        d.on_frame(xlog(INSERT_OUTBOX), &mut out).unwrap();
        let Some(Change::Row(row)) = out.pop_front() else {
            panic!("{out:?}")
        };
        assert_eq!(&*row.table, "public.events");

        let mut d = Decoder::new(0, ["public.events".to_string()], Vec::<String>::new());
        let Step::NeedAncestors { relation_id, .. } =
            d.on_frame(xlog(RELATION_OUTBOX), &mut out).unwrap()
        else {
            panic!()
        };
        let e = d.resolve_relation(relation_id, None).unwrap_err();
        assert!(e.message().contains("no longer exists"), "{e}");
        assert!(!e.is_transient());
        // Until resolved, a row of the relation is never silently dropped.
        let mut d = Decoder::new(0, ["public.events".to_string()], Vec::<String>::new());
        d.on_frame(xlog(RELATION_OUTBOX), &mut out).unwrap();
        assert!(d.on_frame(xlog(INSERT_OUTBOX), &mut out).is_err());
    }
}
