//! `outboxd audit`: proving delivery in production, row by row. The rows still in the outbox
//! tables are read and routed exactly as `run` routes them; the records the broker holds on their
//! destinations are read without consuming them; the two are matched by row id
//! ([`matching`], the same code the integration tests' delivery checker uses). The report names
//! the rows that never arrived, those that arrived more than once, those that arrived out of key
//! order, and counts the records whose id names no row in the table.
//!
//! # When is a row missing, not just not yet sent?
//! The table is read first, in one consistent read; then the source's log end `L` is taken. Every
//! row the read saw was committed before `L`. The audit then waits (up to `--wait`) for the live
//! checkpoint to reach `L`: once it has, outboxd has had every row acknowledged, so a row with no
//! record is *missing*. If it does not get there (outboxd stopped, or behind), rows without a
//! record are *pending* instead, and the report says why; they do not fail the audit.
//!
//! # Safe by construction
//! Reads only: a `READ ONLY` transaction on the database (the one `outboxd snapshot` reads in, no
//! lock and no replication slot), partitions assigned to a consumer that never joins its group and
//! never commits, the checkpoint read without its lock. Every read has a timeout.
//!
//! # Memory
//! Each row in the window costs its id and where it is (about 100 bytes); the records stream past.
//! `--max-rows` bounds it: an audit that would hold more refuses before reading the broker.

pub mod kafka;
pub mod matching;
mod report;
mod rows;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, SystemTime};

pub use report::Report;

use crate::checkpoint::{Access, Store};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::route::{ID_HEADER, POSITION_HEADER};
use crate::sink::SinkConfig;
use matching::{Matcher, Rank, Record};

/// What the command line chose.
#[derive(Debug, Clone)]
pub struct Options {
    /// Only rows (and records) stamped at or after now minus this (needs `route.timestamp`).
    pub since: Option<Duration>,
    /// How long to wait for the checkpoint to cover the rows read.
    pub wait: Duration,
    /// The most rows the audit holds.
    pub max_rows: u64,
    /// A progress line on stderr (a terminal).
    pub progress: bool,
}

/// The sink's non-destructive reader, or why there is none.
fn kafka_of(config: &Config) -> Result<&crate::sink::kafka::config::KafkaConfig> {
    let name = config.sink().name();
    match config.sink() {
        SinkConfig::Kafka(kafka) => Ok(kafka),
        SinkConfig::RabbitMq(_) | SinkConfig::Sqs(_) | SinkConfig::Sns(_) => Err(Error::config(format!(
            "audit cannot read what the {name} sink delivered: a {name} queue hands each message to one consumer and removes it, so there is no way to look at what it holds without taking it from the application"
        ))
        .remedy("audit the records where your consumers store them, or run a Kafka pipeline beside this one and audit that")),
        SinkConfig::Nats(_) | SinkConfig::Redis(_) => Err(Error::config(format!(
            "audit does not read the {name} sink yet: only Kafka topics are audited"
        ))
        .remedy("audit a Kafka pipeline of the same tables, or compare by hand (NATS: `nats stream view`; Redis: XRANGE) until it does")),
    }
}

