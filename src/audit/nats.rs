//! Reading what JetStream holds for the audit: per subject, an ephemeral ordered consumer from the
//! stream's first message to the stream's last message when the audit came to it. An ordered consumer takes
//! nothing (no acknowledgements; a work-queue stream is refused, as reading it would remove its
//! messages) and the server removes it once the audit stops asking.

use std::collections::BTreeSet;
use std::time::Duration;

use async_nats::jetstream::consumer::pull::OrderedConfig;
use async_nats::jetstream::context::GetStreamByNameErrorKind;
use async_nats::jetstream::stream::RetentionPolicy;
use async_nats::jetstream::{self, Context};
use base64::Engine;
use futures_util::StreamExt;

use super::matching::Matcher;
use super::tally::{BrokerRead, Read, Tally};
use crate::error::{Error, Result};
use crate::route::{ID_HEADER, POSITION_HEADER, ROW_HEADER, TABLE_HEADER};
use crate::sink::nats::config::NatsConfig;
use crate::sink::nats::message::{
    BASE64_HEADER, ERROR_HEADER, KEY_HEADER, SUBJECT_HEADER, TIMESTAMP_HEADER,
};

/// The longest one request, or a wait for the next message, may take.
const REPLY: Duration = Duration::from_secs(30);

fn failed(what: &str, e: impl std::fmt::Display) -> Error {
    Error::sink(format!("audit: {what} on NATS failed: {e}"))
        .remedy("check that NATS is up and the user may look up streams and create consumers ($JS.API.STREAM.NAMES, $JS.API.STREAM.INFO.*, $JS.API.CONSUMER.CREATE.*, $JS.API.CONSUMER.INFO.*, $JS.API.CONSUMER.MSG.NEXT.* and the inbox replies; the audit never publishes to a stream)")
        .transient()
}

async fn bounded<T, E: std::fmt::Display>(
    what: &str,
    step: impl std::future::Future<Output = std::result::Result<T, E>>,
) -> Result<T> {
    match tokio::time::timeout(REPLY, step).await {
        Ok(result) => result.map_err(|e| failed(what, e)),
        Err(_) => Err(failed(what, "no answer within 30 s")),
    }
}

/// Reads every subject of `topics` (and the dead-letter subject) into `tally`.
pub async fn read(
    pipeline: &str,
    config: &NatsConfig,
    topics: &BTreeSet<String>,
    mut tally: Tally,
) -> Result<(Matcher, BrokerRead)> {
    let client = crate::sink::nats::connect_client(&format!("{pipeline}-audit"), config).await?;
    let js = jetstream::new(client);
    for topic in topics {
        match scan(&js, topic, &mut |r| tally.record(r)).await? {
            Some(Held::All) => tally.out.topics.push(topic.clone()),
            Some(Held::Thinned(stream, until)) => {
                tally.out.topics.push(topic.clone());
                tally.matcher.partial(topic, until);
                tally.out.notes.push(format!(
                    "stream {stream:?} (holding {topic:?}) no longer has every message it stored (limits, a purge or deleted messages): a row without a message there is unverifiable, not missing"
                ));
            }
            None => tally.out.absent_topics.push(topic.clone()),
        }
    }
    if let Some(dlq) = &config.dead_letter_topic {
        if let Some(Held::Thinned(stream, until)) =
            scan(&js, dlq, &mut |r| tally.dead_letter(r)).await?
        {
            tally.matcher.partial_dead_letters(until);
            tally.out.notes.push(format!(
                "stream {stream:?} (holding the dead letters) no longer has every message it stored: an unroutable row without a dead letter is unverifiable, not missing, unless it is newer than what the stream removed"
            ));
        }
    }
    Ok(tally.finish())
}

/// What a stream still holds of what it stored.
enum Held {
    All,
    /// The stream (named) removed messages (by its limits, a purge, or a delete), none stamped
    /// after the time given (ms; `i64::MAX`: any).
    Thinned(String, i64),
}

/// A row's time and the server's may differ this much: a message the server stored at `t` may
/// carry a row stamped up to this much after `t`.
const SKEW_MS: i64 = 300_000;

