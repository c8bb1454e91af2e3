//! The initial snapshot (`source.snapshot`) and `outboxd snapshot`, on real MariaDB and Postgres:
//! rows already in the outbox when outboxd first starts arrive exactly once, together with rows
//! written while the tables are read and after; a crash in the middle resumes the snapshot; a
//! predicate chooses the rows; an on-demand snapshot re-sends rows with their own ids.

use std::collections::HashMap;

use crate::on_both_servers;
use crate::postgres_pipeline as pg_rows;
use crate::rig::scenario::{
    check_records_by, config_body, consume_distinct_events, event, insert_rows, insert_sql, n_of,
    transactions, Env, SCHEMA,
};
use crate::rig::{
    create_topic, mysqld::sql_at, Broker, Consumed, Flavor, Mysqld, Outboxd, Postgres,
};

fn maria_env(name: &str, source_extra: &str) -> Env {
    binlog_env(Flavor::MariaDb, name, source_extra)
}

fn binlog_env(flavor: Flavor, name: &str, source_extra: &str) -> Env {
    let db = Mysqld::start(flavor, &[]);
    db.sql_socket(SCHEMA);
    let broker = Broker::start();
    for topic in ["outbox.event.order", "outbox.event.customer"] {
        create_topic(&broker.bootstrap(), topic, 3);
    }
    let body = config_body(&db.cdc_url(), &broker.bootstrap(), "", "").replace(
        "heartbeat_interval_ms = 1000\n",
        &format!("heartbeat_interval_ms = 1000\n{source_extra}\n"),
    );
    let outboxd = Outboxd::new(name, &body);
    Env {
        db,
        broker,
        outboxd,
    }
}

struct PgEnv {
    pg: Postgres,
    broker: Broker,
    outboxd: Outboxd,
}

