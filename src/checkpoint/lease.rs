//! The pipeline's lead when checkpoints live in Kafka: several instances may run, one forwards.
//!
//! The lead is a lease kept in the checkpoint topic itself. The leader commits a small record
//! under key `NAME/lead` (who leads, since when) every third of `checkpoint.takeover_timeout_ms`,
//! through the same transactional writer as its checkpoints. Every standby tails the topic and
//! takes over when it has heard neither that record nor a checkpoint of the pipeline for a whole
//! takeover timeout: the leader was killed, cut off or frozen. It hears every record written,
//! committed or not (`read_uncommitted`): the pipelines share the topic's partition, and another
//! pipeline's open transaction would hide a healthy leader's renewals from a committed-only reader
//! for that transaction's whole timeout (see `kafka::Isolation::Written`).
//!
//! A clean stop writes a release record, which frees the lead at once; a standby acts on it only
//! once it is committed (a second consumer, `read_committed`, tells it so): one that took over on
//! the record alone would fence the stopping leader's commit of it, which then reports the
//! handover as a failed release.
//!
//! Taking over is [`super::kafka::KafkaStore::take_over`]: `init_transactions` with the pipeline's
//! transactional id fences every earlier writer, so an old leader that wakes up (SIGSTOP, a long
//! pause, a healed network partition) can no longer commit a checkpoint or a renewal; its first
//! try fails and it stands by. A leader also gives up on its own when it could not renew for a
//! whole timeout (it cannot know whether a standby has taken over), before it learns of any fence.
//!
//! Why not a consumer group on the topic (the partition's owner leads)? It would need the group
//! coordinator to evict a dead member on time, and a broker we test on never does when the dead
//! member led the group; the lease needs only what fencing needs already: transactions.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};
use tokio::sync::watch;

use super::kafka::KafkaStore;
use crate::error::{Error, Result};

/// Listens for the leader's renewals (a standby's view of the lead).
pub struct Lease {
    store: Arc<KafkaStore>,
    takeover: Duration,
    /// Milliseconds since `base` when the pipeline's leader was last heard from.
    heard: Arc<AtomicU64>,
    /// The leader said it stopped (SIGTERM): no need to wait out the timeout. Also set at the
    /// start when no instance has led lately (a first start, or after a clean stop).
    released: Arc<AtomicBool>,
    /// A tombstone of the pipeline's checkpoint (`checkpoint reset`) was heard since the last
    /// [`Lease::reset_heard`].
    reset: Arc<AtomicBool>,
    base: Instant,
    stop: Arc<AtomicBool>,
}

impl Lease {
    /// Starts listening to the checkpoint topic for pipeline renewals and checkpoints.
    pub fn listen(store: Arc<KafkaStore>, takeover: Duration) -> Result<Lease> {
        let written = tail(&store, false, Offset::End)?;
        let base = Instant::now();
        let heard = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        // Unknown (the read failed or timed out): as if an instance led lately, so this one waits
        // out the takeover timeout rather than stop.
        let (free, newest) = store.lead_at_start().unwrap_or_else(|e| {
            tracing::warn!(error = %e, "could not read who leads the pipeline; waiting out the takeover timeout");
            (false, None)
        });
        // A release still open at the start is read again from its own offset once committed
        // (from the end, a tail whose offset lookup ended after the commit would never see it).
        let from = match newest {
            Some((offset, true)) if !free => Offset::Offset(offset),
            _ => Offset::End,
        };
        let committed = tail(&store, true, from)?;
        let released = Arc::new(AtomicBool::new(free));
        let reset = Arc::new(AtomicBool::new(false));
        let heard_of = Heard {
            live: store.live_key(),
            lead: store.lead_key(),
            base,
            heard: heard.clone(),
            released: released.clone(),
            reset: reset.clone(),
        };
        let stopping = stop.clone();
        std::thread::Builder::new()
            .name("outboxd-lease".into())
            .spawn(move || listen(&written, &committed, heard_of, newest, stopping))
            .map_err(|e| Error::checkpoint(format!("cannot start the lease thread: {e}")))?;
        Ok(Lease {
            store,
            takeover,
            heard,
            released,
            reset,
            base,
            stop,
        })
    }

    /// Whether the pipeline's checkpoint was reset (a tombstone written, committed or not) since
    /// the last call: a first start this instance chose before and could not write is then
    /// stale, since a reset means "start at the end" (see `Store::unwritten_first`). A stored
    /// checkpoint needs no flag: the next session loads it.
    pub fn reset_heard(&self) -> bool {
        self.reset.swap(false, Ordering::Relaxed)
    }

    /// Waits until the lead is vacant: no renewal or checkpoint of the pipeline heard for a
    /// whole takeover timeout, counted from now at the earliest.
    pub async fn vacant(&self) {
        self.heard_now();
        loop {
            if self.released.swap(false, Ordering::Relaxed) {
                tracing::info!(
                    "the lead is free (released by the last leader, or nobody led lately)"
                );
                return;
            }
            let heard = Duration::from_millis(self.heard.load(Ordering::Relaxed));
            let silent = self.base.elapsed().saturating_sub(heard);
            if silent >= self.takeover {
                return;
            }
            tokio::time::sleep((self.takeover - silent).min(Duration::from_millis(200))).await;
        }
    }

