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
use crate::sink::nats::message::{BASE64_HEADER, ERROR_HEADER, KEY_HEADER, TIMESTAMP_HEADER};

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
            Some(Held::Thinned(stream)) => {
                tally.out.topics.push(topic.clone());
                tally.matcher.partial(topic);
                tally.out.notes.push(format!(
                    "stream {stream:?} (holding {topic:?}) no longer has every message it stored (limits, a purge or deleted messages): a row without a message there is unverifiable, not missing"
                ));
            }
            None => tally.out.absent_topics.push(topic.clone()),
        }
    }
    if let Some(dlq) = &config.dead_letter_topic {
        if let Some(Held::Thinned(_)) = scan(&js, dlq, &mut |r| tally.dead_letter(r)).await? {
            tally.matcher.partial_dead_letters();
        }
    }
    Ok(tally.finish())
}

/// What a stream still holds of what it stored.
enum Held {
    All,
    /// The stream (named) removed messages: by its limits, a purge, or a delete.
    Thinned(String),
}

/// Every message on `subject`; `None` when no stream captures it.
async fn scan(js: &Context, subject: &str, each: &mut dyn FnMut(Read<'_>)) -> Result<Option<Held>> {
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
    let held = if info.state.first_sequence > 1 || info.state.deleted_count.unwrap_or(0) > 0 {
        Held::Thinned(name.clone())
    } else {
        Held::All
    };
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
        return Ok(Some(held));
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
            return Ok(Some(held));
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
            return Ok(Some(held));
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
