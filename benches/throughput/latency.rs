//! `--only latency`: commit→consume latency at fixed offered rates of 1-row transactions, split
//! into the hops a record takes, against a running outboxd that has caught up.
//!
//! ## How each number is taken
//! - **The commit stamp** is the database's own clock as it executes the INSERT (`SYSDATE(6)` on
//!   MariaDB, `clock_timestamp()` on Postgres), written into the payload. Earlier versions stamped
//!   rows in the loader when it built a tick's script, so a row waited for the rows before it in
//!   that script to commit, and that wait was counted as outboxd's.
//! - **commit → consume** (p50, p99, max): a consumer's receive time minus the stamp, per record.
//! - **commit → append**: the broker's append time minus the stamp, per record. The latency topics
//!   are created with `message.timestamp.type=LogAppendTime`, so the broker overwrites outboxd's
//!   record timestamp (the source commit time) with its own clock (milliseconds). This hop holds the
//!   database shipping the change, outboxd, librdkafka's batching and the produce request.
//! - **commit → read** (Postgres only): the p99 of `outboxd_source_delay_seconds` (the commit
//!   time pgoutput gives, in microseconds, → outboxd reading the row): the database, the socket,
//!   and any wait for outboxd to read. MariaDB's binlog commit times are whole seconds.
//! - **outboxd's share**: the p99 of `outboxd_handoff_seconds` (a row read off the log → its record
//!   handed to librdkafka), a histogram bucket bound read from `/metrics` before and after.
//! - **handoff → ack**: the p99 of `outboxd_delivery_seconds` (librdkafka's `linger.ms`, the
//!   produce round trip and the broker), also a bucket bound.
//! - **append → consume**: receive time minus append time, per record (the consumer's fetch).
//!
//! A run whose records carry no append time, whose commit→append is negative (beyond the
//! millisecond the broker's clock rounds down), or whose outboxd exported no handoff samples is
//! refused: those numbers would be wrong, not slow.
//!
//! The series runs at each rate with outboxd's defaults and again with the low-latency settings
//! README recommends ([`LOW_LATENCY`]), in the same run.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use mysql_async::prelude::Queryable;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Message, Timestamp};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

use super::rig::scenario::uuid_of;
use super::rig::{self, create_topic_with, wait_until, Broker, Outboxd};
use super::{tree_cpu_seconds, KEYS};

/// The offered rates (events/s, 1-row transactions).
pub const RATES: [u64; 3] = [1_000, 5_000, 20_000];

/// The `[kafka]` lines of the low-latency settings README recommends: librdkafka sends a record
/// as soon as it has it instead of lingering up to 5 ms for more.
pub const LOW_LATENCY: &str = "[kafka.properties]\n\"linger.ms\" = \"0\"\n";

/// The settings a series ran with: a label and the extra `[kafka]` lines.
#[derive(Clone, Copy)]
pub struct Settings {
    pub label: &'static str,
    pub kafka: &'static str,
}

/// outboxd's defaults, then [`LOW_LATENCY`].
pub const SETTINGS: [Settings; 2] = [
    Settings {
        label: "defaults",
        kafka: "",
    },
    Settings {
        label: "linger.ms = 0",
        kafka: LOW_LATENCY,
    },
];

/// Creates a latency topic: six partitions, stamped by the broker on append.
pub fn create_topic(bootstrap: &str, topic: &str) {
    create_topic_with(
        bootstrap,
        topic,
        6,
        &[("message.timestamp.type", "LogAppendTime")],
    );
}

/// The MariaDB root URL for the latency loader (set once in main).
pub static ROOT_URL: std::sync::Mutex<String> = std::sync::Mutex::new(String::new());

