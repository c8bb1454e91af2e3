//! Prometheus metrics and the liveness signal behind `/readyz`.
//!
//! One [`Metrics`] value per process, shared by the stages: the sink counts acknowledged records per
//! topic and delivery errors and keeps the in-flight gauge; the pipeline counts dead letters, reconnects
//! and records when the checkpoint last caught up; the source marks every event it reads (heartbeats
//! included), which is what readiness is judged by: a stream that has said nothing for three heartbeat
//! intervals is reported unready even while its TCP connection looks alive.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use prometheus_client::encoding::{text::encode, EncodeLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TopicLabel {
    topic: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: String,
}

/// Never set.
const NEVER: i64 = i64::MIN;

pub struct Metrics {
    registry: Registry,
    forwarded: Family<TopicLabel, Counter>,
    timestamps_clamped: Family<TopicLabel, Counter>,
    dead_letter: Family<ReasonLabel, Counter>,
    ignored: Family<KindLabel, Counter>,
    inflight: Gauge,
    /// 1 while `/readyz` answers 200, updated when rendered.
    ready: Gauge,
    checkpoint_age: Gauge<f64, AtomicU64>,
    source_lag: Gauge<f64, AtomicU64>,
    reconnects: Counter,
    delivery_errors: Counter,
    delivery_seconds: Histogram,
    handoff_seconds: Histogram,
    source_delay_seconds: Histogram,
    snapshot_rows: Counter,
    pruned_rows: Counter,
    partitions_dropped: Counter,
    partitions_created: Counter,
    create_failures: Counter,
    prune_runs: Family<ResultLabel, Counter>,
    transactions: Family<ResultLabel, Counter>,
    outbox_rows: Gauge,
    /// 1 while this instance forwards the pipeline (0 while it stands by).
    leader: Gauge,
    /// [`Role`] as a number: what `/readyz` reports.
    role: std::sync::atomic::AtomicU8,
    base: Instant,
    /// Milliseconds since `base` of the last source event (NEVER before the first).
    last_source_event: AtomicI64,
    /// Milliseconds since `base` when the checkpoint last caught up with the acks.
    last_checkpoint_current: AtomicI64,
    /// Unix milliseconds of the last forwarded transaction's commit (or of the last heartbeat).
    source_time_ms: AtomicI64,
    stale_after: Duration,
    forwarded_total: AtomicU64,
}

