//! The checker's reader: one real consumer that reads the topic from its first offset for the whole
//! run (read_committed in exactly-once mode) and, once told to stop, reads on to each partition's
//! end. It keeps what identifies a record, not its payload: the row id, where it sits, when the
//! broker appended it (the topic uses LogAppendTime) and when it arrived here.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

use super::load::{key_of, producer_of, seq_of};

pub struct Delivery {
    pub id: u128,
    pub partition: i32,
    pub offset: i64,
    /// The broker's append time (ms since the epoch).
    pub appended_ms: i64,
    /// Whether the record's key is the one its row was written with.
    pub key_ok: bool,
}

#[derive(Default)]
pub struct Seen {
    pub deliveries: Vec<Delivery>,
    /// The first arrival of each row id.
    pub first: HashMap<u128, Instant>,
    /// Records whose id header was missing or not a row id of this run.
    pub malformed: u64,
    /// Records this reader was handed again at an offset it had read (the consumer's own
    /// re-fetch, not a second copy in the topic): left out of `deliveries`.
    pub re_read: u64,
    /// Whether the reader's position reached every partition's end after the stop (a
    /// read_committed position may stop short of a final transaction marker; the reader also
    /// ends after 5 s without a record).
    pub drained: bool,
}

pub struct Tail {
    pub seen: Arc<Mutex<Seen>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Tail {
    pub fn start(bootstrap: &str, topic: &str, partitions: i32, read_committed: bool) -> Tail {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap)
            .set("group.id", "outboxd-soak-checker")
            .set("enable.auto.commit", "false")
            .set(
                "isolation.level",
                if read_committed {
                    "read_committed"
                } else {
                    "read_uncommitted"
                },
            )
            .set("fetch.max.bytes", "52428800")
            .set("receive.message.max.bytes", "104857600")
            .create()
            .unwrap();
        let mut tpl = TopicPartitionList::new();
        for p in 0..partitions {
            tpl.add_partition_offset(topic, p, Offset::Beginning)
                .unwrap();
        }
        consumer.assign(&tpl).unwrap();
        let seen = Arc::new(Mutex::new(Seen::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (s, t, topic) = (seen.clone(), stop.clone(), topic.to_string());
        let thread = std::thread::spawn(move || read(&consumer, &topic, partitions, &s, &t));
        Tail {
            seen,
            stop,
            thread: Some(thread),
        }
    }

    /// Whether every id in `ids` has arrived.
    pub fn has_all(&self, ids: &[u128]) -> bool {
        let seen = self.seen.lock().unwrap();
        ids.iter().all(|id| seen.first.contains_key(id))
    }

    /// Reads on to the end of every partition (bounded), then stops; returns what was seen.
    pub fn finish(mut self) -> Seen {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().unwrap().join().unwrap();
        std::mem::take(&mut *self.seen.lock().unwrap())
    }
}

fn read(
    consumer: &BaseConsumer,
    topic: &str,
    partitions: i32,
    seen: &Mutex<Seen>,
    stop: &AtomicBool,
) {
    let mut ends: Option<(Vec<i64>, Instant)> = None;
    let mut offsets: std::collections::HashSet<(i32, i64)> = std::collections::HashSet::new();
    let mut last = Instant::now();
    loop {
        if stop.load(Ordering::Relaxed) && ends.is_none() {
            let highs = (0..partitions)
                .map(|p| {
                    consumer
                        .fetch_watermarks(topic, p, Duration::from_secs(10))
                        .map_or(i64::MAX, |(_, high)| high)
                })
                .collect();
            ends = Some((highs, Instant::now()));
        }
        if let Some((highs, since)) = &ends {
            let position = consumer.position().unwrap();
            let at_end = (0..partitions).all(|p| {
                match position.find_partition(topic, p).map(|e| e.offset()) {
                    Some(Offset::Offset(o)) => o >= highs[p as usize],
                    _ => highs[p as usize] == 0,
                }
            });
            let quiet =
                last.elapsed() > Duration::from_secs(5) && since.elapsed() > Duration::from_secs(5);
            if at_end || quiet || since.elapsed() > Duration::from_secs(120) {
                seen.lock().unwrap().drained = at_end;
                return;
            }
        }
        match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(m)) => {
                last = Instant::now();
                let id = m
                    .headers()
                    .and_then(|h| h.iter().find(|h| h.key == "id").and_then(|h| h.value))
                    .and_then(|v| std::str::from_utf8(v).ok())
                    .and_then(|s| u128::from_str_radix(&s.replace('-', ""), 16).ok());
                let mut seen = seen.lock().unwrap();
                if !offsets.insert((m.partition(), m.offset())) {
                    seen.re_read += 1;
                    continue;
                }
                let Some(id) = id else {
                    seen.malformed += 1;
                    continue;
                };
                let key_ok = m.key() == Some(key_of(producer_of(id), seq_of(id)).as_bytes());
                seen.first.entry(id).or_insert_with(Instant::now);
                seen.deliveries.push(Delivery {
                    id,
                    partition: m.partition(),
                    offset: m.offset(),
                    appended_ms: m.timestamp().to_millis().unwrap_or(0),
                    key_ok,
                });
            }
            Some(Err(e)) if crate::rig::kafka::passing(&e) => {}
            Some(Err(e)) => eprintln!("soak checker: consumer error (reading on): {e}"),
            None => {}
        }
    }
}
