//! Kafka sink on librdkafka: idempotent producer, `acks=all`, a bounded in-flight window.
//!
//! Sending is two steps, like a service that is first polled for readiness: [`KafkaSink::reserve`]
//! waits for room in the bounded window (a count and a byte budget, both semaphores), then
//! [`KafkaSink::send`] enqueues the record with the ticket the pipeline issued for it. The room is
//! returned by the record's delivery report, so a slow or absent broker pauses the source instead of
//! growing memory. Delivery reports arrive on librdkafka's polling thread and go straight to the
//! session's [`Acks`] (acked, or the failure that ends the session: the pipeline stops producing,
//! keeps the last good checkpoint, and reconnects). With idempotence on, librdkafka's own retries neither reorder nor
//! duplicate records within a session.
//!
//! With `kafka.exactly_once` the producer is transactional: [`KafkaSink::init_transactions`] fences
//! every earlier producer of the pipeline (and settles the transaction a killed one left open),
//! [`KafkaSink::begin`] opens a Kafka transaction, and [`KafkaSink::commit`] adds one last record
//! (the checkpoint) and commits, which makes all of them visible to `read_committed` consumers at
//! once. Acks still arrive per record and still free the window; they mean "written", not "visible".

use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, Message, OwnedHeaders};
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::ClientContext;

use self::config::KafkaConfig;
use self::index::{Indexed, RecordIndex};
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::preflight::Item;
use crate::route::Record;
use crate::sink::ack::{Acks, Ticket};
use crate::sink::window::{Room, Window};

pub mod config;
mod grants;
pub mod index;

/// How long a topic metadata request may take.
const METADATA_TIMEOUT: Duration = Duration::from_secs(5);

/// The Java client's partitioner for keyed records (murmur2 of the key). Records without a key
/// (a route without one) go to one partition for a while, then another: librdkafka's sticky
/// partitioning (`sticky.partitioning.linger.ms`), much like the Java client's.
pub const DEFAULT_PARTITIONER: &str = "murmur2_random";

/// A Kafka transaction's timeout unless `kafka.properties` sets `transaction.timeout.ms`: the
/// brokers abort a transaction open longer (a killed leader's is aborted sooner, by the next
/// instance's `init_transactions`).
pub const DEFAULT_TRANSACTION_TIMEOUT: Duration = Duration::from_secs(60);

/// librdkafka's default `message.max.bytes`.
const DEFAULT_MESSAGE_MAX_BYTES: usize = 1_000_000;

struct AckContext {
    acks: Arc<dyn Acks>,
    window: Window,
    metrics: Arc<Metrics>,
    /// Acks counted per topic here and handed to the metrics in batches: a per-ack label lookup
    /// (and its String) would sit on the hottest path.
    acked: std::sync::Mutex<(std::collections::HashMap<String, u64>, u64)>,
    /// Transactional (`kafka.exactly_once`): a fenced delivery means another instance took over.
    transactional: bool,
    /// Where the open transaction's checkpoint record landed (its delivery report), for the
    /// checkpoint's index ([`index`]).
    checkpoint_at: std::sync::Mutex<Option<i64>>,
}

impl Drop for AckContext {
    fn drop(&mut self) {
        if let Ok(mut acked) = self.acked.lock() {
            let mut taken = std::mem::take(&mut *acked);
            self.flush_acks(&mut taken);
        }
    }
}

/// Acks per topic are flushed to the metrics every this many acknowledgements (and on drop).
const ACK_METRICS_BATCH: u64 = 256;

impl AckContext {
    fn count_ack(&self, topic: &str) {
        let mut acked = self.acked.lock().expect("ack counts");
        match acked.0.get_mut(topic) {
            Some(n) => *n += 1,
            None => {
                acked.0.insert(topic.to_string(), 1);
            }
        }
        acked.1 += 1;
        // The delivery callback returned this ack's permit already.
        if acked.1 >= ACK_METRICS_BATCH || self.window.idle() {
            self.flush_acks(&mut acked);
        }
    }

    fn flush_acks(&self, acked: &mut (std::collections::HashMap<String, u64>, u64)) {
        for (topic, n) in acked.0.iter_mut() {
            if *n > 0 {
                self.metrics.forwarded_n(topic, *n);
                *n = 0;
            }
        }
        acked.1 = 0;
    }
}

impl ClientContext for AckContext {}

/// What a delivery report needs to know about its record.
struct InFlight {
    /// `None`: a record the sink adds itself (the checkpoint in a transaction), outside the window.
    ticket: Option<Ticket>,
    /// Bytes of the byte budget this record holds.
    cost: u32,
    /// When the record was handed to librdkafka (for `outboxd_delivery_seconds`).
    enqueued: Instant,
}

impl ProducerContext for AckContext {
    type DeliveryOpaque = Box<InFlight>;

    fn delivery(&self, result: &DeliveryResult<'_>, record: Box<InFlight>) {
        let Some(ticket) = record.ticket else {
            // The checkpoint record of a transaction: its commit reports what became of it, and
            // indexes it where it landed.
            if let Ok(message) = result {
                *self.checkpoint_at.lock().expect("checkpoint offset") = Some(message.offset());
            }
            return;
        };
        self.window.give_back(record.cost);
        self.metrics.acknowledged();
        match result {
            Ok(message) => {
                self.metrics.delivered_after(record.enqueued.elapsed());
                self.acks.acked(ticket);
                self.count_ack(message.topic());
            }
            // Purged when a session ended: resent by the next one, nothing failed.
            Err((
                KafkaError::MessageProduction(
                    RDKafkaErrorCode::PurgeQueue | RDKafkaErrorCode::PurgeInflight,
                ),
                _,
            )) => {}
            Err((e, message)) => {
                self.metrics.delivery_error();
                let error = if self.transactional && fenced(e) {
                    fenced_error(e)
                } else {
                    delivery_error(e, message.topic())
                };
                self.acks.failed(error);
            }
        }
    }
}

