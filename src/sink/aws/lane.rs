//! A lane: one task per destination that turns the messages handed to it into batches of up to
//! 10, sends them, and settles each entry from the batch's reply.
//!
//! Order on a FIFO destination: a batch holds at most one message per group, two batches in
//! flight never share a group, and a batch takes a group's messages only in the order they came.
//! A reply that fails some entries (a 200 with `Failed` entries): the stored ones are
//! acknowledged, the failed ones go back to the front, in order, and are sent again with the same
//! de-duplication ids. No group's later message can pass its earlier one: it was never in the
//! same batch, and it waits behind the failed one. (With two messages of a group in one batch, a
//! reply that fails the first and stores the second would reorder the group, whatever is sent
//! again: test `a_reply_failing_only_the_first_entry_of_a_batch_reorders_no_fifo_group`.)
//!
//! A failure time heals (throttling, a server error, no answer) pauses the lane with a growing
//! backoff. The lane ends the session when a message sent once is still not stored
//! `message_timeout_ms` after its first send; the next session sends it again from the
//! checkpoint. The clock starts at the first send, not when the message joined the lane: a FIFO
//! group goes one message per round trip, so a backlog of one hot key waits its turn far longer
//! than any timeout that would still catch a silent endpoint, and waiting is not failing
//! (test `a_backlog_of_one_hot_fifo_group_waits_its_turn_without_ending_the_session`). The
//! limit (at most 4 minutes) keeps resends inside FIFO's 5-minute de-duplication window.
//!
//! A refused entry (too large, an attribute the service refuses) goes to the dead-letter
//! destination with its reason, or stops outboxd naming it: never sent forever. A refusal every
//! message would meet (a KMS key, a grant) stops outboxd instead of parking all traffic.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};
use tokio::sync::mpsc;

use super::message::Message;
use super::service::{Client, Destination, Failure, Outcome};
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::sink::ack::{Acks, Ticket};
use crate::sink::window::Room;

/// The most entries `SendMessageBatch` and `PublishBatch` take.
pub const BATCH_ENTRIES: usize = 10;

/// How far into the waiting messages a batch looks for ones it may take.
const LOOK_AHEAD: usize = 1_000;

/// How often a lane looks for a message past its timeout.
const TIMEOUT_TICK: Duration = Duration::from_millis(250);

const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// A message on its way to a destination.
pub struct Entry {
    pub ticket: Ticket,
    /// The routed topic it was meant for.
    pub topic: String,
    pub message: Message,
    pub size: usize,
    pub enqueued: Instant,
    /// When it was first sent to this destination (its timeout counts from then).
    pub sent: Option<Instant>,
    /// A dead letter already: a refusal stops outboxd.
    pub dead_lettered: bool,
    pub _room: Room,
}

impl Entry {
    pub fn new(ticket: Ticket, topic: String, message: Message, room: Room) -> Entry {
        Entry {
            ticket,
            topic,
            size: message.size(),
            message,
            enqueued: Instant::now(),
            sent: None,
            dead_lettered: false,
            _room: room,
        }
    }

    /// This entry as a dead letter (`why`), with its body while it fits `max_bytes`.
    pub fn into_dead_letter(self, why: &str, keep_body: bool, max_bytes: usize) -> Entry {
        let mut message = self.message.dead_letter(&self.topic, why, keep_body);
        if message.size() > max_bytes {
            message = self.message.dead_letter(&self.topic, why, false);
        }
        // A new message to another destination: its clock starts when it is first sent there.
        Entry {
            size: message.size(),
            message,
            sent: None,
            dead_lettered: true,
            ..self
        }
    }
}

/// A batch back from the service: its entries, the reply, and the first send of its oldest
/// message (the key it holds in the lane's `flying`).
type Sent = (
    Vec<Entry>,
    std::result::Result<Vec<Outcome>, Failure>,
    Instant,
);

/// Where a lane hands what it cannot deliver.
#[derive(Clone)]
pub struct DeadLetters {
    pub name: String,
    pub max_bytes: usize,
    pub lane: mpsc::UnboundedSender<Entry>,
}

