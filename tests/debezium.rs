//! Debezium drop-in, end to end: the Outbox Event Router's options as outboxd's `[route]` keys
//! (regex topics, additional placements, timestamps, trace context) on real servers.

use std::time::Duration;

use crate::rig::{consume, create_topic, Broker, Mysqld, Outboxd, Postgres};

const LIMIT: Duration = Duration::from_secs(60);

const PARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

/// The same `[route]` for both databases: Debezium's `route.by.field = type`, a regex topic, an
/// extra header and envelope field, and the shard column as the partition.
const ROUTE: &str = r#"
[route]
by = "type"
topic_regex = 'Order\.(?<action>[A-Za-z]+)'
topic = "orders.${action}"
additional = [
  { column = "type", placement = "header", as = "eventType" },
  { column = "aggregatetype", placement = "envelope", as = "kind" },
  { column = "shard", placement = "partition" },
]
"#;

fn header(r: &crate::rig::Consumed, name: &str) -> String {
    r.header(name).unwrap_or_default()
}

#[test]
fn mariadb_rows_are_routed_by_regex_with_envelope_header_partition_timestamp_and_trace_context() {
    let db = Mysqld::mariadb(&[]);
    db.sql_socket(
        "CREATE DATABASE app;
         CREATE TABLE app.events (
           id CHAR(36) PRIMARY KEY, aggregatetype VARCHAR(64), aggregateid VARCHAR(64), type VARCHAR(64),
           payload JSON, created_at DATETIME(3), tracingspancontext TEXT, shard INT
         );",
    );
    let broker = Broker::start();
    for topic in ["orders.Created", "orders.Paid"] {
        create_topic(&broker.bootstrap(), topic, 3);
    }
    create_topic(&broker.bootstrap(), "dlq", 1);
    let body = format!(
        "[source]\nkind = \"mysql\"\nurl = \"{}\"\ntables = [\"app.events\"]\nserver_id = 99\n\
         [kafka]\nbrokers = \"{}\"\ndead_letter_topic = \"dlq\"\n[http]\nlisten = \"\"\n{ROUTE}timestamp = \"created_at\"\n",
        db.cdc_url(),
        broker.bootstrap()
    );
    let mut outboxd = Outboxd::new("dbz-maria", &body);
    outboxd.start();
    db.sql_socket(&format!(
        "INSERT INTO app.events VALUES
           ('00000000-0000-0000-0000-000000000001', 'order', 'o-1', 'Order.Created', '{{\"n\": 1}}',
            '2024-05-01 12:00:00.123', '#Mon Nov 23 2026\\ntraceparent={PARENT}\\ntracestate=congo\\\\=t61\\n', 2),
           ('00000000-0000-0000-0000-000000000002', 'order', 'o-1', 'Order.Paid', '{{\"n\": 2}}',
            '2024-05-01 12:00:01.000', NULL, 0),
           ('00000000-0000-0000-0000-000000000003', 'customer', 'c-1', 'Customer.Created', '{{\"n\": 3}}',
            '2024-05-01 12:00:02.000', NULL, 1),
           ('00000000-0000-0000-0000-000000000004', 'order', 'o-2', 'Order.Created', '{{\"n\": 4}}',
            '2024-05-01 12:00:03.000', NULL, 7);"
    ));
    // The capture group picks the topic.
    let created = consume(&broker.bootstrap(), "orders.Created", 1, LIMIT);
    let paid = consume(&broker.bootstrap(), "orders.Paid", 1, LIMIT);
    assert_eq!((created.len(), paid.len()), (1, 1));
    let created = &created[0];
    assert_eq!(created.partition, 2, "the shard column is the partition");
    assert_eq!(
        created.timestamp,
        Some(1_714_564_800_123),
        "created_at is the timestamp"
    );
    assert_eq!(header(created, "eventType"), "Order.Created");
    assert_eq!(header(created, "traceparent"), PARENT);
    assert_eq!(header(created, "tracestate"), "congo=t61");
    // The payload is a string in the envelope, as Debezium (without expand.json.payload) writes it.
    let value: serde_json::Value = serde_json::from_slice(created.value.as_ref().unwrap()).unwrap();
    assert_eq!(
        value,
        serde_json::json!({"payload": "{\"n\": 1}", "kind": "order"})
    );
    let paid = &paid[0];
    assert_eq!(paid.partition, 0);
    assert_eq!(paid.header("traceparent"), None);
    // A type the regex does not match, and a partition the topic does not have, are dead-lettered
    // with their reasons: not dropped, not retried forever.
    let dead = consume(&broker.bootstrap(), "dlq", 2, LIMIT);
    let mut reasons: Vec<String> = dead
        .iter()
        .map(|d| {
            header(d, "outboxd.error")
                .split(':')
                .next()
                .unwrap()
                .to_string()
        })
        .collect();
    reasons.sort();
    assert_eq!(reasons, ["invalid_partition", "topic_regex_mismatch"]);
    outboxd.stop();
}

