//! The settler: owns every message published and not yet settled, reads their confirms and the
//! broker's returns, and hands tickets back in publish order (see the module docs of `rabbitmq`
//! for why it looks this way).
//!
//! Each unsettled message has a *generation*: its first publish is generation 0, its copy to the
//! dead-letter routing key generation 1. A confirm or a return counts only for the generation it
//! was published as (the header `outboxd.publish` names the publish exactly), and a message is
//! settled only when the confirm of its current generation arrived, with no return for it.

use std::collections::{HashMap, VecDeque};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::Instant;

use futures_util::future::BoxFuture;
use futures_util::stream::{FuturesUnordered, Stream};
use futures_util::{FutureExt, StreamExt};
use lapin::message::BasicReturnMessage;
use lapin::types::{AMQPValue, LongString, ShortString};
use lapin::{Channel, Confirmation};
use tokio::sync::mpsc;

use super::connect::channel_error;
use super::{publish, publish_id_of, PUBLISH_HEADER};
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::sink::ack::{Acks, Ticket};
use crate::sink::window::{Room, Window};

/// A message the sink published, on its way to the settler.
pub(super) struct Published {
    pub ticket: Ticket,
    /// The value of its `outboxd.publish` header.
    pub publish_id: String,
    pub routing_key: String,
    /// A dead letter the router made (its own return must stop outboxd, not be dead-lettered).
    pub dead_letter: bool,
    pub enqueued: Instant,
    pub confirm: BoxFuture<'static, lapin::Result<Confirmation>>,
    pub room: Room,
}

type Confirmed = (u64, u32, lapin::Result<Confirmation>);

pub(super) struct Settler {
    pub channel: Channel,
    pub exchange: ShortString,
    pub dead_letter: Option<String>,
    pub acks: Arc<dyn Acks>,
    pub metrics: Arc<Metrics>,
    /// In publish order; `next_seq - unsettled.len()` is the first one's sequence number.
    unsettled: VecDeque<Unsettled>,
    /// Publish id -> sequence number, for the current generation of every unsettled message.
    by_publish: HashMap<String, u64>,
    pending: FuturesUnordered<BoxFuture<'static, Confirmed>>,
    /// Returns collected from confirms, not yet matched.
    returned: Vec<BasicReturnMessage>,
    next_seq: u64,
    /// Publishes the sink began (counted before lapin registers their confirm), and how many of
    /// them reached this settler. While some are on their way, nothing is settled: a confirm that
    /// is not in `pending` yet may carry an earlier message's return.
    started: Arc<AtomicU64>,
    received: u64,
    /// A settling round was skipped for that reason; the next arrival runs it.
    deferred: bool,
    /// After a nack: the narrowed window, and how many more confirms until it is widened to
    /// `max_in_flight`.
    careful: Option<(Window, usize, usize)>,
}

struct Unsettled {
    ticket: Ticket,
    publish_id: String,
    routing_key: String,
    generation: u32,
    /// The broker's answer to the current generation's publish: `Some(true)` ack, `Some(false)`
    /// nack (or a confirm that failed).
    confirmed: Option<bool>,
    /// A return for the current generation.
    returned: Option<Box<BasicReturnMessage>>,
    /// This is a dead letter already (a copy, or one the router made).
    dead_lettered: bool,
    enqueued: Instant,
    _room: Room,
}

impl Settler {
    pub fn new(
        channel: Channel,
        exchange: ShortString,
        dead_letter: Option<String>,
        acks: Arc<dyn Acks>,
        metrics: Arc<Metrics>,
        started: Arc<AtomicU64>,
        careful: Option<(Window, usize)>,
    ) -> Settler {
        Settler {
            channel,
            exchange,
            dead_letter,
            acks,
            metrics,
            unsettled: VecDeque::new(),
            by_publish: HashMap::new(),
            pending: FuturesUnordered::new(),
            returned: Vec::new(),
            next_seq: 0,
            started,
            received: 0,
            deferred: false,
            careful: careful.map(|(window, max)| (window, max, max)),
        }
    }

    pub async fn run(mut self, mut queue: mpsc::UnboundedReceiver<Published>) {
        loop {
            let round = tokio::select! {
                published = queue.recv() => match published {
                    Some(p) => {
                        self.push(p);
                        std::mem::take(&mut self.deferred)
                    }
                    None => return,
                },
                Some((seq, generation, confirmation)) = self.pending.next(), if !self.pending.is_empty() => {
                    self.record(seq, generation, confirmation);
                    true
                }
            };
            if round {
                if let Err(e) = self.round(&mut queue).await {
                    self.acks.failed(e);
                    return;
                }
            }
        }
    }