/// Latency at one offered rate (milliseconds).
pub struct Latency {
    pub rate: u64,
    pub settings: &'static str,
    /// The rate the loader actually managed (below `rate` when the database could not keep up).
    pub achieved: f64,
    pub count: usize,
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
    /// p99 of commit → the broker's append time.
    pub to_append_p99: f64,
    /// p99 of the broker's append time → the consumer's receive time.
    pub append_to_consume_p99: f64,
    /// p99 bucket bound of `outboxd_source_delay_seconds` (commit → read by outboxd; Postgres
    /// only, NaN on MariaDB).
    pub source_delay_p99: f64,
    /// p99 bucket bound of `outboxd_handoff_seconds`: outboxd's own share.
    pub handoff_p99: f64,
    /// p99 bucket bound of `outboxd_delivery_seconds`: librdkafka's batching plus the broker.
    pub ack_p99: f64,
    /// Cores busy meanwhile: the database (including the loader's inserts), broker, outboxd.
    pub cores: [f64; 3],
}

/// Where the series run: the database (`pg_url` None: MariaDB at [`ROOT_URL`]) and its pid (for
/// its CPU), the broker and topic outboxd writes to, and outboxd's `/metrics` port.
pub struct Target<'a> {
    pub pg_url: Option<&'a str>,
    pub db_pid: i32,
    pub broker: &'a Broker,
    pub topic: &'static str,
    pub http_port: u16,
}

/// Latency at each of [`RATES`], once per [`SETTINGS`] at each rate (interleaved: a broker or
/// database that warms up or fills does not favour one setting). Before each measurement outboxd
/// is started with `config(settings.kafka)` and waited for until `caught_up` and `/readyz` say
/// so; after it, stopped. A first, unrecorded run at 5k events/s warms the broker's JIT up.
/// `first` is the sequence number of the first row to insert; returns the rows and the next one.
#[allow(clippy::too_many_arguments)]
pub fn each_setting(
    rt: &tokio::runtime::Runtime,
    target: &Target<'_>,
    outboxd: &mut Outboxd,
    config: impl Fn(&str) -> String,
    mut caught_up: impl FnMut(&Outboxd) -> bool,
    quick: bool,
    mut first: u64,
) -> (Vec<Latency>, u64) {
    let seconds = if quick { 5 } else { 20 };
    let mut rows = Vec::new();
    let warm_up = std::iter::once((5_000, SETTINGS[0], 3));
    // A B, then B A at the next rate: neither setting always goes first.
    let runs = RATES.iter().enumerate().flat_map(|(r, &rate)| {
        let mut order = SETTINGS;
        if r % 2 == 1 {
            order.reverse();
        }
        order.map(|settings| (rate, settings, seconds))
    });
    for (i, (rate, settings, seconds)) in warm_up.chain(runs).enumerate() {
        outboxd.rewrite_config(&config(settings.kafka));
        outboxd.start();
        wait_until("outboxd to catch up", Duration::from_secs(600), || {
            caught_up(outboxd) && rig::http_get(target.http_port, "/readyz").0 == 200
        });
        let pid = outboxd.pid().as_raw();
        let latency = at_rate(
            rt,
            target,
            pid,
            Some(target.http_port),
            settings,
            rate,
            seconds,
            first,
        );
        outboxd.stop();
        first += rate * seconds;
        if i > 0 {
            rows.push(latency);
        }
    }
    (rows, first)
}

/// The histograms outboxd exports per hop, scraped from `/metrics` before and after a rate.
const HISTOGRAMS: [&str; 3] = [
    "outboxd_source_delay_seconds",
    "outboxd_handoff_seconds",
    "outboxd_delivery_seconds",
];

