//! Binlog positions: `FILE:POS` always, plus the server's GTID state when it has one.
//!
//! Resumption prefers the GTID state because it names transactions, not byte offsets, so it survives a
//! move to another server of the same replication topology; `FILE:POS` is kept as the exact spot on the
//! server that wrote it. MariaDB's GTID state is one `domain-server-seq` per replication domain (the
//! last transaction applied in that domain); it is what `@slave_connect_state` takes.

use std::collections::BTreeMap;
use std::fmt;

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

    /// Whether this state knows every replication domain `other` names.
    pub fn has_domains_of(&self, other: &MariaGtidState) -> bool {
        other.domains.keys().all(|d| self.domains.contains_key(d))
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

/// The largest transaction number MySQL hands out (`GNO_END - 1`).
const MAX_GNO: u64 = (1 << 63) - 2;

/// A MySQL GTID set: for each source (`uuid`, or `uuid:tag` from 8.4 on), the transaction numbers
/// executed, as sorted, merged, inclusive intervals. Printed the way MySQL prints `gtid_executed`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MysqlGtidSet {
    sources: BTreeMap<String, Vec<(u64, u64)>>,
}

impl MysqlGtidSet {
    /// Adds transaction `gno` of `source` (`uuid` or `uuid:tag`).
    pub fn add(&mut self, source: &str, gno: u64) {
        self.add_interval(source, gno, gno);
    }

    /// Adds the inclusive interval `start..=end`.
    pub fn add_interval(&mut self, source: &str, start: u64, end: u64) {
        let intervals = self.sources.entry(source.to_string()).or_default();
        intervals.push((start, end));
        intervals.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(intervals.len());
        for &(a, b) in intervals.iter() {
            match merged.last_mut() {
                Some(last) if a <= last.1.saturating_add(1) => last.1 = last.1.max(b),
                _ => merged.push((a, b)),
            }
        }
        *intervals = merged;
    }

    /// Parses MySQL's notation: `uuid:1-5:7,uuid2:3` and, from 8.4, tags inside a uuid's entry:
    /// `uuid:1-5:tag:1-3` (intervals after a tag belong to `uuid:tag`).
    pub fn parse(text: &str) -> Result<Self> {
        let mut set = MysqlGtidSet::default();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let bad = || {
                Error::source(format!("{part:?} is not a MySQL GTID set"))
                    .remedy("write MySQL GTID sets like 3E11FA47-71CA-11E1-9E33-C80AA9429562:1-5")
            };
            let mut pieces = part.split(':');
            let uuid = pieces.next().ok_or_else(bad)?;
            uuid::Uuid::parse_str(uuid).map_err(|_| bad())?;
            let uuid = uuid.to_ascii_lowercase();
            let mut source = uuid.clone();
            let mut intervals = 0;
            for piece in pieces {
                if !piece.starts_with(|c: char| c.is_ascii_digit()) {
                    // MySQL's tags: a letter or _, then letters, digits or _; 32 at most.
                    let tag_ok = piece.len() <= 32
                        && piece.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
                        && piece.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
                    if !tag_ok {
                        return Err(bad());
                    }
                    source = format!("{uuid}:{}", piece.to_ascii_lowercase());
                    continue;
                }
                let (a, b) = match piece.split_once('-') {
                    Some((a, b)) => (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?),
                    None => {
                        let n = piece.parse().map_err(|_| bad())?;
                        (n, n)
                    }
                };
                // MySQL's transaction numbers run from 1 to 2^63 - 2.
                if a > b || a == 0 || b > MAX_GNO {
                    return Err(bad());
                }
                set.add_interval(&source, a, b);
                intervals += 1;
            }
            if intervals == 0 {
                return Err(bad());
            }
        }
        Ok(set)
    }

    pub fn is_empty(&self) -> bool {
        self.sources.is_empty()
    }

    /// The sources (`uuid` or `uuid:tag`) the set names.
    pub fn sources(&self) -> impl Iterator<Item = &str> {
        self.sources.keys().map(String::as_str)
    }

    pub fn has_source(&self, source: &str) -> bool {
        self.sources.contains_key(source)
    }

    /// The set as COM_BINLOG_DUMP_GTID sends it: one block per source (tagged ones in the TSID
    /// format the driver picks by itself).
    pub fn sids(&self) -> Result<Vec<mysql_common::packets::Sid<'static>>> {
        self.sources
            .iter()
            .map(|(source, intervals)| {
                let mut text = source.clone();
                for (a, b) in intervals {
                    text.push_str(&format!(":{a}-{b}"));
                }
                text.parse().map_err(|e| {
                    Error::source(format!(
                        "GTID set {text:?} cannot be sent to the server: {e}"
                    ))
                })
            })
            .collect()
    }

    /// Every transaction of `other` is in this set.
    pub fn covers(&self, other: &MysqlGtidSet) -> bool {
        other.sources.iter().all(|(source, intervals)| {
            let mine = self.sources.get(source);
            intervals
                .iter()
                .all(|(a, b)| mine.is_some_and(|m| m.iter().any(|(x, y)| x <= a && b <= y)))
        })
    }
}

