//! What the brokers allow outboxd's principal on the topics it will use, asked the way Kafka's own
//! tools ask (KIP-430: DescribeTopics with the authorized operations), so `check` and `run`'s
//! preflight name a missing ACL grant before the first record meets it.
//!
//! Why `unsafe` here: the rdkafka crate wraps neither DescribeTopics nor its authorized
//! operations, and they are the only read-only way to learn a grant (producing to find out would
//! write, and `init_transactions` would fence a running instance). This file is the only FFI of
//! the sink; every handle it creates is destroyed before [`describe`] returns, and what it reads
//! from librdkafka is copied out before the event that owns it is destroyed.
//!
//! Transactional ids have no such question (there is no read-only request that a missing grant on
//! one fails), so their grants are still reported by `run` when it takes the id.

use std::ffi::{CStr, CString};
use std::time::Duration;

use rdkafka::bindings as rd;
use rdkafka::client::Client;
use rdkafka::ClientContext;

use crate::preflight::Item;

/// An operation outboxd needs on a topic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    Read,
    Write,
}

impl Operation {
    fn acl(self) -> rd::rd_kafka_AclOperation_t {
        match self {
            Operation::Read => rd::rd_kafka_AclOperation_t::RD_KAFKA_ACL_OPERATION_READ,
            Operation::Write => rd::rd_kafka_AclOperation_t::RD_KAFKA_ACL_OPERATION_WRITE,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Operation::Read => "READ",
            Operation::Write => "WRITE",
        }
    }
}

/// What the brokers said about one topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Access {
    /// No such topic.
    Missing,
    /// The principal may not even describe it (so it cannot tell whether the topic exists).
    Denied,
    /// The brokers did not report operations (a broker that does not implement KIP-430).
    Unreported,
    /// What the principal may do (ALL already expanded by the broker).
    Allowed(Vec<rd::rd_kafka_AclOperation_t>),
}

/// Each topic asked about, with the brokers' answer.
pub type Answers = Vec<(String, Access)>;

/// A topic outboxd will use, what for, and what it needs there.
pub struct Need {
    pub topic: String,
    pub what: &'static str,
    pub operations: &'static [Operation],
    /// Whether outboxd certainly uses it (the dead-letter and checkpoint topics, a fixed route
    /// topic), rather than an existing topic the route's template could name.
    pub certain: bool,
}

/// Asks the brokers, through `client`, what the principal may do on each of `topics`.
pub fn describe<C: ClientContext>(
    client: &Client<C>,
    topics: &[String],
    timeout: Duration,
) -> Result<Answers, String> {
    if topics.is_empty() {
        return Ok(Vec::new());
    }
    let names: Vec<CString> = topics
        .iter()
        .map(|t| CString::new(t.as_str()).map_err(|_| format!("topic name {t:?} holds a NUL")))
        .collect::<Result<_, _>>()?;
    let mut pointers: Vec<*const std::os::raw::c_char> = names.iter().map(|n| n.as_ptr()).collect();
    let rk = client.native_ptr();
    let timeout_ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
    // SAFETY: every pointer passed is valid for the call (the names outlive the collection, which
    // copies them); each handle created here is destroyed below, the event first but only after
    // `read_answer` copied everything out of it. A result that arrives after the poll gave up is
    // dropped by librdkafka with the destroyed queue.
    unsafe {
        let collection =
            rd::rd_kafka_TopicCollection_of_topic_names(pointers.as_mut_ptr(), pointers.len());
        let options = rd::rd_kafka_AdminOptions_new(
            rk,
            rd::rd_kafka_admin_op_t::RD_KAFKA_ADMIN_OP_DESCRIBETOPICS,
        );
        let mut errstr = [0 as std::os::raw::c_char; 256];
        rd::rd_kafka_AdminOptions_set_request_timeout(
            options,
            timeout_ms,
            errstr.as_mut_ptr(),
            errstr.len(),
        );
        let error = rd::rd_kafka_AdminOptions_set_include_authorized_operations(options, 1);
        if !error.is_null() {
            rd::rd_kafka_error_destroy(error);
        }
        let queue = rd::rd_kafka_queue_new(rk);
        rd::rd_kafka_DescribeTopics(rk, collection, options, queue);
        let event = rd::rd_kafka_queue_poll(queue, timeout_ms.saturating_add(1000));
        let answer = if event.is_null() {
            Err(format!("no answer to DescribeTopics within {timeout:?}"))
        } else {
            read_answer(event)
        };
        if !event.is_null() {
            rd::rd_kafka_event_destroy(event);
        }
        rd::rd_kafka_queue_destroy(queue);
        rd::rd_kafka_AdminOptions_destroy(options);
        rd::rd_kafka_TopicCollection_destroy(collection);
        answer
    }
}

