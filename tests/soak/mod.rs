//! The soak: a steady keyed load into the outbox, outboxd forwarding it to Apache Kafka (or Redis
//! Streams, NATS JetStream or RabbitMQ: `sink`), and a nemesis that breaks one thing after another on a schedule drawn from a
//! seed (`plan`): kill -9 and SIGSTOP of outboxd, a standby's leader killed, the broker killed or
//! frozen, the database restarted, the MariaDB replica outboxd reads stopped, the network between outboxd and every server cut, lossy or slow (a namespace of the
//! test's own: `rig::netns`), the checkpoint's disk full. Every fault heals before the next; at the
//! end outboxd catches up and an independent checker (`checker`) compares the database's table
//! with everything the topic holds.
//!
//! CI runs three 3-minute schedules with fixed seeds (the tests below); `scripts/soak.sh` runs any
//! length, seed and combination, and writes `report.json` and `timeline.png` to the folder it
//! names. RELIABILITY.md "Fault schedule" says how to read them and replay a seed.

mod checker;
mod load;
mod operator;
mod plan;
mod report;
mod sink;
mod tail;
mod world;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sink::Sink;
use world::{Source, World};

pub struct Options {
    pub minutes: f64,
    pub seed: u64,
    pub source: Source,
    pub sink: Sink,
    pub exactly_once: bool,
    pub out: PathBuf,
    /// Only these kinds of fault (empty: every kind the world can take).
    pub only: Vec<plan::Kind>,
}

/// Producers writing at once; each owns eight keys.
const PRODUCERS: u64 = 3;

/// Sets its flag when dropped.
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

fn mariadb_insert(id: &str, key: &str, payload: &str) -> String {
    format!(
        "INSERT INTO app.outbox (id, aggregatetype, aggregateid, type, payload) \
         VALUES (UNHEX('{id}'), 'soak', '{key}', 'Created', '{payload}');"
    )
}

fn postgres_insert(id: &str, key: &str, payload: &str) -> String {
    format!(
        "INSERT INTO public.outbox (id, aggregatetype, aggregateid, type, payload) \
         VALUES ('{id}', 'soak', '{key}', 'Created', '{payload}');"
    )
}