    /// Collects what can be known now and settles what it allows.
    async fn round(&mut self, queue: &mut mpsc::UnboundedReceiver<Published>) -> Result<()> {
        // Every confirm the ack frame being handled completed is complete after this.
        let drained = barrier(&self.channel);
        self.returned.extend(drained);
        // Every publish that reached the sink's queue, and every completed confirm.
        while let Ok(p) = queue.try_recv() {
            self.push(p);
        }
        self.collect_completed();
        self.match_returns()?;
        if self.started.load(Ordering::SeqCst) > self.received {
            // A publish is on its way here, its confirm perhaps complete with a return.
            self.deferred = true;
            return Ok(());
        }
        self.settle().await
    }

    fn push(&mut self, p: Published) {
        self.received += 1;
        let seq = self.next_seq;
        self.next_seq += 1;
        self.pending
            .push(p.confirm.map(move |c| (seq, 0, c)).boxed());
        self.by_publish.insert(p.publish_id.clone(), seq);
        self.unsettled.push_back(Unsettled {
            ticket: p.ticket,
            publish_id: p.publish_id,
            routing_key: p.routing_key,
            generation: 0,
            confirmed: None,
            returned: None,
            dead_lettered: p.dead_letter,
            enqueued: p.enqueued,
            _room: p.room,
        });
    }

    fn entry(&mut self, seq: u64) -> Option<&mut Unsettled> {
        let first = self.next_seq - self.unsettled.len() as u64;
        seq.checked_sub(first)
            .and_then(|i| self.unsettled.get_mut(i as usize))
    }

    /// Every confirm that is complete now, however many: `FuturesUnordered` may answer "pending"
    /// with completed ones still queued (it yields after a few, or while another thread is adding
    /// to its queue) and then wakes itself; a waker that notes that makes this poll again.
    fn collect_completed(&mut self) {
        let woken = Arc::new(Flag(AtomicBool::new(false)));
        let waker = Waker::from(woken.clone());
        let mut cx = Context::from_waker(&waker);
        loop {
            woken.0.store(false, Ordering::Release);
            match Pin::new(&mut self.pending).poll_next(&mut cx) {
                Poll::Ready(Some((seq, generation, confirmation))) => {
                    self.record(seq, generation, confirmation)
                }
                Poll::Ready(None) => return,
                Poll::Pending if woken.0.load(Ordering::Acquire) => {}
                Poll::Pending => return,
            }
        }
    }

    fn record(&mut self, seq: u64, generation: u32, confirmation: lapin::Result<Confirmation>) {
        let answer = match confirmation {
            Ok(Confirmation::Ack(returned)) => {
                self.returned.extend(returned);
                true
            }
            Ok(Confirmation::Nack(returned)) => {
                // A broker's refusal (a failed confirm is not one: a lost connection).
                super::nacked(true);
                self.returned.extend(returned);
                false
            }
            // Confirm mode is on for this channel: never counted as delivered.
            Ok(Confirmation::NotRequested) => false,
            Err(e) => {
                self.acks
                    .failed(channel_error("waiting for a publisher confirm", &e));
                false
            }
        };
        if let Some(entry) = self.entry(seq) {
            if entry.generation == generation && entry.confirmed.is_none() {
                entry.confirmed = Some(answer);
            }
        }
    }

    /// Each return names its publish exactly (header `outboxd.publish`). A return may come before
    /// its publish reached the settler (it rides on an earlier message's confirm while the publish
    /// call is still returning): it waits in the pool for it. One that names no publish when none
    /// is on its way cannot be placed, so nothing may be settled on a guess: the session ends and
    /// everything unsettled is published again.
    fn match_returns(&mut self) -> Result<()> {
        let on_their_way = self.started.load(Ordering::SeqCst) > self.received;
        for message in std::mem::take(&mut self.returned) {
            let id = publish_id_of(&message.delivery.properties);
            let seq = id.as_ref().and_then(|id| self.by_publish.get(id).copied());
            match seq.and_then(|seq| self.entry(seq)) {
                Some(entry) => entry.returned = Some(Box::new(message)),
                None if on_their_way => self.returned.push(message),
                None => {
                    return Err(Error::sink(format!(
                        "RabbitMQ returned a message outboxd cannot place (routing key {:?}, publish {:?})",
                        message.delivery.routing_key.as_str(),
                        id
                    ))
                    .remedy("outboxd reconnects and publishes again from the checkpoint")
                    .transient())
                }
            }
        }
        Ok(())
    }