/// Runs the audit (see the module docs).
pub async fn run(config: &Config, options: &Options) -> Result<Report> {
    let kafka = kafka_of(config)?;
    let since_ms = match options.since {
        None => None,
        Some(_) if config.route.timestamp.is_none() => {
            return Err(Error::config(
                "--since needs route.timestamp: without it the rows in the table carry no time the records share (a record's timestamp is then the commit time, which the table does not hold)",
            )
            .remedy("set route.timestamp to the outbox table's creation-time column, or audit the whole table (leave out --since)"));
        }
        Some(since) => {
            let now = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .unwrap_or_default();
            Some(now.saturating_sub(since).as_millis() as i64)
        }
    };
    let router = config.sink().router(&config.route);
    let mut rows = rows::Rows::new(options.max_rows, options.progress);
    rows.read(config, &router, since_ms).await?;
    // Every row the read saw was committed before this end (see the module docs).
    let end = crate::source::current_end_position(&config.source).await?;
    let store = Store::open(config, &config.name, Access::Read)?;
    let behind = crate::retention::wait_for_checkpoint_to(&store, &end, options.wait).await?;
    let checkpoint = store
        .load_from_async()?
        .map(|c| c.position.to_string())
        .unwrap_or_else(|| "none".to_string());
    let rows::Rows {
        mut matcher,
        topics,
        unroutable,
        ..
    } = rows;
    let kafka = kafka.clone();
    let pipeline = config.name.clone();
    let id_column = config.route.id.clone();
    let progress = options.progress;
    let read = tokio::task::spawn_blocking(move || {
        let read = read_kafka(
            &kafka,
            &pipeline,
            &topics,
            &id_column,
            since_ms,
            progress,
            &mut matcher,
        );
        read.map(|read| (read, matcher))
    });
    let (read, matcher) = read
        .await
        .map_err(|e| Error::sink(format!("audit: the Kafka reader stopped: {e}")))??;
    Ok(Report::new(
        matcher.finish(),
        read,
        unroutable,
        behind,
        checkpoint,
        end.to_string(),
    ))
}

/// What the broker read found besides the matches.
#[derive(Debug, Default)]
pub struct KafkaRead {
    pub records: u64,
    pub topics: Vec<String>,
    /// Destinations the rows route to that the brokers do not have.
    pub absent_topics: Vec<String>,
    /// Dead letters of rows in the window, by reason.
    pub dead_letters: BTreeMap<String, u64>,
}

fn read_kafka(
    kafka: &crate::sink::kafka::config::KafkaConfig,
    pipeline: &str,
    topics: &BTreeSet<String>,
    id_column: &str,
    since_ms: Option<i64>,
    progress: bool,
    matcher: &mut Matcher,
) -> Result<KafkaRead> {
    let reader = kafka::Reader::connect(kafka, pipeline)?;
    let mut out = KafkaRead::default();
    for topic in topics {
        let Some(partitions) = reader.partitions(topic)? else {
            out.absent_topics.push(topic.clone());
            continue;
        };
        out.topics.push(topic.clone());
        for partition in 0..partitions {
            let mut each = |r: kafka::Read<'_>| {
                let id = (r.header)(ID_HEADER).map(String::from_utf8_lossy);
                let known = id.as_deref().is_some_and(|id| matcher.expects(id));
                // Outside the window: neither a match nor a stranger.
                if !known && since_ms.zip(r.timestamp).is_some_and(|(s, t)| t < s) {
                    return;
                }
                let rank = (r.header)(POSITION_HEADER)
                    .and_then(|p| std::str::from_utf8(p).ok())
                    .and_then(Rank::of_origin);
                matcher.observe(Record {
                    id: id.as_deref(),
                    topic: r.topic,
                    partition: r.partition,
                    offset: r.offset,
                    key: r.key,
                    rank: rank.as_ref(),
                });
            };
            out.records += reader.read(topic, partition, since_ms, &mut each)?;
            if progress {
                eprint!("\raudit: {} records read", out.records);
            }
        }
    }
    if let Some(dlq) = &kafka.dead_letter_topic {
        if let Some(partitions) = reader.partitions(dlq)? {
            for partition in 0..partitions {
                let mut each = |r: kafka::Read<'_>| {
                    let Some(id) = dead_letter_id(r.value, id_column) else {
                        return;
                    };
                    if matcher.dead_lettered(&id) {
                        let error = (r.header)("outboxd.error").map(String::from_utf8_lossy);
                        let reason = error
                            .as_deref()
                            .and_then(|e| e.split(':').next())
                            .unwrap_or("unknown");
                        *out.dead_letters.entry(reason.to_string()).or_default() += 1;
                    }
                };
                reader.read(dlq, partition, since_ms, &mut each)?;
            }
        }
    }
    if progress {
        eprintln!();
    }
    Ok(out)
}

/// The row id in a dead letter's body (the row as JSON), if it is text.
fn dead_letter_id(value: Option<&[u8]>, id_column: &str) -> Option<String> {
    let body: serde_json::Value = serde_json::from_slice(value?).ok()?;
    match body.get(id_column)? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}