static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// One run: setup, load and faults for `minutes`, catch-up, check, report. Panics (after writing
/// the report) when the checker finds a loss, a phantom, an order violation, or in exactly-once
/// mode a duplicate.
pub fn run(options: &Options) {
    // One schedule at a time: each is meant to be the only chaos on the machine (its freezes and
    // restarts are timed against the servers' own timeouts), and two at once on two cores stretch
    // a broker's 8 s freeze past its 9 s session. The other test thread runs other tests meanwhile.
    let _alone = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut world = World::setup(options.source, options.sink, options.exactly_once);
    world.start();
    let tail = match &world.sink {
        sink::SinkServer::Kafka(broker) => tail::Tail::kafka(
            &broker.bootstrap(),
            sink::TOPIC,
            sink::PARTITIONS,
            options.exactly_once,
        ),
        sink::SinkServer::Redis(redis) => tail::Tail::redis(redis, sink::TOPIC),
        sink::SinkServer::Nats(nats) => tail::Tail::nats(&nats.url(), sink::STREAM),
        sink::SinkServer::RabbitMq(rabbit) => tail::Tail::rabbitmq(&rabbit.url(), sink::STREAM),
    };
    let stop = Arc::new(AtomicBool::new(false));
    // Stops the load after a panic too (the test binary goes on with other tests).
    let _stop_the_load = StopOnDrop(stop.clone());
    let insert = match options.source {
        Source::Mysqld => mariadb_insert,
        Source::Postgres => postgres_insert,
    };
    let producers = load::start(PRODUCERS, options.seed, world.exec(), insert, stop.clone());
    let started = Instant::now();
    let length = Duration::from_secs_f64(options.minutes * 60.0);
    let kinds: Vec<plan::Kind> = world::kinds(options.source, options.sink, options.exactly_once)
        .into_iter()
        .filter(|k| options.only.is_empty() || options.only.contains(k))
        .collect();
    let mut schedule = plan::Schedule::new(options.seed, &kinds);
    let mut faults = Vec::new();
    loop {
        let step = schedule.next_step();
        world.idle(step.gap);
        if started.elapsed() >= length {
            break;
        }
        let fault = world.inject(&step);
        println!(
            "soak: {:>6.1} s  {} ({})",
            (fault.started - started).as_secs_f64(),
            fault.kind.name(),
            fault.detail
        );
        faults.push(fault);
    }
    stop.store(true, Ordering::Relaxed);
    let logs: Vec<load::Log> = producers.into_iter().map(|p| p.join().unwrap()).collect();
    let committed = world.committed_ids();
    let caught_up = world.idle_until(Duration::from_secs(300), || tail.has_all(&committed));
    let caught_up_after = started.elapsed().saturating_sub(length);
    world.stop();
    let seen = tail.finish();
    let verdict = checker::check(&checker::Inputs {
        committed: &committed,
        logs: &logs,
        seen: &seen,
        faults: &faults,
        exits: &world.exits,
        started,
        exactly_once: options.exactly_once,
    });
    let mut json = verdict.json;
    let header = serde_json::json!({
        "seed": options.seed,
        "minutes": options.minutes,
        "source": format!("{:?}", options.source),
        "sink": options.sink.name(),
        "mode": if options.exactly_once { "exactly-once" } else { "at-least-once" },
        "caught_up": caught_up,
        "catch_up_s": caught_up_after.as_secs(),
        "outboxd_starts": world.starts,
        "peak_rss_mib": world.peak_rss_kib / 1024,
        // Hanging Kafka transactions outboxd named, find-hanging listed and the operator aborted
        // (outboxd's remedy); named but never listed (so left alone).
        "hanging_transactions_unconfirmed": world.operator.unconfirmed,
        "hanging_transactions_aborted": world
            .operator
            .aborted
            .iter()
            .map(|a| serde_json::json!({
                "offset": a.offset,
                "at_s": a.at.saturating_duration_since(started).as_secs(),
            }))
            .collect::<Vec<_>>(),
    });
    json.as_object_mut()
        .unwrap()
        .extend(header.as_object().unwrap().clone());
    world.save_logs(&options.out.join("logs"));
    report::write(
        &options.out,
        &json,
        &verdict.timeline,
        &report::bands(&faults, started),
    );
    println!(
        "soak: seed {} {:?} → {} {}: {} faults, {} rows committed, {} delivered, {} lost, {} duplicates \
         ({} unexplained, {} replayed by a rewind), {} order violations; peak RSS {} MiB; report in {}",
        options.seed,
        options.source,
        options.sink.name(),
        if options.exactly_once { "exactly-once" } else { "at-least-once" },
        faults.len(),
        json["rows_committed"],
        json["rows_delivered"],
        json["lost"],
        json["duplicates"],
        json["duplicates_unexplained"],
        json["duplicates_replayed_by_rewind"],
        json["order_violations"],
        json["peak_rss_mib"],
        options.out.display()
    );
    assert!(
        verdict.failures.is_empty(),
        "soak seed {} failed: {:?}\nreport: {}\n{}\n--- the brokers' transactions ---\n{}\n{}",
        options.seed,
        verdict.failures,
        options.out.join("report.json").display(),
        world.log_tails(),
        std::fs::read_to_string(options.out.join("logs/kafka-transactions.txt"))
            .unwrap_or_default(),
        report::broker_events(&options.out.join("logs"))
    );
}

/// The CI schedules' seeds (see the test that checks what they draw).
const CI_MARIADB_SEED: u64 = 20261660;
const CI_POSTGRES_SEED: u64 = 20261773;

fn out_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("target/soak")
        .join(name)
}

#[test]
fn mariadb_to_kafka_at_least_once_loses_nothing_under_a_three_minute_fault_schedule() {
    run(&Options {
        minutes: 3.0,
        seed: CI_MARIADB_SEED,
        source: Source::Mysqld,
        sink: Sink::Kafka,
        exactly_once: false,
        out: out_dir("ci-mariadb"),
        only: Vec::new(),
    });
}

/// The same schedule (seed and kinds of fault) against NATS JetStream: its ack path (one chain of
/// expected last ids per stream, resends answered as duplicates) under kills, freezes and lost
/// packets.
#[test]
fn mariadb_to_nats_loses_nothing_and_keeps_key_order_under_a_three_minute_fault_schedule() {
    run(&Options {
        minutes: 3.0,
        seed: CI_MARIADB_SEED,
        source: Source::Mysqld,
        sink: Sink::Nats,
        exactly_once: false,
        out: out_dir("ci-mariadb-nats"),
        only: Vec::new(),
    });
}

