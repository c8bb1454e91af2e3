//! The reader task: the source is not cancel-safe, so it runs in its own task and hands changes to
//! the session over a bounded channel, which is how back-pressure from the sink reaches the source.

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::route::OnUpdateDelete;
use crate::source::{Change, Source};

/// Changes handed over in one channel message, at most: a batch is sent when the source would
/// wait, when it is this long, or when the byte budget runs out. Batches cut the task wake-ups per
/// change (the session handles a whole batch per wake-up when the source is ahead of it).
pub(super) const BATCH: usize = 256;
/// Batches buffered between the reader task and the session (with [`BATCH`]: about 1024 changes).
pub(super) const CHANNEL_DEPTH: usize = 4;
/// Bytes of rows buffered between the reader task and the session (large rows would otherwise let
/// 1024 changes hold a gigabyte). A row larger than this takes all of it.
pub(super) const CHANNEL_BYTES: u32 = 16 * 1024 * 1024;

/// A change from the reader task, with the part of the channel's byte budget it holds (released
/// per change, as the session handles it) and, for a row, when the source gave it
/// (`outboxd_handoff_seconds` times the row from here to its hand-over to the sink).
pub(super) type Queued = (
    Result<Change>,
    Option<OwnedSemaphorePermit>,
    Option<Instant>,
);

/// Starts the reader task; the receiver ends when the source fails, is exhausted, or the task is
/// aborted.
pub(super) fn spawn(
    source: Source,
    on_update_delete: OnUpdateDelete,
    metrics: Arc<Metrics>,
) -> (mpsc::Receiver<Vec<Queued>>, tokio::task::JoinHandle<()>) {
    let (tx, rx) = mpsc::channel::<Vec<Queued>>(CHANNEL_DEPTH);
    let budget = Arc::new(Semaphore::new(CHANNEL_BYTES as usize));
    (
        rx,
        tokio::spawn(read_changes(source, on_update_delete, tx, budget, metrics)),
    )
}

/// Pulls changes until the source fails or the channel closes. Rows take their size from the
/// channel's byte budget before they are queued. Changes the source has ready are gathered into
/// one batch; the source's pending call is never dropped (it is not cancel-safe), only awaited
/// after the batch so far was sent.
async fn read_changes(
    mut source: Source,
    on_update_delete: OnUpdateDelete,
    tx: mpsc::Sender<Vec<Queued>>,
    budget: Arc<Semaphore>,
    metrics: Arc<Metrics>,
) {
    let mut reported = source.ignored();
    let mut wall = source.commit_times_precise().then(WallClock::new);
    let mut updated = Updates::default();
    let mut batch: Vec<Queued> = Vec::new();
    loop {
        let change = {
            let mut next = std::pin::pin!(source.next());
            match futures_util::poll!(next.as_mut()) {
                std::task::Poll::Ready(change) => change,
                std::task::Poll::Pending => {
                    if !batch.is_empty() && !send(&tx, &mut batch).await {
                        return;
                    }
                    next.await
                }
            }
        };
        // One clock read per row times both hops (none for commits and heartbeats).
        let read_at = match &change {
            Ok(Change::Row(row)) => {
                let now = Instant::now();
                if let (Some(wall), Some(committed_ms)) = (wall.as_mut(), row.committed_ms) {
                    metrics.read_after_commit(wall.unix_ms(now) - committed_ms);
                }
                Some(now)
            }
            _ => None,
        };
        let ended = matches!(change, Ok(Change::Exhausted));
        let ignored = source.ignored();
        let (updates, deletes) = (
            ignored.updates - reported.updates,
            ignored.deletes - reported.deletes,
        );
        metrics.ignored("update", updates);
        metrics.ignored("delete", deletes);
        reported = ignored;
        // The change that revealed an update is not passed on under `fatal`: the session ends
        // before its position could be checkpointed, so a restart stops at the same place.
        let change = match updated.judge(on_update_delete, updates) {
            Some(stop) => Err(stop),
            None => change,
        };
        let ended = ended && change.is_ok();
        let failed = change.is_err();
        let permit = match &change {
            Ok(Change::Row(row)) => {
                let cost = u32::try_from(row.size())
                    .unwrap_or(u32::MAX)
                    .clamp(1, CHANNEL_BYTES);
                // The budget comes back as the session handles the changes: never wait for it
                // while holding changes it has not been sent.
                let permit = match budget.clone().try_acquire_many_owned(cost) {
                    Ok(permit) => permit,
                    Err(_) => {
                        if !batch.is_empty() && !send(&tx, &mut batch).await {
                            return;
                        }
                        match budget.clone().acquire_many_owned(cost).await {
                            Ok(permit) => permit,
                            Err(_) => return,
                        }
                    }
                };
                Some(permit)
            }
            _ => None,
        };
        batch.push((change, permit, read_at));
        if failed || ended {
            let _ = send(&tx, &mut batch).await;
            return;
        }
        if batch.len() >= BATCH && !send(&tx, &mut batch).await {
            return;
        }
    }
}

