//! The reader task: the source is not cancel-safe, so it runs in its own task and hands changes to
//! the session over a bounded channel, which is how back-pressure from the sink reaches the source.

use std::sync::Arc;

use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

use crate::error::Result;
use crate::metrics::Metrics;
use crate::source::{Change, Source};

/// Changes buffered between the reader task and the session.
pub(super) const CHANNEL_DEPTH: usize = 1024;
/// Bytes of rows buffered between the reader task and the session (large rows would otherwise let
/// 1024 changes hold a gigabyte). A row larger than this takes all of it.
pub(super) const CHANNEL_BYTES: u32 = 16 * 1024 * 1024;

/// A change from the reader task, with the part of the channel's byte budget it holds.
pub(super) type Queued = (Result<Change>, Option<OwnedSemaphorePermit>);

/// Starts the reader task; the receiver ends when the source fails, is exhausted, or the task is
/// aborted.
pub(super) fn spawn(
    source: Source,
    metrics: Arc<Metrics>,
) -> (mpsc::Receiver<Queued>, tokio::task::JoinHandle<()>) {
    let (tx, rx) = mpsc::channel::<Queued>(CHANNEL_DEPTH);
    let budget = Arc::new(Semaphore::new(CHANNEL_BYTES as usize));
    (rx, tokio::spawn(read_changes(source, tx, budget, metrics)))
}

/// Pulls changes until the source fails or the channel closes. Rows take their size from the
/// channel's byte budget before they are queued.
async fn read_changes(
    mut source: Source,
    tx: mpsc::Sender<Queued>,
    budget: Arc<Semaphore>,
    metrics: Arc<Metrics>,
) {
    let mut reported = source.ignored();
    loop {
        let change = source.next().await;
        let ended = matches!(change, Ok(Change::Exhausted));
        let ignored = source.ignored();
        metrics.ignored("update", ignored.updates - reported.updates);
        metrics.ignored("delete", ignored.deletes - reported.deletes);
        reported = ignored;
        let failed = change.is_err();
        let permit = match &change {
            Ok(Change::Row(row)) => {
                let cost = u32::try_from(row.size())
                    .unwrap_or(u32::MAX)
                    .clamp(1, CHANNEL_BYTES);
                match budget.clone().acquire_many_owned(cost).await {
                    Ok(permit) => Some(permit),
                    Err(_) => return,
                }
            }
            _ => None,
        };
        if tx.send((change, permit)).await.is_err() || failed || ended {
            return;
        }
    }
}