/// `record` as librdkafka's record, carrying `in_flight` to its delivery report.
fn base_record(
    record: &Record,
    timestamp: Option<i64>,
    in_flight: InFlight,
) -> BaseRecord<'_, [u8], [u8], Box<InFlight>> {
    let mut headers = OwnedHeaders::new_with_capacity(record.headers.len());
    for (key, value) in &record.headers {
        headers = headers.insert(Header {
            key,
            value: value.as_deref(),
        });
    }
    let mut base = BaseRecord::with_opaque_to(&record.topic, Box::new(in_flight)).headers(headers);
    if let Some(ts) = timestamp {
        base = base.timestamp(ts);
    }
    if let Some(partition) = record.partition {
        base = base.partition(partition);
    }
    if let Some(key) = &record.key {
        base = base.key(key.as_slice());
    }
    if let Some(value) = &record.value {
        base = base.payload(value.as_slice());
    }
    base
}

/// Whether another producer with the transactional id took over (the checkpoint writer's too).
pub fn fenced(e: &KafkaError) -> bool {
    e.rdkafka_error_code().is_some_and(fenced_code)
}

/// The codes librdkafka and the brokers give a fenced producer.
fn fenced_code(code: RDKafkaErrorCode) -> bool {
    matches!(
        code,
        RDKafkaErrorCode::Fenced
            | RDKafkaErrorCode::ProducerFenced
            | RDKafkaErrorCode::InvalidProducerEpoch
    )
}

fn fenced_error(e: &KafkaError) -> Error {
    fence(&e.to_string()).caused_by(e.clone())
}

/// Another producer with the transactional id took over: `why` is librdkafka's word for it.
fn fence(why: &str) -> Error {
    Error::sink(format!(
        "another instance of the pipeline took over its Kafka transactions (this producer was fenced: {why}); nothing this instance had not committed becomes visible"
    ))
    .remedy("nothing to do if you run a standby: this instance stands by. Otherwise another `outboxd run` uses this pipeline's name")
    .superseded()
}

/// What a failed transactional call means: fenced (another instance leads), refused for good (no
/// grant, no transactions on the broker), or passing (reconnect and resume from the committed
/// checkpoint; whatever the failed transaction held is aborted and sent again).
fn transaction_error(what: &str, transactional_id: &str, e: &KafkaError) -> Error {
    use RDKafkaErrorCode as C;
    if fenced(e) {
        return fenced_error(e);
    }
    let error = Error::sink(format!(
        "{what} (transactional id {transactional_id}) failed: {e}"
    ))
    .caused_by(e.clone());
    match e.rdkafka_error_code() {
        Some(C::TransactionalIdAuthorizationFailed | C::ClusterAuthorizationFailed) => error.remedy(format!(
            "grant outboxd's principal WRITE and DESCRIBE on the transactional id {transactional_id} (and, on brokers older than Kafka 3.0, IDEMPOTENT_WRITE on the cluster), then restart"
        )),
        Some(C::UnsupportedVersion | C::UnsupportedForMessageFormat | C::UnsupportedFeature) => error.remedy(
            "these brokers do not support transactions: remove kafka.exactly_once (at-least-once delivery, every record carries its id header)",
        ),
        Some(C::InvalidTransactionTimeout) => error.remedy(
            "kafka.properties.transaction.timeout.ms exceeds the brokers' transaction.max.timeout.ms: lower it (outboxd's default is 60000)",
        ),
        _ => error
            .remedy("outboxd aborts the open transaction, reconnects and resumes from the last committed checkpoint; check the broker")
            .transient(),
    }
}

/// Errors a retry cannot cure end the process with a remedy instead of a reconnect loop.
fn delivery_error(e: &KafkaError, topic: &str) -> Error {
    use RDKafkaErrorCode as C;
    let code = match e {
        KafkaError::MessageProduction(code) => Some(*code),
        _ => None,
    };
    let error = Error::sink(format!("delivery to topic {topic} failed: {e}")).caused_by(e.clone());
    match code {
        Some(C::MessageSizeTooLarge | C::InvalidMessageSize) => error.remedy(format!(
            "the broker refuses a record this large: raise the topic's max.message.bytes (and the broker's message.max.bytes) for {topic}, then restart; nothing was skipped"
        )),
        // Kafka 4 answers a timestamp out of the topic's range with INVALID_RECORD, not
        // INVALID_TIMESTAMP (the broker's log names the reason).
        Some(C::InvalidRecord) => error.remedy(format!(
            "the broker refuses a record of {topic} as invalid (its log says why): most often the timestamp is outside the topic's message.timestamp.after.max.ms / message.timestamp.before.max.ms (lower kafka.max_timestamp_ahead_ms below the first, or raise the topic's limits), or a record without a key went to a compacted topic (give the route a key, or another topic); then restart; nothing was skipped"
        )),
        Some(C::TopicAuthorizationFailed | C::ClusterAuthorizationFailed) => error.remedy(format!(
            "grant the outboxd principal WRITE on topic {topic} (and, on brokers older than Kafka 3.0, IDEMPOTENT_WRITE on the cluster), then restart"
        )),
        Some(C::InvalidTopic | C::PolicyViolation) => error.remedy(format!(
            "the broker rejects topic {topic}: create it, or change route.topic"
        )),
        // Checked against the topic's metadata before sending when the broker gave a count;
        // reaching here means it did not, or the topic shrank: a reconnect would only repeat it.
        Some(C::UnknownPartition) => error.remedy(format!(
            "a route.additional partition placement names a partition {topic} does not have: fix the row or the topic, then restart; nothing was skipped"
        )),
        Some(C::InvalidTimestamp) => error.remedy(format!(
            "the broker refuses the record's timestamp: {topic}'s message.timestamp.after.max.ms (how far ahead of the broker's clock) is below kafka.max_timestamp_ahead_ms, or its message.timestamp.before.max.ms (how far behind) is below the record's age; lower kafka.max_timestamp_ahead_ms or raise the topic's limits, then restart; nothing was skipped"
        )),
        _ => error
            .remedy("outboxd reconnects and resumes from the last checkpoint; check the broker")
            .transient(),
    }
}

