//! The audit's verdict: text for a person, JSON for a script, and the exit status.

use std::fmt::Write;

use serde_json::json;

use super::matching::{Absent, Outcome};
use super::tally::BrokerRead;

/// How many ids of each kind the text lists (the JSON lists them all).
const LISTED: usize = 20;

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
    pub checkpoint: String,
    pub log_end: String,
}

impl Report {
    pub fn new(
        mut outcome: Outcome,
        read: BrokerRead,
        unroutable: u64,
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
            checkpoint,
            log_end,
        }
    }

    /// Nothing missing and nothing out of key order (duplicates are allowed: bounded, same id).
    pub fn passed(&self) -> bool {
        self.outcome.missing.is_empty() && self.outcome.disorder.is_empty()
    }

    pub fn json(&self) -> serde_json::Value {
        let o = &self.outcome;
        json!({
            "rows": o.rows,
            "delivered": o.delivered,
            "missing": o.missing,
            "duplicates": o.duplicates,
            "order_violations": o.disorder,
            "unknown": o.unknown,
            "without_id": o.without_id,
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
            "passed": self.passed(),
        })
    }

    pub fn text(&self) -> String {
        let o = &self.outcome;
        let mut t = String::new();
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
        let _ = writeln!(
            t,
            "  unknown         {} (records whose id is not in the tables: pruned rows, or not outbox rows)",
            o.unknown
        );
        if o.without_id > 0 {
            let _ = writeln!(t, "  without id      {}", o.without_id);
        }
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
        let list = |t: &mut String, title: &str, items: Vec<String>| {
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
        };
        list(
            &mut t,
            "missing (committed, checkpointed, never delivered)",
            o.missing
                .iter()
                .map(|a| format!("{} at {}", a.id, a.place))
                .collect(),
        );
        list(
            &mut t,
            "out of key order",
            o.disorder
                .iter()
                .map(|d| {
                    format!(
                        "{} (key {:?}, {} partition {} offset {}) arrived after {}, committed after it",
                        d.id, d.key, d.topic, d.partition, d.offset, d.after
                    )
                })
                .collect(),
        );
        list(
            &mut t,
            "duplicated",
            o.duplicates
                .iter()
                .map(|(id, n)| format!("{id} ×{n}"))
                .collect(),
        );
        let _ = writeln!(
            t,
            "{}",
            if self.passed() {
                "PASS: every row due was delivered, in key order"
            } else {
                "FAIL: rows are missing or out of key order"
            }
        );
        t
    }
}