pub struct Lane {
    pub destination: Destination,
    pub client: Arc<Client>,
    pub dead_letters: Option<DeadLetters>,
    pub acks: Arc<dyn Acks>,
    pub metrics: Arc<Metrics>,
    pub max_batches: usize,
    /// `message_timeout_ms`: how long a message may stay unstored after its first send.
    pub timeout: Duration,
}

impl Lane {
    /// Runs until the sink drops its sender (and what it holds is settled), or an entry cannot
    /// be delivered (reported through [`Acks::failed`]).
    pub async fn run(self, mut queue: mpsc::UnboundedReceiver<Entry>) {
        let mut pending: VecDeque<Entry> = VecDeque::new();
        let mut busy: HashSet<String> = HashSet::new();
        let mut in_flight: FuturesUnordered<BoxFuture<'static, Sent>> = FuturesUnordered::new();
        let mut paused_until: Option<tokio::time::Instant> = None;
        let mut backoff = FIRST_BACKOFF;
        let mut open = true;
        // The first send of the oldest message of each batch in flight (and how many batches
        // share it).
        let mut flying: BTreeMap<Instant, usize> = BTreeMap::new();
        let mut tick = tokio::time::interval(TIMEOUT_TICK.min(self.timeout));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            while paused_until.is_none() && in_flight.len() < self.max_batches {
                let mut batch = self.take_batch(&mut pending, &busy);
                if batch.is_empty() {
                    break;
                }
                if self.destination.fifo {
                    busy.extend(batch.iter().map(|e| e.message.group.clone()));
                }
                let now = Instant::now();
                for entry in &mut batch {
                    entry.sent.get_or_insert(now);
                    self.metrics.produced();
                }
                let sent = first_sent(&batch);
                *flying.entry(sent).or_default() += 1;
                in_flight.push(self.send(batch, sent));
            }
            if !open && pending.is_empty() && in_flight.is_empty() {
                return;
            }
            let pause = async {
                match paused_until {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                entry = queue.recv(), if open => match entry {
                    Some(entry) => pending.push_back(entry),
                    None => open = false,
                },
                Some((batch, reply, sent)) = in_flight.next(), if !in_flight.is_empty() => {
                    if let Some(n) = flying.get_mut(&sent) {
                        *n -= 1;
                        if *n == 0 {
                            flying.remove(&sent);
                        }
                    }
                    if self.destination.fifo {
                        for entry in &batch {
                            busy.remove(&entry.message.group);
                        }
                    }
                    match self.settle(batch, reply, &mut pending) {
                        Ok(false) => backoff = FIRST_BACKOFF,
                        // Another batch in flight may have paused the lane already.
                        Ok(true) if paused_until.is_some() => {}
                        Ok(true) => {
                            paused_until = Some(tokio::time::Instant::now() + backoff);
                            backoff = (backoff * 2).min(MAX_BACKOFF);
                        }
                        Err(e) => {
                            self.metrics.delivery_error();
                            self.acks.failed(e);
                            return;
                        }
                    }
                }
                () = pause => paused_until = None,
                // Only a message sent and not settled can be overdue: one is in flight, or back
                // in the queue while the lane pauses (unpaused, the loop above sends it at once).
                // An idle lane sleeps.
                _ = tick.tick(), if !in_flight.is_empty() || paused_until.is_some() => {
                    // In flight, or sent and waiting to go again (never-sent ones do not count).
                    let oldest = flying
                        .keys()
                        .next()
                        .copied()
                        .into_iter()
                        .chain(pending.iter().filter_map(|e| e.sent))
                        .min();
                    if let Some(age) = oldest.map(|at| at.elapsed()).filter(|age| *age > self.timeout) {
                        self.metrics.delivery_error();
                        self.acks.failed(self.overdue(age, in_flight.len()));
                        return;
                    }
                }
            }
            while let Ok(entry) = queue.try_recv() {
                pending.push_back(entry);
            }
        }
    }