/// What the broker said about a topic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TopicState {
    Missing,
    /// The partition count, when the broker gave it.
    Exists {
        partitions: Option<usize>,
    },
}

pub struct KafkaSink {
    producer: Option<Arc<ThreadedProducer<AckContext>>>,
    /// `kafka.exactly_once`: the producer's transactional id.
    transactional_id: Option<String>,
    /// `kafka.properties` as configured (a few are read back, e.g. timeouts).
    properties: std::collections::BTreeMap<String, String>,
    window: Window,
    metrics: Arc<Metrics>,
    future: FutureStamps,
}

/// Record timestamps ahead of this host's clock: Kafka 4 refuses a record more than
/// `message.timestamp.after.max.ms` (an hour by default) ahead of the broker's clock, and one
/// refused record would stop the pipeline for good. Such a record goes out stamped with
/// outboxd's clock, counted per topic and logged (at most once a minute, with how many).
///
/// Clamped rather than dead-lettered: the row itself is good, and a dead letter would take it
/// out of its key's order on the topic its consumers read; only the record's metadata changes
/// (`route.additional` can carry the column as a header where consumers need the original).
struct FutureStamps {
    /// `kafka.max_timestamp_ahead_ms`.
    ahead_ms: i64,
    /// When the last warning was logged, and how many were clamped since.
    told: std::sync::Mutex<(Option<Instant>, u64)>,
}

impl FutureStamps {
    fn new(config: &KafkaConfig) -> FutureStamps {
        FutureStamps {
            ahead_ms: i64::try_from(config.max_timestamp_ahead_ms).unwrap_or(i64::MAX / 2),
            told: std::sync::Mutex::new((None, 0)),
        }
    }

