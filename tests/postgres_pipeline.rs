//! End-to-end: private PostgreSQL 15 (wal_level=logical) -> outboxd binary -> real broker -> consumer.

use crate::rig;

use std::time::Duration;

use crate::rig::scenario::{
    check_per_key_order, check_per_key_order_by, check_records_by, consume_events, event,
    mixed_transactions, n_of, uuid_of, MixedSql, LIMIT,
};
use crate::rig::{consume, create_topic, wait_until, Broker, Outboxd, Postgres};

pub(crate) const SCHEMA: &str = "
CREATE ROLE cdc WITH LOGIN REPLICATION;
CREATE TABLE public.outbox (
  id uuid PRIMARY KEY,
  aggregatetype text,
  aggregateid text NOT NULL,
  type text NOT NULL,
  payload jsonb,
  created_at timestamptz NOT NULL DEFAULT now()
);
ALTER TABLE public.outbox OWNER TO cdc;
CREATE TABLE public.other (id bigserial PRIMARY KEY, note text, raw bytea);
GRANT SELECT ON ALL TABLES IN SCHEMA public TO cdc;
GRANT CREATE ON DATABASE app TO cdc;
";

pub(crate) struct PgEnv {
    pub(crate) pg: Postgres,
    pub(crate) broker: Broker,
    pub(crate) outboxd: Outboxd,
}

fn setup(name: &str, extra_kafka: &str) -> PgEnv {
    setup_with_schema(name, SCHEMA, extra_kafka)
}

pub(crate) fn setup_with_schema(name: &str, schema: &str, extra_kafka: &str) -> PgEnv {
    setup_with_server(name, schema, extra_kafka, &[])
}

/// `server_conf` lines go into postgresql.conf.
fn setup_with_server(name: &str, schema: &str, extra_kafka: &str, server_conf: &[&str]) -> PgEnv {
    setup_on(15, name, schema, extra_kafka, server_conf)
}

/// [`setup_with_server`] on PostgreSQL `major`.
pub(crate) fn setup_on(
    major: u32,
    name: &str,
    schema: &str,
    extra_kafka: &str,
    server_conf: &[&str],
) -> PgEnv {
    let pg = Postgres::start_major(major, server_conf);
    pg.sql("postgres", "CREATE DATABASE app;");
    pg.sql("app", schema);
    let broker = Broker::start();
    for topic in ["outbox.event.order", "outbox.event.customer"] {
        create_topic(&broker.bootstrap(), topic, 3);
    }
    let body = format!(
        "[source]\nkind = \"postgres\"\nurl = \"{}\"\ntables = [\"public.outbox\"]\nslot = \"outboxd_{name}\"\n\
         publication = \"outboxd_{name}\"\nmessage_prefixes = [\"outbox\"]\nheartbeat_interval_ms = 1000\n\
         [kafka]\nbrokers = \"{}\"\n{extra_kafka}\n[http]\nlisten = \"\"\n",
        pg.url("cdc", "app"),
        broker.bootstrap()
    );
    let outboxd = Outboxd::new(name, &body);
    PgEnv {
        pg,
        broker,
        outboxd,
    }
}

