//! Binlog positions: `FILE:POS` always, plus the server's GTID state when it has one.
//!
//! Resumption prefers the GTID state because it names transactions, not byte offsets, so it survives a
//! move to another server of the same replication topology; `FILE:POS` is kept as the exact spot on the
//! server that wrote it. MariaDB's GTID state is one `domain-server-seq` per replication domain (the
//! last transaction applied in that domain); it is what `@slave_connect_state` takes.

use std::collections::BTreeMap;
use std::fmt;

use serde_json::json;

use crate::error::{Error, Result};
use crate::source::Position;

/// A MariaDB GTID state: for each domain, the last `(server_id, seq_no)` applied.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MariaGtidState {
    domains: BTreeMap<u32, (u32, u64)>,
}

impl MariaGtidState {
    pub fn parse(text: &str) -> Result<Self> {
        let mut domains = BTreeMap::new();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let nums: Vec<&str> = part.split('-').collect();
            let parsed = match nums.as_slice() {
                [d, s, q] => d
                    .parse::<u32>()
                    .ok()
                    .zip(s.parse::<u32>().ok())
                    .zip(q.parse::<u64>().ok()),
                _ => None,
            };
            let ((domain, server), seq) = parsed.ok_or_else(|| {
                Error::source(format!(
                    "{part:?} is not a MariaDB GTID (domain-server-seq)"
                ))
                .remedy("write MariaDB GTIDs like 0-1-42, several separated by commas")
            })?;
            domains.insert(domain, (server, seq));
        }
        Ok(MariaGtidState { domains })
    }

    /// Records that transaction `domain-server-seq` committed.
    pub fn apply(&mut self, domain: u32, server: u32, seq: u64) {
        self.domains.insert(domain, (server, seq));
    }

    pub fn is_empty(&self) -> bool {
        self.domains.is_empty()
    }

    /// Every domain of `other` is at or past its sequence number here.
    pub fn covers(&self, other: &MariaGtidState) -> bool {
        other.domains.iter().all(|(domain, (_, seq))| {
            self.domains
                .get(domain)
                .is_some_and(|(_, mine)| mine >= seq)
        })
    }
}

impl fmt::Display for MariaGtidState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for (domain, (server, seq)) in &self.domains {
            if !first {
                f.write_str(",")?;
            }
            first = false;
            write!(f, "{domain}-{server}-{seq}")?;
        }
        Ok(())
    }
}

/// Where a reader of one server's binlog stands: the next event starts at `file:pos`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BinlogPosition {
    pub file: String,
    pub pos: u64,
    /// MariaDB's GTID state after the transaction ending here (None on servers without GTIDs).
    pub gtid: Option<MariaGtidState>,
}

impl BinlogPosition {
    pub fn to_position(&self) -> Position {
        let gtid = self.gtid.as_ref().map(|g| g.to_string());
        let json = match &gtid {
            Some(g) => json!({"file": self.file, "pos": self.pos, "gtid_set": g}),
            None => json!({"file": self.file, "pos": self.pos}),
        };
        Position::new(json, self.to_string())
    }

    pub fn from_position(position: &Position) -> Result<Self> {
        let json = position.json();
        let bad = || {
            Error::checkpoint(format!("{json} is not a MySQL/MariaDB binlog position"))
                .remedy("set a position like mysql-bin.000003:1234 with `outboxd checkpoint set`, or remove the checkpoint file")
        };
        let file = json.get("file").and_then(|v| v.as_str()).ok_or_else(bad)?;
        let pos = json.get("pos").and_then(|v| v.as_u64()).ok_or_else(bad)?;
        let gtid = match json.get("gtid_set") {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::String(s)) => Some(MariaGtidState::parse(s)?),
            Some(_) => return Err(bad()),
        };
        Ok(BinlogPosition {
            file: file.to_string(),
            pos,
            gtid,
        })
    }
}

impl fmt::Display for BinlogPosition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.file, self.pos)?;
        if let Some(g) = &self.gtid {
            if !g.is_empty() {
                write!(f, " gtid:{g}")?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gtid_state_round_trips_and_advances() {
        let mut s = MariaGtidState::parse("0-1-42, 3-7-9").unwrap();
        assert_eq!(s.to_string(), "0-1-42,3-7-9");
        s.apply(0, 2, 43);
        assert_eq!(s.to_string(), "0-2-43,3-7-9");
        assert!(MariaGtidState::parse("").unwrap().is_empty());
        assert!(MariaGtidState::parse("0-1").is_err());
        assert!(MariaGtidState::parse("a-b-c").is_err());
        let later = MariaGtidState::parse("0-2-43,3-7-9").unwrap();
        assert!(later.covers(&MariaGtidState::parse("0-1-42").unwrap()));
        assert!(!later.covers(&MariaGtidState::parse("0-1-44").unwrap()));
        assert!(!later.covers(&MariaGtidState::parse("5-1-1").unwrap()));
    }

    #[test]
    fn position_round_trips_through_json() {
        let p = BinlogPosition {
            file: "mariadb-bin.000002".into(),
            pos: 1234,
            gtid: Some(MariaGtidState::parse("0-1-5").unwrap()),
        };
        let stored = p.to_position();
        assert_eq!(stored.to_string(), "mariadb-bin.000002:1234 gtid:0-1-5");
        let back =
            BinlogPosition::from_position(&Position::from_json(stored.json().clone())).unwrap();
        assert_eq!(back, p);
        let no_gtid = BinlogPosition { gtid: None, ..p };
        assert!(no_gtid.to_position().json().get("gtid_set").is_none());
        assert!(
            BinlogPosition::from_position(&Position::from_json(json!({"lsn": "0/1"}))).is_err()
        );
    }
}
