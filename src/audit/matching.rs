//! Matching the rows an outbox table holds with the records a broker holds, by row id: which rows
//! never arrived, which arrived more than once, which arrived out of key order, and which records
//! name no row. Pure (no I/O), one implementation for `outboxd audit` and the integration tests'
//! delivery checker, so the check users run in production is the one the fault schedule proves.
//!
//! # Order
//! A record's place in commit order is its [`Rank`], read from its `outboxd.position` header: the
//! transaction's commit LSN (Postgres), GTID sequence number (MariaDB, per domain; MySQL, per
//! source UUID) or binlog file position. Two ranks compare only within one *lane* (a MariaDB
//! domain, a MySQL source UUID, the LSN line, a binlog file series): across lanes, or without a
//! rank (a snapshot row, a record another producer wrote), nothing is claimed. Rows of one
//! transaction share a rank, so their order among themselves is not checked either.
//!
//! Records must be fed partition by partition in offset order. Per key and partition, each row's
//! first appearance must not come before an earlier-committed row's first appearance: a resend
//! (a crash, a retry) repeats older rows after newer ones, which is a duplicate, not disorder.

use std::collections::{BTreeMap, HashMap, HashSet};

/// A record's place in commit order: comparable with ranks of the same `lane` only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rank {
    lane: Box<str>,
    at: u128,
}

impl Rank {
    pub fn new(lane: &str, at: u128) -> Rank {
        Rank {
            lane: lane.into(),
            at,
        }
    }

    /// The rank an `outboxd.position` header names, if it names a log position.
    pub fn of_origin(origin: &str) -> Option<Rank> {
        let number = |s: &str| {
            (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
                .then(|| s.parse::<u128>().ok())
                .flatten()
        };
        if let Some(gtid) = origin.strip_prefix("gtid:") {
            // MariaDB: DOMAIN-SERVER-SEQ (the sequence grows per domain, whichever server wrote).
            let parts: Vec<&str> = gtid.split('-').collect();
            if let [domain, server, seq] = parts[..] {
                if number(domain).is_some() && number(server).is_some() {
                    return Some(Rank::new(&format!("mariadb:{domain}"), number(seq)?));
                }
            }
            // MySQL: UUID[:TAG]:GNO.
            let (source, gno) = gtid.rsplit_once(':')?;
            return Some(Rank::new(&format!("mysql:{source}"), number(gno)?));
        }
        // Postgres: an LSN, X/Y in hex.
        if let Some((high, low)) = origin.split_once('/') {
            let high = u64::from_str_radix(high, 16).ok()?;
            let low = u64::from_str_radix(low, 16).ok()?;
            return Some(Rank::new("lsn", u128::from((high << 32) | low)));
        }
        // MySQL/MariaDB without GTIDs: FILE.NNNNNN:POS.
        let (file, pos) = origin.rsplit_once(':')?;
        let (base, index) = file.rsplit_once('.')?;
        Some(Rank::new(
            &format!("file:{base}"),
            (number(index)? << 64) | number(pos)?,
        ))
    }

    /// Whether this rank is known to come after `other` in commit order.
    fn after(&self, other: &Rank) -> bool {
        self.lane == other.lane && self.at > other.at
    }
}

/// A record as the matcher sees it.
#[derive(Debug, Clone, Copy)]
pub struct Record<'a> {
    /// The `id` header; `None` when the record has none.
    pub id: Option<&'a str>,
    pub topic: &'a str,
    pub partition: i32,
    pub offset: i64,
    pub key: Option<&'a [u8]>,
    pub rank: Option<&'a Rank>,
}

/// A row's first appearance came after that of a row committed after it, with the same key.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Disorder {
    pub topic: String,
    pub partition: i32,
    /// The key, as text (lossy for bytes that are not UTF-8).
    pub key: String,
    /// The row that arrived late, and where.
    pub id: String,
    pub offset: i64,
    /// The row committed after it whose record came first.
    pub after: String,
}

/// A row no record carries.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Absent {
    pub id: String,
    /// Where the row is (its table and primary key), for the operator to look at.
    #[serde(rename = "row")]
    pub place: String,
}

struct Entry {
    /// Where the row is routed: an index into [`Matcher::topics`]; `None` for a row the router
    /// refuses (it is due as a dead letter).
    topic: Option<u32>,
    place: Box<str>,
    /// The row's time (`route.timestamp`, ms), when it has one.
    at: Option<i64>,
    seen: u32,
    dead: bool,
}

