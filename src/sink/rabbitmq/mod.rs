//! RabbitMQ sink (AMQP 0.9.1 on lapin): persistent messages published `mandatory` on one channel in
//! confirm mode, through the same bounded window as every sink.
//!
//! Why the ack path looks the way it does (`shared/sinks.md` has the broker facts):
//! - A publisher confirm alone does not mean "in a queue": a message no binding routes is *returned*
//!   (`basic.return`, sent before its ack) and then acked. So a record counts as delivered only when
//!   its confirm is an ack **and** no return names it; a returned record goes to the dead-letter
//!   routing key (reason `unroutable`) or ends the pipeline naming the exchange and routing key.
//! - lapin hands a return to whichever confirm it completes next, which under a `multiple` ack may
//!   be another message's. So every publish carries a header `outboxd.publish` (this session's
//!   nonce and a counter) that names it exactly; returns are collected from every confirm into one
//!   pool and matched by it. lapin queues returns in arrival order (= publish order) and each
//!   completed confirm takes the oldest; RabbitMQ sends a message's return before its ack. So once
//!   the confirms of a message and of everything before it are complete, every return up to it has
//!   been handed to *some* completed confirm, possibly a later message's, even one whose publish
//!   call has not returned yet. A message is therefore settled only after: taking lapin's ack lock
//!   once (`settle::barrier`, so the frame being handled is done), collecting every completed
//!   confirm, and no publish being on its way to the settler (a counter taken before each
//!   publish). The unroutable-row test caught the last of these missing.
//! - Confirms arrive out of order; tickets are handed back in publish order only (the checkpoint
//!   passes only the highest contiguous acknowledged record anyway).
//! - A nack, a closed channel or a lost connection end the session like any transient error: the
//!   next one reconnects and publishes again from the checkpoint. After a nack (a queue with
//!   `x-overflow = reject-publish` that is full) the next session publishes one message at a time
//!   until a whole window's worth is confirmed: RabbitMQ enqueues a message one queue refused in
//!   every other queue bound to its key, so a full window per retry would copy the window into
//!   them again each time, and a message published behind a refused one could be taken ahead of
//!   its resend. One at a time, a retry repeats one message and nothing overtakes it. Refusals an operator must fix (a
//!   login, a permission, a missing exchange, a message over the broker's size) stop outboxd.
//!
//! `connect.rs` opens sessions and classifies errors; `settle.rs` owns the unsettled messages.

pub mod config;
mod connect;
mod settle;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, ByteArray, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection};
use tokio::sync::mpsc;

use self::config::RabbitMqConfig;
pub use self::connect::preflight;
use self::connect::{channel_error, open};
use self::settle::{Published, Settler};
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::route::Record;
use crate::sink::ack::{Acks, Ticket};
use crate::sink::window::{Room, Window};
use crate::source::config::redact_url;

/// How long opening a session may take (connection, channel, exchange check, confirm mode): a
/// broker that accepts TCP but never answers (frozen, overloaded) must not hold the pipeline.
const OPEN_TIMEOUT: Duration = Duration::from_secs(15);

/// Set by a nack: every later session (of this process's one pipeline) starts with a window of
/// one ([`RabbitMqSink::new`]) until one of them has widened it again. A restart of outboxd starts
/// at full width.
static NACKED: AtomicBool = AtomicBool::new(false);

fn nacked(yes: bool) {
    NACKED.store(yes, Ordering::Relaxed);
}

/// How long closing a session may wait for the broker's answer.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(1);

/// Header holding the record's key (AMQP has no key of its own).
pub const KEY_HEADER: &str = "outboxd.key";

/// Header naming one publish exactly (`<session nonce>:<n>`), so that a returned message is
/// matched to its publish.
pub const PUBLISH_HEADER: &str = "outboxd.publish";

pub struct RabbitMqSink {
    connection: Connection,
    channel: Channel,
    exchange: ShortString,
    dead_letter: Option<String>,
    window: Window,
    /// The negotiated frame size: properties must fit one frame.
    frame_max: usize,
    nonce: String,
    publishes: AtomicU64,
    /// Publishes begun (shared with the settler, which settles nothing while one is on its way).
    started: Arc<AtomicU64>,
    published: mpsc::UnboundedSender<Published>,
    settler: tokio::task::JoinHandle<()>,
    metrics: Arc<Metrics>,
}

