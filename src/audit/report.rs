//! The audit's verdict: text for a person, JSON for a script, and the exit status.

use std::fmt::Write;

use serde_json::json;

use super::matching::{Absent, Outcome};
use super::tally::BrokerRead;

/// How many ids of each kind the text lists (the JSON lists them all).
const LISTED: usize = 20;

/// What the audit concluded (the exit status: 0, 1 or 3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Pass,
    Fail,
    Inconclusive,
}

impl Verdict {
    pub fn name(self) -> &'static str {
        match self {
            Verdict::Pass => "pass",
            Verdict::Fail => "fail",
            Verdict::Inconclusive => "inconclusive",
        }
    }
}

#[derive(Debug)]
pub struct Report {
    pub outcome: Outcome,
    /// Rows without a record while the checkpoint had not covered the read: not yet due.
    pub pending: Vec<Absent>,
    /// Why the rows without a record are pending (the checkpoint did not reach the read).
    pub behind: Option<String>,
    pub read: BrokerRead,
    /// Rows the router refuses (they are due as dead letters).
    pub unroutable: u64,
    /// Rows without an id, where they are: not matched, so neither delivered nor missing.
    pub rows_without_id: Vec<String>,
    pub checkpoint: String,
    pub log_end: String,
}

impl Report {
    pub fn new(
        mut outcome: Outcome,
        read: BrokerRead,
        (unroutable, rows_without_id): (u64, Vec<String>),
        behind: Option<String>,
        checkpoint: String,
        log_end: String,
    ) -> Report {
        let pending = if behind.is_some() {
            std::mem::take(&mut outcome.missing)
        } else {
            Vec::new()
        };
        Report {
            outcome,
            pending,
            behind,
            read,
            unroutable,
            rows_without_id,
            checkpoint,
            log_end,
        }
    }

    /// Fail: a row is missing or out of key order. Inconclusive: otherwise, but some rows could
    /// not be judged (pending, on a destination the broker cannot show in full, an id in several
    /// rows, no id). Pass: every row was judged
    /// delivered or dead-lettered, in key order (duplicates are allowed: bounded, same id).
    pub fn verdict(&self) -> Verdict {
        let o = &self.outcome;
        if !o.missing.is_empty() || !o.disorder.is_empty() {
            Verdict::Fail
        } else if !self.pending.is_empty()
            || !o.unverifiable.is_empty()
            || !o.colliding.is_empty()
            || !self.rows_without_id.is_empty()
        {
            Verdict::Inconclusive
        } else {
            Verdict::Pass
        }
    }

    pub fn passed(&self) -> bool {
        self.verdict() == Verdict::Pass
    }

    pub fn json(&self) -> serde_json::Value {
        let o = &self.outcome;
        json!({
            "rows": o.rows,
            "delivered": o.delivered,
            "missing": o.missing,
            "unverifiable": o.unverifiable,
            "duplicates": o.duplicates,
            "order_violations": o.disorder,
            "unknown": o.unknown,
            "without_id": o.without_id,
            "rows_without_id": self.rows_without_id,
            "unroutable": self.unroutable,
            "dead_lettered": o.dead_lettered,
            "dead_letter_reasons": self.read.dead_letters,
            "pending": self.pending.len(),
            "pending_rows": self.pending,
            "pending_because": self.behind,
            "records": self.read.records,
            "topics": self.read.topics,
            "absent_topics": self.read.absent_topics,
            "checkpoint": self.checkpoint,
            "log_end": self.log_end,
            "colliding_rows": o.colliding,
            "misplaced": o.misplaced,
            "notes": self.read.notes,
            "verdict": self.verdict().name(),
            "passed": self.passed(),
        })
    }

    pub fn text(&self) -> String {
        let mut t = String::new();
        self.counts(&mut t);
        self.context(&mut t);
        self.lists(&mut t);
        let _ = writeln!(t, "{}", self.verdict_line());
        t
    }

    /// The tally: one line per kind of row or record.
    fn counts(&self, t: &mut String) {
        let o = &self.outcome;
        let _ = writeln!(
            t,
            "{} rows in the outbox tables, {} records read from {} topic(s)",
            o.rows,
            self.read.records,
            self.read.topics.len()
        );
        let _ = writeln!(t, "  delivered       {}", o.delivered);
        let _ = writeln!(t, "  missing         {}", o.missing.len());
        let _ = writeln!(
            t,
            "  duplicated      {} ({} extra records)",
            o.duplicates.len(),
            o.extra_records()
        );
        let _ = writeln!(t, "  out of order    {}", o.disorder.len());
        let _ = writeln!(t, "  dead-lettered   {}", o.dead_lettered);
        let _ = writeln!(t, "  pending         {}", self.pending.len());
        if !o.unverifiable.is_empty() {
            let _ = writeln!(
                t,
                "  unverifiable    {} (no record where the broker no longer shows everything: see the notes)",
                o.unverifiable.len()
            );
        }
        let _ = writeln!(
            t,
            "  unknown         {} (records whose id is not in the tables: pruned rows, or not outbox rows)",
            o.unknown
        );
        if o.misplaced > 0 {
            let _ = writeln!(
                t,
                "  misplaced       {} (records of a row's id on another destination than it routes to)",
                o.misplaced
            );
        }
        if o.without_id > 0 {
            let _ = writeln!(t, "  records without an id  {}", o.without_id);
        }
        if !self.rows_without_id.is_empty() {
            let _ = writeln!(
                t,
                "  rows without an id     {} (not matched: give every row an id, route.id names the column)",
                self.rows_without_id.len()
            );
        }
    }

