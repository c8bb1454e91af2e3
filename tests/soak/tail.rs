//! The checker's reader: one real consumer that reads the topic from its first offset for the whole
//! run (read_committed in exactly-once mode) and, once told to stop, reads on to each partition's
//! end: a marker record the checker itself appends to every partition once outboxd stopped (so a
//! position that only looks like the end, below an open transaction or after an offset reset,
//! cannot pass for it). It keeps what identifies a record, not its payload: the row id, where it
//! sits, when the broker appended it (the topic uses LogAppendTime) and when it arrived here.
//!
//! On Redis the same, with `XREAD` from the stream's first entry: the stream is partition 0, an
//! entry's place in it its offset, and the milliseconds of its id (Redis's clock, `XADD *`) its
//! append time. Redis has no uncommitted entries: `MULTI`/`EXEC` applies a batch at once.
//!
//! On NATS JetStream with an ordered consumer from the stream's first message, made again at the
//! next sequence whenever the server goes away: the stream is partition 0, a message's stream
//! sequence its offset, and the server's time it stored it its append time. The end: a sequence
//! past the stream's last one, asked after the stop.
//!
//! On RabbitMQ by consuming the soak's queue (acknowledging what it took), connecting again after
//! each outage: the queue is partition 0, the order of arrival the offset, the arrival the append
//! time (RabbitMQ stamps nothing). A message handed out again because the reader's connection
//! died before its acknowledgement arrives marked `redelivered`; such a copy of an id already seen
//! is the reader's re-read, not the topic's. The end: an empty queue, asked after the stop.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

use super::load::{key_of, producer_of, seq_of};
use crate::rig::redis::Redis;

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
    /// Whether the reader reached the end after the stop: every partition's end marker (Kafka),
    /// an empty read (Redis). It gives up 120 s after the stop.
    pub drained: bool,
    /// How often the reader made its consumer again because it received nothing while the topic
    /// held more.
    pub rebuilt: u64,
}

pub struct Tail {
    pub seen: Arc<Mutex<Seen>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Kafka: where to append the end markers (bootstrap, topic, partitions).
    markers: Option<(String, String, i32)>,
}

