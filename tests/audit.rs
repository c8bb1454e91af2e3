//! `outboxd audit` on real servers (MariaDB and Postgres to Kafka, MariaDB to NATS JetStream and to
//! Redis Streams): a
//! clean pipeline audits clean;
//! rows outboxd never forwarded are missing (pending while the checkpoint is behind), a record
//! produced twice is duplicated, a reordered pair of one key is out of order; sinks without a
//! non-destructive read are refused with the reason.

use std::process::Output;
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde_json::Value as Json;

use std::collections::HashSet;

use crate::postgres_pipeline::{self as pg_rows, PgEnv};
use crate::rig::nats::{config_with_nats, Nats};
use crate::rig::redis::{config_with_redis, Redis};
use crate::rig::scenario::{self, consume_distinct_events, uuid_of};
use crate::rig::{wait_until, Broker, Consumed, Mysqld, Outboxd, Postgres};

/// The database under audit.
enum Db {
    Maria(Mysqld),
    Pg(Postgres),
}

/// Where outboxd delivers.
enum Sink {
    Kafka(Broker),
    Redis(Redis),
    Nats(Nats),
}

struct Rig {
    db: Db,
    sink: Sink,
    outboxd: Outboxd,
}

const ROUTE: &str = "[route]\ntimestamp = \"created_at\"\n";
const TOPICS: [&str; 2] = ["outbox.event.order", "outbox.event.customer"];
/// Where every rig parks what cannot be delivered.
const DEAD_LETTERS: &str = "outboxd.dlq";
const DEAD_LETTER_KEY: &str = "dead_letter_topic = \"outboxd.dlq\"";
/// Rows of this aggregate type route to a destination the sink refuses (on the sinks that can).
const ORPHAN: &str = "orphan";

impl Db {
    fn insert(&self, from: u64, to: u64, per_txn: u64) {
        match self {
            Db::Maria(db) => scenario::insert_rows(db, from, to, per_txn),
            Db::Pg(pg) => pg_rows::insert_rows(pg, from, to, per_txn),
        }
    }

    /// Row `n`, created long before any `--since` window.
    fn insert_old(&self, n: u64) {
        self.insert_at(n, "'2001-02-03 04:05:06'", "'2001-02-03 04:05:06+00'");
    }

    /// Row `n`, stamped a day from now: newer than any record a broker could have removed.
    fn insert_tomorrow(&self, n: u64) {
        self.insert_at(n, "NOW() + INTERVAL 1 DAY", "now() + interval '1 day'");
    }

    /// Row `n` with `created_at` the SQL expression `maria` or `pg`.
    fn insert_at(&self, n: u64, maria: &str, pg: &str) {
        let columns = "(id, aggregatetype, aggregateid, type, payload) VALUES (";
        let at = |when: &str| {
            format!("(created_at, id, aggregatetype, aggregateid, type, payload) VALUES ({when}, ")
        };
        match self {
            Db::Maria(db) => db.sql_socket(&scenario::insert_sql(n).replace(columns, &at(maria))),
            Db::Pg(pg_) => pg_.sql("app", &pg_rows::insert_sql(n).replace(columns, &at(pg))),
        };
    }

    /// Row `n` with aggregate type `kind` (its destination: `outbox.event.<kind>`).
    fn insert_as(&self, n: u64, kind: &str) {
        let sql = |insert: String| {
            let (_, usual, _, _) = scenario::event(n);
            insert.replacen(&format!("'{usual}'"), &format!("'{kind}'"), 1)
        };
        match self {
            Db::Maria(db) => db.sql_socket(&sql(scenario::insert_sql(n))),
            Db::Pg(pg) => pg.sql("app", &sql(pg_rows::insert_sql(n))),
        };
    }

    /// The log's end now, as `checkpoint set` takes it.
    fn log_end(&self) -> String {
        match self {
            Db::Maria(db) => format!("gtid:{}", db.sql_socket("SELECT @@gtid_binlog_pos").trim()),
            Db::Pg(pg) => pg
                .sql("app", "SELECT pg_current_wal_lsn()")
                .trim()
                .to_string(),
        }
    }
}

impl Sink {
    /// Makes the sink refuse what `outbox.event.orphan` gets, so it dead-letters a copy of the
    /// record itself; false where the router's checks leave nothing for the sink to refuse
    /// (Kafka).
    fn refuse_orphans(&self) -> bool {
        match self {
            Sink::Kafka(_) => false,
            // No stream captures the subject.
            Sink::Nats(_) => true,
            Sink::Redis(redis) => {
                let _: String = redis.cmd(
                    redis::cmd("SET")
                        .arg(format!("outbox.event.{ORPHAN}"))
                        .arg("a string"),
                );
                true
            }
        }
    }

