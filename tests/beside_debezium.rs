//! outboxd beside Debezium itself (3.5, Kafka Connect standalone, the Outbox Event Router): the same
//! outbox rows read by both into separate topics and compared record by record, and a cutover in
//! which outboxd continues from the offsets Debezium actually wrote.
//!
//! Two Debezium connectors run in one worker, each with the converters Debezium's outbox docs give
//! for its case: `StringConverter` for keys and values (payloads forwarded as stored; the `header`
//! placement), and `JsonConverter` without schemas plus `table.expand.json.payload` (the `envelope`
//! placement, a JSON value). Every difference that remains is named in [`KNOWN`], and README's
//! "Switching from Debezium" table says why and which option removes it.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::rig::debezium::{Connect, Connector};
use crate::rig::{consume, create_topic, Broker, Consumed, Mysqld, Outboxd, Postgres};

const LIMIT: Duration = Duration::from_secs(120);
const PARTITIONS: i32 = 4;
const TYPES: [&str; 3] = ["order", "customer", "payment"];
const PARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

/// The differences that remain between Debezium's records and outboxd's, each explained in README.
const KNOWN: &[&str] = &[
    // Debezium 3.x stamps every record with its connector's context (name, task, run id).
    "header __debezium.context.connectorLogicalName only from Debezium",
    "header __debezium.context.connectorName only from Debezium",
    "header __debezium.context.runId only from Debezium",
    "header __debezium.context.taskId only from Debezium",
    // outboxd names the row's transaction in the source log (audits, the exactly-once guards).
    "header outboxd.position only from outboxd",
    // outboxd forwards the trace context column's parent as W3C headers; Debezium does so only with
    // OpenTelemetry on Connect's classpath (and then as a span of its own).
    "header traceparent only from outboxd",
];

/// Debezium's `route.topic.replacement` prefixes (`plain`: StringConverter, `json`: JsonConverter)
/// and outboxd's, per pipeline.
const DBZ_PLAIN: &str = "dbz";
const DBZ_JSON: &str = "dbzj";
const OB_PLAIN: &str = "ob";
const OB_JSON: &str = "obj";

fn create_topics(broker: &Broker) {
    for prefix in [DBZ_PLAIN, DBZ_JSON, OB_PLAIN, OB_JSON] {
        for t in TYPES {
            create_topic(&broker.bootstrap(), &format!("{prefix}.{t}"), PARTITIONS);
        }
    }
}

/// Row `n` of the shared set: (aggregate type, key, payload SQL literal, trace context literal).
fn row(n: usize) -> (&'static str, String, String, String) {
    let kind = TYPES[n % TYPES.len()];
    // Non-ASCII keys too; 20 distinct keys reach all four partitions.
    let key = if n.is_multiple_of(5) {
        format!("ключ-{}", n % 20)
    } else {
        format!("k-{}", n % 20)
    };
    let payload = match n % 7 {
        6 => "NULL".to_string(),
        _ => format!("'{{\"n\": {n}, \"name\": \"Zoë ✓\", \"list\": [1, 2.5, true, null]}}'"),
    };
    let trace = if n.is_multiple_of(4) {
        format!("'traceparent={PARENT}'")
    } else {
        "NULL".into()
    };
    (kind, key, payload, trace)
}

/// The Event Router options both connectors share (the defaults plus a timestamp column).
fn router(c: Connector) -> Connector {
    c.with(
        "transforms.outbox.table.field.event.timestamp",
        "created_at",
    )
}

fn plain(c: Connector) -> Connector {
    router(c).with(
        "transforms.outbox.table.fields.additional.placement",
        "type:header:eventType",
    )
}

fn json(c: Connector) -> Connector {
    router(c)
        .with(
            "value.converter",
            "org.apache.kafka.connect.json.JsonConverter",
        )
        .with("value.converter.schemas.enable", "false")
        .with("transforms.outbox.table.expand.json.payload", "true")
        .with(
            "transforms.outbox.table.fields.additional.placement",
            "aggregatetype:envelope:kind",
        )
}

/// outboxd's `[route]` for the same two setups. Not `expand_json_payload`: Debezium 3.5 leaves a
/// payload in an envelope a JSON string even with `table.expand.json.payload` (this test showed it).
fn route(prefix: &str, json: bool) -> String {
    let additional = if json {
        r#"{ column = "aggregatetype", placement = "envelope", as = "kind" }"#
    } else {
        r#"{ column = "type", placement = "header", as = "eventType" }"#
    };
    format!(
        "[route]\ntopic = \"{prefix}.${{routedByValue}}\"\ntimestamp = \"created_at\"\nbinary_16 = \"base64\"\n\
         additional = [{additional}]\n"
    )
}

