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
//! Each row in the window costs its id and where it is (about 250 bytes, measured in BENCHMARKS.md); the records stream past.
//! `--max-rows` bounds it: an audit that would hold more refuses before reading the broker.

mod kafka;
pub mod matching;
#[cfg(feature = "nats")]
mod nats;
#[cfg(feature = "redis")]
mod redis;
mod report;
mod rows;
mod tally;

use std::time::{Duration, SystemTime};

pub use report::{Report, Verdict};

use crate::checkpoint::{Access, Store};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::sink::SinkConfig;
use tally::Tally;

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

/// A broker the audit can read without taking anything from it.
enum Broker<'a> {
    Kafka(&'a crate::sink::kafka::config::KafkaConfig),
    #[cfg(feature = "redis")]
    Redis(&'a crate::sink::redis::config::RedisConfig),
    #[cfg(feature = "nats")]
    Nats(&'a crate::sink::nats::config::NatsConfig),
}

/// The sink's non-destructive reader, or why there is none.
fn broker_of(config: &Config) -> Result<Broker<'_>> {
    let name = config.sink().name();
    #[allow(unreachable_patterns)]
    match config.sink() {
        SinkConfig::Kafka(kafka) => Ok(Broker::Kafka(kafka)),
        #[cfg(feature = "redis")]
        SinkConfig::Redis(redis) => Ok(Broker::Redis(redis)),
        #[cfg(feature = "nats")]
        SinkConfig::Nats(nats) => Ok(Broker::Nats(nats)),
        SinkConfig::RabbitMq(_) | SinkConfig::Sqs(_) | SinkConfig::Sns(_) => Err(Error::config(format!(
            "audit cannot read what the {name} sink delivered: a {name} queue hands each message to one consumer and removes it, so there is no way to look at what it holds without taking it from the application"
        ))
        .remedy("audit the records where your consumers store them, or run a Kafka pipeline beside this one and audit that")),
        // A sink this build lacks: the config's validation refused it already.
        _ => Err(Error::config(format!(
            "this outboxd was built without the {name} sink, so it cannot audit it"
        ))
        .remedy(format!("build it with the sink: cargo build --release --features {name}"))),
    }
}

/// Runs the audit (see the module docs).
pub async fn run(config: &Config, options: &Options) -> Result<Report> {
    let broker = broker_of(config)?;
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
    let identity = rows.read(config, &router, since_ms).await?;
    // Every row the read saw was committed before this end (see the module docs).
    let end = crate::source::current_end_position(&config.source);
    let end = rows::bounded("reading the log end", Duration::from_secs(60), end).await?;
    let store = Store::open(config, &config.name, Access::Read)?;
    if store.load_from_async()?.is_none() {
        return Err(Error::checkpoint(format!(
            "audit: there is no checkpoint at {}, so no row can be told missing from not yet sent",
            store.describe()
        ))
        .remedy("audit with the pipeline's own config (name, checkpoint.store and checkpoint.dir as `run` has them), once outboxd has forwarded something"));
    }
    let wait = crate::retention::wait_for_checkpoint_to(&store, &end, &identity, options.wait);
    let behind = wait.await?;
    let stored = store.load_from_async()?;
    let cluster_unknown = unknown_cluster(stored.as_ref().map(|c| &c.source), &identity);
    let checkpoint = stored
        .map(|c| c.position.to_string())
        .unwrap_or_else(|| "none".to_string());
    let rows::Rows {
        matcher,
        topics,
        unroutable,
        without_id,
        ..
    } = rows;
    let tally = Tally::new(
        matcher,
        since_ms,
        &config.name,
        &config.route.id,
        options.progress,
    );
    let (matcher, mut read) = match broker {
        Broker::Kafka(kafka) => {
            let kafka = kafka.clone();
            let pipeline = config.name.clone();
            let read =
                tokio::task::spawn_blocking(move || kafka::read(&kafka, &pipeline, &topics, tally));
            read.await
                .map_err(|e| Error::sink(format!("audit: the Kafka reader stopped: {e}")))??
        }
        #[cfg(feature = "redis")]
        Broker::Redis(redis) => redis::read(redis, &topics, tally).await?,
        #[cfg(feature = "nats")]
        Broker::Nats(nats) => nats::read(&config.name, nats, &topics, tally).await?,
    };
    read.notes.extend(cluster_unknown);
    // Notes may quote a server's words; the rest of the report is counts and the table's and the
    // broker's own data, which scrubbing could only corrupt (a short password inside a number).
    for note in &mut read.notes {
        *note = crate::secrets::scrub(note).into_owned();
    }
    Ok(Report::new(
        matcher.finish(),
        read,
        (unroutable, without_id),
        behind,
        checkpoint,
        end.to_string(),
    ))
}

/// A note when a Postgres checkpoint cannot be told to belong to the cluster read: its LSNs are
/// then compared as if it did, and a checkpoint copied from another cluster would make rows look
/// missing.
fn unknown_cluster(
    stored: Option<&crate::source::SourceIdentity>,
    read: &crate::source::SourceIdentity,
) -> Option<String> {
    let stored = stored?;
    if stored.kind != crate::source::config::SourceKind::Postgres {
        return None;
    }
    let why = match (&stored.system_identifier, &read.system_identifier) {
        (Some(_), Some(_)) => return None,
        (None, _) => "the checkpoint names no cluster (set by hand, or written by an older outboxd); the next checkpoint `run` writes will",
        (_, None) => "this cluster's system identifier could not be read: the audit's user needs REPLICATION or EXECUTE on pg_control_system()",
    };
    Some(format!(
        "could not tell whether the checkpoint was written against this Postgres cluster ({why}): if it was copied from another cluster, missing rows may be an artefact of that"
    ))
}