/// Unix milliseconds from a monotonic instant: the wall clock is read once a second, not per row.
struct WallClock {
    unix_ms: i64,
    at: Instant,
}

impl WallClock {
    fn new() -> WallClock {
        WallClock {
            unix_ms: unix_ms_now(),
            at: Instant::now(),
        }
    }

    fn unix_ms(&mut self, now: Instant) -> i64 {
        let since = now.saturating_duration_since(self.at);
        if since > std::time::Duration::from_secs(1) {
            *self = WallClock::new();
            return self.unix_ms;
        }
        self.unix_ms + since.as_millis() as i64
    }
}

fn unix_ms_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as i64
}

/// UPDATEs of outbox rows seen and not yet logged. DELETEs are not judged: deleting forwarded
/// rows is how an outbox is kept small (Debezium skips them too); they are only counted.
#[derive(Default)]
struct Updates {
    unlogged: u64,
    logged_at: Option<std::time::Instant>,
}

/// At most one log line per this interval, with the count since the last one.
const UPDATE_LOG_INTERVAL: std::time::Duration = std::time::Duration::from_secs(60);

impl Updates {
    /// Logs `updates` as `policy` says (at most once a minute); under `fatal`, the error that
    /// stops outboxd.
    fn judge(&mut self, policy: OnUpdateDelete, updates: u64) -> Option<Error> {
        if updates == 0 {
            return None;
        }
        if policy == OnUpdateDelete::Fatal {
            return Some(
                Error::source(format!(
                    "{updates} UPDATE(s) of outbox rows reached outboxd, and route.on_update_delete = \"fatal\" (outboxd forwards INSERTs only)"
                ))
                .remedy("the application changed outbox rows it should only insert; fix it, or set route.on_update_delete = \"warn\" (they are then counted in outboxd_ignored_events_total and skipped), then restart"),
            );
        }
        self.unlogged += updates;
        if self
            .logged_at
            .is_some_and(|at| at.elapsed() < UPDATE_LOG_INTERVAL)
        {
            return None;
        }
        let count = std::mem::take(&mut self.unlogged);
        self.logged_at = Some(std::time::Instant::now());
        let what = "UPDATEs of outbox rows were not forwarded (outboxd forwards INSERTs only; route.on_update_delete)";
        if policy == OnUpdateDelete::Error {
            tracing::error!(updates = count, "{what}");
        } else {
            tracing::warn!(updates = count, "{what}");
        }
        None
    }
}

/// Sends the batch (leaving `batch` empty); `false` once the session is gone.
async fn send(tx: &mpsc::Sender<Vec<Queued>>, batch: &mut Vec<Queued>) -> bool {
    tx.send(std::mem::take(batch)).await.is_ok()
}

/// The next change: from the batch being handled, or else the next batch (waiting for it).
/// Cancel-safe.
pub(super) async fn next_queued(
    pending: &mut std::vec::IntoIter<Queued>,
    changes: &mut mpsc::Receiver<Vec<Queued>>,
) -> Option<Queued> {
    loop {
        if let Some(queued) = pending.next() {
            return Some(queued);
        }
        *pending = changes.recv().await?.into_iter();
    }
}

/// [`next_queued`] without waiting: `None` when nothing is queued.
pub(super) fn try_next_queued(
    pending: &mut std::vec::IntoIter<Queued>,
    changes: &mut mpsc::Receiver<Vec<Queued>>,
) -> Option<Queued> {
    loop {
        if let Some(queued) = pending.next() {
            return Some(queued);
        }
        *pending = changes.try_recv().ok()?.into_iter();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows are timed against the wall clock read once a second: it must agree with the system
    /// clock, and read it again once that second has passed.
    #[test]
    fn the_wall_clock_follows_the_system_clock_and_reanchors_each_second() {
        let mut wall = WallClock::new();
        let now = Instant::now();
        assert!((wall.unix_ms(now) - unix_ms_now()).abs() <= 5);
        let anchored = wall.at;
        let later = now + std::time::Duration::from_millis(1500);
        let told = wall.unix_ms(later);
        assert!(wall.at > anchored, "not anchored again after a second");
        assert!((told - unix_ms_now()).abs() <= 5, "{told}");
        // Within the second, the time moves with the monotonic clock.
        let at = wall.at;
        assert_eq!(
            wall.unix_ms(at + std::time::Duration::from_millis(250)),
            wall.unix_ms + 250
        );
    }
}