    /// The next batch: up to 10 waiting entries, within the destination's size, none of a group
    /// that is in flight or has an earlier entry left waiting; on FIFO at most one per group (a
    /// reply may fail a group's first entry and store its second: sent again, the first would
    /// land after the second).
    fn take_batch(&self, pending: &mut VecDeque<Entry>, busy: &HashSet<String>) -> Vec<Entry> {
        let fifo = self.destination.fifo;
        let mut blocked: HashSet<&str> = HashSet::new();
        let mut taken = Vec::new();
        let mut bytes = 0;
        for (i, entry) in pending.iter().enumerate().take(LOOK_AHEAD) {
            if taken.len() == BATCH_ENTRIES {
                break;
            }
            let group = entry.message.group.as_str();
            let fits = bytes + entry.size <= self.destination.max_bytes || taken.is_empty();
            if fifo && (busy.contains(group) || blocked.contains(group) || !fits) {
                blocked.insert(group);
                continue;
            }
            if !fits {
                continue;
            }
            bytes += entry.size;
            taken.push(i);
            if fifo {
                blocked.insert(group);
            }
        }
        let mut batch = Vec::with_capacity(taken.len());
        for i in taken.into_iter().rev() {
            batch.push(pending.remove(i).expect("index taken from the queue"));
        }
        batch.reverse();
        batch
    }

