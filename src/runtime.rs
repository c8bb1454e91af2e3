//! The async runtime every command runs on.
//!
//! ## Why one worker thread
//! The pipeline is one stream: the reader task hands batches of changes to the session task, and
//! the session hands records to librdkafka, whose own threads write the produce requests and
//! report deliveries. Blocking calls go to tokio's blocking pool (`spawn_blocking`,
//! `block_in_place`). So the worker only runs the pipeline's tasks, one after another.
//!
//! On one worker, each hand-over wakes a task on the same thread. On two (tokio's default on a
//! 2-core machine), the scheduler unparks the idle worker to steal whichever task just became
//! runnable, and that park/unpark traffic was the largest item in the Postgres drain's profile:
//! the walsender sends every message in a segment of its own, so a caught-up reader wakes often,
//! and every switch took CPU the walsender needed on the same cores. Measured side by side in one
//! run (BENCHMARKS.md, "One worker thread"): Postgres 1-row transactions 22k → 32k events/s with
//! context switches 91 → 38 per 100 rows, 100-row 57k → 85k, 10-row unchanged (59k → 57k); MariaDB
//! within noise (10-row 0.83 against 0.81 of `mariadb-binlog` there, 0.73 against 0.76 in another
//! run). Against the build before it, in one run: Postgres 28k → 37k, 42k → 70k, 72k → 95k.
//!
//! The price: a synchronous stretch on the worker stalls every task (the HTTP endpoints, signal
//! handling, the Postgres status updates, the lease renewal). So the live sources give the worker
//! back between events (tokio's cooperative budget: the Postgres source through its socket reads,
//! the MySQL source per event, since a compressed payload's events come from memory), and the
//! prune task reads checkpoints off it. Not yet: a file replay decodes on the worker (README,
//! "Not yet"). `TOKIO_WORKER_THREADS` (tokio's own variable) sets another count.

use crate::error::{Error, Result};

/// A multi-thread runtime (so `block_in_place` works) with one worker, unless
/// `TOKIO_WORKER_THREADS` asks for another count.
pub fn build() -> Result<tokio::runtime::Runtime> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if std::env::var_os("TOKIO_WORKER_THREADS").is_none() {
        builder.worker_threads(1);
    }
    builder
        .enable_all()
        .build()
        .map_err(|e| Error::config(format!("cannot start the async runtime: {e}")))
}

#[cfg(test)]
mod tests {
    /// The default the benchmarks measured; `TOKIO_WORKER_THREADS` still overrides it.
    #[test]
    fn one_worker_unless_tokio_worker_threads_says_otherwise() {
        let runtime = super::build().unwrap();
        let expected = std::env::var("TOKIO_WORKER_THREADS")
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(1);
        assert_eq!(runtime.metrics().num_workers(), expected);
    }
}
