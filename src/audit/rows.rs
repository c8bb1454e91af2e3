//! The table side: every row in the window, routed as `run` routes it.

use std::collections::BTreeSet;
use std::io::IsTerminal;
use std::time::Duration;

use super::matching::Matcher;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::route::{Router, ID_HEADER};
use crate::source::snapshot::KeyValue;
use crate::source::SourceIdentity;

/// The longest opening the read (or closing it) may take.
const CONNECT: Duration = Duration::from_secs(60);
/// The longest one chunk may take (a table without a usable key order scans far).
const CHUNK: Duration = Duration::from_secs(300);

/// `step`, or an error naming `what` when the database does not answer within `limit`.
pub async fn bounded<T>(
    what: &str,
    limit: Duration,
    step: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    tokio::time::timeout(limit, step).await.unwrap_or_else(|_| {
        Err(Error::source(format!(
            "audit: {what} got no answer from the database within {}",
            humantime::format_duration(limit)
        ))
        .remedy("check the database (a long lock, a frozen server) and run the audit again")
        .transient())
    })
}

pub struct Rows {
    pub matcher: Matcher,
    /// The destinations the rows route to.
    pub topics: BTreeSet<String>,
    /// Rows the router refuses (expected as dead letters).
    pub unroutable: u64,
    /// Rows with no id (where they are): their records cannot be matched.
    pub without_id: Vec<String>,
    max_rows: u64,
    progress: bool,
}

impl Rows {
    pub fn new(max_rows: u64, progress: bool) -> Rows {
        Rows {
            matcher: Matcher::new(),
            topics: BTreeSet::new(),
            unroutable: 0,
            without_id: Vec::new(),
            max_rows,
            progress: progress && std::io::stderr().is_terminal(),
        }
    }

    pub async fn read(
        &mut self,
        config: &Config,
        router: &Router,
        since_ms: Option<i64>,
    ) -> Result<SourceIdentity> {
        let source = &config.source;
        let begin = crate::source::snapshot::begin(source, false);
        let begun = bounded("opening the read", CONNECT, begin).await?;
        let (mut reader, identity) = (begun.reader, begun.identity);
        for table in &source.tables {
            let mut after: Option<Vec<KeyValue>> = None;
            loop {
                let chunk = reader.chunk(table, after.as_deref(), None, source.snapshot_chunk);
                let chunk = bounded(&format!("reading {table}"), CHUNK, chunk).await?;
                let last = chunk.len() < source.snapshot_chunk;
                for keyed in &chunk {
                    self.add(config, router, table, keyed, since_ms)?;
                }
                if self.progress {
                    eprint!("\raudit: {} rows read", self.matcher.expected());
                }
                match chunk.into_iter().last() {
                    Some(row) if !last => after = Some(row.key),
                    _ => break,
                }
            }
        }
        let _ = tokio::time::timeout(CONNECT, reader.close()).await;
        if self.progress {
            eprintln!();
        }
        Ok(identity)
    }

    fn add(
        &mut self,
        config: &Config,
        router: &Router,
        table: &str,
        keyed: &crate::source::snapshot::KeyedRow,
        since_ms: Option<i64>,
    ) -> Result<()> {
        let key: Vec<String> = keyed.key.iter().map(ToString::to_string).collect();
        let place = format!("{table} ({})", key.join(", "));
        // A row without a time in the column (NULL, a zero date) is in no window: its record
        // carries the commit time, which the table does not hold.
        if since_ms.is_some_and(|s| router.column_timestamp(&keyed.row).is_none_or(|t| t < s)) {
            return Ok(());
        }
        let (id, topic) = match router.route(&keyed.row) {
            Ok(record) => {
                self.topics.insert(record.topic.clone());
                let id = record
                    .headers
                    .iter()
                    .find(|(name, _)| name == ID_HEADER)
                    .and_then(|(_, v)| v.as_deref())
                    .map(|v| String::from_utf8_lossy(v).into_owned());
                (id, Some(record.topic))
            }
            Err(_) => {
                self.unroutable += 1;
                let id = keyed
                    .row
                    .get(&config.route.id)
                    .and_then(|v| match v.to_json() {
                        serde_json::Value::String(s) => Some(s),
                        serde_json::Value::Number(n) => Some(n.to_string()),
                        _ => None,
                    });
                (id, None)
            }
        };
        match id.filter(|id| !id.is_empty()) {
            Some(id) => {
                let at = router.column_timestamp(&keyed.row);
                self.matcher.expect_at(&id, topic.as_deref(), &place, at)
            }
            // Its records cannot be told from any other's: named, not matched.
            None => self.without_id.push(place),
        }
        if (self.matcher.held() + self.without_id.len()) as u64 > self.max_rows {
            return Err(Error::config(format!(
                "audit: the outbox tables hold more than {} rows in the window",
                self.max_rows
            ))
            .remedy("audit a shorter window (--since, with route.timestamp), or raise --max-rows (about 250 bytes of memory per row)"));
        }
        Ok(())
    }
}
