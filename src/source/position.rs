//! Log positions, typed: a binlog position (file, offset and GTID state) or a WAL LSN, or a place in
//! an initial snapshot (the table and key read last, and the log position streaming starts at).
//!
//! A position is what the checkpoint stores and what a session resumes from. It is a plain value:
//! ordered by [`Position::reached`], shown by `Display`, stored by serde in the checkpoint's JSON
//! form (`{"file", "pos", "gtid_set"}` or `{"lsn"}`, unchanged since the first checkpoint format).
//! Sources make one per transaction; the binlog form is behind an `Arc` so the pipeline's clones
//! (tracker, checkpoint writer) cost a reference count, and nothing is rendered until it is stored
//! or shown.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::mysql::BinlogPosition;
use super::postgres::Lsn;
use super::snapshot::SnapshotPosition;
use crate::error::{Error, Result};

/// A resumable log position.
#[derive(Clone, PartialEq, Eq)]
pub enum Position {
    /// MySQL/MariaDB: the next event's `FILE:POS`, with the GTID state after the transaction.
    Binlog(Arc<BinlogPosition>),
    /// Postgres: a commit's end LSN (or a keepalive's WAL end).
    Lsn(Lsn),
    /// Inside a snapshot of the outbox tables; never a log position itself.
    Snapshot(Arc<SnapshotPosition>),
}

impl Position {
    /// The binlog position, or the error a MySQL source gives for a position of another kind.
    pub fn binlog(&self) -> Result<&BinlogPosition> {
        match self {
            Position::Binlog(b) => Ok(b),
            other => Err(Error::checkpoint(format!(
                "{other} is not a MySQL/MariaDB binlog position"
            ))
            .remedy("set a position like mysql-bin.000003:1234 with `outboxd checkpoint set`, or remove the checkpoint file")),
        }
    }

    /// The LSN, or the error a Postgres source gives for a position of another kind.
    pub fn lsn(&self) -> Result<Lsn> {
        match self {
            Position::Lsn(l) => Ok(*l),
            other => Err(Error::checkpoint(format!("{other} is not a Postgres position"))
                .remedy("set a position like 0/16B3748 with `outboxd checkpoint set`, or remove the checkpoint file")),
        }
    }

    /// Whether this boundary is at or past `target`; positions of different kinds (and snapshot
    /// places) never reach each other.
    pub fn reached(&self, target: &Position) -> bool {
        match (self, target) {
            (Position::Lsn(c), Position::Lsn(t)) => c >= t,
            (Position::Binlog(c), Position::Binlog(t)) => c.reached(t),
            _ => false,
        }
    }
}

impl From<BinlogPosition> for Position {
    fn from(b: BinlogPosition) -> Self {
        Position::Binlog(Arc::new(b))
    }
}

impl From<Lsn> for Position {
    fn from(l: Lsn) -> Self {
        Position::Lsn(l)
    }
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Position::Binlog(b) => b.fmt(f),
            Position::Lsn(l) => l.fmt(f),
            Position::Snapshot(s) => s.fmt(f),
        }
    }
}

impl fmt::Debug for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Position({self})")
    }
}

/// The stored form (field names are the checkpoint file's).
#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum Stored {
    Snapshot {
        snapshot: SnapshotPosition,
    },
    Lsn {
        lsn: String,
    },
    Binlog {
        file: String,
        pos: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        gtid_set: Option<String>,
    },
}

impl Serialize for Position {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        let stored = match self {
            Position::Lsn(l) => Stored::Lsn { lsn: l.to_string() },
            Position::Snapshot(s) => Stored::Snapshot {
                snapshot: (**s).clone(),
            },
            Position::Binlog(b) => Stored::Binlog {
                file: b.file.clone(),
                pos: b.pos,
                gtid_set: b.gtid_text(),
            },
        };
        stored.serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Position {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        let bad = || {
            D::Error::custom(
                "not a position: expected {\"file\": NAME, \"pos\": N[, \"gtid_set\": GTIDS]}, {\"lsn\": \"X/Y\"} or {\"snapshot\": {...}}",
            )
        };
        match Stored::deserialize(deserializer).map_err(|_| bad())? {
            Stored::Snapshot { snapshot } => {
                if matches!(snapshot.then, Position::Snapshot(_)) {
                    return Err(D::Error::custom(
                        "a snapshot's `then` must be a log position",
                    ));
                }
                Ok(Position::Snapshot(Arc::new(snapshot)))
            }
            Stored::Lsn { lsn } => Lsn::parse(&lsn)
                .map(Position::Lsn)
                .ok_or_else(|| D::Error::custom(format!("{lsn:?} is not an LSN (like 0/16B3748)"))),
            Stored::Binlog {
                file,
                pos,
                gtid_set,
            } => BinlogPosition::with_gtid_text(file, pos, gtid_set.as_deref())
                .map(Position::from)
                .map_err(|e| D::Error::custom(e.message())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn positions_keep_the_checkpoint_files_json_form() {
        for stored in [
            json!({"lsn": "0/1531B38"}),
            json!({"file": "mariadb-bin.000002", "pos": 1234, "gtid_set": "0-1-5"}),
            json!({"file": "binlog.000001", "pos": 4}),
            json!({"file": "binlog.000001", "pos": 4, "gtid_set": "3e11fa47-71ca-11e1-9e33-c80aa9429562:1-5"}),
        ] {
            let position: Position = serde_json::from_value(stored.clone()).unwrap();
            assert_eq!(serde_json::to_value(&position).unwrap(), stored);
        }
        for bad in [
            json!({"lsn": "zero"}),
            json!({"n": 1}),
            json!({"file": "b.000001"}),
            json!({"file": "b.000001", "pos": 4, "gtid_set": "x-y"}),
        ] {
            assert!(
                serde_json::from_value::<Position>(bad.clone()).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn a_snapshot_place_is_stored_with_the_log_position_it_streams_from() {
        let stored = json!({"snapshot": {
            "table": "app.outbox",
            "after": [42, "text", {"base64": "AAE="}],
            "rows": 1000,
            "where": "published = false",
            "then": {"file": "b.000002", "pos": 4}
        }});
        let position: Position = serde_json::from_value(stored.clone()).unwrap();
        assert_eq!(serde_json::to_value(&position).unwrap(), stored);
        let Position::Snapshot(at) = &position else {
            panic!("{position}")
        };
        assert_eq!(at.after.as_ref().unwrap()[2].to_bytes(), vec![0, 1]);
        assert!(!position.reached(&at.then) && !at.then.reached(&position));
        assert!(position
            .to_string()
            .contains("then streaming from b.000002:4"));
        let nested = json!({"snapshot": {"table": "t", "rows": 0, "then": stored}});
        assert!(serde_json::from_value::<Position>(nested).is_err());
    }

    #[test]
    fn reached_compares_positions_of_one_kind_only() {
        let a = Position::Lsn(Lsn(10));
        let b = Position::Lsn(Lsn(20));
        assert!(b.reached(&a) && b.reached(&b) && !a.reached(&b));
        let file: Position = serde_json::from_value(json!({"file": "b.000002", "pos": 4})).unwrap();
        assert!(!file.reached(&a) && !a.reached(&file));
        assert!(a.binlog().is_err() && file.lsn().is_err());
    }
}