    fn heard_now(&self) {
        self.heard
            .store(self.base.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// Holds the lead (after [`KafkaStore::take_over`]): renews it every third of the timeout.
    /// The returned receiver turns false when the lead is lost: a renewal was fenced, or none
    /// succeeded for a whole timeout.
    pub fn hold(&self) -> Holding {
        let (held_tx, held) = watch::channel(true);
        let store = self.store.clone();
        let takeover = self.takeover;
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(takeover / 3);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                // The store's deadline moves with every committed renewal and live checkpoint
                // (counted from when its transaction began). Checked before trying: a leader
                // frozen past it may have been replaced already, whatever the renewal below
                // would say.
                let until = store.lead_until();
                let left = until.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    tracing::warn!(
                        "could not renew the pipeline's lead within checkpoint.takeover_timeout_ms; giving it up"
                    );
                    held_tx.send_replace(false);
                    return;
                }
                let renewing = store.clone();
                let renewal = tokio::task::spawn_blocking(move || renewing.renew());
                match tokio::time::timeout(left, renewal).await {
                    Ok(Ok(Ok(()))) => {}
                    Ok(Ok(Err(e))) if e.is_superseded() => {
                        tracing::warn!(error = %e, "the pipeline's lead was taken over");
                        held_tx.send_replace(false);
                        return;
                    }
                    Ok(Ok(Err(e))) => {
                        tracing::warn!(error = %e, "could not renew the pipeline's lead; retrying")
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(error = %e, "the lead renewal task died; retrying")
                    }
                    // The next tick gives up the lead (the timeout has passed by then).
                    Err(_) => {}
                }
            }
        });
        Holding { held, task }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// The lead while this instance holds it.
pub struct Holding {
    held: watch::Receiver<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Holding {
    /// Turns false when the lead is lost.
    pub fn watch(&self) -> watch::Receiver<bool> {
        self.held.clone()
    }
}

impl Drop for Holding {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What the listening thread records.
struct Heard {
    live: String,
    lead: String,
    base: Instant,
    heard: Arc<AtomicU64>,
    released: Arc<AtomicBool>,
    reset: Arc<AtomicBool>,
}

type Tail = BaseConsumer<super::kafka::QuietContext>;

/// A consumer of the checkpoint topic from `from` (`committed`: only committed records, and
/// `Offset::End` is the last stable offset).
fn tail(store: &KafkaStore, committed: bool, from: Offset) -> Result<Tail> {
    let consumer = store.tail_consumer(committed)?;
    let mut end = TopicPartitionList::new();
    end.add_partition_offset(store.topic(), 0, from)
        .and_then(|()| consumer.assign(&end))
        .map_err(|e| {
            Error::checkpoint(format!("cannot listen on {}: {e}", store.topic()))
                .remedy("outboxd retries; check the brokers")
                .transient()
        })?;
    Ok(consumer)
}

/// The listening thread: notes when a record of the pipeline's lead or checkpoint arrives
/// (`written`: every record, committed or not), and when the newest lead record is a release that
/// `committed` (committed records only) has seen committed. `newest`: the newest lead record's
/// offset and whether it releases, as read at the start.
fn listen(
    written: &Tail,
    committed: &Tail,
    of: Heard,
    newest: Option<(i64, bool)>,
    stop: Arc<AtomicBool>,
) {
    let mut newest = newest;
    // The offset of the newest release seen committed.
    let mut committed_release = None;
    while !stop.load(Ordering::Relaxed) {
        match written.poll(Duration::from_millis(100)) {
            Some(Ok(message)) => {
                let key = message.key().unwrap_or_default();
                if key == of.lead.as_bytes() || key == of.live.as_bytes() {
                    of.heard
                        .store(of.base.elapsed().as_millis() as u64, Ordering::Relaxed);
                }
                if key == of.live.as_bytes() && message.payload().is_none() {
                    of.reset.store(true, Ordering::Relaxed);
                }
                // The newest lead record says whether the lead is free: a release that a newer
                // renewal followed (a release that never committed, then another instance's
                // take-over) frees nothing, and a release frees it once committed.
                if key == of.lead.as_bytes() {
                    if let Some(record) = super::kafka::LeadRecord::parse(message.payload()) {
                        newest = Some((message.offset(), record.released));
                        let free = record.released && committed_release == Some(message.offset());
                        of.released.store(free, Ordering::Relaxed);
                    }
                }
            }
            Some(Err(e)) => {
                tracing::debug!(error = %e, "listening for the pipeline's lead");
                std::thread::sleep(Duration::from_millis(100));
            }
            None => {}
        }
        // Everything committed meanwhile (a busy topic's committed records must not queue up
        // behind one poll per written one).
        while let Some(result) = committed.poll(Duration::ZERO) {
            let message = match result {
                Ok(message) => message,
                Err(e) => {
                    tracing::debug!(error = %e, "listening for the pipeline's committed release");
                    continue;
                }
            };
            if message.key().unwrap_or_default() != of.lead.as_bytes() {
                continue;
            }
            let released = super::kafka::LeadRecord::parse(message.payload())
                .is_some_and(|record| record.released);
            if released {
                committed_release = Some(message.offset());
                if newest == Some((message.offset(), true)) {
                    tracing::debug!("the last leader's release is committed");
                    of.released.store(true, Ordering::Relaxed);
                }
            }
        }
    }
}
