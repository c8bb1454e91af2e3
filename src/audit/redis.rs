//! Reading what Redis holds for the audit: `XRANGE` over each stream, in pages, up to the last
//! entry it had when the read began. Reading a stream takes nothing from it (no consumer group is
//! created, nothing is acknowledged or trimmed).

use std::collections::BTreeSet;
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Value};

use super::matching::Matcher;
use super::tally::{BrokerRead, Read, Tally};
use crate::error::{Error, Result};
use crate::sink::redis::config::RedisConfig;
use crate::source::config::redact_url;

/// Entries per `XRANGE`.
const PAGE: usize = 1000;
/// The longest one command may take.
const REPLY: Duration = Duration::from_secs(30);
/// An entry's id is the time Redis added it, after the row's `route.timestamp`: a window starts
/// this much earlier, so a clock running behind the database's does not hide entries.
const SKEW_MS: i64 = 300_000;

/// Reads every stream of `topics` (and the dead-letter stream) into `tally`.
pub async fn read(
    config: &RedisConfig,
    topics: &BTreeSet<String>,
    mut tally: Tally,
) -> Result<(Matcher, BrokerRead)> {
    let shown = redact_url(&config.url);
    let failed = |what: &str, e: redis::RedisError| {
        Error::sink(format!("audit: {what} on Redis at {shown} failed: {e}"))
            .remedy("check that Redis is up and the user may run TYPE, XRANGE, XREVRANGE and XINFO (the audit never writes)")
            .transient()
    };
    let options = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(REPLY))
        .set_response_timeout(Some(REPLY));
    let mut conn = crate::sink::redis::client(config)?
        .get_multiplexed_async_connection_with_config(&options)
        .await
        .map_err(|e| failed("connecting", e))?;
    let start_ms = tally.since_ms().map_or(0, |ms| (ms - SKEW_MS).max(0));
    let start = match tally.since_ms() {
        None => "-".to_string(),
        Some(_) => format!("{start_ms}-0"),
    };
    for topic in topics {
        if !is_stream(&mut conn, topic)
            .await
            .map_err(|e| failed("TYPE", e))?
        {
            tally.out.absent_topics.push(topic.clone());
            continue;
        }
        tally.out.topics.push(topic.clone());
        let mut each = |r: Read<'_>| tally.record(r);
        scan(&mut conn, topic, &start, &mut each)
            .await
            .map_err(|e| failed(&format!("reading {topic:?}"), e))?;
        // After the scan: an entry trimmed while it ran counts too.
        match deleted(&mut conn, topic).await {
            Deleted::Since(ms) if ms >= start_ms => {
                tally.matcher.partial(topic, ms.saturating_add(SKEW_MS));
                tally.out.notes.push(format!(
                    "stream {topic:?} had entries deleted in the window (MAXLEN or MINID trimming, XTRIM or XDEL): a row without an entry there is unverifiable, not missing, unless it is newer than the last entry deleted"
                ));
            }
            Deleted::Since(_) | Deleted::Never => {}
            Deleted::Unknown(why) => tally.out.notes.push(format!(
                "could not tell whether stream {topic:?} had entries deleted ({why}): if it had (MAXLEN trimming), a missing row may have been trimmed away"
            )),
        }
    }
    if let Some(dlq) = &config.dead_letter_topic {
        if is_stream(&mut conn, dlq)
            .await
            .map_err(|e| failed("TYPE", e))?
        {
            let mut each = |r: Read<'_>| tally.dead_letter(r);
            scan(&mut conn, dlq, &start, &mut each)
                .await
                .map_err(|e| failed(&format!("reading {dlq:?}"), e))?;
            let deletions = deleted(&mut conn, dlq).await;
            if let Deleted::Unknown(why) = &deletions {
                tally.out.notes.push(format!(
                    "could not tell whether the dead-letter stream {dlq:?} had entries deleted ({why}): if it had, an unroutable row reported missing may have been dead-lettered"
                ));
            }
            if let Deleted::Since(ms) = deletions {
                if ms >= start_ms {
                    tally
                        .matcher
                        .partial_dead_letters(ms.saturating_add(SKEW_MS));
                    tally.out.notes.push(format!(
                        "the dead-letter stream {dlq:?} had entries deleted in the window: an unroutable row without a dead letter is unverifiable, not missing, unless it is newer than the last entry deleted"
                    ));
                }
            }
        }
    }
    Ok(tally.finish())
}

async fn is_stream(conn: &mut MultiplexedConnection, key: &str) -> redis::RedisResult<bool> {
    let kind: String = redis::cmd("TYPE").arg(key).query_async(conn).await?;
    Ok(kind == "stream")
}

