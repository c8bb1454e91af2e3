//! RabbitMQ sink (AMQP 0.9.1 on lapin): persistent messages published `mandatory` on one channel in
//! confirm mode, through the same bounded window as every sink.
//!
//! Why the ack path looks the way it does (`shared/sinks.md` has the broker facts):
//! - A publisher confirm alone does not mean "in a queue": a message no binding routes is *returned*
//!   (`basic.return`, sent before its ack) and then acked. So a record counts as delivered only when
//!   its confirm is an ack **and** no return names it; a returned record goes to the dead-letter
//!   routing key (reason `unroutable`) or ends the pipeline naming the exchange and routing key.
//! - lapin hands a return to whichever confirm it completes next, which under a `multiple` ack may
//!   be another message's. So returns are collected from every confirm into one pool and matched to
//!   the oldest unsettled message with the same `message_id` and routing key. A message's return
//!   is always received before its ack, and lapin completes all confirms of one ack frame under one
//!   lock, so taking that lock once ([`barrier`]) after a confirm completes and collecting every
//!   completed confirm puts every return that could name it in the pool before it is settled.
//! - Confirms arrive out of order; the tickets are handed back in publish order only (the
//!   checkpoint passes only the highest contiguous confirmed message anyway).
//! - A nack (an internal broker error), a closed channel or a lost connection end the session like
//!   any transient error: the next one reconnects and publishes again from the checkpoint.