impl Metrics {
    /// Every series carries `pipeline` and `sink` (one of [`crate::sink::SINK_NAMES`]: the same
    /// names on every sink, told apart by the label). `heartbeat` is the source's heartbeat
    /// interval; readiness fails after three of them.
    pub fn new(pipeline: &str, sink: &str, heartbeat: Duration) -> Arc<Metrics> {
        let mut registry = Registry::with_prefix_and_labels(
            "outboxd",
            [
                ("pipeline".into(), pipeline.to_string().into()),
                ("sink".into(), sink.to_string().into()),
            ]
            .into_iter(),
        );
        let forwarded = Family::<TopicLabel, Counter>::default();
        let timestamps_clamped = Family::<TopicLabel, Counter>::default();
        let dead_letter = Family::<ReasonLabel, Counter>::default();
        let ignored = Family::<KindLabel, Counter>::default();
        let inflight = Gauge::default();
        let ready = Gauge::default();
        let checkpoint_age = Gauge::<f64, AtomicU64>::default();
        let source_lag = Gauge::<f64, AtomicU64>::default();
        let reconnects = Counter::default();
        let delivery_errors = Counter::default();
        let snapshot_rows = Counter::default();
        let pruned_rows = Counter::default();
        let partitions_dropped = Counter::default();
        let partitions_created = Counter::default();
        let create_failures = Counter::default();
        let prune_runs = Family::<ResultLabel, Counter>::default();
        let transactions = Family::<ResultLabel, Counter>::default();
        let outbox_rows = Gauge::default();
        let leader = Gauge::default();
        // 1 ms … 10 s, fine where a healthy broker answers (single-digit to tens of milliseconds).
        let delivery_seconds = Histogram::new(
            [
                1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 15.0, 20.0, 25.0, 30.0, 40.0, 50.0,
                75.0, 100.0, 150.0, 250.0, 500.0, 1000.0, 2500.0, 10000.0,
            ]
            .map(|ms| ms / 1000.0),
        );
        // 1 ms … 60 s: a caught-up stream is milliseconds behind, a backlog seconds or more. The
        // commit times are whole milliseconds, so nothing finer can be told.
        let source_delay_seconds = Histogram::new(
            [
                1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 10000.0,
                60000.0,
            ]
            .map(|ms| ms / 1000.0),
        );
        // 50 µs … 10 s: a caught-up pipeline hands a row over in well under a millisecond; the
        // upper buckets are a full window (a slow broker) or a topic lookup.
        let handoff_seconds = Histogram::new(
            [
                0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 1000.0,
                10000.0,
            ]
            .map(|ms| ms / 1000.0),
        );
        registry.register(
            "events_forwarded",
            "Records acknowledged by the broker, per topic",
            forwarded.clone(),
        );
        registry.register(
            "timestamps_clamped",
            "Records stamped with outboxd's clock because their own timestamp was more than kafka.max_timestamp_ahead_ms ahead of it, per topic",
            timestamps_clamped.clone(),
        );
        registry.register(
            "dead_letter",
            "Rows that could not be delivered, sent to the dead-letter destination, per reason",
            dead_letter.clone(),
        );
        registry.register(
            "ignored_events",
            "UPDATE/DELETE row events on outbox tables, ignored by design",
            ignored.clone(),
        );
        registry.register(
            "inflight_events",
            "Records produced and not yet acknowledged",
            inflight.clone(),
        );
        registry.register(
            "ready",
            "1 while the source said something within three heartbeat intervals (what /readyz judges a forwarding instance by), else 0; always 0 on a standby, whose /readyz answers 200",
            ready.clone(),
        );
        registry.register(
            "checkpoint_age_seconds",
            "Seconds since the durable checkpoint last caught up with the acknowledgements",
            checkpoint_age.clone(),
        );
        registry.register(
            "source_lag_seconds",
            "Now minus the commit time of the last forwarded transaction (0 after a heartbeat)",
            source_lag.clone(),
        );
        registry.register(
            "source_reconnects",
            "Sessions ended by a transient error and reconnected",
            reconnects.clone(),
        );
        registry.register(
            "delivery_errors",
            "Records the broker failed to acknowledge (refused, or not acknowledged in time)",
            delivery_errors.clone(),
        );
        registry.register(
            "delivery_seconds",
            "Time from handing a record to the sink's client to the broker's acknowledgement (batching, network, broker)",
            delivery_seconds.clone(),
        );
        registry.register(
            "handoff_seconds",
            "Time from the source reading a row to handing its record to the sink's client (routing, topic lookups, waiting for room in the in-flight window): outboxd's own share of commit-to-consume latency",
            handoff_seconds.clone(),
        );
        registry.register(
            "source_delay_seconds",
            "Time from a row's commit (the log's commit time) to outboxd reading it: the database's and the network's share of commit-to-consume latency, and any wait for outboxd to read (Postgres only: MariaDB's binlog commit times are whole seconds)",
            source_delay_seconds.clone(),
        );
        registry.register(
            "snapshot_rows",
            "Rows read from the outbox tables by a snapshot (sent like log rows, acknowledged or not)",
            snapshot_rows.clone(),
        );
        registry.register(
            "prune_rows",
            "Forwarded rows deleted from the outbox tables by prune",
            pruned_rows.clone(),
        );
        registry.register(
            "prune_partitions_dropped",
            "Outbox table partitions dropped by prune (mode drop_partitions)",
            partitions_dropped.clone(),
        );
        registry.register(
            "prune_partitions_created",
            "Outbox table partitions created ahead by prune (prune.partitions_ahead)",
            partitions_created.clone(),
        );
        registry.register(
            "prune_create_failures",
            "Prune rounds that could not create the partitions ahead (the log says why; alert on it: inserts fail once the last partition is passed)",
            create_failures.clone(),
        );
        registry.register(
            "prune_runs",
            "Prune rounds by result: pruned, waiting (the checkpoint had not reached the sampled log end; nothing deleted), failed",
            prune_runs.clone(),
        );
        registry.register(
            "transactions",
            "Exactly-once transactions (Kafka with kafka.exactly_once, Redis MULTI/EXEC with checkpoint.store = redis) by result: committed (records and checkpoint visible together), aborted (taken back; sent again from the last committed checkpoint)",
            transactions.clone(),
        );
        registry.register(
            "outbox_rows",
            "The database's estimate of the rows in the outbox tables, read by each prune round",
            outbox_rows.clone(),
        );
        registry.register(
            "leader",
            "1 while this instance forwards the pipeline; 0 while it stands by (checkpoint.store = \"kafka\" with several instances) or has not started",
            leader.clone(),
        );
        Arc::new(Metrics {
            registry,
            forwarded,
            timestamps_clamped,
            dead_letter,
            ignored,
            inflight,
            ready,
            checkpoint_age,
            source_lag,
            reconnects,
            delivery_errors,
            delivery_seconds,
            handoff_seconds,
            source_delay_seconds,
            snapshot_rows,
            pruned_rows,
            partitions_dropped,
            partitions_created,
            create_failures,
            prune_runs,
            transactions,
            outbox_rows,
            leader,
            role: std::sync::atomic::AtomicU8::new(Role::Single as u8),
            base: Instant::now(),
            last_source_event: AtomicI64::new(NEVER),
            last_checkpoint_current: AtomicI64::new(NEVER),
            source_time_ms: AtomicI64::new(NEVER),
            stale_after: heartbeat * 3,
            forwarded_total: AtomicU64::new(0),
        })
    }