/// What the matcher found; missing rows are sorted by where they are, the other lists are in the
/// order the records were read.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Rows expected.
    pub rows: u64,
    /// Rows with at least one record.
    pub delivered: u64,
    /// Rows with neither a record nor a dead letter.
    pub missing: Vec<Absent>,
    /// Rows without a record on a destination the broker could not show in full (it deleted
    /// records there, or an open transaction hides its end): maybe delivered, maybe not.
    pub unverifiable: Vec<Absent>,
    /// Rows with more than one record, and how many.
    pub duplicates: BTreeMap<String, u32>,
    pub disorder: Vec<Disorder>,
    /// Records whose id names no expected row.
    pub unknown: u64,
    /// Records carrying an expected row's id on another destination than the row routes to (not
    /// counted as its delivery).
    pub misplaced: u64,
    /// Records without an `id` header.
    pub without_id: u64,
    /// Rows with a dead letter and no record.
    pub dead_lettered: u64,
    /// Rows whose id another row in the tables has too (where they are): a record of that id
    /// cannot say which row it delivers, so these are not matched.
    pub colliding: Vec<String>,
}

impl Outcome {
    /// The records beyond the first of each row.
    pub fn extra_records(&self) -> u64 {
        self.duplicates.values().map(|n| u64::from(n - 1)).sum()
    }
}

/// Where per-key order is compared: a topic's partition and a key.
type KeyLane = (Box<str>, i32, Box<[u8]>);

/// Matches expected rows with the records read (see the module docs).
#[derive(Default)]
pub struct Matcher {
    rows: HashMap<Box<str>, Entry>,
    /// The destinations rows route to (an [`Entry`] names its own by index).
    topics: Vec<Box<str>>,
    /// Per key: the latest-committed row seen so far, and its rank.
    last: HashMap<KeyLane, (Rank, Box<str>)>,
    disorder: Vec<Disorder>,
    unknown: u64,
    misplaced: u64,
    without_id: u64,
    colliding: Vec<String>,
    collided: HashSet<Box<str>>,
    /// Destinations (by index) the broker could not show in full, and until when (ms): a row
    /// stamped at or after it, or on a destination with `i64::MAX`, may have lost its record.
    partial: HashMap<u32, i64>,
    /// Until when (ms; `i64::MAX`: any time) the dead-letter destination could not be shown in
    /// full, when it could not.
    partial_dead_letters: Option<i64>,
}

impl Matcher {
    pub fn new() -> Matcher {
        Matcher::default()
    }

    /// Expects the row `id` (found at `place`) on `topic` (`None`: as a dead letter). A second
    /// row with the same id takes the first out of the match too: both are listed as colliding.
    pub fn expect(&mut self, id: &str, topic: Option<&str>, place: &str) {
        self.expect_at(id, topic, place, None);
    }

    /// [`Matcher::expect`] for a row stamped `at` (ms; see [`Matcher::partial`]).
    pub fn expect_at(&mut self, id: &str, topic: Option<&str>, place: &str, at: Option<i64>) {
        if let Some(first) = self.rows.remove(id) {
            self.colliding.push(first.place.into());
            self.collided.insert(id.into());
        }
        if self.collided.contains(id) {
            self.colliding.push(place.into());
            return;
        }
        let topic = topic.map(|t| self.topic_index(t));
        self.rows.insert(
            id.into(),
            Entry {
                topic,
                place: place.into(),
                at,
                seen: 0,
                dead: false,
            },
        );
    }

    fn topic_index(&mut self, topic: &str) -> u32 {
        match self.topics.iter().position(|t| &**t == topic) {
            Some(i) => i as u32,
            None => {
                self.topics.push(topic.into());
                (self.topics.len() - 1) as u32
            }
        }
    }

    /// The broker cannot show all it took for `topic` before `until` (ms; `i64::MAX`: at any
    /// time): it deleted records there, or an open transaction hides the end. A row routed there
    /// without a record is unverifiable, not missing, unless its stamp says its record came after
    /// `until`.
    pub fn partial(&mut self, topic: &str, until: i64) {
        if let Some(i) = self.topics.iter().position(|t| &**t == topic) {
            let at = self.partial.entry(i as u32).or_insert(until);
            *at = (*at).max(until);
        }
    }

    /// The same for the dead-letter destination: an unroutable row (no destination of its own)
    /// without a dead letter, old enough, is unverifiable, not missing. A routable row whose
    /// record the broker refused, and whose dead letter was removed since, stays missing: taking
    /// every row as unverifiable would let any trimming of the dead letters hide every loss.
    pub fn partial_dead_letters(&mut self, until: i64) {
        let at = self.partial_dead_letters.get_or_insert(until);
        *at = (*at).max(until);
    }

    /// Whether `id` is an expected row.
    pub fn expects(&self, id: &str) -> bool {
        self.rows.contains_key(id)
    }

    pub fn expected(&self) -> usize {
        self.rows.len()
    }

    /// The rows held: expected ones and those taken out of the match for sharing an id.
    pub fn held(&self) -> usize {
        self.rows.len() + self.colliding.len()
    }