/// Latency at `rate` for `seconds` with `settings`; the forwarder (outboxd or a peer, process
/// `forwarder_pid`) already runs with them. With `metrics` (outboxd's `/metrics` port) the
/// per-hop histograms are read too, and a run without handoff samples is refused; without (a
/// peer), those columns are NaN. `first` is the sequence number of the first row to insert.
#[allow(clippy::too_many_arguments)]
pub fn at_rate(
    rt: &tokio::runtime::Runtime,
    target: &Target<'_>,
    forwarder_pid: i32,
    metrics: Option<u16>,
    settings: Settings,
    rate: u64,
    seconds: u64,
    first: u64,
) -> Latency {
    let pids = [target.db_pid, target.broker.pid(), forwarder_pid];
    let cpu = || pids.map(tree_cpu_seconds);
    let scrape = || metrics.map(|port| HISTOGRAMS.map(|name| buckets(port, name)));
    let probe = consumer(target.broker, target.topic, 0);
    let held_before = held(&probe, target.topic);
    let (before, start) = (cpu(), Instant::now());
    let mut scraped = None;
    let mariadb_url = ROOT_URL.lock().unwrap().clone();
    let measured = rt.block_on(async {
        let loader = match target.pg_url {
            Some(url) => Loader::postgres(url).await,
            None => Loader::mariadb_url(&mariadb_url).await,
        };
        measure(loader, target, rate, seconds, first, || scraped = scrape()).await
    });
    let wall = start.elapsed().as_secs_f64();
    let after = cpu();
    assert!(
        !measured.total.is_empty(),
        "no stamped record came back at {rate} events/s"
    );
    // Every row of this run delivered before the next run starts (or the forwarder stops): a
    // backlog left behind would be measured by the next run.
    let total = rate * seconds;
    wait_until(
        "the forwarder to deliver every row of the run",
        Duration::from_secs(600),
        || held(&probe, target.topic) >= held_before + total,
    );
    let [source_delay, handoff, ack] = match (scraped, scrape()) {
        (Some(before), Some(after)) => {
            let [delay, handoff, ack] = [0, 1, 2].map(|i| bucket_p99(&before[i], &after[i]));
            assert!(
                handoff.1 > 0.0,
                "outboxd exported no outboxd_handoff_seconds samples at {rate} events/s: its own share cannot be told"
            );
            [delay.0, handoff.0, ack.0]
        }
        _ => [f64::NAN; 3],
    };
    Latency {
        rate,
        settings: settings.label,
        achieved: measured.achieved,
        count: measured.total.len(),
        p50: percentile(&measured.total, 0.5),
        p99: percentile(&measured.total, 0.99),
        max: measured.total.last().copied().unwrap_or(f64::NAN),
        to_append_p99: percentile(&measured.to_append, 0.99),
        append_to_consume_p99: percentile(&measured.to_consume, 0.99),
        source_delay_p99: source_delay,
        handoff_p99: handoff,
        ack_p99: ack,
        cores: [0, 1, 2].map(|i| (after[i] - before[i]) / wall),
    }
}

/// Records `topic` holds (the sum of its partitions' high watermarks).
fn held(probe: &BaseConsumer, topic: &str) -> u64 {
    (0..6)
        .map(|p| {
            probe
                .fetch_watermarks(topic, p, Duration::from_secs(10))
                .unwrap()
                .1 as u64
        })
        .sum()
}

/// What one rate measured: sorted milliseconds per hop, and the rate the loader achieved.
struct Measured {
    total: Vec<f64>,
    to_append: Vec<f64>,
    to_consume: Vec<f64>,
    achieved: f64,
}

/// Inserts `rate` rows a second for `seconds` (a tick every 10 ms) while a consumer reads them
/// back; the first second is a warm-up and not measured.
/// `at_warm` runs once the warm-up second has passed (the histograms are scraped then, so that
/// they cover the same records as the end-to-end numbers).
async fn measure(
    mut loader: Loader,
    target: &Target<'_>,
    rate: u64,
    seconds: u64,
    first: u64,
    mut at_warm: impl FnMut(),
) -> Measured {
    assert!(
        rate.is_multiple_of(100),
        "a rate is inserted 1/100 each 10 ms tick"
    );
    let total = rate * seconds;
    let consumer = consumer(target.broker, target.topic, rate);
    let warm_until = now_micros() + 1_000_000;
    let reader = std::thread::spawn(move || read_back(consumer, total, seconds, warm_until));
    let tick = Duration::from_millis(10);
    let per_tick = (rate / 100).max(1);
    let start = Instant::now();
    let mut n = first;
    for i in 0..(seconds * 100) {
        let due = start + tick * i as u32;
        tokio::time::sleep_until(tokio::time::Instant::from_std(due)).await;
        if i == 100 {
            at_warm();
        }
        let mut script = String::new();
        for _ in 0..per_tick {
            script.push_str(&loader.insert(n));
            n += 1;
        }
        loader.run(script).await;
    }
    let achieved = total as f64 / start.elapsed().as_secs_f64();
    let mut measured = reader.join().unwrap();
    measured.achieved = achieved;
    measured
}