    fn now_ms(&self) -> i64 {
        self.base.elapsed().as_millis() as i64
    }

    /// Records acknowledged since start, all topics.
    pub fn forwarded_total(&self) -> u64 {
        self.forwarded_total.load(Ordering::Relaxed)
    }

    pub fn forwarded(&self, topic: &str) {
        self.forwarded_n(topic, 1);
    }

    /// `count` more records acknowledged on `topic`.
    pub fn forwarded_n(&self, topic: &str, count: u64) {
        self.forwarded_total.fetch_add(count, Ordering::Relaxed);
        self.forwarded
            .get_or_create(&TopicLabel {
                topic: topic.to_string(),
            })
            .inc_by(count);
    }

    /// A record on `topic` went out stamped with outboxd's clock instead of its own (future) time.
    pub fn timestamp_clamped(&self, topic: &str) {
        self.timestamps_clamped
            .get_or_create(&TopicLabel {
                topic: topic.to_string(),
            })
            .inc();
    }

    pub fn dead_letter(&self, reason: &str) {
        self.dead_letter
            .get_or_create(&ReasonLabel {
                reason: reason.to_string(),
            })
            .inc();
    }

    pub fn ignored(&self, kind: &str, count: u64) {
        if count > 0 {
            self.ignored
                .get_or_create(&KindLabel {
                    kind: kind.to_string(),
                })
                .inc_by(count);
        }
    }

    pub fn produced(&self) {
        self.inflight.inc();
    }

    pub fn acknowledged(&self) {
        self.inflight.dec();
    }

    /// A session ended with records still in flight: they will never be acknowledged.
    pub fn abandon_inflight(&self) {
        self.inflight.set(0);
    }

    /// A record was acknowledged `after` it was handed to the producer.
    pub fn delivered_after(&self, after: Duration) {
        self.delivery_seconds.observe(after.as_secs_f64());
    }

    /// A row read `after` ago was handed to the sink's client.
    pub fn handed_off_after(&self, after: Duration) {
        self.handoff_seconds.observe(after.as_secs_f64());
    }

    /// A row was read `delay_ms` after its commit (by the log's commit time and this host's
    /// clock; a database clock ahead of this one counts as no delay).
    pub fn read_after_commit(&self, delay_ms: i64) {
        self.source_delay_seconds
            .observe(delay_ms.max(0) as f64 / 1000.0);
    }

    pub fn delivery_error(&self) {
        self.delivery_errors.inc();
    }

    pub fn reconnect(&self) {
        self.reconnects.inc();
    }

    /// A snapshot read `rows` rows (the read also counts as the source being alive).
    pub fn snapshot_rows(&self, rows: u64) {
        self.snapshot_rows.inc_by(rows);
        self.source_event();
    }

    /// A Kafka transaction ended: `result` is committed or aborted.
    pub fn transaction(&self, result: &str) {
        self.transactions
            .get_or_create(&ResultLabel {
                result: result.to_string(),
            })
            .inc();
    }

    /// `[prune]` runs: every result's series exists (at 0) before the first round ends.
    pub fn prune_runs_declared(&self) {
        for result in ["pruned", "waiting", "failed"] {
            drop(self.prune_runs.get_or_create(&ResultLabel {
                result: result.to_string(),
            }));
        }
    }

    /// A prune round ended: `result` is pruned, waiting or failed.
    pub fn prune_run(&self, result: &str) {
        self.prune_runs
            .get_or_create(&ResultLabel {
                result: result.to_string(),
            })
            .inc();
    }

    /// Prune deleted `rows`, dropped `dropped` and created `created` partitions (counted as they
    /// happen, so a round that fails later still counts what it did).
    pub fn pruned(&self, rows: u64, dropped: u64, created: u64) {
        self.pruned_rows.inc_by(rows);
        self.partitions_dropped.inc_by(dropped);
        self.partitions_created.inc_by(created);
    }

    /// A round could not create the partitions ahead.
    pub fn prune_create_failed(&self) {
        self.create_failures.inc();
    }

    /// The database's estimate of the rows in the outbox tables.
    pub fn outbox_rows(&self, rows: u64) {
        self.outbox_rows.set(rows.min(i64::MAX as u64) as i64);
    }

    /// The source read an event (any event, heartbeats included).
    pub fn source_event(&self) {
        self.last_source_event
            .store(self.now_ms(), Ordering::Relaxed);
    }