    /// The timestamp `record` goes out with.
    fn stamp(&self, record: &Record, metrics: &Metrics) -> Option<i64> {
        let ts = record.timestamp?;
        let now = now_ms();
        if ts <= now.saturating_add(self.ahead_ms) {
            return Some(ts);
        }
        metrics.timestamp_clamped(&record.topic);
        let mut told = self.told.lock().expect("clamp log state");
        told.1 += 1;
        if told
            .0
            .is_none_or(|at| at.elapsed() >= Duration::from_secs(60))
        {
            tracing::warn!(
                topic = record.topic,
                timestamp = %chrono::DateTime::from_timestamp_millis(ts).map_or_else(|| ts.to_string(), |t| t.to_rfc3339()),
                ahead_s = (ts - now) / 1000,
                records = told.1,
                "a record timestamp is more than kafka.max_timestamp_ahead_ms ahead of this host's clock (route.timestamp's column, or the database's clock): stamped with outboxd's clock instead, as Kafka would refuse it (outboxd_timestamps_clamped_total counts them)"
            );
            *told = (Some(Instant::now()), 0);
        }
        Some(now)
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

impl KafkaSink {
    /// The session's producer; transactional (exactly-once) with `transactional_id`.
    pub fn new(
        name: &str,
        config: &KafkaConfig,
        transactional_id: Option<&str>,
        acks: Arc<dyn Acks>,
        metrics: Arc<Metrics>,
    ) -> Result<KafkaSink> {
        let window = Window::new(config.max_in_flight, config.max_in_flight_bytes);
        let mut client = ClientConfig::new();
        client.set("client.id", format!("outboxd-{name}"));
        for (k, v) in &config.properties {
            // Enforced by outboxd (below); the config refuses the alias delivery.timeout.ms.
            if k != "message.timeout.ms" {
                client.set(k, v);
            }
        }
        // librdkafka's own queue must hold the whole window (with room to spare): a full queue
        // would make `send` wait for room that only acks free. A smaller configured value is raised.
        let at_least = |key: &str, floor: u64, default: u64| {
            let configured = config
                .properties
                .get(key)
                .and_then(|v| v.trim().parse::<u64>().ok())
                .unwrap_or(default);
            configured.max(floor).to_string()
        };
        let messages = at_least(
            "queue.buffering.max.messages",
            (config.max_in_flight as u64 * 2).max(100_000),
            100_000,
        );
        let kbytes = at_least(
            "queue.buffering.max.kbytes",
            (config.max_in_flight_bytes / 1024 * 2).min(i32::MAX as u64),
            1_048_576,
        );
        client
            .set("queue.buffering.max.messages", messages)
            .set("queue.buffering.max.kbytes", kbytes);
        // librdkafka never times a record out itself: one that timed out while later ones were
        // still waiting would leave a gap the idempotent producer fills with those later records,
        // and the resend from the checkpoint would put the older record after them (per-key order
        // broken). `message.timeout.ms` is enforced by the pipeline instead, for the whole session
        // (see `KafkaConfig::delivery_timeout`), and a session that ends purges and closes its
        // producer before the next one sends anything.
        // Keyed records go where Kafka's Java client would put them (murmur2 of the key, positive,
        // modulo the partition count), so a cutover from Debezium or any Java producer keeps each
        // key on its partition. librdkafka's own default hashes with CRC32.
        if !config.properties.contains_key("partitioner") {
            client.set("partitioner", DEFAULT_PARTITIONER);
        }
        client
            .set("message.timeout.ms", "0")
            .set("bootstrap.servers", &config.brokers)
            .set("enable.idempotence", "true")
            .set("acks", "all");
        if let Some(id) = transactional_id {
            client.set("transactional.id", id);
            if !config.properties.contains_key("transaction.timeout.ms") {
                client.set(
                    "transaction.timeout.ms",
                    DEFAULT_TRANSACTION_TIMEOUT.as_millis().to_string(),
                );
            }
        }
        let context = AckContext {
            acks,
            window: window.clone(),
            metrics: metrics.clone(),
            acked: Default::default(),
            transactional: transactional_id.is_some(),
            checkpoint_at: std::sync::Mutex::new(None),
        };
        let producer: ThreadedProducer<AckContext> =
            client.create_with_context(context).map_err(|e| {
                Error::config(format!("cannot create the Kafka producer: {e}"))
                    .remedy("check kafka.brokers and kafka.properties (they are passed to librdkafka verbatim)")
            })?;
        Ok(KafkaSink {
            producer: Some(Arc::new(producer)),
            transactional_id: transactional_id.map(str::to_string),
            properties: config.properties.clone(),
            window,
            metrics,
            future: FutureStamps::new(config),
        })
    }

    /// How long the brokers let one Kafka transaction stay open (`transaction.timeout.ms`).
    pub fn transaction_timeout(config: &KafkaConfig) -> Duration {
        config
            .properties
            .get("transaction.timeout.ms")
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map_or(DEFAULT_TRANSACTION_TIMEOUT, Duration::from_millis)
    }

    /// The producer's `message.max.bytes` as configured (records above it are unroutable).
    pub fn max_message_bytes(config: &KafkaConfig) -> usize {
        config
            .properties
            .get("message.max.bytes")
            .and_then(|v| v.parse().ok())
            .unwrap_or(DEFAULT_MESSAGE_MAX_BYTES)
    }

    /// Waits for room in the window for `record` (one of `kafka.max_in_flight`, and its size from
    /// `kafka.max_in_flight_bytes`; a record larger than the whole budget takes all of it and goes
    /// alone). Cancel-safe: dropping the future or the room takes nothing.
    pub async fn reserve(&self, record: &Record) -> Result<Room> {
        self.window.reserve(record).await
    }

    /// Enqueues `record` in the `room` reserved for it; its delivery report hands `ticket` to the
    /// session's [`Acks`]. Does not wait for the broker (only, briefly, for librdkafka's own queue,
    /// which the window keeps from filling).
    pub async fn send(&self, room: Room, record: &Record, ticket: Ticket) -> Result<()> {
        // From here the delivery report gives the room back.
        let cost = room.forget();
        let producer = self.producer.as_ref().expect("producer lives until close");
        let timestamp = self.future.stamp(record, &self.metrics);
        let mut base = base_record(
            record,
            timestamp,
            InFlight {
                ticket: Some(ticket),
                cost,
                enqueued: Instant::now(),
            },
        );
        loop {
            match producer.send(base) {
                Ok(()) => {
                    self.metrics.produced();
                    crate::fault::crash_point(crate::fault::AFTER_PRODUCE_BEFORE_ACK);
                    return Ok(());
                }
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                    base = back;
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                Err((e, back)) => {
                    // Never enqueued: no delivery report will give the room back.
                    drop(back);
                    self.window.give_back(cost);
                    return Err(delivery_error(&e, &record.topic));
                }
            }
        }
    }

    /// `kafka.exactly_once`: `e` as what it means when this producer was fenced. librdkafka
    /// reports the fence on the producer (a fatal error) and fails what was in flight with a bare
    /// `Fatal`, which reads as a passing delivery failure: the session would reconnect, and its
    /// `init_transactions` would fence the instance that took over (test
    /// `exactly_once::a_fenced_leader_stands_by_instead_of_fencing_the_new_one_back`). The
    /// session's own error is kept in the message.
    pub fn explain_fatal(&self, e: Error) -> Error {
        if e.is_superseded() || self.transactional_id.is_none() {
            return e;
        }
        let Some(producer) = &self.producer else {
            return e;
        };
        match producer.client().fatal_error() {
            Some((code, reason)) if fenced_code(code) => fence(&format!(
                "{reason}; the session ended with: {}",
                e.message()
            )),
            _ => e,
        }
    }

    /// The transactional producer and its id (`kafka.exactly_once`).
    fn transactional(&self) -> (Arc<ThreadedProducer<AckContext>>, String) {
        let producer = self.producer.clone().expect("producer lives until close");
        let id = self
            .transactional_id
            .clone()
            .expect("a transaction call on a transactional sink");
        (producer, id)
    }

    /// `kafka.exactly_once`: makes this producer the pipeline's only transactional one. Every
    /// earlier producer with the id is fenced (its commits fail from now on) and the transaction it
    /// left open is settled first, so what is committed can be read right after this returns.
    pub async fn init_transactions(&self, limit: Duration) -> Result<()> {
        let (producer, id) = self.transactional();
        tokio::task::spawn_blocking(move || {
            producer.init_transactions(limit).map_err(|e| {
                transaction_error("taking over the pipeline's Kafka transactions", &id, &e)
            })
        })
        .await
        .map_err(|e| Error::sink(format!("the transaction task died: {e}")))?
    }

    /// Opens a Kafka transaction (local to the producer: no round trip).
    pub fn begin(&self) -> Result<()> {
        let (producer, id) = self.transactional();
        producer
            .begin_transaction()
            .map_err(|e| transaction_error("beginning a Kafka transaction", &id, &e))
    }

    /// Sends `last` (the checkpoint of the transaction's end) into the open transaction and
    /// commits it: every record sent since [`KafkaSink::begin`] becomes visible with it, or none
    /// does. Waits, within `limit` in all, for the acks of the whole transaction, then for the
    /// commit, on a blocking thread. The records are flushed before the checkpoint joins the
    /// transaction: the checkpoint topic is shared, and its partition's readers wait for an open
    /// transaction there only for the commit's round trip.
    /// The checkpoint record's offset joins the transaction as its `index` entry (see [`index`]).
    pub async fn commit(&self, last: Record, index: RecordIndex, limit: Duration) -> Result<()> {
        let (producer, id) = self.transactional();
        tokio::task::spawn_blocking(move || {
            let deadline = Instant::now() + limit;
            let left = || deadline.saturating_duration_since(Instant::now());
            producer
                .flush(left())
                .map_err(|e| transaction_error("flushing the Kafka transaction", &id, &e))?;
            *producer
                .context()
                .checkpoint_at
                .lock()
                .expect("checkpoint offset") = None;
            let mut base = base_record(
                &last,
                last.timestamp,
                InFlight {
                    ticket: None,
                    cost: 0,
                    enqueued: Instant::now(),
                },
            );
            loop {
                match producer.send(base) {
                    Ok(()) => break,
                    Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back))
                        if !left().is_zero() =>
                    {
                        base = back;
                        std::thread::sleep(Duration::from_millis(2));
                    }
                    Err((e, _)) => {
                        return Err(transaction_error(
                            "adding the checkpoint to the Kafka transaction",
                            &id,
                            &e,
                        ))
                    }
                }
            }
            // The checkpoint written too (what the commit would wait for anyway), so a crash
            // here leaves the whole transaction open on the brokers.
            producer
                .flush(left())
                .map_err(|e| transaction_error("flushing the checkpoint record", &id, &e))?;
            let offset = producer
                .context()
                .checkpoint_at
                .lock()
                .expect("checkpoint offset")
                .take()
                .ok_or_else(|| {
                    Error::sink(
                        "the checkpoint record of the Kafka transaction was not acknowledged",
                    )
                    .remedy("outboxd retries from the last committed checkpoint")
                    .transient()
                })?;
            let entry = Indexed {
                offset,
                removed: false,
            };
            index.send(&producer, entry, left()).map_err(|e| {
                let e = match e {
                    index::SendError::Kafka(e) => e,
                    // The session ends; the next one's producer fences this one (whose
                    // transactional API is still busy: nothing more is asked of it).
                    index::SendError::Stuck(what) => {
                        return Error::sink(format!(
                            "indexing the checkpoint in the Kafka transaction (transactional id {id}) got stuck: {what}"
                        ))
                        .remedy("outboxd opens a new producer, which fences this one, and resumes from the last committed checkpoint; check the brokers")
                        .transient()
                    }
                };
                let error =
                    transaction_error("indexing the checkpoint in the Kafka transaction", &id, &e);
                if e.rdkafka_error_code() == Some(RDKafkaErrorCode::GroupAuthorizationFailed) {
                    // Waiting cures no missing grant: a stop with the grant to give.
                    Error::sink(error.message().to_string()).remedy(format!(
                        "grant outboxd's principal READ on consumer group {} (the checkpoint's index): kafka-acls.sh --add --allow-principal User:<outboxd's user> --operation Read --group {}, then restart",
                        index.group(),
                        index.group()
                    ))
                } else {
                    error
                }
            })?;
            crate::fault::crash_point(crate::fault::BEFORE_TRANSACTION_COMMIT);
            producer
                .commit_transaction(left())
                .map_err(|e| transaction_error("committing the Kafka transaction", &id, &e))
        })
        .await
        .map_err(|e| Error::sink(format!("the transaction task died: {e}")))?
    }