    fn send(&self, batch: Vec<Entry>, oldest: Instant) -> BoxFuture<'static, Sent> {
        let client = self.client.clone();
        let destination = self.destination.clone();
        async move {
            // A fail point may send only entries `skip..sent` and answer for the others: the
            // head with `head`, the tail with `tail`.
            let (skip, sent, head, tail) = match injected(batch.len()) {
                None => (0, batch.len(), None, None),
                Some(Injected::ReplyLost) => {
                    let messages: Vec<&Message> = batch.iter().map(|e| &e.message).collect();
                    let _ = client.send_batch(&destination, &messages).await;
                    let failure = Failure {
                        code: "RequestTimeout".into(),
                        text: "the reply was lost: injected by the fail point aws_batch_reply_lost"
                            .into(),
                        transient: true,
                        missing: false,
                    };
                    return (batch, Err(failure), oldest);
                }
                Some(Injected::Refused(failure)) => return (batch, Err(failure), oldest),
                Some(Injected::FirstOf(k)) => (0, k, None, Some(injected_failure())),
                Some(Injected::AllButFirst(first)) => (1, batch.len(), Some(first), None),
            };
            let messages: Vec<&Message> = batch[skip..sent].iter().map(|e| &e.message).collect();
            let reply = if messages.is_empty() {
                Ok(Vec::new())
            } else {
                client.send_batch(&destination, &messages).await
            };
            let reply = reply.map(|outcomes| {
                head.into_iter()
                    .chain(outcomes)
                    .chain(std::iter::repeat_n(
                        tail.unwrap_or_else(injected_failure),
                        batch.len() - sent,
                    ))
                    .collect()
            });
            (batch, reply, oldest)
        }
        .boxed()
    }

    /// Settles a batch from its reply. `Ok(true)`: nothing was stored and something goes again,
    /// after a pause (a batch that stored some entries sends the rest again at once).
    fn settle(
        &self,
        batch: Vec<Entry>,
        reply: std::result::Result<Vec<Outcome>, Failure>,
        pending: &mut VecDeque<Entry>,
    ) -> Result<bool> {
        let mut outcomes = match reply {
            Ok(outcomes) => outcomes,
            Err(failure) if failure.transient => {
                tracing::debug!(destination = %self.destination.name, error = %failure.text, "a batch goes again after a pause");
                requeue(pending, batch);
                return Ok(true);
            }
            Err(failure) if failure.missing => {
                let why = format!(
                    "unroutable: the {} {:?} no longer exists",
                    self.client.service().noun(),
                    self.destination.name
                );
                for entry in batch {
                    self.dead_letter(entry, &why, true)?;
                }
                return Ok(false);
            }
            Err(failure) => return Err(self.refused(&failure)),
        };
        // One outcome per entry: an entry without one goes again.
        outcomes.resize_with(batch.len(), || {
            Outcome::Failed(super::service::not_in_reply())
        });
        let mut again = Vec::new();
        let mut progress = false;
        for (entry, outcome) in batch.into_iter().zip(outcomes) {
            match outcome {
                Outcome::Stored => {
                    progress = true;
                    self.stored(entry)
                }
                // Before the transient case: a KMS key or a grant refused on an entry stops
                // outboxd even when the reply does not blame the sender.
                Outcome::Failed(f) if destination_wide(&f.code) => return Err(self.refused(&f)),
                Outcome::Failed(f) if f.transient => again.push(entry),
                Outcome::Failed(f) => {
                    let why = if f.code.contains("TooLong") || f.text.contains("too long") {
                        format!("too_large: {}", f.text)
                    } else {
                        format!("refused: {}", f.text)
                    };
                    let keep = !why.starts_with("too_large");
                    progress = true;
                    self.dead_letter(entry, &why, keep)?;
                }
            }
        }
        let pause = !again.is_empty() && !progress;
        if !again.is_empty() {
            tracing::debug!(destination = %self.destination.name, again = again.len(), "entries of a batch go again");
        }
        requeue(pending, again);
        Ok(pause)
    }

    /// The session-ending error for a message still unstored `age` after its first send.
    fn overdue(&self, age: Duration, batches: usize) -> Error {
        let service = self.client.service();
        Error::sink(format!(
            "a message to the {} {:?} is still not stored {age:?} after it was first sent ({batches} batch(es) in flight; {}.message_timeout_ms is {} ms)",
            service.noun(),
            self.destination.name,
            service.section(),
            self.timeout.as_millis()
        ))
        .remedy("outboxd sends again from the checkpoint (FIFO drops repeats by their de-duplication id within 5 minutes); check the endpoint, the network and throttling")
        .transient()
    }

    fn stored(&self, entry: Entry) {
        self.metrics.acknowledged();
        self.metrics.delivered_after(entry.enqueued.elapsed());
        self.metrics.forwarded(&self.destination.name);
        self.acks.acked(entry.ticket);
    }

    /// Hands `entry` to the dead-letter lane, or the error that stops outboxd.
    fn dead_letter(&self, entry: Entry, why: &str, keep_body: bool) -> Result<()> {
        let service = self.client.service();
        let Some(dead_letters) = self.dead_letters.as_ref().filter(|_| !entry.dead_lettered) else {
            let what = if entry.dead_lettered {
                "the dead-letter"
            } else {
                "a"
            };
            return Err(Error::unroutable(format!(
                "{what} row for {} {:?} cannot be delivered: {why}",
                service.noun(),
                self.destination.name
            ))
            .remedy(format!(
                "fix what the service names (a {} that exists, a message it takes), then restart outboxd; or set {}.dead_letter_topic to park such rows; nothing was skipped",
                service.noun(),
                service.section()
            )));
        };
        tracing::warn!(destination = %self.destination.name, dead_letter = %dead_letters.name, reason = %why, "a message the service refused sent to the dead-letter destination");
        self.metrics
            .dead_letter(why.split(':').next().unwrap_or("unroutable"));
        let letter = entry.into_dead_letter(why, keep_body, dead_letters.max_bytes);
        dead_letters
            .lane
            .send(letter)
            .map_err(|_| Error::sink("the dead-letter lane ended").transient())
    }

    fn refused(&self, failure: &Failure) -> Error {
        let service = self.client.service();
        let grant = match service {
            super::config::Service::Sqs => "sqs:SendMessage and sqs:GetQueueAttributes",
            super::config::Service::Sns => "sns:Publish and sns:GetTopicAttributes",
        };
        failure.error(
            service,
            &self.destination.name,
            &format!(
                "fix what the service names: credentials (the AWS chain: env, profile, web identity, instance role) allowed {grant} on {}, a KMS key they may use; then restart outboxd; nothing was skipped",
                self.destination.address
            ),
        )
    }
}

/// The first send of a batch's oldest message (every entry of a batch taken has one).
fn first_sent(batch: &[Entry]) -> Instant {
    batch
        .iter()
        .filter_map(|e| e.sent)
        .min()
        .unwrap_or_else(Instant::now)
}

fn injected_failure() -> Outcome {
    Outcome::Failed(Failure {
        code: "InternalError".into(),
        text: "InternalError: injected by the fail point aws_batch_partial".into(),
        transient: true,
        missing: false,
    })
}