/// Every record of the `prefix` topics by id; `logs` says what the side's writers logged when a
/// topic holds more than it should (a repeat means a session ended and sent again: their logs
/// say why).
fn read_all(
    broker: &Broker,
    prefix: &str,
    expected: usize,
    logs: &dyn Fn() -> String,
) -> BTreeMap<String, Consumed> {
    let mut all = BTreeMap::new();
    let mut count = 0;
    for t in TYPES {
        let topic = format!("{prefix}.{t}");
        let want = expected_per_type(expected, t);
        let records = consume(&broker.bootstrap(), &topic, want, LIMIT);
        let end = crate::rig::topic_end(&broker.bootstrap(), &topic);
        assert_eq!(
            end,
            records.len(),
            "{topic} holds no more than it should; the writers logged:\n{}",
            logs()
        );
        for r in records {
            count += 1;
            let id = r.header("id").expect("every record has an id header");
            all.insert(id, r);
        }
    }
    assert_eq!(count, expected, "records under {prefix}.*");
    assert_eq!(all.len(), expected, "distinct ids under {prefix}.*");
    all
}

fn expected_per_type(total: usize, kind: &str) -> usize {
    (0..total).filter(|n| row(*n).0 == kind).count()
}

/// Every difference between Debezium's record and outboxd's for the same id, as short sentences.
fn differences(dbz: &Consumed, ob: &Consumed, json: bool) -> Vec<String> {
    let mut out = Vec::new();
    let topic_suffix = |r: &Consumed| r.topic.split_once('.').unwrap().1.to_string();
    if topic_suffix(dbz) != topic_suffix(ob) {
        out.push(format!(
            "topic: Debezium {} outboxd {}",
            dbz.topic, ob.topic
        ));
    }
    if dbz.partition != ob.partition {
        out.push("partition".into());
    }
    if dbz.key != ob.key {
        out.push(format!(
            "key: Debezium {:?} outboxd {:?}",
            dbz.key.as_deref().map(String::from_utf8_lossy),
            ob.key.as_deref().map(String::from_utf8_lossy)
        ));
    }
    if dbz.value != ob.value {
        let parsed = |v: &Option<Vec<u8>>| {
            v.as_deref()
                .map(|b| serde_json::from_slice::<serde_json::Value>(b).ok())
        };
        let same_json = json && parsed(&dbz.value) == parsed(&ob.value);
        out.push(format!(
            "value{}: Debezium {:?} outboxd {:?}",
            if same_json { " bytes (same JSON)" } else { "" },
            dbz.value.as_deref().map(String::from_utf8_lossy),
            ob.value.as_deref().map(String::from_utf8_lossy)
        ));
    }
    for (name, value) in &dbz.headers {
        match ob.headers.get(name) {
            None => out.push(format!("header {name} only from Debezium")),
            Some(o) if o != value => out.push(format!(
                "header {name}: Debezium {:?} outboxd {:?}",
                value.as_deref().map(String::from_utf8_lossy),
                o.as_deref().map(String::from_utf8_lossy)
            )),
            Some(_) => {}
        }
    }
    for name in ob.headers.keys() {
        if !dbz.headers.contains_key(name) {
            out.push(format!("header {name} only from outboxd"));
        }
    }
    if dbz.timestamp != ob.timestamp {
        out.push(format!(
            "timestamp: Debezium {:?} outboxd {:?}",
            dbz.timestamp, ob.timestamp
        ));
    }
    out
}

/// Compares both sides id by id; panics listing every difference not in [`KNOWN`].
fn compare(
    dbz: &BTreeMap<String, Consumed>,
    ob: &BTreeMap<String, Consumed>,
    json: bool,
) -> BTreeSet<String> {
    assert_eq!(
        dbz.keys().collect::<Vec<_>>(),
        ob.keys().collect::<Vec<_>>(),
        "the same ids on both sides"
    );
    let mut kinds = BTreeSet::new();
    let mut unexplained = Vec::new();
    for (id, d) in dbz {
        for diff in differences(d, &ob[id], json) {
            if !KNOWN.contains(&diff.as_str()) {
                unexplained.push(format!("{id}: {diff}"));
            }
            kinds.insert(diff);
        }
    }
    assert!(
        unexplained.is_empty(),
        "differences from Debezium not in README's switching table ({} of them):\n{}",
        unexplained.len(),
        unexplained.join("\n")
    );
    let partitions: BTreeSet<i32> = ob.values().map(|r| r.partition).collect();
    assert_eq!(
        partitions.len(),
        PARTITIONS as usize,
        "the keys reach every partition"
    );
    kinds
}