    /// Aborts the open Kafka transaction (its records never become visible to `read_committed`
    /// consumers). Best effort: the next session's `init_transactions` aborts it otherwise.
    pub async fn abort(&self, limit: Duration) {
        let (producer, id) = self.transactional();
        let aborted = tokio::task::spawn_blocking(move || producer.abort_transaction(limit)).await;
        match aborted {
            Ok(Ok(())) => tracing::info!("aborted the open Kafka transaction; it is sent again from the last committed checkpoint"),
            // A producer given up as stuck in librdkafka is still busy with that call.
            Ok(Err(e)) if e.rdkafka_error_code() == Some(RDKafkaErrorCode::Conflict) => tracing::info!(transactional_id = id, "the producer given up as stuck was not asked to abort; the next session's producer fences it and its transaction"),
            Ok(Err(e)) => tracing::warn!(error = %e, transactional_id = id, "could not abort the open Kafka transaction; the next session's start aborts it"),
            Err(_) => {}
        }
    }

    /// Gets the producer ready to send at once. librdkafka's idempotent producer asks for its
    /// producer id on a 500 ms timer after creation, unless a metadata response from a connected
    /// broker starts the request earlier; two metadata requests (the second one reaching the broker
    /// the first one named) do that. Without this every session start, and so every restart, waited
    /// half a second before its first record (see BENCHMARKS.md). Errors are left to the first send.
    pub async fn warm_up(&self) {
        let producer = self.producer.clone().expect("producer lives until close");
        let _ = tokio::task::spawn_blocking(move || {
            for _ in 0..2 {
                if producer
                    .client()
                    .fetch_metadata(None, Duration::from_secs(1))
                    .is_err()
                {
                    break;
                }
            }
        })
        .await;
    }

    /// Whether `topic` exists (or is being created by the broker right now), and its partition
    /// count when the broker said. Asking is what a produce does too, so a broker that auto-creates
    /// topics creates it here; one that does not answers "unknown topic", which the pipeline treats
    /// as a property of the record (dead-letter it, or stop naming the topic) instead of a delivery
    /// failure to retry forever. "Unknown" is believed only after it persisted for
    /// `topic.metadata.propagation.max.ms` (librdkafka's own patience, 30 s by default): a broker
    /// whose metadata lags, or one busy auto-creating, may say so for a moment.
    pub async fn topic_state(&self, topic: &str) -> Result<TopicState> {
        let patience = Duration::from_millis(
            self.properties
                .get("topic.metadata.propagation.max.ms")
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(30_000),
        );
        let started = Instant::now();
        loop {
            match self.topic_metadata(topic).await? {
                Some(TopicState::Missing) if started.elapsed() < patience => {
                    tokio::time::sleep(Duration::from_millis(500)).await
                }
                Some(known) => return Ok(known),
                // No answer (the broker is down or slow): produce as before; librdkafka queues the
                // record, and a topic that turns out missing fails its delivery, which ends the
                // session, and the next session asks again.
                None => return Ok(TopicState::Exists { partitions: None }),
            }
        }
    }