    /// A boundary was forwarded; `committed_at` is its commit time (None for a heartbeat: caught up).
    pub fn source_time(&self, committed_at: Option<SystemTime>) {
        let at = committed_at.unwrap_or_else(SystemTime::now);
        let ms = at
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_millis() as i64;
        self.source_time_ms.store(ms, Ordering::Relaxed);
    }

    /// The durable checkpoint is as new as the acknowledgements allow.
    pub fn checkpoint_current(&self) {
        self.last_checkpoint_current
            .store(self.now_ms(), Ordering::Relaxed);
    }

    /// Seconds from the commit of the last transaction read (its records may still be in flight) to
    /// now (0 after a heartbeat); None before the first.
    pub fn source_lag_seconds(&self) -> Option<f64> {
        let source_ms = self.source_time_ms.load(Ordering::Relaxed);
        (source_ms != NEVER).then(|| {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_millis() as i64;
            (now - source_ms).max(0) as f64 / 1000.0
        })
    }

    /// Records produced and not yet acknowledged.
    pub fn inflight_now(&self) -> i64 {
        self.inflight.get()
    }

    /// This instance forwards (`true`) or stands by for another instance of the pipeline.
    pub fn set_leader(&self, leads: bool) {
        self.leader.set(i64::from(leads));
        let role = if leads { Role::Leader } else { Role::Standby };
        self.role.store(role as u8, Ordering::Relaxed);
    }

    /// The only instance (file checkpoint): forwarding.
    pub fn set_single(&self) {
        self.leader.set(1);
        self.role.store(Role::Single as u8, Ordering::Relaxed);
    }

    pub fn role(&self) -> Role {
        match self.role.load(Ordering::Relaxed) {
            x if x == Role::Leader as u8 => Role::Leader,
            x if x == Role::Standby as u8 => Role::Standby,
            _ => Role::Single,
        }
    }

    /// Ready when the source said something within three heartbeat intervals.
    pub fn ready(&self) -> bool {
        let last = self.last_source_event.load(Ordering::Relaxed);
        last != NEVER && self.now_ms() - last <= self.stale_after.as_millis() as i64
    }

    /// The Prometheus text exposition, with the time-derived gauges brought up to date.
    pub fn render(&self) -> String {
        let now = self.now_ms();
        let checkpoint = self.last_checkpoint_current.load(Ordering::Relaxed);
        if checkpoint != NEVER {
            self.checkpoint_age.set((now - checkpoint) as f64 / 1000.0);
        }
        let source_ms = self.source_time_ms.load(Ordering::Relaxed);
        if source_ms != NEVER {
            let wall = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_millis() as i64;
            self.source_lag
                .set(((wall - source_ms).max(0)) as f64 / 1000.0);
        }
        self.ready.set(i64::from(self.ready()));
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }
}

/// What an instance does for its pipeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The only instance (the checkpoint is a file, locked by this process).
    Single = 0,
    /// Several instances share a Kafka checkpoint: this one forwards.
    Leader = 1,
    /// Several instances share a Kafka checkpoint: another one forwards, this one waits to take over.
    Standby = 2,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_and_gauges_render_with_the_pipeline_label() {
        let m = Metrics::new("orders", "kafka", Duration::from_secs(5));
        m.forwarded("outbox.event.order");
        m.forwarded("outbox.event.order");
        m.dead_letter("invalid_topic");
        m.ignored("update", 3);
        m.produced();
        m.reconnect();
        let text = m.render();
        assert!(
            text.contains(
                r#"outboxd_events_forwarded_total{pipeline="orders",sink="kafka",topic="outbox.event.order"} 2"#
            ),
            "{text}"
        );
        assert!(text.contains(
            r#"outboxd_dead_letter_total{pipeline="orders",sink="kafka",reason="invalid_topic"} 1"#
        ));
        assert!(text.contains(
            r#"outboxd_ignored_events_total{pipeline="orders",sink="kafka",kind="update"} 3"#
        ));
        assert!(text.contains(r#"outboxd_inflight_events{pipeline="orders",sink="kafka"} 1"#));
        assert!(
            text.contains(r#"outboxd_source_reconnects_total{pipeline="orders",sink="kafka"} 1"#)
        );
    }

    #[test]
    fn readiness_needs_a_recent_source_event() {
        let m = Metrics::new("x", "kafka", Duration::from_millis(1));
        assert!(!m.ready(), "not ready before the source said anything");
        assert!(m
            .render()
            .contains(r#"outboxd_ready{pipeline="x",sink="kafka"} 0"#));
        m.source_event();
        assert!(m.ready());
        std::thread::sleep(Duration::from_millis(10));
        assert!(!m.ready(), "stale after 3 heartbeats");
        let m = Metrics::new("x", "kafka", Duration::from_secs(60));
        m.source_event();
        assert!(m
            .render()
            .contains(r#"outboxd_ready{pipeline="x",sink="kafka"} 1"#));
    }
}