fn pg_env(name: &str, schema_extra: &str, source_extra: &str) -> PgEnv {
    let pg = Postgres::start(&[]);
    pg.sql("postgres", "CREATE DATABASE app;");
    pg.sql("app", pg_rows::SCHEMA);
    if !schema_extra.is_empty() {
        pg.sql("app", schema_extra);
    }
    let broker = Broker::start();
    for topic in ["outbox.event.order", "outbox.event.customer"] {
        create_topic(&broker.bootstrap(), topic, 3);
    }
    let body = format!(
        "[source]\nkind = \"postgres\"\nurl = \"{}\"\ntables = [\"public.outbox\"]\nslot = \"outboxd_snap\"\n\
         publication = \"outboxd_snap\"\nheartbeat_interval_ms = 1000\n{source_extra}\n\
         [kafka]\nbrokers = \"{}\"\n[http]\nlisten = \"\"\n",
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

/// How often each row arrived.
fn counts(records: &[Consumed]) -> HashMap<u64, usize> {
    let mut seen = HashMap::new();
    for r in records {
        *seen.entry(n_of(r)).or_insert(0) += 1;
    }
    seen
}

fn assert_streaming_checkpoint(outboxd: &Outboxd) {
    let position = &outboxd.checkpoint()["position"];
    assert!(
        position.get("snapshot").is_none(),
        "the checkpoint should hold a log position once the snapshot is done: {position}"
    );
}

/// Rows 0..2000 exist before the first start; 2000..3000 are written while it starts and reads;
/// 3000..3100 after it is done. Each arrives exactly once.
fn mariadb_first_start(name: &str, grants: &str, env_vars: &[(&str, &str)]) {
    first_start(Flavor::MariaDb, name, grants, env_vars)
}

fn first_start(flavor: Flavor, name: &str, grants: &str, env_vars: &[(&str, &str)]) {
    let mut env = binlog_env(
        flavor,
        name,
        "snapshot = \"initial\"\nsnapshot_chunk = 150\n[route]\nheaders = { state = \"state\" }",
    );
    // An ENUM travels in the binlog as its index: snapshot rows must carry the same.
    env.db.sql_socket(&format!(
        "ALTER TABLE app.outbox ADD COLUMN state ENUM('new', 'sent') NOT NULL DEFAULT 'sent'; {grants}"
    ));
    insert_rows(&env.db, 0, 2000, 10);
    // The writer is already committing while outboxd pairs its read with the binlog position, so a
    // pairing that missed or repeated a transaction shows below as a missing or twice-sent row.
    let socket = env.db.socket_path();
    let writer = std::thread::spawn(move || {
        sql_at(&socket, &transactions(2000, 3000, 1, insert_sql));
    });
    env.outboxd.start_with_env(&[], env_vars);
    writer.join().unwrap();
    let records = consume_distinct_events(&env.broker.bootstrap(), 3000);
    let duplicates = check_records_by(&records, 0..3000, |n| event(n).3);
    assert_eq!(duplicates, 0, "rows arrived twice: {:?}", {
        let mut twice: Vec<u64> = counts(&records)
            .into_iter()
            .filter(|(_, c)| *c > 1)
            .map(|(n, _)| n)
            .collect();
        twice.sort();
        twice.truncate(10);
        twice
    });
    for r in &records {
        assert_eq!(r.header("state").as_deref(), Some("2"), "row {}", n_of(r));
    }
    let snapshot_rows = records
        .iter()
        .filter(|r| {
            r.header("outboxd.position")
                .is_some_and(|p| p.starts_with("snapshot:app.outbox:"))
        })
        .count();
    assert!(
        snapshot_rows >= 2000,
        "the rows written before the start come from the snapshot: {snapshot_rows}"
    );
    insert_rows(&env.db, 3000, 3100, 10);
    let records = consume_distinct_events(&env.broker.bootstrap(), 3100);
    assert_eq!(check_records_by(&records, 0..3100, |n| event(n).3), 0);
    let log = env.outboxd.log();
    assert!(log.contains("snapshot read every table"), "{log}");
    assert!(log.contains("snapshot done: streaming the log"), "{log}");
    assert_streaming_checkpoint(&env.outboxd);
    env.outboxd.stop();
    // The log position the snapshot paired its read with carries the server's GTIDs on.
    assert_eq!(
        env.outboxd.checkpoint()["position"]["gtid_set"],
        env.db.gtid().as_str()
    );
}

#[test]
fn mariadb_first_start_sends_the_rows_already_there_once_then_streams() {
    mariadb_first_start("snap-maria", "", &[]);
}

on_both_servers! {
/// MySQL has no `Binlog_snapshot_file`: its path (a brief LOCK TABLES … READ pairing the read with
/// the binlog end and, with GTIDs, the executed set) runs on MySQL 9, and is forced on MariaDB,
/// which understands the same statements.
fn the_mysql_lock_pairing_also_sends_each_row_exactly_once(flavor: Flavor) {
    let forced: &[(&str, &str)] = match flavor {
        Flavor::MariaDb => &[("OUTBOXD_TEST_SNAPSHOT_LOCK", "1")],
        Flavor::MySql => &[],
    };
    first_start(
        flavor,
        "snap-lock",
        "GRANT LOCK TABLES ON app.* TO 'cdc'@'127.0.0.1';",
        forced,
    );
}
}

#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "needs --features failpoints")]
fn a_crash_in_the_middle_of_a_mariadb_snapshot_resumes_it_and_loses_nothing() {
    let mut env = maria_env("snap-crash", "snapshot = \"initial\"\nsnapshot_chunk = 200");
    insert_rows(&env.db, 0, 20_000, 100);
    crash_and_resume(&mut env.outboxd, &env.broker, 20_000, |n| event(n).3);
}

#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "needs --features failpoints")]
fn a_crash_in_the_middle_of_a_postgres_snapshot_resumes_it_and_loses_nothing() {
    let mut env = pg_env(
        "snap-pg-crash",
        "",
        "snapshot = \"initial\"\nsnapshot_chunk = 200",
    );
    pg_rows::insert_rows(&env.pg, 0, 20_000, 100);
    crash_and_resume(&mut env.outboxd, &env.broker, 20_000, pg_rows::pg_payload);
}

/// Aborts the first run at its fifth checkpoint write (inside the snapshot), then restarts it.
fn crash_and_resume(
    outboxd: &mut Outboxd,
    broker: &Broker,
    total: u64,
    payload: impl Fn(u64) -> String,
) {
    outboxd.start_with_env(
        &[],
        &[(
            "FAILPOINTS",
            &format!(
                "{}=4*off->return",
                outboxd::fault::AFTER_ACK_BEFORE_CHECKPOINT
            ),
        )],
    );
    let status = outboxd.wait_exit(crate::rig::scenario::LIMIT);
    assert!(!status.success(), "the fail point did not fire");
    let at_crash = outboxd.checkpoint();
    let done = at_crash["position"]["snapshot"]["rows"]
        .as_u64()
        .unwrap_or_else(|| panic!("the crash should hit inside the snapshot: {at_crash}"));
    assert!(done > 0 && done < total, "{at_crash}");
    outboxd.start();
    let records = consume_distinct_events(&broker.bootstrap(), total as usize);
    let duplicates = check_records_by(&records, 0..total, payload);
    assert!(
        duplicates as u64 <= total - done,
        "{duplicates} duplicates: more than the rows after the checkpoint ({})",
        total - done
    );
    let log = outboxd.log();
    assert!(log.contains("resuming the snapshot"), "{log}");
    assert_streaming_checkpoint(outboxd);
    outboxd.stop();
}

/// `initial_where` on Postgres: rows a relay already published (0..500) stay unsent; the rest of
/// the backlog (500..1000) comes from the slot's exported snapshot, rows written meanwhile
/// (1000..1500) from the stream; each exactly once.
#[test]
fn postgres_first_start_sends_the_unpublished_rows_once_then_streams() {
    let mut env = pg_env(
        "snap-pg",
        "ALTER TABLE public.outbox ADD COLUMN published boolean NOT NULL DEFAULT false, \
         ADD COLUMN flag boolean DEFAULT true, ADD COLUMN code char(4) DEFAULT 'ab';",
        "snapshot = \"initial_where\"\nsnapshot_where = \"NOT published\"\nsnapshot_chunk = 70\n\
         [route]\nheaders = { flag = \"flag\", code = \"code\" }",
    );
    pg_rows::insert_rows(&env.pg, 0, 1000, 10);
    env.pg.sql(
        "app",
        &(0..500u64)
            .map(|n| {
                format!(
                    "UPDATE public.outbox SET published = true WHERE id = '{}';",
                    crate::rig::scenario::uuid_of(n)
                )
            })
            .collect::<String>(),
    );
    // Writes go on while outboxd creates the slot and imports its snapshot (see mariadb_first_start).
    let (pg, outboxd) = (&env.pg, &mut env.outboxd);
    std::thread::scope(|scope| {
        scope.spawn(|| pg_rows::insert_rows(pg, 1000, 1500, 1));
        outboxd.start();
    });
    let records = consume_distinct_events(&env.broker.bootstrap(), 1000);
    let seen = counts(&records);
    let published: Vec<u64> = seen.keys().copied().filter(|n| *n < 500).collect();
    assert!(
        published.is_empty(),
        "published rows were sent: {published:?}"
    );
    let duplicates = check_records_by(&records, 500..1500, pg_rows::pg_payload);
    assert_eq!(duplicates, 0);
    // Snapshot rows render their columns exactly as streamed rows do (pgoutput's text forms).
    for r in &records {
        assert_eq!(r.header("flag").as_deref(), Some("true"), "row {}", n_of(r));
        assert_eq!(r.header("code").as_deref(), Some("ab  "), "row {}", n_of(r));
    }
    let log = env.outboxd.log();
    assert!(
        log.contains("created the replication slot with an exported snapshot"),
        "{log}"
    );
    assert_streaming_checkpoint(&env.outboxd);
    env.outboxd.stop();
}

/// `outboxd snapshot` beside a running pipeline: it re-sends the chosen rows with their own ids and
/// exits; a predicate the server refuses is named, and nothing is sent.
#[test]
fn an_on_demand_snapshot_resends_the_chosen_rows_and_leaves_the_pipeline_alone() {
    let mut env = maria_env("snap-again", "");
    env.outboxd.start();
    insert_rows(&env.db, 0, 300, 10);
    consume_distinct_events(&env.broker.bootstrap(), 300);
    let before = env.outboxd.checkpoint();

    let out = env
        .outboxd
        .command_output(&["snapshot", "--where", "no_such_column = 1"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("no_such_column") && stderr.contains("snapshot_where"),
        "{stderr}"
    );

    let out = env
        .outboxd
        .command_output(&["snapshot", "--where", "aggregatetype = 'customer'"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let customers = (0..300u64).filter(|n| event(*n).1 == "customer").count();
    assert!(
        stdout.contains(&format!("sent {customers} record(s)")),
        "{stdout}"
    );
    // 300 rows once, the customer rows twice (same id, same content).
    let records = crate::rig::scenario::consume_events(&env.broker.bootstrap(), 300 + customers);
    check_records_by(&records, 0..300, |n| event(n).3);
    for (n, count) in counts(&records) {
        let expected = if event(n).1 == "customer" { 2 } else { 1 };
        assert_eq!(count, expected, "row {n}");
    }
    // The running pipeline still streams, from its own checkpoint.
    insert_rows(&env.db, 300, 310, 10);
    crate::rig::scenario::consume_events(&env.broker.bootstrap(), 310 + customers);
    assert!(env.outboxd.child_running());
    let after = env.outboxd.checkpoint();
    assert_ne!(before["position"], after["position"]);
    assert!(after["position"].get("snapshot").is_none());
    env.outboxd.stop();
}