/// Both setups compared (outboxd's side read first, then Debezium's, whose tasks must still
/// run), then everything stopped.
fn compare_both_and_stop(
    broker: &Broker,
    connect: &mut Connect,
    pipelines: Vec<Outboxd>,
    total: usize,
) {
    let report = [(DBZ_PLAIN, OB_PLAIN, false), (DBZ_JSON, OB_JSON, true)].map(|(d, o, json)| {
        let ours = read_all(broker, o, total, &|| {
            pipelines
                .iter()
                .map(|p| p.log())
                .collect::<Vec<_>>()
                .join("\n--- next pipeline ---\n")
        });
        connect.assert_running();
        compare(
            &read_all(broker, d, total, &|| "(Debezium's worker)".to_string()),
            &ours,
            json,
        )
    });
    eprintln!("differences (plain, json): {report:#?}");
    connect.stop();
    for mut p in pipelines {
        p.stop();
    }
}

#[test]
fn mariadb_outbox_rows_reach_kafka_exactly_as_debeziums_outbox_event_router_writes_them() {
    let db = Mysqld::mariadb(&[]);
    db.sql_socket(
        "CREATE DATABASE app;
         CREATE TABLE app.outbox (
           id CHAR(36) PRIMARY KEY, aggregatetype VARCHAR(64), aggregateid VARCHAR(64), type VARCHAR(64),
           payload JSON, created_at DATETIME(3), tracingspancontext TEXT
         ) DEFAULT CHARSET utf8mb4;
         CREATE TABLE app.outbox_bin (
           id BINARY(16) PRIMARY KEY, aggregatetype VARCHAR(64), aggregateid VARCHAR(64), type VARCHAR(64),
           payload JSON, created_at DATETIME(3), tracingspancontext TEXT
         ) DEFAULT CHARSET utf8mb4;",
    );
    let broker = Broker::start();
    create_topics(&broker);
    let tables = "app.outbox,app.outbox_bin";
    let mut connect = Connect::start(
        &broker.bootstrap(),
        vec![
            plain(Connector::mariadb("plain", &db, 5401, tables, DBZ_PLAIN)),
            json(Connector::mariadb("json", &db, 5402, tables, DBZ_JSON)),
        ],
    );
    let mut pipelines = Vec::new();
    for (name, prefix, json, server_id) in [
        ("beside-plain", OB_PLAIN, false, 5403),
        ("beside-json", OB_JSON, true, 5404),
    ] {
        let body = format!(
            "[source]\nkind = \"mysql\"\nurl = \"{}\"\ntables = [\"app.outbox\", \"app.outbox_bin\"]\n\
             server_id = {server_id}\n[kafka]\nbrokers = \"{}\"\n[http]\nlisten = \"\"\n{}",
            db.cdc_url(),
            broker.bootstrap(),
            route(prefix, json)
        );
        let mut outboxd = Outboxd::new(name, &body);
        outboxd.start();
        pipelines.push(outboxd);
    }
    // 60 rows in six transactions; every fifth in the BINARY(16) table.
    let total = 60;
    for tx in 0..6 {
        let mut sql = String::from("BEGIN;\n");
        for n in tx * 10..tx * 10 + 10 {
            let (kind, key, payload, trace) = row(n);
            let (table, id) = if n % 5 == 4 {
                ("outbox_bin", format!("UNHEX('{n:032x}')"))
            } else {
                ("outbox", format!("'00000000-0000-4000-8000-{n:012}'"))
            };
            sql.push_str(&format!(
                "INSERT INTO app.{table} VALUES ({id}, '{kind}', '{key}', '{kind}.Created', {payload}, \
                 '2024-05-01 10:00:{:02}.{:03}', {trace});\n",
                n % 60,
                n * 7 % 1000
            ));
        }
        sql.push_str("COMMIT;");
        db.sql_socket(&sql);
    }
    compare_both_and_stop(&broker, &mut connect, pipelines, total);
}

