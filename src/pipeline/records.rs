//! What a routed row becomes: its record once the topic is known to exist, or its dead-letter
//! record, or the error that stops the pipeline (nothing is skipped without a dead-letter topic).

use std::collections::HashMap;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::route::{Record, Router, Unroutable};
use crate::sink::kafka::TopicState;
use crate::sink::Sink;
use crate::source::Row;

/// The record for `row`, the `index`-th row of its transaction, given what the router made of it
/// (`routed`): the record, once its topic is known to exist, or its dead-letter record when it
/// cannot be delivered (the router refuses it, or its topic does not exist and the broker does not
/// create it), or the error that stops the pipeline. Each topic is asked about once per session (`topics` remembers the answer, so rows for
/// a missing topic do not wait for the broker again).
pub(super) async fn resolve_record(
    config: &Config,
    router: &Router,
    sink: &Sink,
    topics: &mut HashMap<String, TopicState>,
    metrics: &Metrics,
    (row, index): (&Row, u32),
    routed: std::result::Result<Record, Unroutable>,
) -> Result<Record> {
    let why = match routed {
        Ok(record) => {
            let mut state = match topics.get(&record.topic) {
                Some(known) => *known,
                None => {
                    let state = sink.topic_state(&record.topic).await?;
                    topics.insert(record.topic.clone(), state);
                    state
                }
            };
            // A fixed partition beyond what is known (or with no count yet): ask again, since
            // topics gain partitions while a session runs.
            if let (TopicState::Exists { partitions }, Some(p)) = (state, record.partition) {
                if partitions.is_none_or(|n| p as usize >= n) {
                    state = sink.topic_state(&record.topic).await?;
                    topics.insert(record.topic.clone(), state);
                }
            }
            match (state, record.partition) {
                (TopicState::Missing, _) => Unroutable {
                    reason: "unknown_topic",
                    detail: format!(
                        "topic {} does not exist and the broker did not create it",
                        record.topic
                    ),
                },
                (
                    TopicState::Exists {
                        partitions: Some(n),
                    },
                    Some(p),
                ) if p as usize >= n => Unroutable {
                    reason: "invalid_partition",
                    detail: format!(
                        "partition {p} (route.additional) does not exist: topic {} has {n}",
                        record.topic
                    ),
                },
                (TopicState::Exists { .. }, _) => return Ok(record),
            }
        }
        Err(why) => why,
    };
    let record = dead_letter(config, router, row, index, &why)?;
    if !matches!(topics.get(&record.topic), Some(TopicState::Exists { .. })) {
        let state = sink.topic_state(&record.topic).await?;
        if state == TopicState::Missing {
            return Err(Error::unroutable(format!(
                "row of {} at {} cannot be routed ({}: {}), and the dead-letter topic {} does not exist",
                row.table, row.origin, why.reason, why.detail, record.topic
            ))
            .remedy(format!(
                "create the dead-letter topic {}, then restart outboxd (nothing was skipped)",
                record.topic
            )));
        }
        topics.insert(record.topic.clone(), state);
    }
    metrics.dead_letter(why.reason);
    Ok(record)
}

/// The dead-letter record for an unroutable row, or the error that stops the pipeline without one.
fn dead_letter(
    config: &Config,
    router: &Router,
    row: &Row,
    index: u32,
    why: &Unroutable,
) -> Result<Record> {
    let section = config.sink().name();
    let Some(topic) = &config.delivery().dead_letter_topic else {
        if why.reason == "unknown_topic" {
            return Err(Error::unroutable(format!(
                "row of {} at {} cannot be delivered: {}",
                row.table, row.origin, why.detail
            ))
            .remedy(format!("create the topic (or let the broker auto-create topics), or change route.topic; or set {section}.dead_letter_topic to park such rows and continue. Nothing was skipped: restart outboxd after the fix")));
        }
        return Err(Error::unroutable(format!(
            "row of {} at {} cannot be routed ({}): {}",
            row.table, row.origin, why.reason, why.detail
        ))
        .remedy(format!(
            "fix the row's producer, or set {section}.dead_letter_topic to park such rows and continue"
        )));
    };
    tracing::warn!(table = %row.table, position = %row.origin, reason = why.reason, detail = %why.detail, topic = %topic, "unroutable row sent to the dead-letter topic");
    let identity = crate::route::row_identity(&config.name, row, index);
    Ok(router.dead_letter(row, &identity, why, topic))
}
