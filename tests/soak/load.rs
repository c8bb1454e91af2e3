//! The load: several producers, each committing transactions of 1–50 rows into the outbox through
//! the database's own client, some rolled back, some rows large. Every producer owns its keys, so
//! the order of one key's rows is the order its producer committed them, and each row's id carries
//! its producer and sequence number: `id = producer << 64 | seq`.
//!
//! A transaction whose client failed (the database restarting under it) may or may not have
//! committed; the checker takes the database's table as the truth at the end, so such rows are
//! only counted, never guessed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Runs one SQL script; `Err` carries the client's message.
pub type Exec = Arc<dyn Fn(&str) -> Result<String, String> + Send + Sync>;

/// The INSERT of one row: id (32 hex digits), key, payload (JSON text).
pub type Insert = fn(&str, &str, &str) -> String;

/// What one producer did.
#[derive(Default)]
pub struct Log {
    /// Rows whose transaction's COMMIT returned, with the moment it returned.
    pub acked: Vec<(u128, Instant)>,
    /// Rows of transactions that ended in ROLLBACK: never to be delivered.
    pub rolled_back: Vec<u128>,
    /// Rows of transactions whose client failed: in the database or not.
    pub ambiguous: Vec<u128>,
    pub transactions: u64,
    pub failed_calls: u64,
}

pub fn id_of(producer: u64, seq: u64) -> u128 {
    (u128::from(producer) << 64) | u128::from(seq)
}

pub fn producer_of(id: u128) -> u64 {
    (id >> 64) as u64
}

pub fn seq_of(id: u128) -> u64 {
    id as u64
}

/// The key of a row: each producer owns eight.
pub fn key_of(producer: u64, seq: u64) -> String {
    format!("p{producer}-k{}", seq % 8)
}

/// Starts `producers` threads writing until `stop` is set; join them for their logs.
pub fn start(
    producers: u64,
    seed: u64,
    exec: Exec,
    insert: Insert,
    stop: Arc<AtomicBool>,
) -> Vec<std::thread::JoinHandle<Log>> {
    (0..producers)
        .map(|p| {
            let (exec, stop) = (exec.clone(), stop.clone());
            std::thread::spawn(move || produce(p, seed, &*exec, insert, &stop))
        })
        .collect()
}

fn produce(
    p: u64,
    seed: u64,
    exec: &dyn Fn(&str) -> Result<String, String>,
    insert: Insert,
    stop: &AtomicBool,
) -> Log {
    let mut rng = fastrand::Rng::with_seed(seed ^ (p + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let mut log = Log::default();
    let mut seq = 0u64;
    while !stop.load(Ordering::Relaxed) {
        // Mostly small transactions, a few large ones: 60 % 1-5 rows, 30 % 6-20, 10 % 21-50.
        let rows = match rng.u32(0..10) {
            0..=5 => rng.u64(1..=5),
            6..=8 => rng.u64(6..=20),
            _ => rng.u64(21..=50),
        };
        let rollback = rng.u32(0..20) == 0;
        let mut ids = Vec::with_capacity(rows as usize);
        let mut script = String::from("BEGIN;\n");
        for _ in 0..rows {
            let id = id_of(p, seq);
            // One row in fifty carries 64-256 KiB (a document, an image's metadata blob).
            let pad = if rng.u32(0..50) == 0 {
                rng.usize(64 << 10..=256 << 10)
            } else {
                rng.usize(10..200)
            };
            let payload = format!(r#"{{"p":{p},"s":{seq},"pad":"{}"}}"#, "x".repeat(pad));
            script.push_str(&insert(&format!("{id:032x}"), &key_of(p, seq), &payload));
            script.push('\n');
            ids.push(id);
            seq += 1;
        }
        script.push_str(if rollback { "ROLLBACK;\n" } else { "COMMIT;\n" });
        match exec(&script) {
            Ok(_) if rollback => log.rolled_back.extend(ids),
            Ok(_) => {
                let now = Instant::now();
                log.acked.extend(ids.into_iter().map(|id| (id, now)));
            }
            Err(_) => {
                log.failed_calls += 1;
                log.ambiguous.extend(ids);
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        log.transactions += 1;
        std::thread::sleep(Duration::from_millis(rng.u64(20..80)));
    }
    log
}