/// A consumer at the end of every partition of `topic` that returns fetches as soon as a record is
/// there, so that it adds little to the latency. The ends are read before it is assigned (an
/// `Offset::End` is only resolved at the first fetch, and would skip the records appended before).
fn consumer(broker: &Broker, topic: &str, rate: u64) -> BaseConsumer {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", broker.bootstrap())
        .set("group.id", format!("bench-latency-{rate}"))
        .set("enable.auto.commit", "false")
        .set("fetch.wait.max.ms", "5")
        .set("fetch.min.bytes", "1")
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    for p in 0..6 {
        let (_, end) = consumer
            .fetch_watermarks(topic, p, Duration::from_secs(10))
            .unwrap();
        tpl.add_partition_offset(topic, p, Offset::Offset(end))
            .unwrap();
    }
    consumer.assign(&tpl).unwrap();
    consumer
}

/// Reads `total` records (or until a minute past the load), timing those stamped after
/// `warm_until`.
fn read_back(consumer: BaseConsumer, total: u64, seconds: u64, warm_until: u128) -> Measured {
    let mut m = Measured {
        total: Vec::new(),
        to_append: Vec::new(),
        to_consume: Vec::new(),
        achieved: 0.0,
    };
    let deadline = Instant::now() + Duration::from_secs(seconds + 60);
    let mut seen = 0;
    while seen < total && Instant::now() < deadline {
        let Some(Ok(record)) = consumer.poll(Duration::from_millis(100)) else {
            continue;
        };
        seen += 1;
        let received = now_micros();
        let value: serde_json::Value =
            serde_json::from_slice(record.payload().unwrap_or(b"{}")).unwrap();
        let Some(stamp) = value["t"].as_u64().map(u128::from) else {
            continue;
        };
        if stamp <= warm_until {
            continue;
        }
        let Timestamp::LogAppendTime(appended) = record.timestamp() else {
            panic!(
                "a latency record carries {:?}, not the broker's append time: was the topic created with message.timestamp.type=LogAppendTime?",
                record.timestamp()
            );
        };
        let appended = appended as f64;
        let stamp_ms = stamp as f64 / 1000.0;
        // The broker's clock is read in whole milliseconds: an append up to 1 ms "before" the
        // commit is rounding; more means the clocks or the stamps are wrong.
        assert!(
            appended - stamp_ms > -1.0,
            "record appended at {appended} ms, {:.3} ms before its commit stamp: the stamps are not comparable",
            stamp_ms - appended
        );
        m.total.push((received - stamp) as f64 / 1000.0);
        m.to_append.push((appended - stamp_ms).max(0.0));
        m.to_consume
            .push((received as f64 / 1000.0 - appended).max(0.0));
    }
    if seen < total {
        eprintln!("latency: only {seen} of {total} records came back within a minute of the load");
    }
    for v in [&mut m.total, &mut m.to_append, &mut m.to_consume] {
        v.sort_by(|a, b| a.total_cmp(b));
    }
    m
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted
        .get(((sorted.len() as f64 * p) as usize).min(sorted.len().saturating_sub(1)))
        .copied()
        .unwrap_or(f64::NAN)
}

fn now_micros() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros()
}

/// Where the loader writes its 1-row transactions.
enum Loader {
    Mariadb(mysql_async::Conn),
    Postgres(tokio_postgres::Client),
}

impl Loader {
    async fn mariadb_url(url: &str) -> Loader {
        Loader::Mariadb(mysql_async::Conn::from_url(url).await.unwrap())
    }