    /// One metadata request for `topic`; `None` without an answer.
    async fn topic_metadata(&self, topic: &str) -> Result<Option<TopicState>> {
        let producer = self.producer.clone().expect("producer lives until close");
        let name = topic.to_string();
        let answer = tokio::task::spawn_blocking(move || {
            let metadata = producer
                .client()
                .fetch_metadata(Some(&name), METADATA_TIMEOUT)?;
            Ok::<_, KafkaError>(
                metadata
                    .topics()
                    .iter()
                    .find(|t| t.name() == name)
                    .map(|t| (t.error().map(RDKafkaErrorCode::from), t.partitions().len())),
            )
        })
        .await
        .map_err(|e| Error::sink(format!("topic metadata task died: {e}")))?;
        Ok(match answer {
            Ok(Some((None, partitions))) => Some(TopicState::Exists {
                partitions: (partitions > 0).then_some(partitions),
            }),
            Ok(Some((
                Some(RDKafkaErrorCode::UnknownTopicOrPartition | RDKafkaErrorCode::UnknownTopic),
                _,
            )))
            | Ok(None) => Some(TopicState::Missing),
            // Being created (leader not yet elected) or another passing state: produce and let
            // the delivery report tell.
            Ok(Some((Some(code), _))) => {
                tracing::debug!(
                    topic,
                    ?code,
                    "topic metadata carries an error; producing anyway"
                );
                Some(TopicState::Exists { partitions: None })
            }
            Err(e) => {
                tracing::debug!(topic, error = %e, "no topic metadata; producing anyway");
                None
            }
        })
    }

    /// Stops the producer off the async threads (librdkafka's teardown blocks). What is still
    /// queued or in flight is purged: the next session resends it from the checkpoint, and it must
    /// not be written by this producer after the next one started.
    pub async fn close(mut self) {
        if let Some(producer) = self.producer.take() {
            let _ = tokio::task::spawn_blocking(move || {
                let _ = producer.flush(Duration::from_secs(1));
                producer.purge(rdkafka::producer::PurgeConfig::default().queue().inflight());
                let _ = producer.flush(Duration::from_secs(1));
                drop(producer);
            })
            .await;
        }
    }
}

/// What the preflight asks the brokers about besides reachability: the grants on the topics
/// outboxd will use.
pub struct Wanted {
    /// Whether an existing topic is one the route can send events to.
    pub event_topic: Box<dyn Fn(&str) -> bool + Send>,
    /// The route's one topic, when it names no other (then outboxd certainly sends there).
    pub fixed_event_topic: Option<String>,
    /// The checkpoint topic, when checkpoints live in Kafka.
    pub checkpoint_topic: Option<String>,
    /// The checkpoint lives in the Redis sink's server (`checkpoint.store = "redis"`).
    pub checkpoint_in_redis: bool,
}

/// What a reachable cluster told the preflight.
struct Reached {
    brokers: usize,
    /// The brokers' `auto.create.topics.enable`, as one of them describes it.
    auto_create: Option<bool>,
    topics: Vec<String>,
    /// The topics asked about and the answers, or why asking failed.
    grants: std::result::Result<(Vec<grants::Need>, grants::Answers), String>,
}

/// Preflight: the brokers answer (a refused login or TLS handshake is a FAIL, not a wait), the
/// dead-letter topic (if any) exists, and outboxd's principal has the grants it needs.
pub async fn preflight(config: &KafkaConfig, wanted: Wanted) -> Vec<Item> {
    let kafka = config.clone();
    let result = tokio::task::spawn_blocking(move || reach(&kafka, wanted))
        .await
        .unwrap_or_else(|e| Err((e.to_string(), None)));
    match result {
        Ok(reached) => reached_items(config, reached),
        Err((e, heard)) => vec![unreached_item(config, e, heard)],
    }
}

/// Connects as outboxd will (same properties), lists the topics and asks for the grants.
fn reach(
    kafka: &KafkaConfig,
    wanted: Wanted,
) -> std::result::Result<Reached, (String, Option<String>)> {
    use rdkafka::producer::BaseProducer;
    let mut client = ClientConfig::new();
    for (k, v) in &kafka.properties {
        client.set(k, v);
    }
    client.set("bootstrap.servers", &kafka.brokers);
    let producer: BaseProducer<Heard> = client
        .create_with_context(Heard::default())
        .map_err(|e| (e.to_string(), None))?;
    // Asked in growing rounds (1, 2, 4 s, then the rest of 10 s): a refused certificate or login
    // is certain after a handshake, and waiting out the rest would only delay saying so. Certain
    // once a whole round more has passed without an answer (another bootstrap broker could still
    // answer: one restarting, or a TLS proxy whose backend is down, fails that way for a moment).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut round = Duration::from_secs(1);
    let mut refused_rounds = 0;
    let metadata = loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match producer.client().fetch_metadata(None, round.min(left)) {
            Ok(metadata) => break metadata,
            Err(e) => {
                // Error events reach the context through the queue poll serves.
                producer.poll(Duration::from_millis(100));
                let heard = producer.context().last();
                if heard
                    .as_deref()
                    .is_some_and(|h| tls_failure(h) || sasl_failure(h))
                {
                    refused_rounds += 1;
                }
                if refused_rounds >= 2 || std::time::Instant::now() >= deadline {
                    return Err((e.to_string(), heard));
                }
                round = (round * 2).min(Duration::from_secs(10));
            }
        }
    };
    let topics: Vec<String> = metadata
        .topics()
        .iter()
        .map(|t| t.name().to_string())
        .collect();
    let named = |t: &str| {
        Some(t) == kafka.dead_letter_topic.as_deref()
            || Some(t) == wanted.checkpoint_topic.as_deref()
    };
    // Topics starting with "_" are internal by convention (__consumer_offsets, _schemas).
    let mut needs: Vec<grants::Need> = topics
        .iter()
        .filter(|t| !t.starts_with('_') && !named(t) && (wanted.event_topic)(t))
        .map(|t| grants::Need {
            topic: t.clone(),
            what: "event topic",
            operations: &[grants::Operation::Write],
            certain: wanted.fixed_event_topic.as_ref() == Some(t),
        })
        .collect();
    if let Some(fixed) = &wanted.fixed_event_topic {
        if !topics.contains(fixed) && !named(fixed) {
            needs.push(grants::Need {
                topic: fixed.clone(),
                what: "event topic",
                operations: &[grants::Operation::Write],
                certain: true,
            });
        }
    }
    if let Some(dlq) = &kafka.dead_letter_topic {
        needs.push(grants::Need {
            topic: dlq.clone(),
            what: "the dead-letter topic",
            operations: &[grants::Operation::Write],
            certain: true,
        });
    }
    if let Some(topic) = &wanted.checkpoint_topic {
        needs.push(grants::Need {
            topic: topic.clone(),
            what: "the checkpoint topic",
            operations: &[grants::Operation::Read, grants::Operation::Write],
            certain: true,
        });
    }
    let mut names: Vec<String> = needs.iter().map(|n| n.topic.clone()).collect();
    names.sort();
    names.dedup();
    let grants = grants::describe(producer.client(), &names, METADATA_TIMEOUT)
        .map(|answers| (needs, answers));
    let auto_create = metadata
        .brokers()
        .first()
        .and_then(|b| broker_auto_creates(&client, b.id()));
    Ok(Reached {
        brokers: metadata.brokers().len(),
        auto_create,
        topics,
        grants,
    })
}