#[test]
fn postgres_outbox_rows_reach_kafka_exactly_as_debeziums_outbox_event_router_writes_them() {
    let pg = Postgres::start(&[]);
    pg.sql("postgres", "CREATE DATABASE app;");
    pg.sql(
        "app",
        "CREATE TABLE public.outbox (
           id uuid PRIMARY KEY, aggregatetype text, aggregateid text, type text, payload jsonb,
           created_at timestamp(3), tracingspancontext text
         );",
    );
    let broker = Broker::start();
    create_topics(&broker);
    let mut connect = Connect::start(
        &broker.bootstrap(),
        vec![
            plain(Connector::postgres(
                "plain",
                &pg,
                "dbz_plain",
                "public.outbox",
                DBZ_PLAIN,
            )),
            json(Connector::postgres(
                "json",
                &pg,
                "dbz_json",
                "public.outbox",
                DBZ_JSON,
            )),
        ],
    );
    let mut pipelines = Vec::new();
    for (name, prefix, json) in [
        ("beside_plain", OB_PLAIN, false),
        ("beside_json", OB_JSON, true),
    ] {
        let body = format!(
            "[source]\nkind = \"postgres\"\nurl = \"{}\"\ntables = [\"public.outbox\"]\nslot = \"{name}\"\n\
             publication = \"{name}\"\n[kafka]\nbrokers = \"{}\"\n[http]\nlisten = \"\"\n{}",
            pg.url("debezium", "app"),
            broker.bootstrap(),
            route(prefix, json)
        );
        let mut outboxd = Outboxd::new(name, &body);
        outboxd.start();
        pipelines.push(outboxd);
    }
    let total = 60;
    for tx in 0..6 {
        let mut sql = String::from("BEGIN;\n");
        for n in tx * 10..tx * 10 + 10 {
            let (kind, key, payload, trace) = row(n);
            sql.push_str(&format!(
                "INSERT INTO public.outbox VALUES ('00000000-0000-4000-8000-{n:012}', '{kind}', '{key}', \
                 '{kind}.Created', {payload}, '2024-05-01 10:00:{:02}.{:03}', {trace});\n",
                n % 60,
                n * 7 % 1000
            ));
        }
        sql.push_str("COMMIT;");
        pg.sql("app", &sql);
    }
    compare_both_and_stop(&broker, &mut connect, pipelines, total);
}

/// Rows per transaction and transactions in a cutover run.
const TX_ROWS: usize = 5;
const TXS: usize = 400;
/// The one topic of a cutover (one partition: its order is the commit order).
const CUT_TOPIC: &str = "outbox.event.order";

fn cut_id(n: usize) -> String {
    format!("00000000-0000-4000-8000-{n:012}")
}

fn cut_n(id: &str) -> usize {
    id.rsplit('-').next().unwrap().parse().unwrap()
}

/// The SQL of cutover transaction `tx` (its rows `tx * TX_ROWS ..`), for `table`.
fn cut_tx(table: &str, tx: usize) -> String {
    let mut sql = String::from("BEGIN;\n");
    for n in tx * TX_ROWS..(tx + 1) * TX_ROWS {
        sql.push_str(&format!(
            "INSERT INTO {table} (id, aggregatetype, aggregateid, type, payload) VALUES \
             ('{}', 'order', 'k-{}', 'order.Created', '{{\"n\": {n}}}');\n",
            cut_id(n),
            n % 13
        ));
    }
    sql.push_str("COMMIT;\n");
    sql
}

/// Every record of the cutover topic (its end asked of the broker first), in offset order.
fn read_everything(broker: &Broker) -> Vec<Consumed> {
    let end = crate::rig::topic_end(&broker.bootstrap(), CUT_TOPIC);
    let records = consume(&broker.bootstrap(), CUT_TOPIC, end, LIMIT);
    assert_eq!(records.len(), end, "the topic's records up to its end");
    records
}