/// Whether a stream ever lost entries.
enum Deleted {
    Never,
    /// The newest entry it deleted (by trimming or `XDEL`) was added then (ms).
    Since(i64),
    /// The server would not say (before Redis 7, or `XINFO` refused).
    Unknown(String),
}

/// What `XINFO STREAM`'s `max-deleted-entry-id` (Redis 7) says about `stream`.
async fn deleted(conn: &mut MultiplexedConnection, stream: &str) -> Deleted {
    let info: Value = match redis::cmd("XINFO")
        .arg("STREAM")
        .arg(stream)
        .query_async(conn)
        .await
    {
        Ok(info) => info,
        Err(e) => return Deleted::Unknown(format!("XINFO STREAM failed: {e}")),
    };
    let pairs: Vec<(Value, Value)> = match info {
        Value::Map(pairs) => pairs,
        Value::Array(items) => {
            let mut items = items.into_iter();
            std::iter::from_fn(|| Some((items.next()?, items.next()?))).collect()
        }
        _ => Vec::new(),
    };
    let text = |v: &Value| match v {
        Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        Value::SimpleString(s) => s.clone(),
        _ => String::new(),
    };
    let newest = pairs
        .iter()
        .find(|(name, _)| text(name) == "max-deleted-entry-id")
        .map(|(_, id)| text(id));
    let Some((ms, seq)) = newest.as_deref().and_then(|id| id.split_once('-')) else {
        return Deleted::Unknown(
            "the server reports no max-deleted-entry-id: Redis 7 or later does".into(),
        );
    };
    match (ms.parse::<i64>(), seq.parse::<u64>()) {
        (Ok(0), Ok(0)) => Deleted::Never,
        (Ok(ms), Ok(_)) => Deleted::Since(ms),
        _ => Deleted::Unknown(format!(
            "max-deleted-entry-id {newest:?} is not an entry id"
        )),
    }
}

/// One entry: its id and its fields.
type Entry = (Vec<u8>, Vec<(Vec<u8>, Vec<u8>)>);

/// `XRANGE`/`XREVRANGE`'s reply as entries; anything else is none.
fn entries(reply: Value) -> Vec<Entry> {
    let Value::Array(items) = reply else {
        return Vec::new();
    };
    items
        .into_iter()
        .filter_map(|item| {
            let Value::Array(mut parts) = item else {
                return None;
            };
            let (Value::Array(fields), Value::BulkString(id)) = (parts.pop()?, parts.pop()?) else {
                return None;
            };
            let mut pairs = Vec::with_capacity(fields.len() / 2);
            let mut fields = fields.into_iter();
            while let (Some(Value::BulkString(name)), Some(Value::BulkString(value))) =
                (fields.next(), fields.next())
            {
                pairs.push((name, value));
            }
            Some((id, pairs))
        })
        .collect()
}

/// Every entry of `stream` from `start` to the last one it held when the scan began.
async fn scan(
    conn: &mut MultiplexedConnection,
    stream: &str,
    start: &str,
    each: &mut dyn FnMut(Read<'_>),
) -> redis::RedisResult<()> {
    let last: Value = redis::cmd("XREVRANGE")
        .arg(stream)
        .arg("+")
        .arg("-")
        .arg("COUNT")
        .arg(1)
        .query_async(conn)
        .await?;
    let Some((last, _)) = entries(last).into_iter().next() else {
        return Ok(());
    };
    let mut from = start.as_bytes().to_vec();
    let mut offset = 0i64;
    loop {
        let page: Value = redis::cmd("XRANGE")
            .arg(stream)
            .arg(&from)
            .arg(&last)
            .arg("COUNT")
            .arg(PAGE)
            .query_async(conn)
            .await?;
        let page = entries(page);
        let full = page.len() == PAGE;
        for (id, fields) in &page {
            let field = |name: &str| -> Option<&[u8]> {
                fields
                    .iter()
                    .find(|(n, _)| n == name.as_bytes())
                    .map(|(_, v)| v.as_slice())
            };
            let timestamp = field("timestamp")
                .and_then(|t| std::str::from_utf8(t).ok())
                .and_then(|t| t.parse().ok());
            each(Read {
                topic: stream,
                partition: 0,
                offset,
                key: field("key"),
                value: field("payload"),
                timestamp,
                header: &field,
            });
            offset += 1;
            from = [b"(".as_slice(), id].concat();
        }
        if !full || page.last().is_some_and(|(id, _)| *id == last) {
            return Ok(());
        }
    }
}