/// The same schedule against RabbitMQ: publisher confirms, a nack or a lost connection mid-window,
/// resends after every restart (RabbitMQ drops no repeat: duplicates are expected, loss and
/// disorder are not).
#[test]
#[ignore = "a RabbitMQ node once took over 90 s to take logins after its kill -9 (a 30-minute run \
            beside another, 614 s in): not in CI until that is understood; scripts/soak.sh \
            --sink rabbitmq runs it"]
fn mariadb_to_rabbitmq_loses_nothing_and_keeps_key_order_under_a_three_minute_fault_schedule() {
    run(&Options {
        minutes: 3.0,
        seed: CI_MARIADB_SEED,
        source: Source::Mysqld,
        sink: Sink::RabbitMq,
        exactly_once: false,
        out: out_dir("ci-mariadb-rabbitmq"),
        only: Vec::new(),
    });
}

#[test]
fn postgres_to_kafka_exactly_once_loses_and_repeats_nothing_under_a_three_minute_fault_schedule() {
    run(&Options {
        minutes: 3.0,
        seed: CI_POSTGRES_SEED,
        source: Source::Postgres,
        sink: Sink::Kafka,
        exactly_once: true,
        out: out_dir("ci-postgres-eos"),
        only: Vec::new(),
    });
}

/// A 3-minute run injects 15–20 faults; its seed must reach every kind its world takes well
/// before the end (quiet and holds only: a fault's own recovery comes on top). Found by trying the
/// seeds from 20261100 on.
#[test]
fn the_ci_seeds_draw_every_kind_of_fault_their_world_takes_within_two_minutes() {
    for (source, sink, exactly_once, seed) in [
        (Source::Mysqld, Sink::Kafka, false, CI_MARIADB_SEED),
        (Source::Mysqld, Sink::Nats, false, CI_MARIADB_SEED),
        (Source::Mysqld, Sink::RabbitMq, false, CI_MARIADB_SEED),
        (Source::Postgres, Sink::Kafka, true, CI_POSTGRES_SEED),
    ] {
        let after = plan::all_drawn_after(seed, &world::kinds(source, sink, exactly_once));
        assert!(
            after <= Duration::from_secs(120),
            "seed {seed} ({source:?} to {sink:?}) draws its last kind of fault only after {after:?}"
        );
    }
}

/// `scripts/soak.sh` runs this with its options in the environment.
#[test]
#[ignore = "run by scripts/soak.sh"]
fn from_the_command_line() {
    let var = |name: &str| std::env::var(format!("OUTBOXD_SOAK_{name}")).ok();
    let source = match var("SOURCE").as_deref() {
        None | Some("mariadb") => Source::Mysqld,
        Some("postgres") => Source::Postgres,
        Some(other) => panic!("--source {other}: use mariadb or postgres"),
    };
    let sink = match var("SINK").as_deref() {
        None | Some("kafka") => Sink::Kafka,
        Some("redis") => Sink::Redis,
        Some("nats") => Sink::Nats,
        Some("rabbitmq") => Sink::RabbitMq,
        Some(other) => {
            panic!("--sink {other}: the soak drives Apache Kafka, Redis, NATS and RabbitMQ so far (README \"Not yet\")")
        }
    };
    let minutes: f64 = var("MINUTES").map_or(3.0, |m| m.parse().expect("--minutes: a number"));
    let seed: u64 = var("SEED").map_or(1, |s| s.parse().expect("--seed: an integer"));
    let exactly_once = var("EXACTLY_ONCE").is_some_and(|v| v == "1");
    let out = var("OUT").map(PathBuf::from).unwrap_or_else(|| {
        out_dir(&format!(
            "{}-{}-{}-{seed}",
            var("SOURCE").unwrap_or("mariadb".into()),
            var("SINK").unwrap_or("kafka".into()),
            if exactly_once { "eos" } else { "alo" }
        ))
    });
    let only = var("FAULTS")
        .unwrap_or_default()
        .split(',')
        .filter(|f| !f.is_empty())
        .map(|f| {
            *plan::Kind::ALL
                .iter()
                .find(|k| k.flag() == f)
                .unwrap_or_else(|| panic!("--faults {f}: not a fault this soak knows"))
        })
        .collect();
    run(&Options {
        minutes,
        seed,
        source,
        sink,
        exactly_once,
        out,
        only,
    });
}