/// Every message on `subject`; `None` when no stream captures it. What the stream lost is
/// looked at after the read, so messages removed while it ran count too.
async fn scan(js: &Context, subject: &str, each: &mut dyn FnMut(Read<'_>)) -> Result<Option<Held>> {
    let Some(name) = read_subject(js, subject, each).await? else {
        return Ok(None);
    };
    let mut stream = bounded("reading the stream", js.get_stream(&name)).await?;
    let state = bounded("reading the stream", stream.info())
        .await?
        .state
        .clone();
    Ok(Some(if state.deleted_count.unwrap_or(0) > 0 {
        // Messages deleted one by one: of any time.
        Held::Thinned(name, i64::MAX)
    } else if state.first_sequence > 1 && state.messages == 0 {
        // Every message removed (limits, a purge): the stream names no first one (its first
        // time is the zero time), so all up to its last one, which it still names.
        let last_ms = (state.last_timestamp.unix_timestamp_nanos() / 1_000_000) as i64;
        let until = if last_ms > 0 {
            last_ms.saturating_add(SKEW_MS)
        } else {
            i64::MAX
        };
        Held::Thinned(name, until)
    } else if state.first_sequence > 1 {
        // Removed from the front (limits, a purge): all older than the first one left.
        let first_ms = (state.first_timestamp.unix_timestamp_nanos() / 1_000_000) as i64;
        Held::Thinned(name, first_ms.saturating_add(SKEW_MS))
    } else {
        Held::All
    }))
}

/// Reads every message on `subject` into `each`; the name of the stream capturing it, `None`
/// when there is none.
async fn read_subject(
    js: &Context,
    subject: &str,
    each: &mut dyn FnMut(Read<'_>),
) -> Result<Option<String>> {
    let name = match tokio::time::timeout(REPLY, js.stream_by_subject(subject)).await {
        Ok(Ok(name)) => name,
        Ok(Err(e)) if e.kind() == GetStreamByNameErrorKind::NotFound => return Ok(None),
        Ok(Err(e)) => return Err(failed(&format!("finding the stream of {subject:?}"), e)),
        Err(_) => {
            return Err(failed(
                &format!("finding the stream of {subject:?}"),
                "no answer within 30 s",
            ))
        }
    };
    let mut stream = bounded("reading the stream", js.get_stream(&name)).await?;
    let info = bounded("reading the stream", stream.info()).await?;
    if info.config.retention == RetentionPolicy::WorkQueue {
        return Err(Error::config(format!(
            "audit cannot read the stream {name:?}: it is a work queue, so reading its messages would remove them"
        ))
        .remedy("audit a stream with limits or interest retention"));
    }
    let config = OrderedConfig {
        filter_subject: subject.to_string(),
        ..Default::default()
    };
    // The end: what the stream held when the audit came to it. A message after it is left for
    // the next audit, so a stream taking new messages as fast as they are read still ends.
    let last = info.state.last_sequence;
    let mut consumer = bounded(
        "creating an ordered consumer",
        stream.create_consumer(config),
    )
    .await?;
    let pending = bounded("reading the consumer", consumer.info())
        .await?
        .num_pending;
    if pending == 0 {
        return Ok(Some(name));
    }
    let mut messages = bounded("reading messages", consumer.messages()).await?;
    loop {
        let message = match tokio::time::timeout(REPLY, messages.next()).await {
            Ok(Some(Ok(message))) => message,
            Ok(Some(Err(e))) => return Err(failed(&format!("reading {subject:?}"), e)),
            Ok(None) => {
                return Err(failed(
                    &format!("reading {subject:?}"),
                    "the consumer ended",
                ))
            }
            Err(_) => {
                return Err(failed(
                    &format!("reading {subject:?}"),
                    "no message within 30 s while some were pending",
                ))
            }
        };
        let info = message
            .info()
            .map_err(|e| failed("reading a message's sequence", e))?;
        let (sequence, left) = (info.stream_sequence, info.pending);
        if sequence > last {
            return Ok(Some(name));
        }
        let headers = decoded(message.headers.as_ref());
        let header = |name: &str| -> Option<&[u8]> {
            headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.as_slice())
        };
        let timestamp = header(TIMESTAMP_HEADER)
            .and_then(|t| std::str::from_utf8(t).ok())
            .and_then(|t| t.parse().ok());
        each(Read {
            topic: subject,
            partition: 0,
            offset: sequence as i64,
            key: header(KEY_HEADER),
            value: Some(&message.payload),
            timestamp,
            header: &header,
        });
        if left == 0 || sequence == last {
            return Ok(Some(name));
        }
    }
}

/// The headers the audit reads, base64 undone where `outboxd.base64` names it.
fn decoded(headers: Option<&async_nats::HeaderMap>) -> Vec<(String, Vec<u8>)> {
    let Some(headers) = headers else {
        return Vec::new();
    };
    let encoded: Vec<&str> = headers
        .get(BASE64_HEADER)
        .map(|v| v.as_str().split(',').collect())
        .unwrap_or_default();
    [
        ID_HEADER,
        POSITION_HEADER,
        KEY_HEADER,
        TIMESTAMP_HEADER,
        ERROR_HEADER,
        ROW_HEADER,
        TABLE_HEADER,
        SUBJECT_HEADER,
    ]
    .into_iter()
    .filter_map(|name| {
        let value = headers.get(name)?.as_str();
        let bytes = if encoded.contains(&name) {
            base64::engine::general_purpose::STANDARD
                .decode(value)
                .ok()?
        } else {
            value.as_bytes().to_vec()
        };
        Some((name.to_string(), bytes))
    })
    .collect()
}