/// librdkafka's error codes read as plain integers: a broker may send a code the bindings' enum
/// has no variant for, and reading one into that Rust enum would be undefined behaviour.
mod raw {
    use std::os::raw::c_int;

    use super::rd;

    extern "C" {
        pub fn rd_kafka_event_error(rkev: *mut rd::rd_kafka_event_t) -> c_int;
        pub fn rd_kafka_error_code(error: *const rd::rd_kafka_error_t) -> c_int;
    }

    pub const NO_ERROR: c_int = rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR as c_int;
    pub const TOPIC_AUTHORIZATION_FAILED: c_int =
        rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED as c_int;
    pub const UNKNOWN_TOPIC_OR_PART: c_int =
        rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART as c_int;
}

/// Copies the topics' answers out of a DescribeTopics result event. librdkafka places each answer
/// at its topic's position and leaves NULL where a broker did not answer for a topic: those are
/// skipped (and so reported as not verified).
///
/// # Safety
/// `event` must be a live event returned for a DescribeTopics request.
unsafe fn read_answer(event: *mut rd::rd_kafka_event_t) -> Result<Answers, String> {
    let text = |p: *const std::os::raw::c_char| {
        if p.is_null() {
            String::new()
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    if raw::rd_kafka_event_error(event) != raw::NO_ERROR {
        return Err(text(rd::rd_kafka_event_error_string(event)));
    }
    let result = rd::rd_kafka_event_DescribeTopics_result(event);
    if result.is_null() {
        return Err("an unexpected answer to DescribeTopics".into());
    }
    let mut count = 0usize;
    let descriptions = rd::rd_kafka_DescribeTopics_result_topics(result, &mut count);
    let mut out = Vec::with_capacity(count);
    for i in 0..count {
        if descriptions.is_null() {
            break;
        }
        let description = *descriptions.add(i);
        if description.is_null() {
            continue;
        }
        let name = text(rd::rd_kafka_TopicDescription_name(description));
        let error = rd::rd_kafka_TopicDescription_error(description);
        let code = if error.is_null() {
            raw::NO_ERROR
        } else {
            raw::rd_kafka_error_code(error)
        };
        let access = match code {
            raw::NO_ERROR => {
                let mut n = 0usize;
                let operations =
                    rd::rd_kafka_TopicDescription_authorized_operations(description, &mut n);
                if operations.is_null() || n == 0 {
                    Access::Unreported
                } else {
                    // librdkafka builds this array from known operations only (3..=12).
                    Access::Allowed(std::slice::from_raw_parts(operations, n).to_vec())
                }
            }
            raw::TOPIC_AUTHORIZATION_FAILED => Access::Denied,
            raw::UNKNOWN_TOPIC_OR_PART => Access::Missing,
            _ => {
                return Err(format!(
                    "describing topic {}: {}",
                    name.escape_debug(),
                    text(rd::rd_kafka_error_string(error))
                ))
            }
        };
        out.push((name, access));
    }
    Ok(out)
}

/// A FAIL line per topic outboxd certainly uses that lacks a grant (naming the operations and the
/// command that gives them), one WARN for the existing topics the route could name that lack WRITE
/// (they may be other pipelines' topics, which outboxd never sends to), and one line each for
/// what was verified and what the brokers did not say. `Missing` topics are left to the caller (a
/// missing dead-letter topic has a line of its own; `run` creates a missing checkpoint topic).
pub fn items(needs: &[Need], answers: &[(String, Access)]) -> Vec<Item> {
    let mut items = Vec::new();
    let mut verified = 0;
    let mut unreported = 0;
    let mut maybe_unwritable = Vec::new();
    for need in needs {
        let access = answers
            .iter()
            .find(|(t, _)| *t == need.topic)
            .map_or(&Access::Unreported, |(_, a)| a);
        let lacking: Vec<Operation> = match access {
            Access::Missing => continue,
            Access::Unreported => {
                unreported += 1;
                continue;
            }
            Access::Denied => need.operations.to_vec(),
            Access::Allowed(allowed) => need
                .operations
                .iter()
                .copied()
                .filter(|o| !allowed.contains(&o.acl()))
                .collect(),
        };
        let topic = need.topic.escape_debug().to_string();
        if lacking.is_empty() {
            verified += 1;
        } else if !need.certain {
            maybe_unwritable.push(topic);
        } else {
            let names: Vec<&str> = lacking.iter().map(|o| o.name()).collect();
            let commands: Vec<String> = lacking.iter().map(|o| grant_command(*o, &topic)).collect();
            let hidden = if *access == Access::Denied {
                " (it may not even describe it)"
            } else {
                ""
            };
            items.push(Item::fail(
                "kafka",
                format!(
                    "outboxd's principal lacks {} on {} {topic}{hidden}",
                    names.join(" and "),
                    need.what,
                ),
                format!("grant it: {}", commands.join("; ")),
            ));
        }
    }
    if !maybe_unwritable.is_empty() {
        let shown = maybe_unwritable.len().min(5);
        let more = maybe_unwritable.len() - shown;
        items.push(Item::warn(
            "kafka",
            format!(
                "outboxd's principal lacks WRITE on {} existing topic(s) the route could name: {}{}",
                maybe_unwritable.len(),
                maybe_unwritable[..shown].join(", "),
                if more > 0 { format!(" and {more} more") } else { String::new() }
            ),
            format!(
                "if outboxd sends events there, grant it WRITE ({}); topics only other pipelines write need nothing",
                grant_command(Operation::Write, &maybe_unwritable[0])
            ),
        ));
    }
    if verified > 0 {
        items.push(Item::pass(
            "kafka",
            format!("the brokers grant outboxd's principal what it needs on {verified} topic(s)"),
        ));
    }
    if unreported > 0 {
        items.push(Item::warn(
            "kafka",
            format!("the brokers did not report outboxd's grants on {unreported} topic(s)"),
            "nothing to do if they have no ACLs; otherwise run reports a missing grant when it meets it",
        ));
    }
    items
}

fn grant_command(operation: Operation, topic: &str) -> String {
    format!(
        "kafka-acls.sh --add --allow-principal User:<outboxd's user> --operation {} --topic {topic}",
        operation.name()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::preflight::Status;
    use rd::rd_kafka_AclOperation_t as Acl;

    fn need(topic: &str, operations: &'static [Operation]) -> Need {
        Need {
            topic: topic.into(),
            what: "the dead-letter topic",
            operations,
            certain: true,
        }
    }

    #[test]
    fn each_topic_lacking_a_grant_is_one_fail_naming_it_and_the_rest_one_line_each() {
        let needs = [
            need("granted", &[Operation::Write]),
            need("read-only", &[Operation::Read, Operation::Write]),
            need("hidden", &[Operation::Write]),
            need("absent", &[Operation::Write]),
            need("not-told", &[Operation::Write]),
            need("unanswered", &[Operation::Write]),
            Need {
                certain: false,
                ..need("outbox.event.other\n", &[Operation::Write])
            },
        ];
        let answers = vec![
            (
                "granted".to_string(),
                Access::Allowed(vec![
                    Acl::RD_KAFKA_ACL_OPERATION_WRITE,
                    Acl::RD_KAFKA_ACL_OPERATION_DESCRIBE,
                ]),
            ),
            (
                "read-only".to_string(),
                Access::Allowed(vec![Acl::RD_KAFKA_ACL_OPERATION_READ]),
            ),
            ("hidden".to_string(), Access::Denied),
            ("absent".to_string(), Access::Missing),
            ("not-told".to_string(), Access::Unreported),
            (
                "outbox.event.other\n".to_string(),
                Access::Allowed(vec![Acl::RD_KAFKA_ACL_OPERATION_DESCRIBE]),
            ),
        ];
        let lines: Vec<(Status, String)> = items(&needs, &answers)
            .into_iter()
            .map(|i| (i.status, i.to_string()))
            .collect();
        let with = |status: Status| -> Vec<&String> {
            lines
                .iter()
                .filter(|(s, _)| *s == status)
                .map(|(_, l)| l)
                .collect()
        };
        let fails = with(Status::Fail);
        assert_eq!(fails.len(), 2, "{lines:?}");
        assert!(
            fails[0].contains("lacks WRITE on the dead-letter topic read-only")
                && fails[0].contains("--operation WRITE --topic read-only"),
            "{lines:?}"
        );
        assert!(fails[1]
            .contains("lacks WRITE on the dead-letter topic hidden (it may not even describe it)"));
        let warns = with(Status::Warn);
        assert_eq!(warns.len(), 2, "{lines:?}");
        // A name from the brokers is printed escaped: it cannot start a line of its own.
        assert!(warns[0].contains(
            "lacks WRITE on 1 existing topic(s) the route could name: outbox.event.other\\n"
        ));
        assert!(warns[1].contains("did not report outboxd's grants on 2 topic(s)"));
        assert!(with(Status::Pass)[0].contains("what it needs on 1 topic(s)"));
    }
}