#[test]
fn postgres_records_carry_the_commit_time_and_are_routed_like_debeziums() {
    let pg = Postgres::start(&["track_commit_timestamp = on"]);
    pg.sql("postgres", "CREATE DATABASE app;");
    pg.sql(
        "app",
        "CREATE ROLE cdc WITH LOGIN REPLICATION;
         CREATE TABLE public.events (
           id uuid PRIMARY KEY, aggregatetype text, aggregateid text, type text, payload jsonb,
           traceparent text, shard int
         );
         ALTER TABLE public.events OWNER TO cdc;",
    );
    pg.sql("postgres", "GRANT CREATE ON DATABASE app TO cdc;");
    let broker = Broker::start();
    create_topic(&broker.bootstrap(), "orders.Created", 3);
    let body = format!(
        "[source]\nkind = \"postgres\"\nurl = \"{}\"\ntables = [\"public.events\"]\nslot = \"dbz\"\npublication = \"dbz\"\n\
         [kafka]\nbrokers = \"{}\"\n[http]\nlisten = \"\"\n{ROUTE}expand_json_payload = true\n",
        pg.url("cdc", "app"),
        broker.bootstrap()
    );
    let mut outboxd = Outboxd::new("dbz-pg", &body);
    outboxd.start();
    pg.sql(
        "app",
        &format!(
            "INSERT INTO public.events VALUES
               ('00000000-0000-0000-0000-000000000001', 'order', 'o-1', 'Order.Created', '{{\"n\": 1}}', '{PARENT}', 1);"
        ),
    );
    let records = consume(&broker.bootstrap(), "orders.Created", 1, LIMIT);
    assert_eq!(records.len(), 1);
    let r = &records[0];
    // The server's own record of the commit time (track_commit_timestamp), in milliseconds.
    let committed: i64 = pg
        .sql(
            "app",
            "SELECT floor(extract(epoch FROM pg_xact_commit_timestamp(xmin)) * 1000)::bigint FROM public.events;",
        )
        .trim()
        .parse()
        .unwrap();
    assert_eq!(
        r.timestamp,
        Some(committed),
        "the record timestamp is the commit time"
    );
    assert_eq!(r.partition, 1);
    assert_eq!(header(r, "eventType"), "Order.Created");
    assert_eq!(header(r, "traceparent"), PARENT);
    // expand_json_payload: jsonb embedded as JSON.
    let value: serde_json::Value = serde_json::from_slice(r.value.as_ref().unwrap()).unwrap();
    assert_eq!(
        value,
        serde_json::json!({"payload": {"n": 1}, "kind": "order"})
    );
    outboxd.stop();
}

#[test]
fn an_update_of_an_outbox_row_stops_outboxd_under_on_update_delete_fatal_and_again_after_a_restart()
{
    let db = Mysqld::mariadb(&[]);
    db.sql_socket(crate::rig::scenario::SCHEMA);
    let broker = Broker::start();
    create_topic(&broker.bootstrap(), "outbox.event.order", 1);
    create_topic(&broker.bootstrap(), "outbox.event.customer", 1);
    let body = crate::rig::scenario::config_body(&db.cdc_url(), &broker.bootstrap(), "", "")
        + "[route]\non_update_delete = \"fatal\"\n";
    let mut outboxd = Outboxd::new("dbz-fatal", &body);
    outboxd.start();
    crate::rig::scenario::insert_rows(&db, 1, 2, 1);
    assert_eq!(
        consume(&broker.bootstrap(), "outbox.event.order", 1, LIMIT).len(),
        1
    );
    // A DELETE (the usual cleanup) is only counted, even under fatal.
    db.sql_socket("DELETE FROM app.outbox;");
    crate::rig::scenario::insert_rows(&db, 2, 3, 1);
    assert_eq!(
        consume(&broker.bootstrap(), "outbox.event.order", 2, LIMIT).len(),
        2
    );
    db.sql_socket("UPDATE app.outbox SET type = 'Changed';");
    let status = outboxd.wait_exit(LIMIT);
    assert!(!status.success());
    let log = outboxd.log();
    assert!(
        log.contains("1 UPDATE(s) of outbox rows reached outboxd")
            && log.contains("on_update_delete = \"warn\""),
        "{log}"
    );
    // The checkpoint stayed before the update: a restart stops at it again instead of skipping it.
    outboxd.start_with(&["--skip-checks"]);
    let status = outboxd.wait_exit(LIMIT);
    assert!(!status.success());
    assert!(outboxd.log().contains("UPDATE(s)"), "{}", outboxd.log());
}

/// The `n` of every record (its `id` header, rig::scenario::uuid_of), sorted.
fn ns(records: &[crate::rig::Consumed]) -> Vec<u64> {
    let mut ns: Vec<u64> = records.iter().map(crate::rig::scenario::n_of).collect();
    ns.sort_unstable();
    ns
}