    /// Hands back the tickets of the settled messages at the front, in publish order.
    async fn settle(&mut self) -> Result<()> {
        // Counted per routing key and handed to the metrics once per call (a label lookup per
        // message would cost more than the settling).
        let mut forwarded: HashMap<String, u64> = HashMap::new();
        let settled = self.settle_front(&mut forwarded).await;
        for (routing_key, n) in forwarded {
            self.metrics.forwarded_n(&routing_key, n);
        }
        settled
    }

    async fn settle_front(&mut self, forwarded: &mut HashMap<String, u64>) -> Result<()> {
        while let Some(front) = self.unsettled.front_mut() {
            match front.confirmed {
                None => return Ok(()),
                Some(false) => {
                    self.metrics.delivery_error();
                    return Err(Error::sink(format!(
                        "RabbitMQ refused (nack) a message for routing key {:?}",
                        front.routing_key
                    ))
                    .remedy("outboxd publishes it again from the checkpoint; a queue with overflow = reject-publish nacks while it is full, see the broker's log")
                    .transient());
                }
                Some(true) => match front.returned.take() {
                    Some(message) => self.unroutable(*message).await?,
                    None => {
                        let done = self.unsettled.pop_front().expect("front exists");
                        self.by_publish.remove(&done.publish_id);
                        self.metrics.acknowledged();
                        self.metrics.delivered_after(done.enqueued.elapsed());
                        *forwarded.entry(done.routing_key).or_default() += 1;
                        self.acks.acked(done.ticket);
                        self.confirmed_carefully();
                    }
                },
            }
        }
        Ok(())
    }

    /// One more message confirmed while the window is narrowed after a nack; a window's worth
    /// widens it.
    fn confirmed_carefully(&mut self) {
        if let Some((window, max, left)) = &mut self.careful {
            *left -= 1;
            if *left == 0 {
                window.widen(*max);
                super::nacked(false);
                tracing::info!(
                    "a window's worth confirmed since the nack: publishing at full width again"
                );
                self.careful = None;
            }
        }
    }

    /// The front message was returned: publish a copy to the dead-letter routing key (the message
    /// stays at the front until that copy is confirmed), or stop.
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
        let copy_id = format!("{}.dead-letter", front.publish_id);
        let mut headers = message
            .delivery
            .properties
            .headers()
            .clone()
            .unwrap_or_default();
        for (name, value) in [
            (PUBLISH_HEADER, copy_id.clone()),
            ("outboxd.error", format!("unroutable: {why}")),
            ("outboxd.routing_key", front.routing_key.clone()),
        ] {
            headers.insert(name.into(), AMQPValue::LongString(LongString::from(value)));
        }
        let properties = message.delivery.properties.clone().with_headers(headers);
        let routing_key = ShortString::try_new(dead_letter.clone())
            .map_err(|_| Error::config("rabbitmq.dead_letter_topic is longer than 255 bytes"))?;
        let confirm = publish(
            &self.channel,
            &self.exchange,
            routing_key,
            &message.delivery.data,
            properties,
        )
        .await
        .map_err(|e| channel_error("publishing to the dead-letter routing key", &e))?;
        let seq = self.next_seq - self.unsettled.len() as u64;
        let front = self.unsettled.front_mut().expect("front exists");
        self.by_publish.remove(&front.publish_id);
        self.by_publish.insert(copy_id.clone(), seq);
        front.publish_id = copy_id;
        front.routing_key = dead_letter;
        front.generation += 1;
        front.confirmed = None;
        front.dead_lettered = true;
        let generation = front.generation;
        self.pending
            .push(confirm.map(move |c| (seq, generation, c)).boxed());
        Ok(())
    }
}

/// Takes the acknowledgement lock of `channel` once: every confirm completed by the ack frame
/// being handled right now is complete when this returns (lapin completes all confirms of one
/// frame under that lock). lapin's `wait_for_confirms` takes the lock on its first poll, before it
/// waits; the wait is not needed and not awaited. Returns what it drained when nothing was
/// pending: returns held for confirms nobody awaits.
fn barrier(channel: &Channel) -> Vec<BasicReturnMessage> {
    channel
        .wait_for_confirms()
        .now_or_never()
        .and_then(|drained| drained.ok())
        .unwrap_or_default()
}

/// A waker that only notes that it was woken.
struct Flag(AtomicBool);

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.0.store(true, Ordering::Release);
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.store(true, Ordering::Release);
    }
}