/// What Debezium and then outboxd wrote, checked: nothing lost, outboxd resumed at the start of
/// the transaction `first` (the one after what the offset committed), and the duplicates are
/// exactly Debezium's records from there on. Returns (Debezium's records, duplicates).
fn check_cutover(records: &[Consumed], total: usize, first: usize) -> (usize, usize) {
    let from_debezium = |r: &Consumed| r.headers.contains_key("__debezium.context.connectorName");
    let dbz: Vec<usize> = records
        .iter()
        .filter(|r| from_debezium(r))
        .map(|r| cut_n(&r.header("id").unwrap()))
        .collect();
    let ours: Vec<usize> = records
        .iter()
        .filter(|r| !from_debezium(r))
        .map(|r| cut_n(&r.header("id").unwrap()))
        .collect();
    assert!(
        records
            .iter()
            .all(|r| from_debezium(r) != r.headers.contains_key("outboxd.position")),
        "every record is Debezium's or outboxd's"
    );
    assert_eq!(
        dbz,
        (0..dbz.len()).collect::<Vec<_>>(),
        "Debezium forwarded a prefix of the rows, in commit order, once each"
    );
    assert_eq!(
        ours,
        (first..total).collect::<Vec<_>>(),
        "outboxd forwarded every row from the offset's next transaction on, in commit order, once each"
    );
    assert!(
        first <= dbz.len(),
        "no row between Debezium's last and outboxd's first"
    );
    (dbz.len(), dbz.len() - first)
}

/// The one connector's offset in Connect standalone's offsets file.
fn offset_json(connect: &Connect) -> serde_json::Value {
    let mut offsets = connect.offsets();
    assert_eq!(
        offsets.len(),
        1,
        "one offset in {:?}",
        connect.offsets_file()
    );
    offsets.pop().unwrap()
}

/// `outboxd checkpoint import-debezium` on Connect's offsets file, as it is.
fn import_offsets(outboxd: &Outboxd, connect: &Connect) {
    let out = outboxd.command_output(&[
        "checkpoint",
        "import-debezium",
        connect.offsets_file().to_str().unwrap(),
    ]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("import-debezium: {said}");
}

#[test]
fn a_mariadb_cutover_from_debezium_under_load_loses_nothing_and_repeats_only_what_its_offset_had_not_committed(
) {
    let db = Mysqld::mariadb(&[]);
    db.sql_socket(
        "CREATE DATABASE app;
         CREATE TABLE app.outbox (
           id CHAR(36) PRIMARY KEY, aggregatetype VARCHAR(64), aggregateid VARCHAR(64), type VARCHAR(64),
           payload JSON
         ) DEFAULT CHARSET utf8mb4;",
    );
    // The transactions before the load: the GTID of load transaction `tx` is `before + 1 + tx`.
    let before: usize = db
        .sql_socket("SELECT @@gtid_binlog_pos;")
        .trim()
        .rsplit('-')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let broker = Broker::start();
    create_topic(&broker.bootstrap(), CUT_TOPIC, 1);
    let mut connect = Connect::start(
        &broker.bootstrap(),
        vec![Connector::mariadb(
            "cut",
            &db,
            5501,
            "app.outbox",
            "outbox.event",
        )],
    );
    let total = TX_ROWS * TXS;
    let socket = db.socket_path();
    let written = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        let writer = s.spawn(|| {
            for tx in 0..TXS {
                crate::rig::mysqld::sql_at(&socket, &cut_tx("app.outbox", tx));
                written.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        });
        // Debezium forwards part of the stream, then is stopped the way README's cutover says.
        crate::rig::wait_until("Debezium to forward 500 rows", LIMIT, || {
            consume(&broker.bootstrap(), CUT_TOPIC, 500, Duration::from_secs(2)).len() >= 500
        });
        connect.stop();
        let at_stop = written.load(std::sync::atomic::Ordering::SeqCst);
        assert!(
            at_stop < TXS,
            "the load was still being written when Debezium stopped"
        );
        let offset = offset_json(&connect);
        eprintln!("Debezium's offset: {offset}");
        let body = format!(
            "[source]\nkind = \"mysql\"\nurl = \"{}\"\ntables = [\"app.outbox\"]\nserver_id = 5502\n\
             [kafka]\nbrokers = \"{}\"\n[http]\nlisten = \"\"\n",
            db.cdc_url(),
            broker.bootstrap()
        );
        let mut outboxd = Outboxd::new("cutover-maria", &body);
        import_offsets(&outboxd, &connect);
        // The offset's `gtids` counts the transactions Debezium finished, also when it stopped
        // inside the next one (`event`/`row` > 0; `file`/`pos` is then that one's start).
        let completed: usize = offset["gtids"]
            .as_str()
            .unwrap()
            .rsplit('-')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        let first_tx = completed - before;
        let sent = read_everything(&broker).len();
        outboxd.start();
        writer.join().unwrap();
        let expected = sent + total - first_tx * TX_ROWS;
        crate::rig::wait_until("outboxd to forward the rest", LIMIT, || {
            crate::rig::topic_end(&broker.bootstrap(), CUT_TOPIC) >= expected
        });
        outboxd.stop();
        // Nothing more than expected either: the whole topic is read.
        let records = read_everything(&broker);
        assert_eq!(records.len(), expected, "outboxd's log:\n{}", outboxd.log());
        let (sent, duplicates) = check_cutover(&records, total, first_tx * TX_ROWS);
        eprintln!(
            "cutover: Debezium sent {sent} rows, its offset committed {} ; {duplicates} sent again by outboxd",
            first_tx * TX_ROWS
        );
        // A graceful stop commits everything acked: at most the transaction it was in comes again.
        assert!(
            duplicates <= TX_ROWS,
            "{duplicates} duplicates after a graceful stop"
        );
    });
}

