//! Debezium drop-in, end to end: the Outbox Event Router's options as outboxd's `[route]` keys
//! (regex topics, additional placements, timestamps, trace context) on real servers.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::rig::{consume, create_topic, Broker, MariaDb, Outboxd, Postgres};

const LIMIT: Duration = Duration::from_secs(60);

const PARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// The same `[route]` for both databases: Debezium's `route.by.field = type`, a regex topic, an
/// extra header and envelope field, and the shard column as the partition.
const ROUTE: &str = r#"
[route]
by = "type"
topic_regex = 'Order\.(?<action>[A-Za-z]+)'
topic = "orders"
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
    let db = MariaDb::start(&[]);
    db.sql_socket(
        "CREATE DATABASE app;
         CREATE TABLE app.events (
           id CHAR(36) PRIMARY KEY, aggregatetype VARCHAR(64), aggregateid VARCHAR(64), type VARCHAR(64),
           payload JSON, created_at DATETIME(3), tracingspancontext TEXT, shard INT
         );",
    );
    let broker = Broker::start();
    create_topic(&broker.bootstrap(), "orders", 3);
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
            '2024-05-01 12:00:02.000', NULL, 1);"
    ));
    let records = consume(&broker.bootstrap(), "orders", 2, LIMIT);
    assert_eq!(records.len(), 2);
    let created = records
        .iter()
        .find(|r| r.header("id").unwrap().ends_with('1'))
        .unwrap();
    assert_eq!(created.partition, 2, "the shard column is the partition");
    assert_eq!(
        created.timestamp,
        Some(1_714_564_800_123),
        "created_at is the timestamp"
    );
    assert_eq!(header(created, "eventType"), "Order.Created");
    assert_eq!(header(created, "traceparent"), PARENT);
    assert_eq!(header(created, "tracestate"), "congo=t61");
    // MariaDB's JSON type is text: the payload stays a string in the envelope, as Debezium (without
    // expand.json.payload) leaves it. Postgres jsonb is embedded as JSON (below).
    let value: serde_json::Value = serde_json::from_slice(created.value.as_ref().unwrap()).unwrap();
    assert_eq!(
        value,
        serde_json::json!({"payload": "{\"n\": 1}", "kind": "order"})
    );
    let paid = records
        .iter()
        .find(|r| r.header("id").unwrap().ends_with('2'))
        .unwrap();
    assert_eq!(paid.partition, 0);
    assert_eq!(paid.header("traceparent"), None);
    // A type the regex does not match is dead-lettered with the reason, not dropped.
    let dead = consume(&broker.bootstrap(), "dlq", 1, LIMIT);
    assert_eq!(dead.len(), 1);
    assert!(
        header(&dead[0], "outboxd.error").starts_with("topic_regex_mismatch"),
        "{:?}",
        dead[0].headers
    );
    outboxd.stop();
}

#[test]
fn postgres_records_carry_the_commit_time_and_are_routed_like_debeziums() {
    let pg = Postgres::start(&[]);
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
    create_topic(&broker.bootstrap(), "orders", 3);
    let body = format!(
        "[source]\nkind = \"postgres\"\nurl = \"{}\"\ntables = [\"public.events\"]\nslot = \"dbz\"\npublication = \"dbz\"\n\
         [kafka]\nbrokers = \"{}\"\n[http]\nlisten = \"\"\n{ROUTE}",
        pg.url("cdc", "app"),
        broker.bootstrap()
    );
    let mut outboxd = Outboxd::new("dbz-pg", &body);
    outboxd.start();
    let before = now_ms();
    pg.sql(
        "app",
        &format!(
            "INSERT INTO public.events VALUES
               ('00000000-0000-0000-0000-000000000001', 'order', 'o-1', 'Order.Created', '{{\"n\": 1}}', '{PARENT}', 1);"
        ),
    );
    let after = now_ms();
    let records = consume(&broker.bootstrap(), "orders", 1, LIMIT);
    assert_eq!(records.len(), 1);
    let r = &records[0];
    let ts = r.timestamp.expect("a timestamp");
    assert!(
        (before..=after).contains(&ts),
        "the commit time {ts} is not between {before} and {after}"
    );
    assert_eq!(r.partition, 1);
    assert_eq!(header(r, "eventType"), "Order.Created");
    assert_eq!(header(r, "traceparent"), PARENT);
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
    let db = MariaDb::start(&[]);
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
    db.sql_socket("UPDATE app.outbox SET type = 'Changed';");
    let status = outboxd.wait_exit(LIMIT);
    assert!(!status.success());
    let log = outboxd.log();
    assert!(
        log.contains("1 UPDATE(s) and 0 DELETE(s) of outbox rows were not forwarded")
            && log.contains("on_update_delete = \"warn\""),
        "{log}"
    );
    // The checkpoint stayed before the update: a restart stops at it again instead of skipping it.
    outboxd.start_with(&["--skip-checks"]);
    let status = outboxd.wait_exit(LIMIT);
    assert!(!status.success());
    assert!(outboxd.log().contains("UPDATE(s)"), "{}", outboxd.log());
}