impl RabbitMqSink {
    /// Connects, opens the publishing channel in confirm mode and checks that the exchange exists.
    pub async fn new(
        name: &str,
        config: &RabbitMqConfig,
        acks: Arc<dyn Acks>,
        metrics: Arc<Metrics>,
    ) -> Result<RabbitMqSink> {
        let (connection, channel) = tokio::time::timeout(OPEN_TIMEOUT, open(name, config))
            .await
            .map_err(|_| {
                Error::sink(format!(
                    "RabbitMQ at {} did not answer within {OPEN_TIMEOUT:?}",
                    redact_url(&config.url)
                ))
                .remedy("outboxd retries; check that the broker is up and not blocked (rabbitmq-diagnostics status)")
                .transient()
            })??;
        let delivery = config.delivery();
        // Cleared only once a careful session has widened: a session that ends for another
        // reason before that (or never gets to publish) leaves the next one careful too.
        let careful = NACKED.load(Ordering::Relaxed);
        let window = if careful {
            tracing::info!(
                confirmed = delivery.max_in_flight,
                "a nack ended an earlier session: publishing one message at a time until this many are confirmed"
            );
            Window::narrowed(delivery.max_in_flight_bytes)
        } else {
            Window::new(delivery.max_in_flight, delivery.max_in_flight_bytes)
        };
        let (published, queue) = mpsc::unbounded_channel();
        let exchange = ShortString::from(config.exchange.as_str());
        let started = Arc::new(AtomicU64::new(0));
        let settler = tokio::spawn(
            Settler::new(
                channel.clone(),
                exchange.clone(),
                config.dead_letter_topic.clone(),
                acks,
                metrics.clone(),
                started.clone(),
                careful.then(|| (window.clone(), delivery.max_in_flight)),
            )
            .run(queue),
        );
        let frame_max = match connection.configuration().frame_max() {
            0 => usize::MAX,
            n => n as usize,
        };
        Ok(RabbitMqSink {
            connection,
            channel,
            exchange,
            dead_letter: config.dead_letter_topic.clone(),
            window,
            frame_max,
            nonce: format!("{:08x}", rand_nonce()),
            publishes: AtomicU64::new(0),
            started,
            published,
            settler,
            metrics,
        })
    }

    /// Waits for room in the window for `record`; the room is held until the record is settled.
    /// Cancel-safe.
    pub async fn reserve(&self, record: &Record) -> Result<Room> {
        self.window.reserve(record).await
    }

    /// Publishes `record` (routing key = its topic) and hands its confirm to the settler, which
    /// gives `ticket` back through the session's [`Acks`] once it is settled. Waits only for the
    /// frames to be written: a broker that stops reading (a memory or disk alarm) holds it, so the
    /// session races it against failures and its deadlines.
    pub async fn send(&self, room: Room, record: &Record, ticket: Ticket) -> Result<()> {
        let publish_id = format!(
            "{}:{}",
            self.nonce,
            self.publishes.fetch_add(1, Ordering::Relaxed)
        );
        let properties = properties(record, &publish_id);
        // What the router lets through fits RabbitMQ's default frame; a broker configured with a
        // smaller frame_max must not see an oversized frame (it would close the connection, and
        // the resend would close it again).
        if header_bytes(record) + 1024 > self.frame_max {
            return Err(Error::unroutable(format!(
                "a record's key and headers ({} bytes) do not fit the broker's frame_max ({} bytes)",
                header_bytes(record),
                self.frame_max
            ))
            .remedy("raise RabbitMQ's frame_max, or keep ids, keys and header columns smaller; nothing was skipped"));
        }
        let routing_key = ShortString::try_new(record.topic.clone()).map_err(|_| {
            Error::unroutable(format!(
                "routing key {:?} is longer than AMQP's 255 bytes",
                record.topic
            ))
            .remedy("shorten the routed topic (route.topic)")
        })?;
        // Counted before lapin registers the confirm: from here the settler waits for this
        // publish (a send dropped mid-way, when the session ends, leaves it waiting for good).
        self.started.fetch_add(1, Ordering::SeqCst);
        let confirm = publish(
            &self.channel,
            &self.exchange,
            routing_key,
            record.value.as_deref().unwrap_or_default(),
            properties,
        )
        .await
        .map_err(|e| channel_error("publishing", &e))?;
        self.metrics.produced();
        crate::fault::crash_point(crate::fault::AFTER_PRODUCE_BEFORE_ACK);
        self.published
            .send(Published {
                ticket,
                publish_id,
                routing_key: record.topic.clone(),
                dead_letter: self.dead_letter.as_deref() == Some(record.topic.as_str()),
                enqueued: std::time::Instant::now(),
                confirm: confirm.boxed(),
                room,
            })
            .map_err(|_| Error::sink("the RabbitMQ confirm task ended").transient())
    }
    /// Closes the channel and the connection; what is unconfirmed is published again by the next
    /// session from the checkpoint. Bounded: a frozen broker never answers the close, and a
    /// session's end must not wait for it (the connection is dropped then; its heartbeats time
    /// it out).
    pub async fn close(self) {
        self.settler.abort();
        let closing = async {
            let _ = self.channel.close(200, "outboxd session ends".into()).await;
            let _ = self
                .connection
                .close(200, "outboxd session ends".into())
                .await;
        };
        if tokio::time::timeout(CLOSE_TIMEOUT, closing).await.is_err() {
            tracing::debug!("RabbitMQ did not answer the close in time; dropping the connection");
        }
    }
}