/// jsonb as Postgres prints it: keys sorted by length, a space after ':' and ','.
pub(crate) fn pg_payload(n: u64) -> String {
    format!(r#"{{"n": {n}, "note": "café 🎉"}}"#)
}

pub(crate) fn insert_sql(n: u64) -> String {
    let (_, kind, key, payload) = event(n);
    format!(
        "INSERT INTO public.outbox (id, aggregatetype, aggregateid, type, payload) VALUES ('{}', '{kind}', '{key}', 'Created', '{payload}');",
        uuid_of(n)
    )
}

pub(crate) fn insert_rows(pg: &Postgres, from: u64, to: u64, per_txn: u64) {
    pg.sql(
        "app",
        &rig::scenario::transactions(from, to, per_txn, insert_sql),
    );
}

fn lsn(text: &str) -> u64 {
    let (hi, lo) = text.trim().split_once('/').unwrap();
    (u64::from_str_radix(hi, 16).unwrap() << 32) | u64::from_str_radix(lo, 16).unwrap()
}

fn slot_confirmed(env: &PgEnv, name: &str) -> u64 {
    lsn(&env.pg.sql(
        "app",
        &format!("SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = 'outboxd_{name}';"),
    ))
}

fn checkpoint_lsn(env: &PgEnv) -> u64 {
    lsn(env.outboxd.checkpoint()["position"]["lsn"]
        .as_str()
        .unwrap())
}

/// Rows `0..1000` in mixed transactions: with other tables' inserts (text and bytea) in the same
/// transaction, updates of outbox rows, and other tables' updates alone.
pub(crate) fn mixed_script() -> String {
    mixed_transactions(&MixedSql {
        insert: insert_sql,
        other_in_txn: |i| {
            format!("INSERT INTO public.other (note, raw) VALUES ('caf\u{e9} {i}', '\\xff00fe'::bytea);")
        },
        touch: |n| {
            format!(
                "UPDATE public.outbox SET type = 'Touched' WHERE id = '{}';",
                uuid_of(n)
            )
        },
        other_alone: |i| format!("UPDATE public.other SET note = 'x' WHERE id = {};\n", i + 1),
    })
}

#[test]
fn a_thousand_rows_in_mixed_transactions_arrive_exactly_once_with_jsonb_as_json_text() {
    let mut env = setup("mixed", "");
    env.outboxd.start();
    env.pg.sql("app", &mixed_script());
    let records = consume_events(&env.broker.bootstrap(), 1000);
    let duplicates = check_records_by(&records, 0..1000, pg_payload);
    assert_eq!(duplicates, 0);
    assert_eq!(records.len(), 1000);
    check_per_key_order(&records);
    rig::kafka::check_java_partitions(&records, 3);
    env.outboxd.stop();
}

/// Postgres gives commit times in microseconds: every row is timed from its commit to outboxd
/// reading it (`outboxd_source_delay_seconds`), and from that read to its hand-over to the
/// producer (`outboxd_handoff_seconds`), the two hops that split a slow stream from a slow outboxd.
#[test]
fn rows_are_timed_from_commit_to_read_and_from_read_to_handoff() {
    let mut env = setup("timed", "");
    let port = rig::free_port();
    let config = std::fs::read_to_string(env.outboxd.config_path()).unwrap();
    let config = config.replace("listen = \"\"", &format!("listen = \"127.0.0.1:{port}\""));
    std::fs::write(env.outboxd.config_path(), config).unwrap();
    env.outboxd.start();
    let script: String = (0..12).map(insert_sql).collect();
    env.pg.sql("app", &script);
    assert_eq!(consume_events(&env.broker.bootstrap(), 12).len(), 12);
    let count = |name: &str, labels: &str| {
        let metrics = rig::http_get(port, "/metrics").1;
        metrics
            .lines()
            .find(|l| l.starts_with(name) && l.contains(labels))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("no {name} in:\n{metrics}"))
    };
    assert_eq!(count("outboxd_source_delay_seconds_count", ""), 12.0);
    assert_eq!(count("outboxd_handoff_seconds_count", ""), 12.0);
    // Read within a minute of their commits (the largest finite bucket), none later.
    assert_eq!(
        count("outboxd_source_delay_seconds_bucket", "le=\"60.0\""),
        12.0
    );
    env.outboxd.stop();
}

/// An envelope for `pg_logical_emit_message`: the row `n` as a table-less outbox event.
fn envelope(n: u64) -> String {
    let (_, kind, key, _) = event(n);
    format!(
        r#"{{"id":"{}","aggregatetype":"{kind}","aggregateid":"{key}","type":"Created","payload":{{"n":{n}}}}}"#,
        uuid_of(n)
    )
}