/// Refusals that would meet every message (a KMS key or a grant): they stop outboxd instead of
/// dead-lettering all traffic. SQS spells KMS codes `KMS.DisabledException` or `KmsDisabled`;
/// throttling and unavailability (`KmsThrottled`, `KMSUnavailable`) pass and are retried.
fn destination_wide(code: &str) -> bool {
    let lower = code.to_ascii_lowercase();
    let passing = ["throttl", "unavailable", "internal"]
        .iter()
        .any(|word| lower.contains(word));
    !passing
        && !super::service::transient_code(code)
        && (lower.starts_with("kms")
            || lower.contains("accessdenied")
            || lower.contains("authorizationerror")
            || matches!(
                code,
                "InvalidClientTokenId" | "UnrecognizedClientException" | "ExpiredToken"
            ))
}

/// Puts `entries` back at the front, in their order.
fn requeue(pending: &mut VecDeque<Entry>, entries: Vec<Entry>) {
    for entry in entries.into_iter().rev() {
        pending.push_front(entry);
    }
}

/// What a fail point does to a batch.
#[cfg_attr(not(feature = "failpoints"), allow(dead_code))]
enum Injected {
    /// The whole call fails (throttled) before anything is sent.
    Refused(Failure),
    /// Only the first k entries are sent; the rest are reported failed (`InternalError`).
    FirstOf(usize),
    /// Entry 0 is not sent and is reported with this outcome; the others are sent.
    AllButFirst(Outcome),
    /// The whole batch is sent (and stored), and the call fails as if its reply were lost.
    ReplyLost,
}

/// The fail points of the AWS sinks' tests (no AWS-compatible server fails part of a batch,
/// refuses one entry or throttles): `aws_batch_throttle` fails a whole batch as throttled before
/// it is sent; `aws_batch_partial(k)` sends only the first k entries and reports the rest failed
/// (`InternalError`, as SQS does); `aws_batch_entry_fails(code)` reports entry 0 failed with the
/// error code `code` (classed as a reply's would be) and sends the others, which is the reply that
/// reorders a FIFO group when one batch holds two of its messages; `aws_batch_reply_lost` sends
/// the whole batch and then fails the call as if its reply were lost (every entry was stored, and
/// goes again).
fn injected(len: usize) -> Option<Injected> {
    crate::fault_point!("aws_batch_reply_lost", |_| Some(Injected::ReplyLost));
    crate::fault_point!("aws_batch_throttle", |_| Some(Injected::Refused(Failure {
        code: "ThrottlingException".into(),
        text: "ThrottlingException: injected by the fail point aws_batch_throttle".into(),
        transient: true,
        missing: false,
    })));
    crate::fault_point!("aws_batch_partial", |arg: Option<String>| {
        let k = arg.and_then(|a| a.parse().ok()).unwrap_or(1usize);
        Some(Injected::FirstOf(k.min(len)))
    });
    crate::fault_point!("aws_batch_entry_fails", |arg: Option<String>| {
        let code = arg.unwrap_or_else(|| "InternalError".into());
        Some(Injected::AllButFirst(Outcome::Failed(
            super::service::entry_failure(
                &code,
                Some("injected by the fail point aws_batch_entry_fails"),
                true,
            ),
        )))
    });
    let _ = len;
    None
}

#[cfg(test)]
mod tests {
    use super::destination_wide;

    #[test]
    fn kms_and_grant_refusals_stop_in_either_spelling_while_throttling_and_bad_entries_pass() {
        for code in [
            "KMS.DisabledException",
            "KmsDisabled",
            "KmsAccessDenied",
            "KMS.NotFoundException",
            "AccessDenied",
            "AccessDeniedException",
            "AuthorizationError",
            "ExpiredToken",
        ] {
            assert!(destination_wide(code), "{code}");
        }
        for code in [
            "KmsThrottled",
            "KMSThrottlingException",
            "KMSUnavailable",
            "KMS.KMSUnavailableException",
            "KMS.KMSInternalException",
            "InvalidParameterValue",
            "InvalidMessageContents",
            "InternalError",
        ] {
            assert!(!destination_wide(code), "{code}");
        }
    }
}