    /// Where the audit stood: checkpoint, log end, and what it could not read in full.
    fn context(&self, t: &mut String) {
        let _ = writeln!(
            t,
            "checkpoint {} (the log end after reading the tables: {})",
            self.checkpoint, self.log_end
        );
        if let Some(why) = &self.behind {
            let _ = writeln!(t, "rows without a record are pending, not missing: {why}");
        }
        for topic in &self.read.absent_topics {
            let _ = writeln!(t, "topic {topic:?} does not exist: its rows have no record");
        }
        for note in &self.read.notes {
            let _ = writeln!(t, "note: {note}");
        }
    }

    /// The ids behind each count, the first [`LISTED`] of each.
    fn lists(&self, t: &mut String) {
        let o = &self.outcome;
        list(
            t,
            "missing (committed, checkpointed, never delivered)",
            o.missing
                .iter()
                .map(|a| format!("{} at {}", shown(&a.id), shown(&a.place)))
                .collect(),
        );
        list(
            t,
            "unverifiable (no record, where the broker deleted records or could not show them)",
            o.unverifiable
                .iter()
                .map(|a| format!("{} at {}", shown(&a.id), shown(&a.place)))
                .collect(),
        );
        list(
            t,
            "out of key order",
            o.disorder
                .iter()
                .map(|d| {
                    format!(
                        "{} (key {:?}, {} partition {} offset {}) arrived after {}, committed after it",
                        shown(&d.id), d.key, shown(&d.topic), d.partition, d.offset, shown(&d.after)
                    )
                })
                .collect(),
        );
        list(
            t,
            "duplicated",
            o.duplicates
                .iter()
                .map(|(id, n)| format!("{} ×{n}", shown(id)))
                .collect(),
        );
        let places = |p: &[String]| p.iter().map(|p| shown(p).into_owned()).collect();
        list(t, "rows without an id", places(&self.rows_without_id));
        list(
            t,
            "rows sharing an id with another row (not matched)",
            places(&o.colliding),
        );
    }

    fn verdict_line(&self) -> &'static str {
        match self.verdict() {
            Verdict::Pass => "PASS: every row due was delivered, in key order",
            Verdict::Fail => "FAIL: rows are missing or out of key order",
            Verdict::Inconclusive => {
                "INCONCLUSIVE: nothing found missing, but some rows could not be judged (pending, unverifiable, or without a unique id)"
            }
        }
    }
}

/// Text from a row (an id, a key column, a topic) as one line: quoted and escaped when it holds a
/// control character, so a hostile row cannot print lines of its own (a forged verdict).
fn shown(text: &str) -> std::borrow::Cow<'_, str> {
    if text.chars().any(char::is_control) {
        format!("{text:?}").into()
    } else {
        text.into()
    }
}

/// A titled list of at most [`LISTED`] items, and how many more there are.
fn list(t: &mut String, title: &str, items: Vec<String>) {
    if items.is_empty() {
        return;
    }
    let _ = writeln!(t, "{title}:");
    for item in items.iter().take(LISTED) {
        let _ = writeln!(t, "  {item}");
    }
    if items.len() > LISTED {
        let _ = writeln!(
            t,
            "  … and {} more (--format json lists all)",
            items.len() - LISTED
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::matching::Matcher;

    #[test]
    fn a_hostile_id_cannot_print_a_line_of_its_own() {
        let mut m = Matcher::new();
        m.expect(
            "x\nPASS: every row due was delivered",
            Some("t"),
            "outbox (1)",
        );
        let report = Report::new(
            m.finish(),
            BrokerRead::default(),
            (0, Vec::new()),
            None,
            "c".into(),
            "e".into(),
        );
        let text = report.text();
        assert!(text.lines().all(|l| !l.starts_with("PASS")), "{text}");
        assert!(text.contains(r#""x\nPASS"#), "{text}");
        assert_eq!(report.verdict(), Verdict::Fail);
    }
}
