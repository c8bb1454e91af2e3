//! `outboxd checkpoint import-debezium`: a Debezium source offset turned into an outboxd position,
//! so outboxd starts where a stopped Debezium connector would have resumed.
//!
//! Where the offset comes from: the value of the connector's record in Kafka Connect's offsets
//! topic (JSON), or Debezium Server's `offsets.dat` (a Java-serialised map whose values are that
//! same JSON: the JSON objects are picked out of the file). What it means:
//! - MySQL/MariaDB `file`/`pos` is the start of the transaction Debezium was in (it skips `event`
//!   events and `row` rows of it when resuming), and `gtids` the transactions completed before it.
//!   outboxd resumes at that transaction's start, so the transaction Debezium was in is sent again
//!   whole: duplicates, each with its row's `id`, and nothing lost.
//! - Postgres `lsn_commit` is the last transaction Debezium finished; outboxd starts there (the
//!   server sends every transaction that commits after it). Without it, `lsn`.
//!
//! An offset taken while Debezium was snapshotting names no streaming position and is refused.

use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::source::config::SourceKind;
use crate::source::mysql::{BinlogPosition, MariaGtidState};
use crate::source::postgres::lsn::{lsn_to_string, Lsn};
use crate::source::Position;

/// What an offset maps to.
#[derive(Debug)]
pub struct Imported {
    pub position: Position,
    /// Lines to tell the operator.
    pub notes: Vec<String>,
}

/// The position an offset stands for.
pub fn import(kind: SourceKind, input: &[u8]) -> Result<Imported> {
    let offsets = offsets_in(input);
    let wanted: Vec<&Map<String, Value>> = offsets
        .iter()
        .filter(|o| match kind {
            SourceKind::Mysql => o.contains_key("file") && o.contains_key("pos"),
            SourceKind::Postgres => o.contains_key("lsn") || o.contains_key("lsn_commit"),
        })
        .collect();
    let offset = match wanted.as_slice() {
        [one] => *one,
        [] => {
            return Err(Error::config(format!(
                "no Debezium {} offset found in the input",
                kind.as_str()
            ))
            .remedy(match kind {
                SourceKind::Mysql => "give the offset JSON, e.g. {\"file\":\"mysql-bin.000003\",\"pos\":154,\"gtids\":\"…\"} (the value in Kafka Connect's offsets topic) or Debezium Server's offsets.dat",
                SourceKind::Postgres => "give the offset JSON, e.g. {\"lsn_commit\":23804272,\"lsn\":23804272} (the value in Kafka Connect's offsets topic) or Debezium Server's offsets.dat",
            }))
        }
        many => {
            return Err(Error::config(format!(
                "{} Debezium offsets found in the input; outboxd cannot tell which connector to follow",
                many.len()
            ))
            .remedy("give the offset of the one connector that read this outbox (its value in the offsets topic)"))
        }
    };
    if offset
        .get("snapshot")
        .is_some_and(|s| s.as_bool() == Some(true) || s.as_str() == Some("true"))
    {
        return Err(Error::config(
            "the Debezium offset was taken during its snapshot, which names no log position to stream from",
        )
        .remedy("let the connector finish its snapshot (or start outboxd without a checkpoint and re-send with a snapshot)"));
    }
    match kind {
        SourceKind::Mysql => mysql(offset),
        SourceKind::Postgres => postgres(offset),
    }
}

/// Every JSON object in `input`: the whole input if it is JSON (an object, or the `[key, value]`
/// pair some tools print), else each object found in a binary file.
fn offsets_in(input: &[u8]) -> Vec<Map<String, Value>> {
    if let Ok(value) = serde_json::from_slice::<Value>(input) {
        let mut out = Vec::new();
        collect(value, &mut out);
        return out;
    }
    let mut out: Vec<Map<String, Value>> = Vec::new();
    let mut at = 0;
    while let Some(start) = input[at..].iter().position(|&b| b == b'{').map(|i| at + i) {
        let mut stream = serde_json::Deserializer::from_slice(&input[start..]).into_iter::<Value>();
        match stream.next() {
            Some(Ok(Value::Object(map))) => {
                at = start + stream.byte_offset();
                if !out.contains(&map) {
                    out.push(map);
                }
            }
            _ => at = start + 1,
        }
    }
    out
}