    /// One record, in offset order within its partition.
    pub fn observe(&mut self, record: Record<'_>) {
        let Some(id) = record.id else {
            self.without_id += 1;
            return;
        };
        let Some(entry) = self.rows.get_mut(id) else {
            self.unknown += 1;
            return;
        };
        let routed = entry.topic.map(|t| &*self.topics[t as usize]);
        if routed != Some(record.topic) {
            self.misplaced += 1;
            return;
        }
        entry.seen += 1;
        if entry.seen > 1 {
            return;
        }
        let (Some(rank), Some(key)) = (record.rank, record.key) else {
            return;
        };
        let lane: KeyLane = (record.topic.into(), record.partition, key.into());
        match self.last.get_mut(&lane) {
            Some((before, before_id)) if before.after(rank) => {
                // The later row stays the one to compare with: one misplaced row, one report.
                self.disorder.push(Disorder {
                    topic: record.topic.to_string(),
                    partition: record.partition,
                    key: String::from_utf8_lossy(key).into_owned(),
                    id: id.to_string(),
                    offset: record.offset,
                    after: before_id.to_string(),
                });
            }
            Some(last) => *last = (rank.clone(), id.into()),
            None => {
                self.last.insert(lane, (rank.clone(), id.into()));
            }
        }
    }

    /// A dead letter for row `id`: one the router made names the row's `table`; a copy the sink
    /// made of a record it could not store names the destination it was `meant_for`, which must
    /// be the row's. Refused or unroutable: handled, not delivered. False when no such row is
    /// expected.
    pub fn dead_lettered(&mut self, id: &str, of: DeadLetterOf<'_>) -> bool {
        let topics = &self.topics;
        match self.rows.get_mut(id) {
            Some(entry)
                if match of {
                    DeadLetterOf::Table(table) => place_is_of(&entry.place, table),
                    DeadLetterOf::Destination(meant) => {
                        entry.topic.is_some_and(|t| &*topics[t as usize] == meant)
                    }
                } =>
            {
                entry.dead = true;
                true
            }
            _ => false,
        }
    }

    pub fn finish(self) -> Outcome {
        let mut outcome = Outcome {
            rows: (self.rows.len() + self.colliding.len()) as u64,
            disorder: self.disorder,
            unknown: self.unknown,
            misplaced: self.misplaced,
            without_id: self.without_id,
            colliding: self.colliding,
            ..Outcome::default()
        };
        for (id, entry) in self.rows {
            // Whether the row is older than what a destination removed (`until`).
            let old_enough =
                |&until: &i64| until == i64::MAX || entry.at.is_none_or(|at| at < until);
            match entry.seen {
                0 if entry.dead => outcome.dead_lettered += 1,
                0 if match entry.topic {
                    Some(t) => self.partial.get(&t).is_some_and(old_enough),
                    None => self.partial_dead_letters.as_ref().is_some_and(old_enough),
                } =>
                {
                    outcome.unverifiable.push(Absent {
                        id: id.into(),
                        place: entry.place.into(),
                    })
                }
                0 => outcome.missing.push(Absent {
                    id: id.into(),
                    place: entry.place.into(),
                }),
                1 => outcome.delivered += 1,
                n => {
                    outcome.delivered += 1;
                    outcome.duplicates.insert(id.into(), n);
                }
            }
        }
        outcome.missing.sort_by(|a, b| a.place.cmp(&b.place));
        outcome.unverifiable.sort_by(|a, b| a.place.cmp(&b.place));
        outcome
    }
}