impl Drop for Tail {
    /// Ends the reader after a panic too (it stops within 120 s).
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// The header of the checker's end markers.
const END_MARKER: &str = "soak-end";

impl Tail {
    pub fn kafka(bootstrap: &str, topic: &str, partitions: i32, read_committed: bool) -> Tail {
        let reader = KafkaReader {
            bootstrap: bootstrap.to_string(),
            topic: topic.to_string(),
            partitions,
            read_committed,
        };
        let seen = Arc::new(Mutex::new(Seen::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (s, t) = (seen.clone(), stop.clone());
        let thread = std::thread::spawn(move || reader.read(&s, &t));
        Tail {
            seen,
            stop,
            thread: Some(thread),
            markers: Some((bootstrap.to_string(), topic.to_string(), partitions)),
        }
    }

    pub fn redis(server: &Redis, stream: &str) -> Tail {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (s, t, url, stream) = (seen.clone(), stop.clone(), server.url(), stream.to_string());
        let thread = std::thread::spawn(move || read_redis(&url, &stream, &s, &t));
        Tail {
            seen,
            stop,
            thread: Some(thread),
            markers: None,
        }
    }

    pub fn nats(url: &str, stream: &str) -> Tail {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (s, t, url, stream) = (
            seen.clone(),
            stop.clone(),
            url.to_string(),
            stream.to_string(),
        );
        let thread = std::thread::spawn(move || read_nats(&url, &stream, &s, &t));
        Tail {
            seen,
            stop,
            thread: Some(thread),
            markers: None,
        }
    }

    pub fn rabbitmq(url: &str, queue: &str) -> Tail {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (s, t, url, queue) = (
            seen.clone(),
            stop.clone(),
            url.to_string(),
            queue.to_string(),
        );
        let thread = std::thread::spawn(move || read_rabbitmq(&url, &queue, &s, &t));
        Tail {
            seen,
            stop,
            thread: Some(thread),
            markers: None,
        }
    }

    /// Whether every id in `ids` has arrived.
    pub fn has_all(&self, ids: &[u128]) -> bool {
        let seen = self.seen.lock().unwrap();
        ids.iter().all(|id| seen.first.contains_key(id))
    }

    /// Reads on to the end of every partition (bounded), then stops; returns what was seen. Call
    /// it once nothing writes any more.
    pub fn finish(mut self) -> Seen {
        if let Some((bootstrap, topic, partitions)) = &self.markers {
            append_end_markers(bootstrap, topic, *partitions);
        }
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().unwrap().join().unwrap();
        std::mem::take(&mut *self.seen.lock().unwrap())
    }
}

/// What the Kafka reader needs to make its consumer (again).
struct KafkaReader {
    bootstrap: String,
    topic: String,
    partitions: i32,
    read_committed: bool,
}

/// How long the reader may receive nothing while the topic holds records past its position
/// before it makes its consumer again.
const STALLED: Duration = Duration::from_secs(20);

impl KafkaReader {
    /// A consumer assigned every partition at `next` (the offset after the last one read; the
    /// first offset for a partition not read yet).
    fn consumer(&self, next: &HashMap<i32, i64>) -> BaseConsumer {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &self.bootstrap)
            .set("group.id", "outboxd-soak-checker")
            .set("enable.auto.commit", "false")
            .set(
                "isolation.level",
                if self.read_committed {
                    "read_committed"
                } else {
                    "read_uncommitted"
                },
            )
            .set("fetch.max.bytes", "52428800")
            .set("receive.message.max.bytes", "104857600")
            // An offset out of range is an error (no marker is then reached), not a silent jump.
            .set("auto.offset.reset", "error")
            .create()
            .unwrap();
        let mut tpl = TopicPartitionList::new();
        for p in 0..self.partitions {
            let offset = next
                .get(&p)
                .map_or(Offset::Beginning, |&o| Offset::Offset(o));
            tpl.add_partition_offset(&self.topic, p, offset).unwrap();
        }
        consumer.assign(&tpl).unwrap();
        consumer
    }

    /// Whether the topic holds records (committed ones, read_committed) past `next` in one of
    /// `quiet` (partitions that delivered nothing for [`STALLED`]), or the broker did not say: a
    /// reader that receives nothing from such a partition is stuck there, not caught up.
    fn behind(&self, consumer: &BaseConsumer, next: &HashMap<i32, i64>, quiet: &[i32]) -> bool {
        // A watermark the broker did not give counts as more: a rebuild too many costs nothing,
        // a consumer left stuck fails the run.
        quiet.iter().any(|&p| {
            consumer
                .fetch_watermarks(&self.topic, p, Duration::from_secs(5))
                .map_or(true, |(_, high)| high > next.get(&p).copied().unwrap_or(0))
        })
    }

    /// For a run that failed: where the reader stood in each partition that showed no end marker,
    /// beside what the broker says the partition holds (a reader far behind: the reader was stuck;
    /// a watermark at the reader: nothing more reached the broker).
    fn say_where_it_stopped(
        &self,
        next: &HashMap<i32, i64>,
        ended: &std::collections::HashSet<i32>,
    ) {
        // A new client: the reader's own may be what is stuck.
        let consumer = self.consumer(next);
        let mut stood = Vec::new();
        for p in (0..self.partitions).filter(|p| !ended.contains(p)) {
            let reached = next.get(&p).copied().unwrap_or(0);
            let holds = match consumer.fetch_watermarks(&self.topic, p, Duration::from_secs(5)) {
                Ok((low, high)) => format!("the broker holds {low}..{high}"),
                Err(e) => format!("the broker gave no watermarks ({e})"),
            };
            stood.push(format!("partition {p}: read up to {reached}, {holds}"));
        }
        eprintln!(
            "soak checker: no end marker within 120 s of the stop; {}",
            stood.join("; ")
        );
    }

    /// Reads until told to stop and then until every partition's end marker (bounded). A
    /// consumer that receives nothing from a partition for [`STALLED`] while that partition holds
    /// more (an open transaction's records count: a rebuild too many costs nothing) is made again
    /// at the offsets reached (after the broker fenced itself and re-elected its own partitions,
    /// one stayed silent for minutes); `reader_rebuilt` counts it.
    fn read(&self, seen: &Mutex<Seen>, stop: &AtomicBool) {
        let mut next: HashMap<i32, i64> = HashMap::new();
        let mut consumer = self.consumer(&next);
        let mut offsets: std::collections::HashSet<(i32, i64)> = std::collections::HashSet::new();
        let mut ended: std::collections::HashSet<i32> = std::collections::HashSet::new();
        let mut stopped: Option<Instant> = None;
        // When each partition last delivered since the consumer was made (none: quiet), and when
        // the reader last looked for quiet partitions.
        let mut last: HashMap<i32, Instant> = HashMap::new();
        let mut looked = Instant::now();
        loop {
            if stop.load(Ordering::Relaxed) && stopped.is_none() {
                stopped = Some(Instant::now());
            }
            if let Some(since) = stopped {
                let at_end = ended.len() == self.partitions as usize;
                if at_end || since.elapsed() > Duration::from_secs(120) {
                    if !at_end {
                        self.say_where_it_stopped(&next, &ended);
                    }
                    seen.lock().unwrap().drained = at_end;
                    return;
                }
            }
            if looked.elapsed() > STALLED {
                looked = Instant::now();
                // Past aborted records and transaction markers too, which no message shows.
                if let Ok(position) = consumer.position() {
                    for e in position.elements() {
                        if let Offset::Offset(o) = e.offset() {
                            let at = next.entry(e.partition()).or_insert(o);
                            *at = (*at).max(o);
                        }
                    }
                }
                let quiet: Vec<i32> = (0..self.partitions)
                    .filter(|p| last.get(p).is_none_or(|at| at.elapsed() > STALLED))
                    .collect();
                if self.behind(&consumer, &next, &quiet) {
                    eprintln!("soak checker: the reader received nothing for {STALLED:?} from a partition that holds more: making its consumer again");
                    seen.lock().unwrap().rebuilt += 1;
                    consumer = self.consumer(&next);
                    last.clear();
                }
            }
            let m = match consumer.poll(Duration::from_millis(100)) {
                Some(Ok(m)) => m,
                Some(Err(e)) if crate::rig::kafka::passing(&e) => continue,
                Some(Err(e)) => {
                    eprintln!("soak checker: consumer error (reading on): {e}");
                    continue;
                }
                None => continue,
            };
            last.insert(m.partition(), Instant::now());
            next.insert(m.partition(), m.offset() + 1);
            let headers = m.headers();
            if headers.is_some_and(|h| h.iter().any(|h| h.key == END_MARKER)) {
                ended.insert(m.partition());
                continue;
            }
            let id = headers
                .and_then(|h| h.iter().find(|h| h.key == "id").and_then(|h| h.value))
                .and_then(row_id);
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
    }
}

/// A row id as the `id` header or field carries it (a UUID's text, or its hex).
fn row_id(text: &[u8]) -> Option<u128> {
    let text = std::str::from_utf8(text).ok()?;
    u128::from_str_radix(&text.replace('-', ""), 16).ok()
}

/// Reads `stream` from its first entry until told to stop and an `XREAD` then finds nothing
/// more (outboxd is stopped by then), reconnecting while the server is down or frozen.
fn read_redis(url: &str, stream: &str, seen: &Mutex<Seen>, stop: &AtomicBool) {
    use redis::streams::{StreamReadOptions, StreamReadReply};
    use redis::Commands;
    let client = redis::Client::open(url).unwrap();
    let mut connection: Option<redis::Connection> = None;
    let mut last_id = "0-0".to_string();
    let mut offset = 0i64;
    let mut stopped: Option<Instant> = None;
    let options = StreamReadOptions::default().count(2000).block(200);
    loop {
        if stop.load(Ordering::Relaxed) && stopped.is_none() {
            stopped = Some(Instant::now());
        }
        if stopped.is_some_and(|at| at.elapsed() > Duration::from_secs(120)) {
            return;
        }
        let Some(conn) = connection.as_mut() else {
            match client.get_connection_with_timeout(Duration::from_secs(2)) {
                Ok(conn) => {
                    let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
                    connection = Some(conn);
                }
                Err(_) => std::thread::sleep(Duration::from_millis(200)),
            }
            continue;
        };
        let reply: redis::RedisResult<Option<StreamReadReply>> =
            conn.xread_options(&[stream], &[&last_id], &options);
        let entries = match reply {
            Ok(reply) => reply
                .map(|r| r.keys.into_iter().flat_map(|k| k.ids).collect::<Vec<_>>())
                .unwrap_or_default(),
            Err(_) => {
                connection = None;
                continue;
            }
        };
        if entries.is_empty() && stopped.is_some() {
            seen.lock().unwrap().drained = true;
            return;
        }
        let mut seen = seen.lock().unwrap();
        for entry in entries {
            last_id = entry.id.clone();
            let appended_ms = entry
                .id
                .split('-')
                .next()
                .and_then(|ms| ms.parse().ok())
                .unwrap_or(0);
            let field = |name: &str| entry.get::<Vec<u8>>(name);
            let Some(id) = field("id").as_deref().and_then(row_id) else {
                seen.malformed += 1;
                continue;
            };
            let key_ok =
                field("key").as_deref() == Some(key_of(producer_of(id), seq_of(id)).as_bytes());
            seen.first.entry(id).or_insert_with(Instant::now);
            seen.deliveries.push(Delivery {
                id,
                partition: 0,
                offset,
                appended_ms,
                key_ok,
            });
            offset += 1;
        }
    }
}

/// Reads `stream` from its first message until told to stop and its last message (asked after
/// the stop) was read, making the consumer again at the next sequence while the server is down,
/// frozen or restarted.
fn read_nats(url: &str, stream: &str, seen: &Mutex<Seen>, stop: &AtomicBool) {
    in_sessions(1u64, seen, stop, |mut next| async move {
        let read = read_nats_session(url, stream, &mut next, seen, stop).await;
        (next, read)
    });
}

/// Runs `session` (on a runtime of its own) from `state` on, again after each failed one with
/// the state it left, until one ends the read (`Ok`: the reader is drained) or 120 s passed since
/// the stop.
fn in_sessions<S, F, R>(mut state: S, seen: &Mutex<Seen>, stop: &AtomicBool, mut session: F)
where
    F: FnMut(S) -> R,
    R: std::future::Future<Output = (S, Result<(), String>)>,
{
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut stopped: Option<Instant> = None;
    runtime.block_on(async {
        loop {
            if stop.load(Ordering::Relaxed) && stopped.is_none() {
                stopped = Some(Instant::now());
            }
            if stopped.is_some_and(|at| at.elapsed() > Duration::from_secs(120)) {
                return;
            }
            let (left, read) = session(state).await;
            state = left;
            match read {
                Ok(()) => {
                    seen.lock().unwrap().drained = true;
                    return;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    });
}

/// One connection's reading from `next` on: `Ok` once the stop was given and `next` is past the
/// stream's last message, `Err` when the connection or the consumer failed.
async fn read_nats_session(
    url: &str,
    stream: &str,
    next: &mut u64,
    seen: &Mutex<Seen>,
    stop: &AtomicBool,
) -> Result<(), String> {
    use async_nats::jetstream::consumer::pull::OrderedConfig;
    use async_nats::jetstream::consumer::DeliverPolicy;
    use futures_util::StreamExt;
    let step = Duration::from_secs(5);
    let bounded = |what: &'static str| move |e: tokio::time::error::Elapsed| format!("{what}: {e}");
    let client = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(2))
        .max_reconnects(Some(1))
        .connect(url)
        .await
        .map_err(|e| e.to_string())?;
    let js = async_nats::jetstream::new(client);
    let mut handle = tokio::time::timeout(step, js.get_stream(stream))
        .await
        .map_err(bounded("stream"))?
        .map_err(|e| e.to_string())?;
    let consumer = tokio::time::timeout(
        step,
        handle.create_consumer(OrderedConfig {
            deliver_policy: DeliverPolicy::ByStartSequence {
                start_sequence: *next,
            },
            ..Default::default()
        }),
    )
    .await
    .map_err(bounded("consumer"))?
    .map_err(|e| e.to_string())?;
    let mut messages = tokio::time::timeout(step, consumer.messages())
        .await
        .map_err(bounded("messages"))?
        .map_err(|e| e.to_string())?;
    // When a message last came, and when the stream was last asked about: a consumer whose
    // client gave up reconnecting yields nothing and no error, so silence is checked.
    let mut came = Instant::now();
    let mut asked = Instant::now();
    loop {
        let m = match tokio::time::timeout(Duration::from_millis(500), messages.next()).await {
            Err(_) => {
                let stopped = stop.load(Ordering::Relaxed);
                if stopped || asked.elapsed() > step {
                    asked = Instant::now();
                    let info = tokio::time::timeout(step, handle.info())
                        .await
                        .map_err(bounded("info"))?
                        .map_err(|e| e.to_string())?;
                    let more = info.state.last_sequence >= *next;
                    if stopped && !more {
                        return Ok(());
                    }
                    if more && came.elapsed() > 2 * step {
                        return Err("the consumer is silent while the stream holds more".into());
                    }
                }
                continue;
            }
            Ok(None) => return Err("the consumer ended".into()),
            Ok(Some(Err(e))) => return Err(e.to_string()),
            Ok(Some(Ok(m))) => m,
        };
        came = Instant::now();
        let info = m.info().map_err(|e| e.to_string())?;
        let sequence = info.stream_sequence;
        let appended_ms = (info.published.unix_timestamp_nanos() / 1_000_000) as i64;
        if sequence < *next {
            seen.lock().unwrap().re_read += 1;
            continue;
        }
        *next = sequence + 1;
        let header = |name: &str| {
            m.headers
                .as_ref()
                .and_then(|h| h.get(name))
                .map(|v| v.as_str().as_bytes().to_vec())
        };
        let mut seen = seen.lock().unwrap();
        let Some(id) = header("id").as_deref().and_then(row_id) else {
            seen.malformed += 1;
            continue;
        };
        let key_ok = header("outboxd.key").as_deref()
            == Some(key_of(producer_of(id), seq_of(id)).as_bytes());
        seen.first.entry(id).or_insert_with(Instant::now);
        seen.deliveries.push(Delivery {
            id,
            partition: 0,
            offset: sequence as i64,
            appended_ms,
            key_ok,
        });
    }
}

/// Consumes `queue` until told to stop and the queue (asked after the stop) is empty, connecting
/// again while the node is down, frozen or restarted.
fn read_rabbitmq(url: &str, queue: &str, seen: &Mutex<Seen>, stop: &AtomicBool) {
    in_sessions(0i64, seen, stop, |mut offset| async move {
        let read = read_rabbitmq_session(url, queue, &mut offset, seen, stop).await;
        (offset, read)
    });
}

/// One connection's consuming: `Ok` once the stop was given and the queue is empty, `Err` when
/// the connection or the channel failed.
async fn read_rabbitmq_session(
    url: &str,
    queue: &str,
    offset: &mut i64,
    seen: &Mutex<Seen>,
    stop: &AtomicBool,
) -> Result<(), String> {
    use futures_util::StreamExt;
    use lapin::options::{
        BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions,
    };
    use lapin::types::{AMQPValue, FieldTable};
    let step = Duration::from_secs(5);
    let within = |what: &'static str| move |e: tokio::time::error::Elapsed| format!("{what}: {e}");
    let connection = tokio::time::timeout(
        step,
        lapin::Connection::connect(url, lapin::ConnectionProperties::default()),
    )
    .await
    .map_err(within("connect"))?
    .map_err(|e| e.to_string())?;
    let channel = tokio::time::timeout(step, connection.create_channel())
        .await
        .map_err(within("channel"))?
        .map_err(|e| e.to_string())?;
    tokio::time::timeout(step, channel.basic_qos(2000, BasicQosOptions::default()))
        .await
        .map_err(within("qos"))?
        .map_err(|e| e.to_string())?;
    let mut consumer = tokio::time::timeout(
        step,
        channel.basic_consume(
            queue.into(),
            "soak-checker".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        ),
    )
    .await
    .map_err(within("consume"))?
    .map_err(|e| e.to_string())?;
    // When a message last came, and when the queue was last asked about: a consumer on a dead
    // connection may yield nothing and no error, so silence is checked.
    let mut came = Instant::now();
    let mut asked = Instant::now();
    loop {
        let delivery = match tokio::time::timeout(Duration::from_millis(500), consumer.next()).await
        {
            Err(_) => {
                let stopped = stop.load(Ordering::Relaxed);
                if stopped || asked.elapsed() > step {
                    asked = Instant::now();
                    let passive = QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    };
                    let state = tokio::time::timeout(
                        step,
                        channel.queue_declare(queue.into(), passive, FieldTable::default()),
                    )
                    .await
                    .map_err(within("queue"))?
                    .map_err(|e| e.to_string())?;
                    let more = state.message_count() > 0;
                    if stopped && !more {
                        let _ = connection.close(200, "read".into()).await;
                        return Ok(());
                    }
                    if more && came.elapsed() > 2 * step {
                        return Err("the consumer is silent while the queue holds more".into());
                    }
                }
                continue;
            }
            Ok(None) => return Err("the consumer ended".into()),
            Ok(Some(Err(e))) => return Err(e.to_string()),
            Ok(Some(Ok(delivery))) => delivery,
        };
        came = Instant::now();
        let header = |name: &str| {
            delivery
                .properties
                .headers()
                .as_ref()
                .and_then(|t| t.inner().get(name).cloned())
                .and_then(|v| match v {
                    AMQPValue::LongString(s) => Some(s.as_bytes().to_vec()),
                    AMQPValue::ByteArray(b) => Some(b.as_slice().to_vec()),
                    _ => None,
                })
        };
        let id = header("id").as_deref().and_then(row_id);
        let key_ok = id.is_some_and(|id| {
            header("outboxd.key").as_deref() == Some(key_of(producer_of(id), seq_of(id)).as_bytes())
        });
        {
            let mut seen = seen.lock().unwrap();
            match id {
                None => seen.malformed += 1,
                Some(id) if delivery.redelivered && seen.first.contains_key(&id) => {
                    seen.re_read += 1
                }
                Some(id) => {
                    seen.first.entry(id).or_insert_with(Instant::now);
                    let appended_ms = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .unwrap()
                        .as_millis() as i64;
                    seen.deliveries.push(Delivery {
                        id,
                        partition: 0,
                        offset: *offset,
                        appended_ms,
                        key_ok,
                    });
                    *offset += 1;
                }
            }
        }
        tokio::time::timeout(step, delivery.acker.ack(BasicAckOptions::default()))
            .await
            .map_err(within("ack"))?
            .map_err(|e| e.to_string())?;
    }
}

/// Appends one marker record (header [`END_MARKER`], outside any transaction) to each partition:
/// a reader that reaches all of them has read everything written before.
fn append_end_markers(bootstrap: &str, topic: &str, partitions: i32) {
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("acks", "all")
        .create()
        .unwrap();
    // A failure here is no panic: the reader then misses a marker, and the run fails saying its
    // reader did not reach the end, with its verdict and report intact.
    for p in 0..partitions {
        let record = BaseRecord::<str, str>::to(topic)
            .partition(p)
            .payload("")
            .headers(OwnedHeaders::new().insert(Header {
                key: END_MARKER,
                value: Some("1"),
            }));
        if let Err((e, _)) = producer.send(record) {
            eprintln!("soak checker: could not append the end marker to partition {p}: {e}");
        }
    }
    if let Err(e) = producer.flush(Duration::from_secs(60)) {
        eprintln!("soak checker: the end markers were not all acknowledged: {e}");
    }
}