fn collect(value: Value, out: &mut Vec<Map<String, Value>>) {
    match value {
        Value::Object(map) => out.push(map),
        Value::Array(items) => items.into_iter().for_each(|v| collect(v, out)),
        _ => {}
    }
}

fn number(offset: &Map<String, Value>, key: &str) -> Option<u64> {
    match offset.get(key)? {
        Value::Number(n) => n.as_u64(),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
}

fn mysql(offset: &Map<String, Value>) -> Result<Imported> {
    let file = offset
        .get("file")
        .and_then(Value::as_str)
        .filter(|f| !f.is_empty())
        .ok_or_else(|| Error::config("the Debezium offset's \"file\" is not a binlog file name"))?;
    let pos = number(offset, "pos")
        .filter(|p| *p >= 4)
        .ok_or_else(|| Error::config("the Debezium offset's \"pos\" is not a binlog position"))?;
    let mut notes = vec![format!(
        "binlog {file}:{pos}: the start of the transaction Debezium was in; it is sent again whole (duplicates carry their row's id)"
    )];
    let mut gtid = None;
    // Debezium stopped inside a transaction (it would skip `event` events and `row` rows of it):
    // its GTID set may already hold that transaction, so resuming by GTID would skip the rest of
    // it. Resume at the transaction's start by FILE:POS instead.
    let inside = number(offset, "event").unwrap_or(0) > 0 || number(offset, "row").unwrap_or(0) > 0;
    if let Some(gtids) = offset
        .get("gtids")
        .and_then(Value::as_str)
        .filter(|g| !g.trim().is_empty())
    {
        match MariaGtidState::parse(&newest_per_domain(gtids)) {
            Ok(_) if inside => notes.push(format!(
                "Debezium stopped inside a transaction, which its GTID state {gtids} may already count: resuming by FILE:POS on that server"
            )),
            Ok(state) if !state.is_empty() => {
                notes.push(format!(
                    "MariaDB GTID state {gtids}: resumed by GTID, so any server of the topology will do"
                ));
                gtid = Some(state);
            }
            _ => notes.push(format!(
                "GTID set {gtids} (MySQL): outboxd resumes a live MySQL server by FILE:POS, so point source.url at the server Debezium read"
            )),
        }
    }
    // Debezium's `server_id` is the server that wrote the last event (the primary, when Debezium
    // read a replica), not necessarily the one it read: it cannot pin the checkpoint to a server.
    if gtid.is_none() {
        let origin = number(offset, "server_id")
            .map(|id| format!(" (its last event was written by server_id {id})"))
            .unwrap_or_default();
        notes.push(format!(
            "a FILE:POS position: source.url must be the very server Debezium read{origin}; binlog file names repeat across servers"
        ));
    }
    let position = BinlogPosition {
        file: file.to_string(),
        pos,
        gtid,
        mysql_gtids: None,
    };
    Ok(Imported {
        position: position.to_position(),
        notes,
    })
}

/// Debezium lists every server of a domain (`0-1-200,0-2-150`); MariaDB's position is the newest
/// sequence number per domain.
fn newest_per_domain(gtids: &str) -> String {
    let mut newest: Vec<(u32, &str, u64)> = Vec::new();
    for part in gtids.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let mut fields = part.splitn(3, '-');
        let (Some(domain), Some(server), Some(seq)) = (fields.next(), fields.next(), fields.next())
        else {
            return gtids.to_string();
        };
        let (Ok(domain), Ok(seq)) = (domain.parse::<u32>(), seq.parse::<u64>()) else {
            return gtids.to_string();
        };
        match newest.iter_mut().find(|(d, _, _)| *d == domain) {
            Some(entry) if entry.2 < seq => *entry = (domain, server, seq),
            Some(_) => {}
            None => newest.push((domain, server, seq)),
        }
    }
    newest
        .iter()
        .map(|(d, s, n)| format!("{d}-{s}-{n}"))
        .collect::<Vec<_>>()
        .join(",")
}