/// What a dead letter names its row by, besides the id.
#[derive(Debug, Clone, Copy)]
pub enum DeadLetterOf<'a> {
    /// The router's: the row's table.
    Table(&'a str),
    /// A sink's copy: the destination the record was meant for.
    Destination(&'a str),
}

/// A place is `table (primary key)`.
fn place_is_of(place: &str, table: &str) -> bool {
    place
        .strip_prefix(table)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with(" ("))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record<'a>(id: &'a str, key: &'a str, offset: i64, rank: &'a Rank) -> Record<'a> {
        Record {
            id: Some(id),
            topic: "t",
            partition: 0,
            offset,
            key: Some(key.as_bytes()),
            rank: Some(rank),
        }
    }

    #[test]
    fn origins_rank_within_their_lane_only() {
        let maria = |s| Rank::of_origin(s).unwrap();
        assert!(maria("gtid:0-1-10").after(&maria("gtid:0-2-9")));
        assert!(!maria("gtid:1-1-10").after(&maria("gtid:0-1-9")));
        let mysql = "gtid:3e11fa47-71ca-11e1-9e33-c80aa9429562:23";
        assert!(maria(mysql).after(&maria("gtid:3e11fa47-71ca-11e1-9e33-c80aa9429562:5")));
        assert!(!maria(mysql).after(&maria("gtid:4e11fa47-71ca-11e1-9e33-c80aa9429562:5")));
        assert!(maria("gtid:3e11fa47-71ca-11e1-9e33-c80aa9429562:tag:7")
            .lane
            .ends_with(":tag"));
        assert!(maria("1/0").after(&maria("0/FFFFFFFF")));
        assert!(maria("binlog.000002:4").after(&maria("binlog.000001:9000")));
        assert!(!maria("binlog.000002:4").after(&maria("other.000001:9000")));
        for none in ["snapshot:app.outbox:7", "", "gtid:", "x/y", "file:pos"] {
            assert_eq!(Rank::of_origin(none), None, "{none}");
        }
    }

    #[test]
    fn missing_duplicated_unknown_and_dead_lettered_rows_are_told_apart() {
        let mut m = Matcher::new();
        for id in ["a", "b", "c", "d", "e"] {
            m.expect(id, Some("t"), &format!("outbox ({id})"));
        }
        // Rows on a destination the broker cannot show in full: unverifiable, not missing.
        m.expect("f", Some("trimmed"), "outbox (f)");
        m.expect("g", Some("trimmed"), "outbox (g)");
        // Stamped after what the broker deleted: its record cannot have been deleted.
        m.expect_at("h", Some("trimmed"), "outbox (h)", Some(2_000));
        m.partial("trimmed", 1_000);
        // One id in three rows (another table's, say): none of them is matched.
        m.expect("a", Some("t"), "other (a)");
        m.expect("a", Some("t"), "third (a)");
        let r = Rank::new("lsn", 1);
        for (i, id) in ["a", "b", "b", "zz"].into_iter().enumerate() {
            m.observe(record(id, "k", i as i64, &r));
        }
        // e's id on another topic: not e's delivery.
        m.observe(Record {
            topic: "elsewhere",
            ..record("e", "k", 0, &r)
        });
        m.observe(Record {
            id: None,
            ..record("", "k", 9, &r)
        });
        assert!(!m.dead_lettered("d", DeadLetterOf::Table("other")));
        assert!(m.dead_lettered("d", DeadLetterOf::Table("outbox")));
        assert!(!m.dead_lettered("nope", DeadLetterOf::Table("outbox")));
        // A sink's copy names the destination it was meant for: the row's, or it is not its.
        assert!(!m.dead_lettered("g", DeadLetterOf::Destination("t")));
        assert!(m.dead_lettered("g", DeadLetterOf::Destination("trimmed")));
        let out = m.finish();
        assert_eq!((out.rows, out.delivered, out.dead_lettered), (10, 1, 2));
        let unverifiable: Vec<&str> = out.unverifiable.iter().map(|a| a.place.as_str()).collect();
        assert_eq!(unverifiable, vec!["outbox (f)"]);
        assert_eq!(out.colliding, vec!["outbox (a)", "other (a)", "third (a)"]);
        assert_eq!(out.misplaced, 1);
        let missing: Vec<&str> = out.missing.iter().map(|a| a.place.as_str()).collect();
        assert_eq!(missing, vec!["outbox (c)", "outbox (e)", "outbox (h)"]);
        assert_eq!(out.duplicates, BTreeMap::from([("b".to_string(), 2)]));
        // zz, and a (colliding, so matched to no row).
        assert_eq!(
            (out.unknown, out.without_id, out.extra_records()),
            (2, 1, 1)
        );
        assert!(out.disorder.is_empty());
    }

    #[test]
    fn a_row_first_seen_after_a_later_one_of_its_key_is_disorder_a_resend_is_not() {
        let mut m = Matcher::new();
        for id in ["r1", "r2", "r3", "o1"] {
            m.expect(id, Some("t"), id);
        }
        let (one, two, three) = (
            Rank::new("lsn", 1),
            Rank::new("lsn", 2),
            Rank::new("lsn", 3),
        );
        m.observe(record("r1", "k", 0, &one));
        m.observe(record("r3", "k", 1, &three));
        // A resend of r1 after r3: a duplicate, not disorder.
        m.observe(record("r1", "k", 2, &one));
        // r2's first appearance after r3's: disorder.
        m.observe(record("r2", "k", 3, &two));
        // Another key, another partition: compared on their own.
        m.observe(record("o1", "other", 4, &one));
        let out = m.finish();
        assert_eq!(
            out.disorder,
            vec![Disorder {
                topic: "t".into(),
                partition: 0,
                key: "k".into(),
                id: "r2".into(),
                offset: 3,
                after: "r3".into(),
            }]
        );
        assert_eq!(out.duplicates.len(), 1);
    }
}