pub mod config;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};
use lapin::message::BasicReturnMessage;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::types::{AMQPValue, ByteArray, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

use self::config::RabbitMqConfig;
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::preflight::Item;
use crate::route::Record;
use crate::sink::{Acks, Ticket};
use crate::source::config::redact_url;

/// How long opening a session may take (connection, channel, exchange check, confirm mode): a
/// broker that accepts TCP but never answers (frozen, overloaded) must not hold the pipeline.
const OPEN_TIMEOUT: Duration = Duration::from_secs(15);

/// How long closing a session may wait for the broker's answer.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(1);

/// Header holding the record's key (the aggregate id): AMQP has no key of its own.
pub const KEY_HEADER: &str = "key";

pub struct RabbitMqSink {
    connection: Connection,
    channel: Channel,
    exchange: ShortString,
    window: Arc<Semaphore>,
    bytes: Arc<Semaphore>,
    max_bytes: u32,
    published: mpsc::UnboundedSender<Published>,
    settler: tokio::task::JoinHandle<()>,
    metrics: Arc<Metrics>,
}

/// Room in the window for one record, taken by [`RabbitMqSink::reserve`]; held until the record
/// is settled.
pub struct Room {
    _window: OwnedSemaphorePermit,
    _bytes: OwnedSemaphorePermit,
}

type ConfirmFuture = BoxFuture<'static, lapin::Result<Confirmation>>;

/// A message published and not yet settled, in publish order.
struct Published {
    ticket: Ticket,
    /// `message_id` and routing key: what a return is matched by.
    id: Option<String>,
    routing_key: String,
    confirm: ConfirmFuture,
    room: Room,
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
        let window = Arc::new(Semaphore::new(delivery.max_in_flight));
        let max_bytes = u32::try_from(delivery.max_in_flight_bytes).unwrap_or(u32::MAX);
        let bytes = Arc::new(Semaphore::new(max_bytes as usize));
        let (published, queue) = mpsc::unbounded_channel();
        let settler = tokio::spawn(
            Settler {
                channel: channel.clone(),
                exchange: ShortString::from(config.exchange.as_str()),
                dead_letter: config.dead_letter_topic.clone(),
                acks,
                metrics: metrics.clone(),
                unsettled: VecDeque::new(),
                pending: FuturesUnordered::new(),
                returned: Vec::new(),
                next_seq: 0,
            }
            .run(queue),
        );
        Ok(RabbitMqSink {
            connection,
            channel,
            exchange: ShortString::from(config.exchange.as_str()),
            window,
            bytes,
            max_bytes,
            published,
            settler,
            metrics,
        })
    }

    /// Waits for room in the window for `record` (as the Kafka sink does). Cancel-safe.
    pub async fn reserve(&self, record: &Record) -> Result<Room> {
        let closed = |_| Error::sink("publishing window closed");
        let window = self.window.clone().acquire_owned().await.map_err(closed)?;
        let cost = u32::try_from(record.size())
            .unwrap_or(u32::MAX)
            .clamp(1, self.max_bytes);
        let bytes = self
            .bytes
            .clone()
            .acquire_many_owned(cost)
            .await
            .map_err(closed)?;
        Ok(Room {
            _window: window,
            _bytes: bytes,
        })
    }

    /// Publishes `record` (routing key = its topic) and hands its confirm to the settler, which
    /// gives `ticket` back through the session's [`Acks`] once it is settled.
    pub async fn send(&self, room: Room, record: &Record, ticket: Ticket) -> Result<()> {
        let (properties, id) = properties(record);
        let routing_key = ShortString::try_new(record.topic.clone()).map_err(|_| {
            Error::unroutable(format!(
                "routing key {:?} is longer than AMQP's 255 bytes",
                record.topic
            ))
            .remedy("shorten the routed topic (route.topic)")
        })?;
        let confirm = self
            .channel
            .basic_publish(
                self.exchange.clone(),
                routing_key,
                BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                },
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
                id,
                routing_key: record.topic.clone(),
                confirm: confirm.boxed(),
                room,
            })
            .map_err(|_| Error::sink("the RabbitMQ confirm task ended").transient())
    }

    /// Closes the channel and the connection. What is unconfirmed is published again by the next
    /// session from the checkpoint.
    /// Bounded: a frozen broker never answers the close, and a session's end must not wait for it
    /// (the connection is dropped then; its heartbeats time it out).
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
/// bytes; the `id` header always carries it), the headers, the key in [`KEY_HEADER`], the commit
/// time (whole seconds: AMQP's timestamp).
fn properties(record: &Record) -> (BasicProperties, Option<String>) {
    let mut headers = FieldTable::default();
    let mut id = None;
    for (name, value) in &record.headers {
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
    let id = id.filter(|id| id.len() <= 255);
    let mut properties = BasicProperties::default()
        .with_delivery_mode(2)
        .with_headers(headers);
    if let Some(id) = &id {
        properties = properties.with_message_id(ShortString::from(id.as_str()));
    }
    if let Some(ms) = record.timestamp.filter(|ms| *ms >= 0) {
        properties = properties.with_timestamp((ms / 1000) as u64);
    }
    (properties, id)
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

/// The session's connection and its publishing channel: the exchange checked, confirm mode on.
async fn open(name: &str, config: &RabbitMqConfig) -> Result<(Connection, Channel)> {
    let connection = connect(name, config).await?;
    let channel = connection.create_channel().await.map_err(|e| {
        Error::sink(format!("cannot open a RabbitMQ channel: {e}"))
            .remedy("outboxd retries; check the broker's channel_max and logs")
            .transient()
    })?;
    check_exchange(&channel, &config.exchange).await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|e| {
            Error::sink(format!("cannot turn on publisher confirms: {e}"))
                .remedy("outboxd retries; publisher confirms are part of every RabbitMQ since 2.x")
                .transient()
        })?;
    Ok((connection, channel))
}

async fn connect(name: &str, config: &RabbitMqConfig) -> Result<Connection> {
    let runtime = lapin::runtime::default_runtime()
        .map_err(|e| Error::sink(format!("no async runtime for RabbitMQ: {e}")))?;
    let cert_chain = match &config.ca_file {
        Some(path) => Some(std::fs::read_to_string(path).map_err(|e| {
            Error::config(format!(
                "cannot read rabbitmq.ca_file {}: {e}",
                path.display()
            ))
            .remedy("point rabbitmq.ca_file at a readable PEM file of the CA(s) to trust")
        })?),
        None => None,
    };
    let tls = lapin::tcp::OwnedTLSConfig {
        identity: None,
        cert_chain,
    };
    let properties = ConnectionProperties::default()
        .with_connection_name(LongString::from(format!("outboxd-{name}")));
    Connection::connect_with_config(&config.url, properties, tls, runtime)
        .await
        .map_err(|e| connect_error(&config.url, &e))
}

/// A connection failure, classified: credentials and vhost access are the operator's to fix (and
/// retrying them only fills the broker's log), the rest is retried.
fn connect_error(url: &str, e: &lapin::Error) -> Error {
    let text = e.to_string();
    let shown = redact_url(url);
    let lower = text.to_ascii_lowercase();
    if lower.contains("access_refused")
        || lower.contains("authentication")
        || lower.contains("login")
    {
        Error::sink(format!("RabbitMQ at {shown} refused the login: {text}"))
            .remedy("check the user and password in rabbitmq.url (or OUTBOXD_RABBITMQ__URL)")
    } else if lower.contains("not_allowed") || lower.contains("vhost") {
        Error::sink(format!("RabbitMQ at {shown} refused the virtual host: {text}"))
            .remedy("grant the user access to the vhost (rabbitmqctl set_permissions -p VHOST USER '' '.*' '')")
    } else if lower.contains("certificate") || lower.contains("ssl") || lower.contains("tls") {
        Error::sink(format!("TLS to RabbitMQ at {shown} failed: {text}"))
            .remedy("check rabbitmq.ca_file and that the broker's certificate names the host in rabbitmq.url")
    } else {
        Error::sink(format!("cannot reach RabbitMQ at {shown}: {text}"))
            .remedy("outboxd retries; check rabbitmq.url and that the broker is up")
            .transient()
    }
}

/// A publish or a confirm failed because the channel or connection closed.
fn channel_error(doing: &str, e: &lapin::Error) -> Error {
    let text = e.to_string();
    if text.contains("NOT_FOUND") || text.contains("no exchange") {
        return Error::sink(format!("RabbitMQ closed the channel while {doing}: {text}"))
            .remedy("create the exchange named by rabbitmq.exchange, then restart outboxd (nothing was skipped)");
    }
    if text.contains("PRECONDITION_FAILED") && text.contains("message size") {
        return Error::unroutable(format!("RabbitMQ refused a message while {doing}: {text}"))
            .remedy(
            "raise the broker's max_message_size, or keep payloads smaller (nothing was skipped)",
        );
    }
    Error::sink(format!("RabbitMQ channel failed while {doing}: {text}"))
        .remedy("outboxd reconnects and publishes again from the checkpoint")
        .transient()
}

/// `exchange` exists (checked passively: outboxd declares nothing). The default exchange (`""`)
/// always does.
async fn check_exchange(channel: &Channel, exchange: &str) -> Result<()> {
    if exchange.is_empty() {
        return Ok(());
    }
    channel
        .exchange_declare(
            exchange.into(),
            lapin::ExchangeKind::Topic,
            ExchangeDeclareOptions {
                passive: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(|e| {
            let text = e.to_string();
            if text.contains("NOT_FOUND") {
                Error::sink(format!("RabbitMQ has no exchange {exchange:?}"))
                    .remedy(format!("declare it (rabbitmqadmin declare exchange name={exchange} type=topic durable=true) or fix rabbitmq.exchange"))
            } else {
                Error::sink(format!("cannot check RabbitMQ exchange {exchange:?}: {text}"))
                    .remedy("outboxd retries; check the broker")
                    .transient()
            }
        })
}

/// Takes the acknowledgement lock of `channel` once: every confirm completed by the ack frame
/// being handled right now is completed when this returns. (lapin's `wait_for_confirms` takes the
/// lock on its first poll, before it waits; the wait is not needed and not awaited.) Returns what
/// it drained when nothing was pending: returns held for confirms nobody awaits.
fn barrier(channel: &Channel) -> Vec<BasicReturnMessage> {
    channel
        .wait_for_confirms()
        .now_or_never()
        .and_then(|drained| drained.ok())
        .unwrap_or_default()
}

/// Owns what is published and not yet settled; see the module docs.
struct Settler {
    channel: Channel,
    exchange: ShortString,
    dead_letter: Option<String>,
    acks: Arc<dyn Acks>,
    metrics: Arc<Metrics>,
    /// In publish order; `next_seq - unsettled.len()` is the first one's sequence number.
    unsettled: VecDeque<Unsettled>,
    pending: FuturesUnordered<BoxFuture<'static, (u64, lapin::Result<Confirmation>)>>,
    /// Returns not yet matched to a message.
    returned: Vec<BasicReturnMessage>,
    next_seq: u64,
}

struct Unsettled {
    ticket: Ticket,
    id: Option<String>,
    routing_key: String,
    state: State,
    /// Already re-published to the dead-letter routing key.
    dead_lettered: bool,
    _room: Room,
}

enum State {
    Waiting,
    Acked,
    Nacked,
    Returned(Box<BasicReturnMessage>),
}

impl Settler {
    async fn run(mut self, mut queue: mpsc::UnboundedReceiver<Published>) {
        loop {
            tokio::select! {
                published = queue.recv() => match published {
                    Some(p) => self.push(p),
                    None => return,
                },
                Some((seq, confirmation)) = self.pending.next(), if !self.pending.is_empty() => {
                    self.record(seq, confirmation);
                    let drained = barrier(&self.channel);
                    self.returned.extend(drained);
                    while let Some(Some((seq, confirmation))) = self.pending.next().now_or_never() {
                        self.record(seq, confirmation);
                    }
                    self.match_returns();
                    if let Err(e) = self.settle().await {
                        self.acks.failed(e);
                        return;
                    }
                }
            }
        }
    }

    fn push(&mut self, p: Published) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.pending.push(p.confirm.map(move |c| (seq, c)).boxed());
        self.unsettled.push_back(Unsettled {
            ticket: p.ticket,
            id: p.id,
            routing_key: p.routing_key,
            state: State::Waiting,
            dead_lettered: false,
            _room: p.room,
        });
    }

    fn entry(&mut self, seq: u64) -> Option<&mut Unsettled> {
        let first = self.next_seq - self.unsettled.len() as u64;
        seq.checked_sub(first)
            .and_then(|i| self.unsettled.get_mut(i as usize))
    }

    fn record(&mut self, seq: u64, confirmation: lapin::Result<Confirmation>) {
        let state = match confirmation {
            Ok(Confirmation::Ack(returned)) => {
                self.returned.extend(returned);
                State::Acked
            }
            Ok(Confirmation::Nack(returned)) => {
                self.returned.extend(returned);
                State::Nacked
            }
            // Confirm mode is on for this channel: a confirm that was not requested is a bug,
            // and never counted as delivered.
            Ok(Confirmation::NotRequested) => State::Nacked,
            Err(e) => {
                self.acks
                    .failed(channel_error("waiting for a publisher confirm", &e));
                State::Nacked
            }
        };
        if let Some(entry) = self.entry(seq) {
            if matches!(entry.state, State::Waiting) {
                entry.state = state;
            }
        }
    }

    /// Each return names the oldest unsettled message with its `message_id` and routing key.
    fn match_returns(&mut self) {
        for message in std::mem::take(&mut self.returned) {
            let id = message
                .delivery
                .properties
                .message_id()
                .as_ref()
                .map(|s| s.as_str().to_string());
            let key = message.delivery.routing_key.as_str().to_string();
            let found = self.unsettled.iter_mut().find(|u| {
                u.id == id
                    && u.routing_key == key
                    && matches!(u.state, State::Waiting | State::Acked)
            });
            match found {
                Some(entry) => entry.state = State::Returned(Box::new(message)),
                None => tracing::warn!(
                    routing_key = %key,
                    "RabbitMQ returned a message outboxd no longer waits for (its session already ended)"
                ),
            }
        }
    }

    /// Hands back the tickets of the settled messages at the front, in publish order.
    async fn settle(&mut self) -> Result<()> {
        while let Some(front) = self.unsettled.front_mut() {
            match std::mem::replace(&mut front.state, State::Waiting) {
                State::Waiting => return Ok(()),
                State::Acked => {
                    let done = self.unsettled.pop_front().expect("front exists");
                    self.acks.acked(done.ticket);
                }
                State::Nacked => {
                    return Err(Error::sink(format!(
                        "RabbitMQ refused (nack) a message for routing key {:?}",
                        front.routing_key
                    ))
                    .remedy("outboxd publishes it again from the checkpoint; see the broker's log for the queue's error")
                    .transient())
                }
                State::Returned(message) => self.unroutable(*message).await?,
            }
        }
        Ok(())
    }

    /// The front message was returned: publish it to the dead-letter routing key (it stays at the
    /// front until that copy is confirmed), or stop.
    async fn unroutable(&mut self, message: BasicReturnMessage) -> Result<()> {
        let exchange = self.exchange.as_str().to_string();
        let front = self.unsettled.front_mut().expect("front exists");
        let why = format!(
            "no queue is bound to exchange {exchange:?} for routing key {:?} ({} {})",
            front.routing_key, message.reply_code, message.reply_text
        );
        let dead_letter = match (&self.dead_letter, front.dead_lettered) {
            (Some(topic), false) => topic.clone(),
            (Some(topic), true) => {
                return Err(Error::unroutable(format!(
                    "the dead-letter routing key {topic:?} is unroutable too: {why}"
                ))
                .remedy(format!("bind a queue to exchange {exchange:?} with routing key {topic:?}, then restart outboxd (nothing was skipped)")))
            }
            (None, _) => {
                return Err(Error::unroutable(format!("a row cannot be delivered: {why}"))
                    .remedy(format!("bind a queue to exchange {exchange:?} for routing key {:?}, or set rabbitmq.dead_letter_topic to park such rows; then restart outboxd (nothing was skipped)", front.routing_key)))
            }
        };
        tracing::warn!(routing_key = %front.routing_key, dead_letter = %dead_letter, "unroutable message sent to the dead-letter routing key");
        self.metrics.dead_letter("unroutable");
        let mut properties = message.delivery.properties.clone();
        let mut headers = properties.headers().clone().unwrap_or_default();
        headers.insert(
            "outboxd.error".into(),
            AMQPValue::LongString(LongString::from(format!("unroutable: {why}"))),
        );
        headers.insert(
            "outboxd.routing_key".into(),
            AMQPValue::LongString(LongString::from(front.routing_key.clone())),
        );
        properties = properties.with_headers(headers);
        let routing_key = ShortString::try_new(dead_letter.clone())
            .map_err(|_| Error::config("rabbitmq.dead_letter_topic is longer than 255 bytes"))?;
        let confirm = self
            .channel
            .basic_publish(
                self.exchange.clone(),
                routing_key,
                BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                },
                &message.delivery.data,
                properties,
            )
            .await
            .map_err(|e| channel_error("publishing to the dead-letter routing key", &e))?;
        front.dead_lettered = true;
        front.routing_key = dead_letter;
        let seq = self.next_seq - self.unsettled.len() as u64;
        self.pending.push(confirm.map(move |c| (seq, c)).boxed());
        Ok(())
    }
}

/// `check`'s lines for the RabbitMQ sink: the broker is reachable with these credentials and the
/// exchange exists. (Whether a binding routes each routing key cannot be asked over AMQP 0.9.1: a
/// message no binding routes is returned at run time, see the module docs.)
pub async fn preflight(config: &RabbitMqConfig) -> Vec<Item> {
    let as_item = |subject: &str, e: &Error| {
        let remedy = e.remedy_text().unwrap_or("see the message").to_string();
        if e.is_transient() {
            Item::unreachable(subject, e.message(), remedy)
        } else {
            Item::fail(subject, e.message(), remedy)
        }
    };
    let shown = redact_url(&config.url);
    let connection = match tokio::time::timeout(OPEN_TIMEOUT, connect("check", config)).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return vec![as_item("rabbitmq", &e)],
        Err(_) => {
            return vec![Item::unreachable(
                "rabbitmq",
                format!("RabbitMQ at {shown} did not answer within {OPEN_TIMEOUT:?}"),
                "check that the broker is up and not blocked (rabbitmq-diagnostics status)",
            )]
        }
    };
    let mut items = vec![Item::pass("rabbitmq", format!("connected to {shown}"))];
    let checking = async {
        match connection.create_channel().await {
            Ok(channel) => check_exchange(&channel, &config.exchange).await,
            Err(e) => Err(channel_error("opening a channel", &e)),
        }
    };
    let checked = tokio::time::timeout(OPEN_TIMEOUT, checking)
        .await
        .unwrap_or_else(|_| {
            Err(Error::sink(format!(
                "RabbitMQ at {shown} did not answer the exchange check"
            ))
            .remedy("check that the broker is up and not blocked")
            .transient())
        });
    items.push(match checked {
        Ok(()) if config.exchange.is_empty() => Item::pass(
            "rabbitmq exchange",
            "the default exchange: each routed topic must name a queue",
        ),
        Ok(()) => Item::pass("rabbitmq exchange", format!("{:?} exists", config.exchange)),
        Err(e) => as_item("rabbitmq exchange", &e),
    });
    let _ = tokio::time::timeout(
        CLOSE_TIMEOUT,
        connection.close(200, "outboxd check done".into()),
    )
    .await;
    items
}
