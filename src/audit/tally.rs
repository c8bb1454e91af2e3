//! Where every broker reader hands its records: each one matched (or counted outside the window),
//! each dead letter credited to its row, whatever the broker.

use std::collections::BTreeMap;

use super::matching::{DeadLetterOf, Matcher, Rank, Record};
use base64::Engine;

use crate::route::{ID_HEADER, POSITION_HEADER, ROW_HEADER, TABLE_HEADER};

/// Every dead letter's header naming why it is one.
const ERROR_HEADER: &str = "outboxd.error";
/// A NATS sink's copy: the subject it was meant for.
const SUBJECT_HEADER: &str = "outboxd.subject";
/// A Redis sink's copy: the stream it was meant for.
const STREAM_HEADER: &str = "outboxd.stream";

/// One record as a broker reader hands it over. `header` finds a header (Kafka), a field (Redis)
/// by name.
pub struct Read<'a> {
    pub topic: &'a str,
    pub partition: i32,
    pub offset: i64,
    pub key: Option<&'a [u8]>,
    pub value: Option<&'a [u8]>,
    pub timestamp: Option<i64>,
    pub header: &'a dyn Fn(&str) -> Option<&'a [u8]>,
}

/// What the broker read found besides the matches.
#[derive(Debug, Default)]
pub struct BrokerRead {
    pub records: u64,
    pub topics: Vec<String>,
    /// Destinations the rows route to that the broker does not have.
    pub absent_topics: Vec<String>,
    /// Dead letters of rows in the window, by reason.
    pub dead_letters: BTreeMap<String, u64>,
    /// What the reader could not read, or what may explain a missing row.
    pub notes: Vec<String>,
}

pub struct Tally {
    pub matcher: Matcher,
    pub out: BrokerRead,
    since_ms: Option<i64>,
    id_column: String,
    pipeline: String,
    progress: bool,
}

impl Tally {
    pub fn new(
        matcher: Matcher,
        since_ms: Option<i64>,
        pipeline: &str,
        id_column: &str,
        progress: bool,
    ) -> Tally {
        Tally {
            matcher,
            out: BrokerRead::default(),
            since_ms,
            id_column: id_column.to_string(),
            pipeline: pipeline.to_string(),
            progress,
        }
    }

    pub fn since_ms(&self) -> Option<i64> {
        self.since_ms
    }

    /// A record on a destination the rows route to.
    pub fn record(&mut self, r: Read<'_>) {
        self.out.records += 1;
        let id = (r.header)(ID_HEADER).map(String::from_utf8_lossy);
        let known = id.as_deref().is_some_and(|id| self.matcher.expects(id));
        // Outside the window: neither a match nor a stranger.
        if !known && self.since_ms.zip(r.timestamp).is_some_and(|(s, t)| t < s) {
            return;
        }
        let rank = (r.header)(POSITION_HEADER)
            .and_then(|p| std::str::from_utf8(p).ok())
            .and_then(Rank::of_origin);
        self.matcher.observe(Record {
            id: id.as_deref(),
            topic: r.topic,
            partition: r.partition,
            offset: r.offset,
            key: r.key,
            rank: rank.as_ref(),
        });
        if self.progress && self.out.records.is_multiple_of(10_000) {
            eprint!("\raudit: {} records read", self.out.records);
        }
    }

    /// A record on the dead-letter destination, with the `outboxd.error` every dead letter has.
    /// One the router made carries the row as JSON and names its pipeline (`outboxd.row` starts
    /// with its name) and table (`outboxd.table`): pipelines and tables may share a dead-letter
    /// destination, so only this pipeline's count, for a row of that table. One a sink made (a
    /// record the broker refused) is the record itself, naming where it was meant to go
    /// (`outboxd.subject` on NATS, `outboxd.stream` on Redis): its `id` credits the row routed
    /// there.
    pub fn dead_letter(&mut self, r: Read<'_>) {
        let text = |name: &str| (r.header)(name).and_then(|v| std::str::from_utf8(v).ok());
        let Some(error) = text(ERROR_HEADER) else {
            return;
        };
        let ours = text(ROW_HEADER).is_none_or(|row| {
            row.strip_prefix(self.pipeline.as_str())
                .is_some_and(|rest| rest.starts_with('/'))
        });
        if !ours {
            return;
        }
        let meant_for = text(SUBJECT_HEADER).or_else(|| text(STREAM_HEADER));
        let credited = match (text(TABLE_HEADER), meant_for) {
            (Some(table), _) => dead_letter_id(r.value, &self.id_column).is_some_and(|id| {
                let of = DeadLetterOf::Table(table);
                // The body renders a 16-byte id as a UUID; the id header may carry its base64
                // (`route.binary_16 = "base64"`).
                self.matcher.dead_lettered(&id, of)
                    || uuid::Uuid::parse_str(&id).is_ok_and(|u| {
                        let encoded =
                            base64::engine::general_purpose::STANDARD.encode(u.as_bytes());
                        self.matcher.dead_lettered(&encoded, of)
                    })
            }),
            (None, Some(meant)) => text(ID_HEADER).is_some_and(|id| {
                self.matcher
                    .dead_lettered(id, DeadLetterOf::Destination(meant))
            }),
            (None, None) => false,
        };
        if credited {
            let reason = error.split(':').next().unwrap_or("unknown");
            *self.out.dead_letters.entry(reason.to_string()).or_default() += 1;
        }
    }

    pub fn finish(self) -> (Matcher, BrokerRead) {
        if self.progress {
            eprintln!();
        }
        (self.matcher, self.out)
    }
}

/// The row id in a dead letter's body (the row as JSON), if it is text or a number.
fn dead_letter_id(value: Option<&[u8]>, id_column: &str) -> Option<String> {
    let body: serde_json::Value = serde_json::from_slice(value?).ok()?;
    match body.get(id_column)? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}