#[test]
fn a_postgres_cutover_onto_debeziums_slot_after_it_crashed_under_load_loses_nothing() {
    let pg = Postgres::start(&[]);
    pg.sql("postgres", "CREATE DATABASE app;");
    pg.sql(
        "app",
        "CREATE TABLE public.outbox (
           id uuid PRIMARY KEY, aggregatetype text, aggregateid text, type text, payload jsonb
         );",
    );
    let broker = Broker::start();
    create_topic(&broker.bootstrap(), CUT_TOPIC, 1);
    let mut connect = Connect::start(
        &broker.bootstrap(),
        vec![Connector::postgres(
            "cut",
            &pg,
            "debezium",
            "public.outbox",
            "outbox.event",
        )],
    );
    let total = TX_ROWS * TXS;
    // Where each load transaction's commit lies, to find the first one after Debezium's offset.
    let commits = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        let writer = s.spawn(|| {
            for tx in 0..TXS {
                // The WAL position just before the commit record: below the commit's own LSN,
                // above every earlier transaction's.
                let sql = cut_tx("public.outbox", tx).replace(
                    "COMMIT;\n",
                    "SELECT pg_current_wal_insert_lsn() - '0/0';\nCOMMIT;\n",
                );
                let lsn: u64 = pg
                    .sql("app", &sql)
                    .lines()
                    .find_map(|l| l.trim().parse().ok())
                    .unwrap();
                commits.lock().unwrap().push(lsn);
            }
        });
        // Debezium forwards part of the stream and crashes: its offsets file is as last flushed
        // (at most a second old here; Connect's default is a minute), the slot where it last
        // confirmed.
        crate::rig::wait_until("Debezium to forward 500 rows", LIMIT, || {
            consume(&broker.bootstrap(), CUT_TOPIC, 500, Duration::from_secs(2)).len() >= 500
        });
        connect.crash();
        let at_crash = commits.lock().unwrap().len();
        assert!(
            at_crash < TXS,
            "the load was still being written when Debezium crashed"
        );
        let offset = offset_json(&connect);
        eprintln!("Debezium's offset: {offset}");
        let body = format!(
            "[source]\nkind = \"postgres\"\nurl = \"{}\"\ntables = [\"public.outbox\"]\n\
             slot = \"debezium\"\npublication = \"debezium_publication\"\n\
             [kafka]\nbrokers = \"{}\"\n[http]\nlisten = \"\"\n",
            pg.url("debezium", "app"),
            broker.bootstrap()
        );
        let mut outboxd = Outboxd::new("cutover_pg", &body);
        import_offsets(&outboxd, &connect);
        let sent = read_everything(&broker).len();
        outboxd.start();
        writer.join().unwrap();
        // `lsn_commit` is the commit of the last transaction Debezium finished: outboxd starts
        // with the first transaction that commits after it.
        let lsn_commit = offset["lsn_commit"].as_u64().expect("lsn_commit");
        let commits = commits.lock().unwrap().clone();
        let first_tx = commits.iter().take_while(|c| **c < lsn_commit).count();
        let expected = sent + total - first_tx * TX_ROWS;
        crate::rig::wait_until("outboxd to forward the rest", LIMIT, || {
            crate::rig::topic_end(&broker.bootstrap(), CUT_TOPIC) >= expected
        });
        outboxd.stop();
        // Nothing more than expected either: the whole topic is read.
        let records = read_everything(&broker);
        assert_eq!(records.len(), expected, "outboxd's log:\n{}", outboxd.log());
        let (sent, duplicates) = check_cutover(&records, total, first_tx * TX_ROWS);
        eprintln!(
            "cutover: Debezium sent {sent} rows, its offset committed {} ; {duplicates} sent again by outboxd",
            first_tx * TX_ROWS
        );
    });
}