#[test]
fn table_less_messages_arrive_in_commit_order_and_rolled_back_ones_never() {
    let mut env = setup("messages", "");
    env.outboxd.start();
    let mut script = String::new();
    let mut rolled_back = Vec::new();
    // Commit order: message n, then (in the same transaction) table row n + 1000.
    let mut commit_rank = std::collections::HashMap::new();
    for n in 0..100u64 {
        commit_rank.insert(n, 2 * n);
        commit_rank.insert(n + 1000, 2 * n + 1);
        let emit = format!(
            "SELECT pg_logical_emit_message(true, 'outbox', '{}');",
            envelope(n)
        );
        if n % 10 == 3 {
            // Emitted, then rolled back: must never arrive.
            script.push_str(&format!("BEGIN; {emit} ROLLBACK;\n"));
            rolled_back.push(n);
        } else if n % 4 == 0 {
            // Mixed with a table row in one transaction (the table row is n + 1000).
            script.push_str(&format!("BEGIN; {emit} {} COMMIT;\n", insert_sql(n + 1000)));
        } else {
            script.push_str(&format!("BEGIN; {emit} COMMIT;\n"));
        }
    }
    commit_rank.insert(500, 1_000);
    // Non-transactional: delivered at once, checkpointed at its own LSN.
    script.push_str(&format!(
        "SELECT pg_logical_emit_message(false, 'outbox', '{}');\n",
        envelope(500)
    ));
    // Another prefix is not ours.
    script.push_str("SELECT pg_logical_emit_message(true, 'audit', '{}');\n");
    env.pg.sql("app", &script);
    let table_rows = (0..100u64).filter(|n| n % 4 == 0 && n % 10 != 3).count();
    let expected = 100 - rolled_back.len() + 1 + table_rows;
    let records = consume_events(&env.broker.bootstrap(), expected);
    assert_eq!(records.len(), expected, "{}", env.outboxd.log());
    let ns: Vec<u64> = records.iter().map(n_of).collect();
    for n in &rolled_back {
        assert!(!ns.contains(n), "rolled-back message {n} arrived");
    }
    assert!(ns.contains(&500), "non-transactional message missing");
    let message = records.iter().find(|r| n_of(r) == 1).unwrap();
    assert_eq!(message.value.as_deref(), Some(&br#"{"n":1}"#[..]));
    assert_eq!(message.key.as_deref(), Some(event(1).2.as_bytes()));
    check_per_key_order_by(&records, |n| commit_rank[&n]);
    env.outboxd.stop();
}

#[test]
fn a_quiet_outbox_on_a_busy_database_still_advances_the_slot() {
    let mut env = setup("quiet", "");
    env.outboxd.start();
    let mut script = String::from("BEGIN;");
    for i in 0..10_000 {
        script.push_str(&format!("INSERT INTO public.other (note) VALUES ('n{i}');"));
        if i % 100 == 99 {
            script.push_str("COMMIT; BEGIN;");
        }
    }
    script.push_str("COMMIT;");
    env.pg.sql("app", &script);
    let after = lsn(&env.pg.sql("app", "SELECT pg_current_wal_lsn();"));
    wait_until("the slot to move past the unrelated inserts", LIMIT, || {
        slot_confirmed(&env, "quiet") >= after
    });
    assert!(checkpoint_lsn(&env) >= slot_confirmed(&env, "quiet"));
    env.outboxd.stop();
}

#[test]
fn the_slot_is_never_confirmed_ahead_of_the_durable_checkpoint() {
    let mut env = setup("confirm", "");
    env.outboxd.start();
    std::thread::scope(|scope| {
        let pg = &env.pg;
        let writer = scope.spawn(move || {
            for batch in 0..40u64 {
                pg.sql(
                    "app",
                    &rig::scenario::transactions(batch * 10, batch * 10 + 10, 1, insert_sql),
                );
            }
        });
        let mut samples = 0;
        while !writer.is_finished() || samples < 20 {
            // The slot first, then the checkpoint: the checkpoint only grows, so a violation cannot hide.
            let confirmed = slot_confirmed(&env, "confirm");
            let durable = checkpoint_lsn(&env);
            assert!(
                confirmed <= durable,
                "slot confirmed {confirmed:X} ahead of checkpoint {durable:X}"
            );
            samples += 1;
            if samples > 2_000 {
                break;
            }
        }
    });
    let records = consume_events(&env.broker.bootstrap(), 400);
    check_records_by(&records, 0..400, pg_payload);
    env.outboxd.stop();
}

#[test]
fn a_postgres_restart_mid_stream_and_a_kill_9_lose_nothing() {
    let mut env = setup("restart", "");
    env.outboxd.start();
    insert_rows(&env.pg, 0, 300, 3);
    env.pg.restart();
    insert_rows(&env.pg, 300, 600, 3);
    wait_until("some rows after the restart", LIMIT, || {
        consume(
            &env.broker.bootstrap(),
            "outbox.event.order",
            350,
            Duration::from_millis(500),
        )
        .len()
            >= 350
    });
    env.outboxd.kill9();
    insert_rows(&env.pg, 600, 900, 3);
    let recovery = std::time::Instant::now();
    env.outboxd.start();
    insert_rows(&env.pg, 900, 1000, 5);
    let records = rig::scenario::consume_distinct_events(&env.broker.bootstrap(), 1000);
    rig::scenario::report(
        "postgres restart + kill -9",
        "pg_ctl restart mid-stream, then kill -9 of outboxd",
        1000,
        &records,
        recovery,
    );
    let duplicates = check_records_by(&records, 0..1000, pg_payload);
    println!("postgres restart + kill -9: {duplicates} duplicates over 1000 rows");
    check_per_key_order(&records);
    assert!(env.outboxd.log().contains("replication stream opened"));
    env.outboxd.stop();
}

#[test]
fn a_null_aggregatetype_goes_to_the_dead_letter_topic_and_the_stream_goes_on() {
    let mut env = setup("nullroute", "dead_letter_topic = \"outboxd.dlq.pg\"");
    create_topic(&env.broker.bootstrap(), "outboxd.dlq.pg", 1);
    env.outboxd.start();
    env.pg.sql(
        "app",
        &format!(
            "INSERT INTO public.outbox (id, aggregatetype, aggregateid, type, payload) VALUES ('{}', NULL, 'k', 'Bad', '{{}}');",
            uuid_of(7777)
        ),
    );
    insert_rows(&env.pg, 1, 2, 1);
    let dead = consume(&env.broker.bootstrap(), "outboxd.dlq.pg", 1, LIMIT);
    assert_eq!(dead.len(), 1, "{}", env.outboxd.log());
    assert!(dead[0]
        .header("outboxd.error")
        .unwrap()
        .starts_with("null_routing_value"));
    assert_eq!(dead[0].header("outboxd.table").unwrap(), "public.outbox");
    let good = consume(&env.broker.bootstrap(), "outbox.event.order", 1, LIMIT);
    assert_eq!(good.len(), 1);
    env.outboxd.stop();
}

#[test]
fn check_reports_a_postgres_setup() {
    let env = setup("check", "");
    let out = env.outboxd.command_output(&["check"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    for needle in [
        "wal_level = logical",
        "REPLICATION attribute",
        "has the routed columns",
    ] {
        assert!(text.contains(needle), "{needle} missing:\n{text}");
    }
}

#[test]
fn a_frozen_walsender_is_noticed_by_the_missing_heartbeats_and_nothing_is_lost() {
    // A walsender that exists but reads nothing is given wal_sender_timeout (it could be replaying
    // one large transaction); 5 s here keeps the test short.
    let mut env = setup_with_server("frozen", SCHEMA, "", &["wal_sender_timeout = '5s'"]);
    env.outboxd.start();
    insert_rows(&env.pg, 0, 50, 5);
    assert_eq!(consume_events(&env.broker.bootstrap(), 50).len(), 50);
    // Freeze the server process that streams to outboxd: its socket stays open, it just goes silent.
    let pid: i32 = env
        .pg
        .sql(
            "app",
            "SELECT pid FROM pg_stat_replication WHERE application_name = 'outboxd';",
        )
        .trim()
        .parse()
        .unwrap();
    let walsender = nix::unistd::Pid::from_raw(pid);
    nix::sys::signal::kill(walsender, nix::sys::signal::Signal::SIGSTOP).unwrap();
    wait_until("outboxd to notice the silent stream", LIMIT, || {
        env.outboxd
            .log()
            .contains("no replication message or heartbeat")
    });
    nix::sys::signal::kill(walsender, nix::sys::signal::Signal::SIGCONT).unwrap();
    let recovery = std::time::Instant::now();
    insert_rows(&env.pg, 50, 100, 5);
    let records = consume_events(&env.broker.bootstrap(), 100);
    rig::scenario::report(
        "frozen walsender",
        "Postgres walsender SIGSTOPped past 3 heartbeats, then SIGCONT",
        100,
        &records,
        recovery,
    );
    assert_eq!(records.len(), 100, "{}", env.outboxd.log());
    check_records_by(&records, 0..100, pg_payload);
    env.outboxd.stop();
}

/// The outbox partitioned by time, as many teams keep it so old events can be dropped cheaply.
pub(crate) const PARTITIONED_SCHEMA: &str = "
CREATE ROLE cdc WITH LOGIN REPLICATION;
CREATE TABLE public.outbox (
  id uuid NOT NULL,
  aggregatetype text,
  aggregateid text NOT NULL,
  type text NOT NULL,
  payload jsonb,
  created_at timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (id, created_at)
) PARTITION BY RANGE (created_at);
CREATE TABLE public.outbox_old PARTITION OF public.outbox FOR VALUES FROM (MINVALUE) TO ('2000-01-01');
CREATE TABLE public.outbox_now PARTITION OF public.outbox FOR VALUES FROM ('2000-01-01') TO ('2100-01-01');
ALTER TABLE public.outbox OWNER TO cdc;
ALTER TABLE public.outbox_old OWNER TO cdc;
ALTER TABLE public.outbox_now OWNER TO cdc;
CREATE TABLE public.other (id bigserial PRIMARY KEY, note text, raw bytea);
GRANT SELECT ON ALL TABLES IN SCHEMA public TO cdc;
GRANT CREATE ON DATABASE app TO cdc;
";

/// Row `n` with an explicit `created_at`, so the test picks the partition it lands in.
pub(crate) fn insert_at_sql(n: u64, created_at: &str) -> String {
    let (_, kind, key, payload) = event(n);
    format!(
        "INSERT INTO public.outbox (id, aggregatetype, aggregateid, type, payload, created_at) VALUES ('{}', '{kind}', '{key}', 'Created', '{payload}', '{created_at}');",
        uuid_of(n)
    )
}

/// Rows into the partitions that existed at start, then into one created after start and one
/// attached after start (a table made first, then `ATTACH PARTITION`).
fn insert_into_every_partition(pg: &Postgres) {
    let mut script = String::from("BEGIN;");
    for n in 0..20 {
        let at = if n % 2 == 0 {
            "1999-06-01"
        } else {
            "2024-06-01"
        };
        script.push_str(&insert_at_sql(n, at));
    }
    script.push_str("COMMIT;");
    pg.sql("app", &script);
    pg.sql(
        "app",
        "CREATE TABLE public.outbox_next PARTITION OF public.outbox FOR VALUES FROM ('2100-01-01') TO ('2200-01-01');\n\
         CREATE TABLE public.outbox_far (LIKE public.outbox INCLUDING DEFAULTS);\n\
         ALTER TABLE public.outbox ATTACH PARTITION public.outbox_far FOR VALUES FROM ('2200-01-01') TO ('2300-01-01');",
    );
    let mut script = String::from("BEGIN;");
    for n in 20..40 {
        let at = if n % 2 == 0 {
            "2150-01-01"
        } else {
            "2250-01-01"
        };
        script.push_str(&insert_at_sql(n, at));
    }
    script.push_str("COMMIT;");
    pg.sql("app", &script);
}

#[test]
fn a_partitioned_outbox_forwards_every_partition_including_ones_attached_after_start() {
    let mut env = setup_with_schema("parted", PARTITIONED_SCHEMA, "");
    env.outboxd.start();
    let started = std::time::Instant::now();
    insert_into_every_partition(&env.pg);
    let records = consume_events(&env.broker.bootstrap(), 40);
    assert_eq!(records.len(), 40, "{}", env.outboxd.log());
    check_records_by(&records, 0..40, pg_payload);
    // The publication outboxd made names the root, so new partitions need nothing.
    let via_root = env.pg.sql(
        "app",
        "SELECT pubviaroot FROM pg_publication WHERE pubname = 'outboxd_parted';",
    );
    assert_eq!(via_root.trim(), "t");
    // A restart does not refuse the publication it made.
    env.outboxd.stop();
    env.outboxd.start();
    env.pg.sql("app", &insert_at_sql(40, "2024-06-02"));
    let records = consume_events(&env.broker.bootstrap(), 41);
    rig::scenario::report(
        "partitioned outbox (postgres)",
        "rows into a RANGE-partitioned outbox: 2 partitions from the start, 1 created and 1 attached after start, then a restart",
        41,
        &records,
        started,
    );
    check_records_by(&records, 0..41, pg_payload);
    let out = env.outboxd.command_output(&["check"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("public.outbox is in publication"), "{text}");
    env.outboxd.stop();
}

#[test]
fn a_publication_without_publish_via_partition_root_is_refused_with_the_alter_that_fixes_it() {
    let env = setup_with_schema("leaves", PARTITIONED_SCHEMA, "");
    // Made by hand (or by Debezium) without the option: rows would arrive under the partitions'
    // names, and a partition detached before outboxd read its rows could not be told apart.
    env.pg.sql(
        "app",
        "CREATE PUBLICATION outboxd_leaves FOR TABLE public.outbox WITH (publish = 'insert');",
    );
    let alter = "ALTER PUBLICATION \"outboxd_leaves\" SET (publish_via_partition_root = true);";
    let out = env.outboxd.command_output(&["check"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("FAIL") && text.contains(alter), "{text}");
    assert!(
        !text.contains("ADD TABLE"),
        "the table is in the publication already:\n{text}"
    );
    let out = env.outboxd.command_output(&["run", "--skip-checks"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(alter), "{stderr}");
    // The remedy works.
    env.pg.sql("app", alter);
    let mut env = env;
    env.outboxd.start();
    let started = std::time::Instant::now();
    insert_into_every_partition(&env.pg);
    let records = consume_events(&env.broker.bootstrap(), 40);
    rig::scenario::report(
        "partitioned outbox, publication fixed (postgres)",
        "a publication without publish_via_partition_root is refused; after the ALTER it names, every partition's rows arrive",
        40,
        &records,
        started,
    );
    assert_eq!(records.len(), 40, "{}", env.outboxd.log());
    check_records_by(&records, 0..40, pg_payload);
    env.outboxd.stop();
}

#[test]
fn a_huge_transaction_on_another_table_is_ridden_out_without_a_reconnect_loop() {
    let mut env = setup("huge", "");
    env.outboxd.start();
    insert_rows(&env.pg, 0, 5, 1);
    assert_eq!(consume_events(&env.broker.bootstrap(), 5).len(), 5);
    // The walsender decodes this for far longer than 3 heartbeat intervals (1 s each) and sends
    // nothing meanwhile: the table is not published.
    env.pg.sql(
        "app",
        "INSERT INTO public.other (note) SELECT 'row ' || g FROM generate_series(1, 3000000) g;",
    );
    let started = std::time::Instant::now();
    insert_rows(&env.pg, 5, 20, 5);
    let records = consume_events(&env.broker.bootstrap(), 20);
    rig::scenario::report(
        "huge foreign transaction (postgres)",
        "a 3,000,000-row INSERT into another table (heartbeat 1 s), then outbox rows",
        20,
        &records,
        started,
    );
    check_records_by(&records, 0..20, pg_payload);
    let log = env.outboxd.log();
    assert!(!log.contains("reconnecting"), "{log}");
    env.outboxd.stop();
}

#[test]
fn a_scram_login_streams_rows_and_a_wrong_password_stops_with_the_remedy() {
    let mut env = setup("scram", "");
    // outboxd's connections must log in with SCRAM-SHA-256 (the first matching line wins; a
    // logical replication connection matches its database's lines, not `replication`).
    let hba = env.pg.dir().join("pg_hba.conf");
    let rules = std::fs::read_to_string(&hba).unwrap();
    std::fs::write(
        &hba,
        format!("host app cdc 127.0.0.1/32 scram-sha-256\n{rules}"),
    )
    .unwrap();
    env.pg.sql(
        "app",
        &format!(
            "ALTER ROLE cdc PASSWORD '{}'; SELECT pg_reload_conf();",
            rig::mysqld::CDC_PASSWORD
        ),
    );
    env.outboxd.start();
    let script: String = (0..20).map(insert_sql).collect();
    env.pg.sql("app", &script);
    let records = consume_events(&env.broker.bootstrap(), 20);
    assert_eq!(check_records_by(&records, 0..20, pg_payload), 0);
    assert_eq!(records.len(), 20, "{}", env.outboxd.log());
    env.outboxd.stop();

    // A password the server no longer takes: a clear stop, not a reconnect loop.
    env.pg
        .sql("app", "ALTER ROLE cdc PASSWORD 'a-different-one';");
    let out = env.outboxd.command_output(&["run", "--skip-checks"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("password authentication failed"),
        "{stderr}"
    );
    assert!(!stderr.contains(rig::mysqld::CDC_PASSWORD), "{stderr}");
}

/// The smoke set for a major other than 15 (those run the whole Postgres suite): a thousand rows in
/// mixed transactions beside other tables' changes arrive once, in key order, with jsonb as JSON
/// text; after a stop, table rows and table-less messages committed meanwhile arrive from the
/// checkpoint, each once.
fn smoke_on(major: u32) {
    assert!(
        rig::postgres::MAJORS.contains(&major),
        "the rig installs {major}"
    );
    let name = format!("pg{major}");
    let mut env = setup_on(major, &name, SCHEMA, "", &[]);
    let version = env.pg.sql("postgres", "SHOW server_version_num;");
    assert!(
        version.trim().starts_with(&major.to_string()),
        "server {version} is PostgreSQL {major}"
    );
    env.outboxd.start();
    env.pg.sql("app", &mixed_script());
    let records = consume_events(&env.broker.bootstrap(), 1000);
    assert_eq!(
        check_records_by(&records, 0..1000, pg_payload),
        0,
        "PostgreSQL {major}: {}",
        env.outboxd.log()
    );
    check_per_key_order(&records);
    env.outboxd.stop();
    insert_rows(&env.pg, 1000, 1100, 10);
    let mut messages = String::new();
    for n in 2000..2010u64 {
        messages.push_str(&format!(
            "SELECT pg_logical_emit_message(true, 'outbox', '{}');\n",
            envelope(n)
        ));
    }
    env.pg.sql("app", &messages);
    env.outboxd.start();
    let records = consume_events(&env.broker.bootstrap(), 1110);
    let ns: std::collections::BTreeSet<u64> = records.iter().map(n_of).collect();
    let expected: std::collections::BTreeSet<u64> = (0..1100).chain(2000..2010).collect();
    assert_eq!(ns, expected, "PostgreSQL {major}: {}", env.outboxd.log());
    assert_eq!(records.len(), 1110, "a clean stop leaves no duplicate");
    env.outboxd.stop();
    routed_columns_the_publication_never_sends_fail_check(&mut env, major);
}

/// A routed column the table has but the publication never sends (a generated column; one left out
/// of a column list, 15+) fails `check`, naming the column, why and the fix. On 18 the fix
/// (`publish_generated_columns = stored`) is applied and rows routed by that column arrive.
fn routed_columns_the_publication_never_sends_fail_check(env: &mut PgEnv, major: u32) {
    let publication = format!("outboxd_pg{major}");
    let check = |env: &PgEnv| {
        let out = env.outboxd.command_output(&["check"]);
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    };
    let path = env.outboxd.config_path();
    let body = std::fs::read_to_string(&path).unwrap();
    if (15..18).contains(&major) {
        env.pg.sql(
            "app",
            &format!("ALTER PUBLICATION {publication} SET TABLE public.outbox (id, aggregatetype, aggregateid, type);"),
        );
        let shown = check(env);
        assert!(
            shown.contains("routed column(s) payload of public.outbox never reach outboxd")
                && shown.contains("column list"),
            "{shown}"
        );
        env.pg.sql(
            "app",
            &format!("ALTER PUBLICATION {publication} SET TABLE public.outbox;"),
        );
    }
    env.pg.sql(
        "app",
        "ALTER TABLE public.outbox ADD COLUMN kind text GENERATED ALWAYS AS (aggregatetype) STORED;",
    );
    std::fs::write(
        &path,
        body.replace("[kafka]", "[route]\nby = \"kind\"\n[kafka]"),
    )
    .unwrap();
    let shown = check(env);
    assert!(
        shown.contains("FAIL")
            && shown.contains("routed column(s) kind of public.outbox never reach outboxd"),
        "PostgreSQL {major}: {shown}"
    );
    if major < 18 {
        assert!(shown.contains("does not send generated columns"), "{shown}");
        return;
    }
    assert!(
        shown.contains("publish_generated_columns = stored"),
        "{shown}"
    );
    env.pg.sql(
        "app",
        &format!("ALTER PUBLICATION {publication} SET (publish_generated_columns = stored);"),
    );
    let shown = check(env);
    assert!(!shown.contains("FAIL"), "{shown}");
    env.outboxd.start();
    insert_rows(&env.pg, 3000, 3010, 5);
    let records = rig::scenario::consume_distinct_events(&env.broker.bootstrap(), 1120);
    let routed = records
        .iter()
        .filter(|r| (3000..3010).contains(&n_of(r)))
        .count();
    assert!(
        routed >= 10,
        "rows routed by a published generated column arrive\n{}",
        env.outboxd.log()
    );
    env.outboxd.stop();
}

#[test]
fn postgres_14_streams_mixed_transactions_and_messages_and_resumes_after_a_stop() {
    smoke_on(14);
}

#[test]
fn postgres_16_streams_mixed_transactions_and_messages_and_resumes_after_a_stop() {
    smoke_on(16);
}

#[test]
fn postgres_17_streams_mixed_transactions_and_messages_and_resumes_after_a_stop() {
    smoke_on(17);
}

#[test]
fn postgres_18_streams_mixed_transactions_and_messages_and_resumes_after_a_stop() {
    smoke_on(18);
}

/// PostgreSQL 13's pgoutput has no logical decoding messages (outboxd's heartbeat and table-less
/// outbox): `check` fails and `run` stops naming the oldest major outboxd reads, instead of the
/// replication command's "unrecognized pgoutput option" or a retry loop.
#[test]
fn postgres_13_is_refused_by_check_and_run_naming_the_oldest_major_outboxd_reads() {
    let mut env = setup_on(13, "pg13", SCHEMA, "", &[]);
    let out = env.outboxd.command_output(&["check"]);
    let shown = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{shown}");
    assert!(
        shown.contains("FAIL") && shown.contains("PostgreSQL 13.") && shown.contains("14 or later"),
        "{shown}"
    );
    env.outboxd.spawn(&[]);
    assert!(!env.outboxd.wait_exit(LIMIT).success());
    let log = env.outboxd.log();
    assert!(
        log.contains("is too old") && log.contains("14 or later"),
        "{log}"
    );
    assert_eq!(log.matches("is too old").count(), 1, "no retry loop: {log}");
}