    async fn postgres(url: &str) -> Loader {
        let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(connection);
        Loader::Postgres(client)
    }

    /// The statements for row `n`, committed on their own, stamped by the database's clock as
    /// the INSERT runs (the payload is the benchmark's usual ~300 bytes).
    fn insert(&self, n: u64) -> String {
        let (head, tail) = stamped_payload(n);
        match self {
            Loader::Mariadb(_) => format!(
                "INSERT INTO app.outbox (id,aggregatetype,aggregateid,type,payload) VALUES (UNHEX('{n:032x}'),'order','key-{}','Created',CONCAT('{head}',CAST(UNIX_TIMESTAMP(SYSDATE(6))*1000000 AS UNSIGNED),'{tail}'));",
                n % KEYS,
            ),
            // One simple query is one transaction unless it says otherwise.
            Loader::Postgres(_) => format!(
                "BEGIN;INSERT INTO public.outbox (id,aggregatetype,aggregateid,type,payload) VALUES ('{}','pgbench','key-{}','Created',('{head}'||(extract(epoch from clock_timestamp())*1000000)::bigint||'{tail}')::jsonb);COMMIT;",
                uuid_of(n),
                n % KEYS,
            ),
        }
    }

    async fn run(&mut self, script: String) {
        match self {
            Loader::Mariadb(conn) => conn.query_drop(script).await.unwrap(),
            Loader::Postgres(client) => client.batch_execute(&script).await.unwrap(),
        }
    }
}

/// The benchmark's payload for row `n` split around its stamp: `head` ends with `"t":`.
fn stamped_payload(n: u64) -> (String, String) {
    const MARK: &str = "\"t\":0,";
    let whole = super::payload(n, 0);
    let at = whole.find(MARK).expect("the payload has a \"t\" field") + MARK.len() - 2;
    (whole[..at].to_string(), whole[at + 1..].to_string())
}

/// outboxd's histogram `name` from `/metrics`: (upper bound in ms, cumulative count) per bucket.
fn buckets(port: u16, name: &str) -> Vec<(f64, f64)> {
    let (_, body) = rig::http_get(port, "/metrics");
    let prefix = format!("{name}_bucket");
    body.lines()
        .filter(|l| l.starts_with(&prefix))
        .filter_map(|l| {
            let le = l.split("le=\"").nth(1)?.split('"').next()?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse::<f64>().ok()? * 1000.0
            };
            Some((le, l.rsplit(' ').next()?.parse().ok()?))
        })
        .collect()
}

/// The bucket bound under which 99% of the samples between two scrapes fell (NaN without
/// samples), and how many samples there were.
fn bucket_p99(before: &[(f64, f64)], after: &[(f64, f64)]) -> (f64, f64) {
    let count = |b: &[(f64, f64)], i: usize| b.get(i).map_or(0.0, |x| x.1);
    let total =
        count(after, after.len().saturating_sub(1)) - count(before, before.len().saturating_sub(1));
    let p99 = after
        .iter()
        .enumerate()
        .find(|(i, (_, n))| n - count(before, *i) >= 0.99 * total)
        .filter(|_| total > 0.0)
        .map_or(f64::NAN, |(_, (le, _))| *le);
    (p99, total)
}

/// Prints one database's table for BENCHMARKS.md.
pub fn print(source: &str, rows: &[Latency]) {
    println!("\n{source} (commit → consume, and the p99 of each hop; ms):");
    println!("\n| settings | offered rate (events/s) | achieved | records | p50 | p99 | max | p99 commit→append | p99 commit→read | p99 outboxd's share (read→handoff) | p99 handoff→ack | p99 append→consume | cores busy: database / broker / forwarder |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    for l in rows {
        let bound = |v: f64| {
            if v.is_nan() {
                "–".to_string()
            } else {
                format!("≤ {v}")
            }
        };
        println!(
            "| {} | {} | {:.0} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {} | {} | {:.1} | {:.2} / {:.2} / {:.2} |",
            l.settings,
            l.rate,
            l.achieved,
            l.count,
            l.p50,
            l.p99,
            l.max,
            l.to_append_p99,
            bound(l.source_delay_p99),
            bound(l.handoff_p99),
            bound(l.ack_p99),
            l.append_to_consume_p99,
            l.cores[0],
            l.cores[1],
            l.cores[2]
        );
    }
}