    /// Deletes the first record of each partition or stream of the outbox topics (on Kafka, of
    /// the dead-letter topic too) as retention or trimming would.
    fn delete_first_records(&self) {
        match self {
            Sink::Kafka(broker) => {
                let client = ClientConfig::new()
                    .set("bootstrap.servers", broker.bootstrap())
                    .clone();
                let consumer: BaseConsumer = client.create().unwrap();
                let mut before = TopicPartitionList::new();
                for topic in TOPICS.into_iter().chain([DEAD_LETTERS]) {
                    for partition in 0..3 {
                        // The dead-letter topic may have fewer partitions (the broker made it).
                        let Ok((_, high)) =
                            consumer.fetch_watermarks(topic, partition, Duration::from_secs(30))
                        else {
                            continue;
                        };
                        if high > 0 {
                            before
                                .add_partition_offset(topic, partition, Offset::Offset(1))
                                .unwrap();
                        }
                    }
                }
                let admin: AdminClient<DefaultClientContext> = client.create().unwrap();
                let deleted = tokio::runtime::Runtime::new()
                    .unwrap()
                    .block_on(admin.delete_records(&before, &AdminOptions::new()))
                    .unwrap();
                assert!(
                    deleted.elements().iter().all(|p| p.error().is_ok()),
                    "{deleted:?}"
                );
            }
            Sink::Redis(redis) => {
                for topic in TOPICS {
                    let first: Vec<(String, Vec<(String, String)>)> = redis.cmd(
                        redis::cmd("XRANGE")
                            .arg(topic)
                            .arg("-")
                            .arg("+")
                            .arg("COUNT")
                            .arg(1),
                    );
                    let _: i64 = redis.cmd(redis::cmd("XDEL").arg(topic).arg(&first[0].0));
                }
            }
            // One stream holds both subjects.
            Sink::Nats(nats) => nats.delete_message("EVENTS", 1),
        }
    }

    /// Every record of the outbox destinations, once `distinct` row ids arrived.
    fn records(&self, distinct: usize) -> Vec<Consumed> {
        match self {
            Sink::Kafka(broker) => consume_distinct_events(&broker.bootstrap(), distinct),
            Sink::Redis(redis) => {
                let mut records = Vec::new();
                wait_until("the rows in Redis", Duration::from_secs(120), || {
                    records = redis
                        .read(&TOPICS, 0, Duration::ZERO)
                        .iter()
                        .enumerate()
                        .map(|(i, g)| g.as_consumed(i as i64))
                        .collect();
                    let ids: HashSet<Option<String>> =
                        records.iter().map(|r| r.header("id")).collect();
                    ids.len() >= distinct
                });
                records
            }
            Sink::Nats(nats) => {
                let mut records = Vec::new();
                wait_until("the rows in JetStream", Duration::from_secs(120), || {
                    records = nats
                        .read("EVENTS", 0, Duration::ZERO)
                        .iter()
                        .enumerate()
                        .map(|(i, g)| g.as_consumed(i as i64))
                        .collect();
                    let ids: HashSet<Option<String>> =
                        records.iter().map(|r| r.header("id")).collect();
                    ids.len() >= distinct
                });
                records
            }
        }
    }

    /// Writes `record` again, as another producer would, with the id `id`, the position
    /// `position` and the key `key` (Kafka: to partition 0).
    fn produce_as(&self, record: &Consumed, id: &str, position: &str, key: &str) {
        let value = record.value.as_deref().unwrap_or_default();
        match self {
            Sink::Kafka(broker) => {
                let producer: BaseProducer = ClientConfig::new()
                    .set("bootstrap.servers", broker.bootstrap())
                    .create()
                    .unwrap();
                let headers = OwnedHeaders::new()
                    .insert(Header {
                        key: "id",
                        value: Some(id),
                    })
                    .insert(Header {
                        key: "outboxd.position",
                        value: Some(position),
                    });
                producer
                    .send(
                        BaseRecord::to(&record.topic)
                            .partition(0)
                            .key(key)
                            .payload(value)
                            .headers(headers),
                    )
                    .map_err(|(e, _)| e)
                    .unwrap();
                producer.flush(Duration::from_secs(30)).unwrap();
            }
            Sink::Redis(redis) => {
                let _: String = redis.cmd(
                    redis::cmd("XADD")
                        .arg(&record.topic)
                        .arg("*")
                        .arg("id")
                        .arg(id)
                        .arg("outboxd.position")
                        .arg(position)
                        .arg("key")
                        .arg(key)
                        .arg("payload")
                        .arg(value),
                );
            }
            // Another message id than outboxd's: JetStream would drop a repeat of it.
            Sink::Nats(nats) => nats.publish_with(
                &record.topic,
                &[
                    ("Nats-Msg-Id", &format!("by-hand-{id}-{position}-{key}")),
                    ("id", id),
                    ("outboxd.position", position),
                    ("outboxd.key", key),
                ],
                value,
            ),
        }
    }
}