fn postgres(offset: &Map<String, Value>) -> Result<Imported> {
    let (key, lsn) = ["lsn_commit", "lsn"]
        .iter()
        .find_map(|k| number(offset, k).map(|n| (*k, n)))
        .ok_or_else(|| {
            Error::config("the Debezium offset's \"lsn_commit\"/\"lsn\" is not an LSN (a number)")
        })?;
    let lsn = Lsn(lsn);
    let notes = vec![
        format!(
            "LSN {} (Debezium {key}): transactions that commit after it are sent; the last one Debezium sent may come again",
            lsn_to_string(lsn.0)
        ),
        "the slot must still hold that WAL: reuse Debezium's slot (source.slot = its slot.name, if it uses pgoutput); a new slot cannot start in the past".to_string(),
    ];
    Ok(Imported {
        position: Position::Lsn(lsn),
        notes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mariadb_offset_becomes_file_pos_and_gtid_state() {
        let json = br#"{"ts_sec":1700000000,"file":"mariadb-bin.000002","pos":1234,"gtids":"0-1-13","row":1,"server_id":1,"event":2}"#;
        // Inside a transaction (event 2, row 1): by FILE:POS on that server, not by GTID.
        let inside = import(SourceKind::Mysql, json).unwrap();
        let b = inside.position.binlog().unwrap();
        assert_eq!((b.file.as_str(), b.pos), ("mariadb-bin.000002", 1234));
        assert_eq!(b.gtid, None);
        assert!(inside.notes.iter().any(|n| n.contains("server_id 1")));
        assert!(inside.notes[0].contains("sent again whole"));
        // Between transactions: by GTID, the newest sequence of each domain.
        let between = br#"{"file":"mariadb-bin.000002","pos":1234,"gtids":"0-1-200,0-2-150,1-1-7","row":0,"server_id":1,"event":0}"#;
        let imported = import(SourceKind::Mysql, between).unwrap();
        let gtid = imported.position.binlog().unwrap().gtid.clone().unwrap();
        assert_eq!(gtid.to_string(), "0-1-200,1-1-7");
    }

    #[test]
    fn a_mysql_offset_keeps_file_pos_and_says_why_the_gtid_set_is_not_used() {
        let json = br#"{"file":"binlog.000003","pos":154,"gtids":"3e11fa47-71ca-11e1-9e33-c80aa9429562:1-5"}"#;
        let imported = import(SourceKind::Mysql, json).unwrap();
        assert_eq!(imported.position.binlog().unwrap().gtid, None);
        assert!(imported.notes[1].contains("FILE:POS"));
    }

    #[test]
    fn a_postgres_offset_starts_at_the_last_commit() {
        let json = br#"{"lsn_proc":23804400,"lsn_commit":23804272,"lsn":23804400,"txId":750,"ts_usec":1700000000000000}"#;
        let imported = import(SourceKind::Postgres, json).unwrap();
        assert_eq!(imported.position, Position::Lsn(Lsn(23804272)));
    }

    #[test]
    fn offsets_are_found_inside_a_debezium_server_offsets_file() {
        // A Java-serialised map: binary framing around the JSON key and value.
        let mut file = vec![0xac, 0xed, 0x00, 0x05, 0x73, 0x72];
        file.extend_from_slice(br#"["outbox",{"server":"db1"}]"#);
        file.extend_from_slice(&[0x75, 0x71, 0x00, 0x7e, 0x00]);
        file.extend_from_slice(br#"{"file":"mariadb-bin.000001","pos":4567}"#);
        file.extend_from_slice(&[0x78]);
        let imported = import(SourceKind::Mysql, &file).unwrap();
        assert_eq!(imported.position.binlog().unwrap().pos, 4567);
    }

    #[test]
    fn what_cannot_be_mapped_is_refused() {
        let snapshot = br#"{"file":"b.000001","pos":4,"snapshot":true}"#;
        assert!(import(SourceKind::Mysql, snapshot)
            .unwrap_err()
            .message()
            .contains("snapshot"));
        assert!(import(SourceKind::Postgres, br#"{"file":"b.000001","pos":4}"#).is_err());
        let two = br#"[{"file":"a.000001","pos":4},{"file":"b.000001","pos":8}]"#;
        assert!(import(SourceKind::Mysql, two)
            .unwrap_err()
            .message()
            .contains("2 Debezium offsets"));
        assert!(import(SourceKind::Mysql, b"not json").is_err());
    }
}
