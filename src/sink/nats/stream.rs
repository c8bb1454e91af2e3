//! What a JetStream stream's settings cost the rows outboxd publishes into it. A `PubAck` says the
//! stream stored a message, not that it keeps it: some settings discard acknowledged messages by
//! design (interest retention with no consumer, or one whose filter misses the subject; memory
//! storage across a server restart; `discard: old` at a limit), and one (`no_ack`) never
//! acknowledges, so every publish
//! would time out and be sent again forever. `check` names each one with what it costs; the ones
//! that lose acknowledged rows fail it (and so stop `run` before it starts) unless
//! `nats.allow_lossy_streams` accepts them.

use async_nats::jetstream::stream::{DiscardPolicy, Info, RetentionPolicy, StorageType};

/// How bad a setting is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cost {
    /// Acknowledged messages can be dropped before anyone reads them (at the stream's limits).
    Drops(String),
    /// Acknowledged messages are lost (accepted only with `nats.allow_lossy_streams`).
    Loses(String),
    /// Publishing cannot work at all.
    Broken(String),
}

/// How to move `subject` out of stream `stream` into one that keeps what it acknowledges.
pub fn remedy(stream: &str, subject: &str) -> String {
    format!(
        "nats stream info {stream} shows its settings. Change them (nats stream edit {stream}; storage cannot change), or move the subject: take it out of {stream} (or delete {stream}), then nats stream add OUTBOX --subjects \"{subject}\" --storage file --retention limits --dupe-window 2m"
    )
}

/// What stream `info`'s settings cost, worst first; empty when none costs anything.
pub fn costs(info: &Info) -> Vec<Cost> {
    let c = &info.config;
    let mut out = Vec::new();
    if c.no_ack {
        out.push(Cost::Broken(
            "it has no_ack set, so the server never acknowledges a publish: every message would time out and be sent again forever".into(),
        ));
    }
    // A work queue keeps a message until a consumer takes it: nothing is lost without one.
    match c.retention {
        RetentionPolicy::Interest if info.state.consumer_count == 0 => out.push(Cost::Loses(
            "its retention is interest and it has no consumer: every message outboxd publishes is acknowledged and discarded at once".into(),
        )),
        RetentionPolicy::Interest => out.push(Cost::Drops(
            "its retention is interest: a message no consumer's filter takes is discarded at once (an ephemeral consumer may be gone by then)".into(),
        )),
        _ => {}
    }
    if c.storage == StorageType::Memory {
        out.push(Cost::Loses(
            "it keeps messages in memory: a server restart loses every acknowledged message not yet read".into(),
        ));
    }
    if c.discard == DiscardPolicy::Old {
        let mut limits = Vec::new();
        if c.max_messages > 0 {
            limits.push(format!("max_msgs {}", c.max_messages));
        }
        if c.max_messages_per_subject > 0 {
            limits.push(format!(
                "max_msgs_per_subject {}",
                c.max_messages_per_subject
            ));
        }
        if c.max_bytes > 0 {
            limits.push(format!("max_bytes {}", c.max_bytes));
        }
        if !c.max_age.is_zero() {
            limits.push(format!("max_age {:?}", c.max_age));
        }
        if !limits.is_empty() {
            out.push(Cost::Drops(format!(
                "at its limits ({}) it discards its oldest messages (discard: old), read or not",
                limits.join(", ")
            )));
        }
    }
    out.sort_by_key(|cost| match cost {
        Cost::Broken(_) => 0,
        Cost::Loses(_) => 1,
        Cost::Drops(_) => 2,
    });
    out
}