/// Produces a record whose header name is not UTF-8 to `topic` (rdkafka's Rust API takes only
/// `&str` names, so the name is added through librdkafka itself). The rdkafka crate's own header
/// iterator panics on it.
fn produce_a_header_name_that_is_not_utf8(broker: &Broker, topic: &str) {
    use rdkafka::bindings as rd;
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", broker.bootstrap())
        .create()
        .unwrap();
    let headers = OwnedHeaders::new();
    let name = b"\xff\xfeid";
    // SAFETY: `BorrowedHeaders` is librdkafka's header list itself (the crate casts the one to
    // the other), and `headers` owns it until the record takes it.
    let native = headers.as_borrowed() as *const rdkafka::message::BorrowedHeaders
        as *mut rd::rd_kafka_headers_t;
    let added = unsafe {
        rd::rd_kafka_header_add(
            native,
            name.as_ptr().cast(),
            name.len() as isize,
            b"x".as_ptr().cast(),
            1,
        )
    };
    assert_eq!(added, rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR);
    producer
        .send(
            BaseRecord::<str, str>::to(topic)
                .payload("hostile")
                .headers(headers),
        )
        .map_err(|(e, _)| e)
        .unwrap();
    producer.flush(Duration::from_secs(30)).unwrap();
}

fn kafka_for(db: Db, body: impl FnOnce(&Broker) -> String, name: &str) -> Rig {
    let broker = Broker::start();
    for topic in TOPICS.into_iter().chain([DEAD_LETTERS]) {
        crate::rig::create_topic(&broker.bootstrap(), topic, 3);
    }
    let outboxd = Outboxd::new(name, &format!("{}{ROUTE}", body(&broker)));
    Rig {
        db,
        sink: Sink::Kafka(broker),
        outboxd,
    }
}

fn maria() -> Mysqld {
    let db = Mysqld::mariadb(&[]);
    db.sql_socket(scenario::SCHEMA);
    db
}

fn mariadb_to_kafka() -> Rig {
    let db = maria();
    let url = db.cdc_url();
    kafka_for(
        Db::Maria(db),
        |broker| scenario::config_body(&url, &broker.bootstrap(), DEAD_LETTER_KEY, ""),
        "audit-maria",
    )
}

fn postgres_to_kafka() -> Rig {
    let PgEnv {
        pg,
        broker,
        outboxd,
    } = pg_rows::setup_with_schema("auditpg", pg_rows::SCHEMA, DEAD_LETTER_KEY);
    crate::rig::create_topic(&broker.bootstrap(), DEAD_LETTERS, 1);
    let body = std::fs::read_to_string(outboxd.config_path()).unwrap();
    std::fs::write(outboxd.config_path(), format!("{body}{ROUTE}")).unwrap();
    Rig {
        db: Db::Pg(pg),
        sink: Sink::Kafka(broker),
        outboxd,
    }
}

fn mariadb_to_nats() -> Rig {
    let db = maria();
    let nats = Nats::start();
    nats.add_stream("EVENTS", &TOPICS);
    nats.add_stream("DEAD", &[DEAD_LETTERS]);
    let body = config_with_nats(&db.cdc_url(), &nats.url(), DEAD_LETTER_KEY);
    let outboxd = Outboxd::new("audit-nats", &format!("{body}{ROUTE}"));
    Rig {
        db: Db::Maria(db),
        sink: Sink::Nats(nats),
        outboxd,
    }
}

fn mariadb_to_redis() -> Rig {
    let db = maria();
    let redis = Redis::start();
    let body = config_with_redis(&db.cdc_url(), &redis.url(), DEAD_LETTER_KEY);
    let outboxd = Outboxd::new("audit-redis", &format!("{body}{ROUTE}"));
    Rig {
        db: Db::Maria(db),
        sink: Sink::Redis(redis),
        outboxd,
    }
}