impl fmt::Display for MysqlGtidSet {
    /// One entry per server uuid, its untagged intervals first, then each tag with its intervals.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut current_uuid: Option<&str> = None;
        for (source, intervals) in &self.sources {
            let (uuid, tag) = match source.split_once(':') {
                Some((u, t)) => (u, Some(t)),
                None => (source.as_str(), None),
            };
            if current_uuid != Some(uuid) {
                if current_uuid.is_some() {
                    f.write_str(",")?;
                }
                f.write_str(uuid)?;
                current_uuid = Some(uuid);
            }
            if let Some(tag) = tag {
                write!(f, ":{tag}")?;
            }
            for (a, b) in intervals {
                if a == b {
                    write!(f, ":{a}")?;
                } else {
                    write!(f, ":{a}-{b}")?;
                }
            }
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
    /// MySQL's executed GTID set after the transaction ending here, when known.
    pub mysql_gtids: Option<MysqlGtidSet>,
}

impl BinlogPosition {
    /// The stored GTID text: MariaDB's state or MySQL's set.
    pub fn gtid_text(&self) -> Option<String> {
        match (&self.gtid, &self.mysql_gtids) {
            (Some(g), _) => Some(g.to_string()),
            (None, Some(m)) if !m.is_empty() => Some(m.to_string()),
            _ => None,
        }
    }

    /// Whether the position names transactions (GTIDs) a server of this kind resumes by, so it
    /// means the same on every server of the replication topology.
    pub fn resumes_by_gtid(&self, is_mariadb: bool) -> bool {
        if is_mariadb {
            self.gtid.as_ref().is_some_and(|g| !g.is_empty())
        } else {
            self.mysql_gtids.as_ref().is_some_and(|g| !g.is_empty())
        }
    }

    pub fn to_position(&self) -> Position {
        Position::from(self.clone())
    }

    /// A position from its stored parts; `gtids` is told apart by its notation (MySQL sets name a
    /// server UUID, with ':'; MariaDB states are domain-server-seq).
    pub fn with_gtid_text(file: String, pos: u64, gtids: Option<&str>) -> Result<Self> {
        let (gtid, mysql_gtids) = match gtids {
            None => (None, None),
            Some(s) if s.contains(':') => (None, Some(MysqlGtidSet::parse(s)?)),
            Some(s) => (Some(MariaGtidState::parse(s)?), None),
        };
        Ok(BinlogPosition {
            file,
            pos,
            gtid,
            mysql_gtids,
        })
    }

    /// Whether this boundary is at or past `target` (both from one topology).
    pub fn reached(&self, target: &BinlogPosition) -> bool {
        match (
            &self.gtid,
            &target.gtid,
            &self.mysql_gtids,
            &target.mysql_gtids,
        ) {
            // A state built from the events seen (a replay from FILE:POS) may lack quiet domains:
            // then only the file position can tell.
            (Some(c), Some(t), _, _) if !t.is_empty() && c.has_domains_of(t) => c.covers(t),
            (_, _, Some(c), Some(t)) if !t.is_empty() => c.covers(t),
            _ => (self.file.as_str(), self.pos) >= (target.file.as_str(), target.pos),
        }
    }
}

impl fmt::Display for BinlogPosition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.file, self.pos)?;
        match self.gtid_text() {
            Some(g) if !g.is_empty() => write!(f, " gtid:{g}"),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
            mysql_gtids: None,
        };
        let stored = p.to_position();
        assert_eq!(stored.to_string(), "mariadb-bin.000002:1234 gtid:0-1-5");
        let json = serde_json::to_value(&stored).unwrap();
        let back: Position = serde_json::from_value(json).unwrap();
        assert_eq!(back.binlog().unwrap(), &p);
        let no_gtid = BinlogPosition { gtid: None, ..p };
        let json = serde_json::to_value(no_gtid.to_position()).unwrap();
        assert!(json.get("gtid_set").is_none());
        assert!(serde_json::from_value::<Position>(json!({"lsn": "0/1"}))
            .unwrap()
            .binlog()
            .is_err());
    }
}