/// Whether broker `id` creates topics on first use (`None`: it would not say).
fn broker_auto_creates(client: &ClientConfig, id: i32) -> Option<bool> {
    let admin: rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext> =
        client.create().ok()?;
    let resource = rdkafka::admin::ResourceSpecifier::Broker(id);
    let value = described_value(
        &admin,
        &resource,
        "auto.create.topics.enable",
        METADATA_TIMEOUT,
    )?;
    Some(value.trim() == "true")
}

/// One setting of a broker or topic as the brokers describe it; `None` when they would not say
/// (no DescribeConfigs grant, no answer within `timeout`). Blocks: call it on a blocking thread
/// (librdkafka's own thread completes the request).
pub(crate) fn described_value<C: rdkafka::ClientContext + 'static>(
    admin: &rdkafka::admin::AdminClient<C>,
    resource: &rdkafka::admin::ResourceSpecifier<'_>,
    name: &str,
    timeout: Duration,
) -> Option<String> {
    let described = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .ok()?
        .block_on(admin.describe_configs(
            [resource],
            &rdkafka::admin::AdminOptions::new().request_timeout(Some(timeout)),
        ))
        .ok()?;
    let resource = described.into_iter().next()?.ok()?;
    resource
        .entries
        .iter()
        .find(|e| e.name == name)?
        .value
        .clone()
}

/// A route that names a topic nobody created makes a new topic on such brokers instead of a dead
/// letter (or a stop naming it), unless the producer asks not to (`allow.auto.create.topics`).
fn auto_create_item(config: &KafkaConfig, broker_creates: Option<bool>) -> Option<Item> {
    let producer_allows = config
        .properties
        .get("allow.auto.create.topics")
        .is_none_or(|v| v.trim() != "false");
    if broker_creates != Some(true) || !producer_allows {
        return None;
    }
    let what = "the brokers create a topic on first use (auto.create.topics.enable=true): a row routed to a topic nobody created (a mistyped aggregatetype) makes a new topic";
    let fix = "to park such rows instead, set [kafka.properties] \"allow.auto.create.topics\" = \"false\" (or auto.create.topics.enable=false on the brokers) and create the topics yourself";
    Some(if config.dead_letter_topic.is_some() {
        Item::warn("kafka", format!("{what}, not a dead letter"), fix)
    } else {
        Item::pass("kafka", format!("{what}; {fix}"))
    })
}

fn reached_items(config: &KafkaConfig, reached: Reached) -> Vec<Item> {
    let mut items = vec![
        Item::pass(
            "kafka",
            format!(
                "{} reachable ({} broker(s))",
                config.brokers, reached.brokers
            ),
        ),
        tls_item(config),
    ];
    let denied = |topic: &str| {
        reached.grants.as_ref().is_ok_and(|(_, answers)| {
            answers
                .iter()
                .any(|(t, a)| t == topic && *a == grants::Access::Denied)
        })
    };
    if let Some(dlq) = &config.dead_letter_topic {
        if reached.topics.iter().any(|t| t == dlq) {
            items.push(Item::pass(
                "kafka",
                format!("dead-letter topic {dlq} exists"),
            ));
        } else if !denied(dlq) {
            // A missing dead-letter topic turns the first unroutable row into a stop. (One outboxd
            // may not describe gets the grant's line below instead.)
            items.push(Item::fail(
                "kafka",
                format!("dead-letter topic {dlq} does not exist"),
                format!("create {dlq} before starting outboxd (for example kafka-topics.sh --create --topic {dlq})"),
            ));
        }
    }
    items.extend(auto_create_item(config, reached.auto_create));
    match &reached.grants {
        Ok((needs, answers)) => items.extend(grants::items(needs, answers)),
        Err(e) => items.push(Item::warn(
            "kafka",
            format!("could not ask the brokers which grants outboxd's principal has: {e}"),
            "nothing to do for check; run reports a missing grant when it meets it",
        )),
    }
    items
}

fn unreached_item(config: &KafkaConfig, e: String, heard: Option<String>) -> Item {
    let detail = heard.map(|h| format!(" ({h})")).unwrap_or_default();
    if sasl_failure(&detail) {
        // Wrong credentials or mechanism: retrying the same login cannot succeed.
        Item::fail(
            "kafka",
            format!("SASL authentication to {} failed: {e}{detail}", config.brokers),
            "check sasl.mechanism, sasl.username and sasl.password (or OUTBOXD_KAFKA__PROPERTIES__SASL.PASSWORD), and that the user exists on the brokers for that mechanism",
        )
    } else if tls_failure(&detail) {
        // A certificate or TLS setting is wrong: waiting will not cure it.
        Item::fail(
            "kafka",
            format!("TLS to {} failed: {e}{detail}", config.brokers),
            "check ssl.ca.location (the CA that signed the brokers' certificates), ssl.certificate.location / ssl.key.location, and that the brokers' names match their certificates (docs/sinks/kafka.md#tls)",
        )
    } else {
        Item::unreachable(
            "kafka",
            format!("{} did not answer: {e}{detail}", config.brokers),
            "check kafka.brokers and the security settings in kafka.properties",
        )
    }
}