#[test]
fn a_mariadb_debezium_offset_imports_and_outboxd_resumes_with_nothing_lost() {
    use crate::rig::scenario::{config_body, consume_events, insert_rows, SCHEMA};
    let db = Mysqld::mariadb(&[]);
    db.sql_socket(SCHEMA);
    let broker = Broker::start();
    create_topic(&broker.bootstrap(), "outbox.event.order", 1);
    create_topic(&broker.bootstrap(), "outbox.event.customer", 1);
    // Debezium forwarded rows 0..5, then stopped inside the transaction of rows 5..10 (after its
    // second event, first row): its offset points at that transaction's start, and its GTID state
    // already counts the transaction.
    insert_rows(&db, 0, 5, 1);
    let (file, pos) = db.binlog_end();
    insert_rows(&db, 5, 10, 5);
    let gtids = db
        .sql_socket("SELECT @@gtid_binlog_pos;")
        .trim()
        .to_string();
    let outboxd = Outboxd::new(
        "dbz-import",
        &config_body(&db.cdc_url(), &broker.bootstrap(), "", ""),
    );
    let offset = outboxd.dir_path().join("offset.json");
    std::fs::write(
        &offset,
        format!(r#"{{"ts_sec":1700000000,"file":"{file}","pos":{pos},"gtids":"{gtids}","row":1,"server_id":1,"event":2}}"#),
    )
    .unwrap();
    let out = outboxd.command_output(&["checkpoint", "import-debezium", offset.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("resuming by FILE:POS"), "{text}");
    let mut outboxd = outboxd;
    outboxd.start();
    let records = consume_events(&broker.bootstrap(), 5);
    assert_eq!(
        ns(&records),
        vec![5, 6, 7, 8, 9],
        "exactly the rows after the offset"
    );
    outboxd.stop();
}

#[test]
fn a_postgres_debezium_offset_imports_onto_debeziums_slot_and_outboxd_resumes_with_nothing_lost() {
    let pg = Postgres::start(&[]);
    pg.sql("postgres", "CREATE DATABASE app;");
    pg.sql(
        "app",
        "CREATE ROLE cdc WITH LOGIN REPLICATION;
         CREATE TABLE public.outbox (id uuid PRIMARY KEY, aggregatetype text, aggregateid text, type text, payload jsonb);
         ALTER TABLE public.outbox OWNER TO cdc;
         CREATE PUBLICATION dbz_publication FOR TABLE public.outbox WITH (publish = 'insert');
         SELECT pg_create_logical_replication_slot('debezium', 'pgoutput');",
    );
    let insert = |from: u64, to: u64| {
        let sql: String = (from..to)
            .map(|n| {
                let (_, kind, key, _) = crate::rig::scenario::event(n);
                format!(
                    "INSERT INTO public.outbox VALUES ('{}', '{kind}', '{key}', 'Created', '{{\"n\": {n}}}');\n",
                    crate::rig::scenario::uuid_of(n)
                )
            })
            .collect();
        pg.sql("app", &sql);
    };
    insert(0, 5);
    let lsn: u64 = pg
        .sql("app", "SELECT pg_current_wal_lsn() - '0/0';")
        .trim()
        .parse()
        .unwrap();
    insert(5, 7);
    // Debezium processed rows 5 and 6 (`lsn`), but its last finished transaction is the one
    // before (`lsn_commit`): outboxd must start at the commit, so they come again rather than never.
    let processed: u64 = pg
        .sql("app", "SELECT pg_current_wal_lsn() - '0/0';")
        .trim()
        .parse()
        .unwrap();
    insert(7, 10);
    let broker = Broker::start();
    create_topic(&broker.bootstrap(), "outbox.event.order", 1);
    create_topic(&broker.bootstrap(), "outbox.event.customer", 1);
    let body = format!(
        "[source]\nkind = \"postgres\"\nurl = \"{}\"\ntables = [\"public.outbox\"]\nslot = \"debezium\"\npublication = \"dbz_publication\"\n\
         [kafka]\nbrokers = \"{}\"\n[http]\nlisten = \"\"\n",
        pg.url("cdc", "app"),
        broker.bootstrap()
    );
    let mut outboxd = Outboxd::new("dbz-import-pg", &body);
    let out = outboxd
        .command(&["checkpoint", "import-debezium", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            child.stdin.take().unwrap().write_all(
                format!(r#"{{"lsn_proc":{processed},"lsn_commit":{lsn},"lsn":{processed},"txId":750,"ts_usec":1700000000000000}}"#)
                    .as_bytes(),
            )?;
            child.wait_with_output()
        })
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    outboxd.start();
    let records = crate::rig::scenario::consume_events(&broker.bootstrap(), 5);
    assert_eq!(
        ns(&records),
        vec![5, 6, 7, 8, 9],
        "exactly the rows after the offset"
    );
    outboxd.stop();
}