/// The rows measured with outboxd's defaults.
fn defaults(rows: &[Latency]) -> Vec<&Latency> {
    rows.iter()
        .filter(|r| r.settings == SETTINGS[0].label)
        .collect()
}

/// Latency against offered rate as a PNG (logarithmic axes): p50 and p99 commit→consume and p99
/// of outboxd's share, per database, with outboxd's defaults. Only positive, finite values are
/// drawn (a log axis has no place for the rest).
pub fn plot(path: &str, sources: &[(&str, &Vec<Latency>)]) {
    use plotters::prelude::*;
    let valid = |v: f64| v.is_finite() && v > 0.0;
    let all: Vec<&Latency> = sources
        .iter()
        .flat_map(|(_, rows)| defaults(rows))
        .collect();
    // plotters draws text with a font it is given; DejaVu Sans ships with most Linux systems.
    let font = std::fs::read("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")
        .expect("DejaVu Sans (apt-get install fonts-dejavu-core) to label the plot");
    plotters::style::register_font(
        "sans-serif",
        FontStyle::Normal,
        Box::leak(font.into_boxed_slice()),
    )
    .map_err(|_| "font")
    .unwrap();
    let root = BitMapBackend::new(path, (800, 500)).into_drawing_area();
    root.fill(&WHITE).unwrap();
    let top = all
        .iter()
        .map(|r| r.max)
        .filter(|v| valid(*v))
        .fold(1.0f64, f64::max)
        .max(25.0)
        * 1.5;
    let lowest = all
        .iter()
        .flat_map(|r| [r.p50, r.handoff_p99])
        .filter(|v| valid(*v))
        .fold(f64::INFINITY, f64::min)
        .min(1.0)
        * 0.7;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "outboxd commit → consume latency vs offered rate",
            ("sans-serif", 22),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d((500f64..40_000f64).log_scale(), (lowest..top).log_scale())
        .unwrap();
    chart
        .configure_mesh()
        .x_desc("offered rate (events/s, 1-row transactions)")
        .y_desc("latency (ms)")
        .x_labels(4)
        .y_labels(6)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y}"))
        .label_style(("sans-serif", 14))
        .draw()
        .unwrap();
    type Series = (&'static str, fn(&Latency) -> f64);
    let series: [Series; 3] = [
        ("p50", |r| r.p50),
        ("p99", |r| r.p99),
        ("p99 outboxd's share (read → handoff)", |r| r.handoff_p99),
    ];
    // One colour family per database: MariaDB blue-red-orange, Postgres green-purple-teal.
    let palettes = [
        [BLUE, RED, RGBColor(230, 140, 0)],
        [
            RGBColor(0, 150, 0),
            RGBColor(140, 0, 160),
            RGBColor(0, 160, 160),
        ],
    ];
    for ((source, rows), palette) in sources.iter().zip(palettes) {
        let rows = defaults(rows);
        if rows.is_empty() {
            continue;
        }
        for ((name, value), color) in series.iter().zip(palette) {
            let points: Vec<(f64, f64)> = rows
                .iter()
                .map(|r| (r.rate as f64, value(r)))
                .filter(|(_, v)| valid(*v))
                .collect();
            chart
                .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
                .unwrap()
                .label(format!("{source} {name}"))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
            chart
                .draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))
                .unwrap();
        }
    }
    let target = vec![(500f64, 20.0), (40_000f64, 20.0)];
    chart
        .draw_series(LineSeries::new(target, BLACK.mix(0.4)))
        .unwrap()
        .label("p99 target at 5k/s (20 ms)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK.mix(0.4)));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()
        .unwrap();
    root.present().unwrap();
}