/// The TLS line for the brokers: what the handshake that just succeeded verified.
fn tls_item(config: &KafkaConfig) -> Item {
    let get = |key: &str| config.properties.get(key).map(|v| v.to_ascii_lowercase());
    let protocol = get("security.protocol").unwrap_or_else(|| "plaintext".into());
    if !protocol.ends_with("ssl") {
        return Item::pass(
            "kafka",
            format!("security.protocol = {protocol}: no TLS to the brokers"),
        );
    }
    if matches!(
        get("enable.ssl.certificate.verification").as_deref(),
        Some("false" | "f" | "0")
    ) {
        return Item::warn(
            "kafka",
            format!(
                "security.protocol = {protocol}, but the brokers' certificates are not verified"
            ),
            "remove enable.ssl.certificate.verification = false and set ssl.ca.location",
        );
    }
    let against = match config.properties.get("ssl.ca.location") {
        Some(ca) if ca != "probe" => format!("against {ca}"),
        _ if config.properties.contains_key("ssl.ca.pem") => "against ssl.ca.pem".into(),
        _ => "against the system's trusted roots".into(),
    };
    let names = if get("ssl.endpoint.identification.algorithm").as_deref() == Some("none") {
        "broker names not checked"
    } else {
        "broker names verified"
    };
    let client = if [
        "ssl.certificate.location",
        "ssl.certificate.pem",
        "ssl.keystore.location",
    ]
    .iter()
    .any(|k| config.properties.contains_key(*k))
    {
        ", client certificate sent"
    } else {
        ""
    };
    Item::pass(
        "kafka",
        format!(
            "TLS ({protocol}) to the brokers: certificates verified {against}, {names}{client}"
        ),
    )
}

/// A login the brokers refused: wrong password or unknown user ("SASL authentication error: …",
/// or "SASL authentication failure" on old brokers), a mechanism the listener does not enable
/// ("… mechanism handshake failed"). Not a login cut short by the network ("SASL authentication
/// error: SaslAuthenticateRequest failed: Local: Broker transport failure"): that is a broker
/// that is down or restarting, worth waiting for.
fn sasl_failure(detail: &str) -> bool {
    // librdkafka words both as "…: Local: Broker transport failure".
    let cut_short = detail.contains("SaslAuthenticateRequest failed: Local:")
        || detail.contains("handshake failed: Local:");
    ((detail.contains("SASL authentication error")
        || detail.contains("mechanism handshake failed"))
        && !cut_short)
        || detail.contains("SASL authentication failure")
}

/// Whether librdkafka's explanation is a TLS failure (a definite one: a certificate, a CA, a
/// listener that does not speak TLS), not a broker that is down.
fn tls_failure(detail: &str) -> bool {
    // librdkafka words a disconnect during the handshake as "SSL handshake failed: Disconnected …
    // (connecting to a PLAINTEXT broker listener?)": a broker that is down, most likely.
    ["certificate verify failed", "SSL routines", " alert "]
        .iter()
        .any(|needle| detail.contains(needle))
        && !detail.contains("unexpected eof")
}

/// What librdkafka reported while a preflight waited (it explains a metadata timeout: a TLS
/// handshake that failed, a refused SASL login). Its summary events ("1/1 brokers are down") come
/// after the cause, so the cause is kept apart from them.
#[derive(Default)]
struct Heard(std::sync::Mutex<(Option<String>, Option<String>)>);

impl Heard {
    /// The cause if one was logged, else the last error event.
    fn last(&self) -> Option<String> {
        self.0
            .lock()
            .ok()
            .and_then(|h| h.0.clone().or_else(|| h.1.clone()))
    }
}

impl ClientContext for Heard {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, log_message: &str) {
        use rdkafka::config::RDKafkaLogLevel::*;
        if matches!(level, Emerg | Alert | Critical | Error) {
            tracing::debug!(fac, log_message, "kafka client log during preflight");
            // "[thrd:ssl://host:port/bootstrap]: ssl://host:port/bootstrap: SSL handshake failed: …"
            let text = log_message
                .split_once("]: ")
                .map_or(log_message, |(_, rest)| rest);
            if let Ok(mut heard) = self.0.lock() {
                // The longest explanation of the first failure (librdkafka logs a short and a long form).
                if heard.0.as_ref().is_none_or(|h| h.len() < text.len()) {
                    heard.0 = Some(text.to_string());
                }
            }
        }
    }

    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        tracing::debug!(%error, reason, "kafka client error during preflight");
        if let Ok(mut heard) = self.0.lock() {
            heard.1 = Some(reason.to_string());
        }
    }
}

impl rdkafka::producer::ProducerContext for Heard {
    type DeliveryOpaque = ();
    fn delivery(&self, _: &rdkafka::message::DeliveryResult<'_>, _: Self::DeliveryOpaque) {}
}

#[cfg(test)]
mod tests {
    use super::sasl_failure;

    #[test]
    fn a_login_cut_short_by_the_network_is_not_a_refused_login() {
        assert!(sasl_failure(
            "SASL SCRAM-SHA-512 mechanism handshake failed: Broker: Unsupported SASL mechanism"
        ));
        assert!(sasl_failure("SASL authentication error: Authentication failed during authentication due to invalid credentials with SASL mechanism SCRAM-SHA-512"));
        assert!(!sasl_failure(
            "SASL SCRAM-SHA-512 mechanism handshake failed: Local: Broker transport failure"
        ));
        assert!(!sasl_failure(
            "SASL authentication error: SaslAuthenticateRequest failed: Local: Broker transport failure"
        ));
    }
}