/// `outboxd audit ARGS --format json`: (exit code, the report, stderr).
fn audit(outboxd: &Outboxd, args: &[&str]) -> (i32, Json, String) {
    let mut all = vec!["audit", "--format", "json"];
    all.extend_from_slice(args);
    let out: Output = outboxd.command_output(&all);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let report = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "audit printed no JSON ({e}): {}\n{stderr}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    (out.status.code().unwrap_or(-1), report, stderr)
}

fn ids(list: &Json, field: &str) -> Vec<String> {
    let mut ids: Vec<String> = list
        .as_array()
        .unwrap_or_else(|| panic!("not a list: {list}"))
        .iter()
        .map(|e| e[field].as_str().unwrap().to_string())
        .collect();
    ids.sort();
    ids
}

fn record_of(records: &[Consumed], n: u64) -> &Consumed {
    records
        .iter()
        .find(|r| r.header("id").as_deref() == Some(uuid_of(n).as_str()))
        .unwrap_or_else(|| panic!("no record of row {n}"))
}

fn audit_finds_missing_duplicated_and_reordered_rows(mut rig: Rig) {
    // Before outboxd has forwarded anything there is no checkpoint: no row can be told missing
    // from not yet sent, so the audit does not run (exit 2) and says why.
    let out = rig.outboxd.command_output(&["audit"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("there is no checkpoint"), "{stderr}");
    rig.outboxd.start();
    rig.db.insert(0, 40, 4);
    rig.db.insert_old(100);
    // Dead letters: one the router makes (no valid destination: the row as JSON), and one the
    // sink makes of the record itself where it can refuse a destination. Both are handled.
    rig.db.insert_as(200, "not a topic!");
    let dead = if rig.sink.refuse_orphans() {
        rig.db.insert_as(201, ORPHAN);
        2
    } else {
        1
    };
    let records = rig.sink.records(41);

    // Clean: every row delivered once, in order, or dead-lettered.
    let (code, report, stderr) = audit(&rig.outboxd, &[]);
    assert_eq!(code, 0, "{report:#}\n{stderr}");
    assert_eq!(report["rows"], 41 + dead, "{report:#}");
    assert_eq!(report["delivered"], 41, "{report:#}");
    assert_eq!(report["dead_lettered"], dead, "{report:#}");
    assert_eq!(report["missing"], serde_json::json!([]), "{report:#}");
    assert_eq!(report["duplicates"], serde_json::json!({}), "{report:#}");
    assert_eq!(
        report["order_violations"],
        serde_json::json!([]),
        "{report:#}"
    );
    assert_eq!(report["pending"], 0, "{report:#}");
    assert_eq!(report["verdict"], "pass", "{report:#}");
    // More rows than --max-rows: refused before the broker is read, with the way out.
    let out = rig.outboxd.command_output(&["audit", "--max-rows", "10"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("more than 10 rows"), "{stderr}");
    // The window: the row created in 2001 and its record are outside the last day.
    let (code, report, _) = audit(&rig.outboxd, &["--since", "1d"]);
    assert_eq!(
        (code, &report["rows"]),
        (0, &Json::from(40 + dead)),
        "{report:#}"
    );
    let text = rig.outboxd.command_output(&["audit"]);
    let text = String::from_utf8_lossy(&text.stdout).into_owned();
    println!("outboxd audit, clean:\n{text}");
    assert!(
        text.contains("PASS") && text.contains("delivered       41"),
        "{text}"
    );
    assert!(text.contains(&format!("dead-lettered   {dead}")), "{text}");

    // A record produced twice: duplicated, and the audit still passes (same id, bounded).
    let five = record_of(&records, 5);
    rig.sink.produce_as(
        five,
        &uuid_of(5),
        &five.header("outboxd.position").unwrap(),
        &String::from_utf8_lossy(five.key.as_deref().unwrap()),
    );
    let (code, report, _) = audit(&rig.outboxd, &[]);
    assert_eq!(code, 0, "{report:#}");
    assert_eq!(
        report["duplicates"],
        serde_json::json!({ uuid_of(5): 2 }),
        "{report:#}"
    );

    // Rows committed while outboxd is stopped: pending (not yet due) while the checkpoint is
    // behind them...
    rig.outboxd.stop();
    rig.db.insert(40, 44, 1);
    rig.db.insert_tomorrow(TOMORROW);
    let (code, report, _) = audit(&rig.outboxd, &["--wait", "1s"]);
    assert_eq!(
        (code, &report["verdict"]),
        (3, &Json::from("inconclusive")),
        "{report:#}"
    );
    assert_eq!(report["pending"], 5, "{report:#}");
    assert_eq!(report["missing"], serde_json::json!([]), "{report:#}");
    // ...and missing once the checkpoint was moved past them (an operator's `checkpoint set`).
    let end = rig.db.log_end();
    let set = rig.outboxd.command_output(&["checkpoint", "set", &end]);
    assert!(set.status.success(), "{set:?}");
    rig.outboxd.start();
    rig.db.insert(44, 46, 1);
    rig.sink.records(43);
    let (code, report, _) = audit(&rig.outboxd, &[]);
    assert_eq!(code, 1, "{report:#}");
    let lost = lost_rows();
    assert_eq!(ids(&report["missing"], "id"), lost, "{report:#}");
    assert_eq!(report["delivered"], 43, "{report:#}");
    if let (Sink::Kafka(broker), Db::Maria(_)) = (&rig.sink, &rig.db) {
        a_foreign_open_transaction_hides_nothing_silently(&rig, broker);
    }

    // Records the broker deleted (retention, trimming): a row without a record there may have
    // been delivered, so it is unverifiable, not missing. Only a row stamped after the oldest
    // record the broker still holds (beyond the clock-skew margin) cannot have been removed: it
    // stays missing.
    rig.sink.delete_first_records();
    let (code, report, _) = audit(&rig.outboxd, &[]);
    assert_eq!(code, 1, "{report:#}");
    assert_eq!(
        ids(&report["missing"], "id"),
        vec![uuid_of(TOMORROW)],
        "{report:#}"
    );
    let unverifiable = ids(&report["unverifiable"], "id");
    assert!(
        lost.iter()
            .filter(|id| **id != uuid_of(TOMORROW))
            .all(|id| unverifiable.contains(id)),
        "{report:#}"
    );
    // The dead-letter topic lost its one dead letter: that row is unverifiable, and nothing else
    // is on its account.
    if let Sink::Kafka(_) = &rig.sink {
        assert!(unverifiable.contains(&uuid_of(200)), "{report:#}");
    }
    assert!(
        report["notes"].as_array().is_some_and(|n| !n.is_empty()),
        "{report:#}"
    );
    if let Sink::Nats(nats) = &rig.sink {
        // A stream emptied altogether names no first message: the cut-off is its last one.
        nats.purge("EVENTS");
        let (code, report, _) = audit(&rig.outboxd, &[]);
        assert_eq!(code, 1, "{report:#}");
        assert_eq!(
            ids(&report["missing"], "id"),
            vec![uuid_of(TOMORROW)],
            "{report:#}"
        );
        assert_eq!(report["delivered"], 0, "{report:#}");
    }

    // Two of them produced by hand, the later-committed first, under one key: out of order.
    // Rows 40 and 41 route to outbox.event.order, as rows 1 and 38 whose records are copied do.
    let (early, late) = (record_of(&records, 1), record_of(&records, 38));
    let position = |r: &Consumed| r.header("outboxd.position").unwrap();
    rig.sink
        .produce_as(late, &uuid_of(41), &position(late), "k-reordered");
    rig.sink
        .produce_as(early, &uuid_of(40), &position(early), "k-reordered");
    // A hostile record nothing reads after this: the audit reads past it (a record without an
    // id), it does not stop.
    if let Sink::Kafka(broker) = &rig.sink {
        produce_a_header_name_that_is_not_utf8(broker, TOPICS[1]);
    }
    let (code, report, _) = audit(&rig.outboxd, &[]);
    assert_eq!(code, 1, "{report:#}");
    let text = rig.outboxd.command_output(&["audit"]);
    println!(
        "outboxd audit, failing:\n{}",
        String::from_utf8_lossy(&text.stdout)
    );
    let disorder = report["order_violations"].as_array().unwrap();
    assert_eq!(disorder.len(), 1, "{report:#}");
    assert_eq!(disorder[0]["id"], uuid_of(40), "{report:#}");
    assert_eq!(disorder[0]["after"], uuid_of(41), "{report:#}");
    assert_eq!(report["misplaced"], 0, "{report:#}");
    let unverifiable = ids(&report["unverifiable"], "id");
    assert!(
        [42, 43]
            .map(uuid_of)
            .iter()
            .all(|id| unverifiable.contains(id))
            && !unverifiable.contains(&uuid_of(40)),
        "{report:#}"
    );
    rig.outboxd.stop();
}

/// Another producer's transaction left open on a topic holds `read_committed` readers at its
/// start: outboxd's later records are there but cannot be read. The audit waits for it, then
/// calls the rows behind it unverifiable, not missing; once it is aborted they are delivered.
fn a_foreign_open_transaction_hides_nothing_silently(rig: &Rig, broker: &Broker) {
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", broker.bootstrap())
        .set("transactional.id", "audit-foreign")
        .create()
        .unwrap();
    let limit = Duration::from_secs(30);
    producer.init_transactions(limit).unwrap();
    producer.begin_transaction().unwrap();
    for partition in 0..3 {
        producer
            .send(
                BaseRecord::<str, str>::to(TOPICS[0])
                    .partition(partition)
                    .payload("not an outbox record"),
            )
            .map_err(|(e, _)| e)
            .unwrap();
    }
    producer.flush(limit).unwrap();
    // Rows 46 and 47 route to that topic.
    rig.db.insert(46, 48, 1);
    let (code, report, _) = audit(&rig.outboxd, &[]);
    assert_eq!(code, 1, "{report:#}");
    let unverifiable = ids(&report["unverifiable"], "id");
    assert!(
        [46, 47]
            .map(uuid_of)
            .iter()
            .all(|id| unverifiable.contains(id)),
        "{report:#}"
    );
    assert_eq!(
        ids(&report["missing"], "id"),
        vec![uuid_of(42), uuid_of(TOMORROW)],
        "{report:#}"
    );
    let notes = report["notes"].to_string();
    assert!(notes.contains("transaction open"), "{report:#}");
    producer.abort_transaction(limit).unwrap();
    let (code, report, _) = audit(&rig.outboxd, &[]);
    assert_eq!(code, 1, "{report:#}");
    assert_eq!(ids(&report["missing"], "id"), lost_rows(), "{report:#}");
    assert_eq!(report["delivered"], 45, "{report:#}");
}

/// A skipped row stamped a day ahead; it routes to `outbox.event.customer`.
const TOMORROW: u64 = 300;

/// The rows outboxd was made to skip.
fn lost_rows() -> Vec<String> {
    (40..44).chain([TOMORROW]).map(uuid_of).collect()
}

#[test]
fn mariadb_audit_finds_missing_duplicated_and_reordered_rows() {
    audit_finds_missing_duplicated_and_reordered_rows(mariadb_to_kafka());
}

#[test]
fn postgres_audit_finds_missing_duplicated_and_reordered_rows() {
    audit_finds_missing_duplicated_and_reordered_rows(postgres_to_kafka());
}

#[test]
fn nats_audit_finds_missing_duplicated_and_reordered_rows() {
    audit_finds_missing_duplicated_and_reordered_rows(mariadb_to_nats());
}

#[test]
fn redis_audit_finds_missing_duplicated_and_reordered_rows() {
    audit_finds_missing_duplicated_and_reordered_rows(mariadb_to_redis());
}

/// Queues cannot be read without taking their messages, and `--since` needs a time the rows and
/// records share: both are refused (exit 2) with the reason, before any server is contacted.
#[test]
fn audit_refuses_sinks_it_cannot_read_and_a_window_without_a_time() {
    let source = "[source]\nkind = \"mysql\"\nurl = \"mysql://cdc@127.0.0.1:1/app\"\ntables = [\"app.outbox\"]\n";
    for (sink, why) in [
        (
            "[rabbitmq]\nurl = \"amqp://outboxd:planted@127.0.0.1:1/%2f\"\nexchange = \"outbox\"\n",
            "removes it",
        ),
        ("[sqs]\nregion = \"eu-west-1\"\n", "removes it"),
    ] {
        let outboxd = Outboxd::new("audit-refused", &format!("{source}{sink}"));
        let out = outboxd.command_output(&["audit"]);
        let text = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{text}");
        assert!(text.contains(why), "{text}");
    }
    let outboxd = Outboxd::new(
        "audit-window",
        &format!("{source}[kafka]\nbrokers = \"127.0.0.1:1\"\n"),
    );
    let out = outboxd.command_output(&["audit", "--since", "1h"]);
    let text = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(text.contains("--since needs route.timestamp"), "{text}");
}