/// The message's properties: persistent, `message_id` = the row id (when it fits AMQP's 255
/// bytes; the `id` header always carries it), the headers, the key in [`KEY_HEADER`], the publish
/// in [`PUBLISH_HEADER`], the commit time (whole seconds: AMQP's timestamp).
fn properties(record: &Record, publish_id: &str) -> BasicProperties {
    let mut headers = FieldTable::default();
    let mut id = None;
    for (name, value) in &record.headers {
        // Header names come from the config, which keeps them within 255 bytes.
        let Ok(name) = ShortString::try_new(name.clone()) else {
            continue;
        };
        if name.as_str() == crate::route::ID_HEADER {
            id = value
                .as_deref()
                .map(|v| String::from_utf8_lossy(v).into_owned());
        }
        headers.insert(name, header_value(value.as_deref()));
    }
    if let Some(key) = &record.key {
        headers.insert(KEY_HEADER.into(), header_value(Some(key)));
    }
    headers.insert(
        PUBLISH_HEADER.into(),
        AMQPValue::LongString(LongString::from(publish_id.to_string())),
    );
    let mut properties = BasicProperties::default()
        .with_delivery_mode(2)
        .with_headers(headers);
    if let Some(id) = id.filter(|id| id.len() <= 255) {
        properties = properties.with_message_id(ShortString::from(id));
    }
    if let Some(ms) = record.timestamp.filter(|ms| *ms >= 0) {
        properties = properties.with_timestamp((ms / 1000) as u64);
    }
    properties
}

/// One publish as outboxd makes every one: `mandatory` (an unroutable message is returned, never
/// dropped), on the confirm-mode channel.
async fn publish(
    channel: &Channel,
    exchange: &ShortString,
    routing_key: ShortString,
    body: &[u8],
    properties: BasicProperties,
) -> lapin::Result<lapin::PublisherConfirm> {
    channel
        .basic_publish(
            exchange.clone(),
            routing_key,
            BasicPublishOptions {
                mandatory: true,
                immediate: false,
            },
            body,
            properties,
        )
        .await
}

/// What a publish's `outboxd.publish` header says.
fn publish_id_of(properties: &BasicProperties) -> Option<String> {
    match properties.headers().as_ref()?.inner().get(PUBLISH_HEADER)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        _ => None,
    }
}

/// Bytes of a record's key and headers (what travels in the properties frame).
pub fn header_bytes(record: &Record) -> usize {
    record.key.as_ref().map_or(0, Vec::len)
        + record
            .headers
            .iter()
            .map(|(k, v)| k.len() + v.as_ref().map_or(0, Vec::len) + 8)
            .sum::<usize>()
}

/// UTF-8 text as a long string (what every AMQP client reads as text), other bytes as a byte
/// array, NULL as void.
fn header_value(value: Option<&[u8]>) -> AMQPValue {
    match value {
        None => AMQPValue::Void,
        Some(bytes) if std::str::from_utf8(bytes).is_ok() => {
            AMQPValue::LongString(LongString::from(bytes.to_vec()))
        }
        Some(bytes) => AMQPValue::ByteArray(ByteArray::from(bytes.to_vec())),
    }
}

/// A session nonce: distinct per session and process, so a publish id never repeats on a channel.
fn rand_nonce() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish() as u32
}
