//! Retention (`[prune]` and `outboxd prune`) on real MariaDB, MySQL 9 and Postgres: forwarded rows are
//! deleted (or their partitions dropped), and while Kafka acknowledges nothing, nothing is.

use std::time::Duration;

use crate::on_both_servers;
use crate::operate::output;
use crate::postgres_pipeline::{self as pg_rows, PgEnv};
use crate::rig::scenario::{
    config_body, consume_distinct_events, insert_rows, insert_sql, Env, SCHEMA,
};
use crate::rig::{create_topic, wait_until, Broker, Mysqld, Outboxd};

const ROUNDS: &str = "[prune]\nevery = \"1s\"\nolder_than = \"0s\"\nbatch = 50\n";

fn maria_env(name: &str, schema: &str, prune: &str) -> Env {
    let db = Mysqld::mariadb(&[]);
    db.sql_socket(schema);
    // Pruning needs DELETE on the outbox, and PROCESS to see the open transactions.
    db.sql_socket(
        "GRANT DELETE, DROP, ALTER ON app.* TO 'cdc'@'127.0.0.1'; GRANT PROCESS ON *.* TO 'cdc'@'127.0.0.1';",
    );
    let broker = Broker::start();
    for topic in ["outbox.event.order", "outbox.event.customer"] {
        create_topic(&broker.bootstrap(), topic, 3);
    }
    let body = format!(
        "{}{prune}",
        config_body(&db.cdc_url(), &broker.bootstrap(), "", "")
    );
    let outboxd = Outboxd::new(name, &body);
    Env {
        db,
        broker,
        outboxd,
    }
}

/// Adds a section at the end of `outboxd`'s config file.
fn append_config(outboxd: &Outboxd, section: &str) {
    use std::io::Write;
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(outboxd.config_path())
        .unwrap();
    file.write_all(section.as_bytes()).unwrap();
}

fn maria_count(db: &Mysqld, sql: &str) -> u64 {
    db.sql_socket(sql).trim().parse().unwrap_or(u64::MAX)
}

/// How many prune rounds the log shows after byte `from`, whatever they did.
fn rounds_since(outboxd: &Outboxd, from: usize) -> usize {
    let log = outboxd.log();
    log[from..].matches("prune: nothing deleted").count()
        + log[from..].matches("prune round done").count()
}

/// `outboxd prune` with a short wait; (exit success, output).
fn prune_once(outboxd: &Outboxd, wait: &str) -> (bool, String) {
    output(outboxd, &["prune", "--older-than", "0s", "--wait", wait])
}

/// Rows forwarded and acknowledged are deleted by `run`'s rounds; with the broker frozen, rounds
/// and `outboxd prune` delete nothing; after it thaws, everything arrives and is deleted.
#[test]
fn mariadb_prune_deletes_what_kafka_acknowledged_and_nothing_while_the_broker_is_frozen() {
    let mut env = maria_env("prune-maria", SCHEMA, ROUNDS);
    env.outboxd.start();
    insert_rows(&env.db, 0, 300, 10);
    consume_distinct_events(&env.broker.bootstrap(), 300);
    let count = "SELECT COUNT(*) FROM app.outbox";
    wait_until(
        "the rounds delete the forwarded rows",
        Duration::from_secs(60),
        || maria_count(&env.db, count) == 0,
    );
    assert!(env.outboxd.log().contains("prune round done"));

    env.broker.freeze();
    // Created "long ago" by the application's clock: only the checkpoint keeps them.
    let mut script = String::new();
    for n in 300..500 {
        script.push_str(&maria_insert_at(n, "2000-01-01 00:00:00"));
    }
    env.db.sql_socket(&script);
    let mark = env.outboxd.log().len();
    wait_until(
        "prune rounds while the broker is frozen",
        Duration::from_secs(60),
        || rounds_since(&env.outboxd, mark) >= 3,
    );
    let (ok, text) = prune_once(&env.outboxd, "2s");
    assert!(!ok, "prune succeeded with a frozen broker:\n{text}");
    assert!(text.contains("prune deleted nothing"), "{text}");
    assert_eq!(
        maria_count(&env.db, count),
        200,
        "unacknowledged rows were deleted"
    );

    env.broker.thaw();
    let records = consume_distinct_events(&env.broker.bootstrap(), 500);
    assert!(records.len() >= 500);
    wait_until(
        "the rounds delete the rest once Kafka acknowledged it",
        Duration::from_secs(60),
        || maria_count(&env.db, count) == 0,
    );
    let (ok, text) = prune_once(&env.outboxd, "30s");
    assert!(ok, "{text}");
    assert!(text.contains("deleted 0 row(s)"), "{text}");
    env.outboxd.stop();
}

#[test]
fn postgres_prune_deletes_what_kafka_acknowledged_and_nothing_while_the_broker_is_frozen() {
    let mut env: PgEnv = pg_rows::setup_with_schema("prunepg", pg_rows::SCHEMA, "");
    append_config(&env.outboxd, ROUNDS);
    env.outboxd.start();
    pg_rows::insert_rows(&env.pg, 0, 300, 10);
    consume_distinct_events(&env.broker.bootstrap(), 300);
    let count = || {
        env.pg
            .sql("app", "SELECT COUNT(*) FROM public.outbox")
            .trim()
            .parse::<u64>()
            .unwrap_or(u64::MAX)
    };
    wait_until(
        "the rounds delete the forwarded rows",
        Duration::from_secs(60),
        || count() == 0,
    );

    env.broker.freeze();
    pg_rows::insert_rows(&env.pg, 300, 500, 10);
    let mark = env.outboxd.log().len();
    wait_until(
        "prune rounds while the broker is frozen",
        Duration::from_secs(60),
        || rounds_since(&env.outboxd, mark) >= 3,
    );
    let (ok, text) = prune_once(&env.outboxd, "2s");
    assert!(!ok, "prune succeeded with a frozen broker:\n{text}");
    assert_eq!(count(), 200, "unacknowledged rows were deleted");

    env.broker.thaw();
    consume_distinct_events(&env.broker.bootstrap(), 500);
    wait_until(
        "the rounds delete the rest once Kafka acknowledged it",
        Duration::from_secs(60),
        || count() == 0,
    );
    env.outboxd.stop();
}

const MARIA_PARTITIONED: &str = "
CREATE DATABASE app;
CREATE TABLE app.outbox (
  id BINARY(16) NOT NULL,
  aggregatetype VARCHAR(255) NOT NULL,
  aggregateid VARCHAR(255) NOT NULL,
  type VARCHAR(255) NOT NULL,
  payload LONGTEXT,
  created_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
  PRIMARY KEY (id, created_at)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4
PARTITION BY RANGE COLUMNS(created_at) (
  PARTITION p2000 VALUES LESS THAN ('2001-01-01'),
  PARTITION p2001 VALUES LESS THAN ('2002-01-01'),
  PARTITION pnow VALUES LESS THAN (MAXVALUE)
);
";

on_both_servers! {
/// `prune.url` names the primary while outboxd reads a replica: the two servers' positions compare
/// by GTID (MariaDB's state, MySQL's executed set). Rows delivered from the replica are deleted on
/// the primary; while Kafka acknowledges nothing, nothing is.
fn prune_on_the_primary_deletes_what_was_delivered_from_a_replica_and_nothing_while_the_broker_is_frozen(flavor: Flavor) {
    const PRUNE_PASSWORD: &str = "prune-pw-57";
    let primary = Mysqld::start(flavor, &[]);
    let (logs, log_end) = match flavor {
        Flavor::MariaDb => ("log-slave-updates=ON", "BINLOG MONITOR"),
        Flavor::MySql => ("log-replica-updates=ON", "REPLICATION CLIENT"),
    };
    let replica = Mysqld::start_replica(&primary, 2, &[logs]);
    primary.sql_socket(SCHEMA);
    primary.sql_socket(&format!(
        "CREATE USER 'pruner'@'127.0.0.1' IDENTIFIED BY '{PRUNE_PASSWORD}';\
         GRANT SELECT, DELETE ON app.* TO 'pruner'@'127.0.0.1';\
         GRANT PROCESS, {log_end} ON *.* TO 'pruner'@'127.0.0.1';"
    ));
    replica.catch_up(&primary);
    let broker = Broker::start();
    for topic in ["outbox.event.order", "outbox.event.customer"] {
        create_topic(&broker.bootstrap(), topic, 3);
    }
    let prune_url = format!("mysql://pruner:{PRUNE_PASSWORD}@127.0.0.1:{}/app", primary.port);
    let body = format!(
        "{}{ROUNDS}url = \"{prune_url}\"\n",
        config_body(&replica.cdc_url(), &broker.bootstrap(), "", "")
    );
    let mut outboxd = Outboxd::new("prune-primary", &body);
    outboxd.start();
    insert_rows(&primary, 0, 200, 10);
    consume_distinct_events(&broker.bootstrap(), 200);
    let count = "SELECT COUNT(*) FROM app.outbox";
    wait_until(
        "the rounds delete the delivered rows on the primary",
        Duration::from_secs(60),
        || maria_count(&primary, count) == 0,
    );

    broker.freeze();
    let mut script = String::new();
    for n in 200..300 {
        script.push_str(&maria_insert_at(n, "2000-01-01 00:00:00"));
    }
    primary.sql_socket(&script);
    replica.catch_up(&primary);
    let mark = outboxd.log().len();
    wait_until(
        "prune rounds while the broker is frozen",
        Duration::from_secs(60),
        || rounds_since(&outboxd, mark) >= 3,
    );
    assert_eq!(
        maria_count(&primary, count),
        100,
        "undelivered rows were deleted:\n{}",
        outboxd.log()
    );
    broker.thaw();
    consume_distinct_events(&broker.bootstrap(), 300);
    wait_until(
        "the rest is deleted once Kafka acknowledged it",
        Duration::from_secs(60),
        || maria_count(&primary, count) == 0,
    );
    assert!(!outboxd.log().contains(PRUNE_PASSWORD));
    outboxd.stop();
}
}

fn maria_insert_at(n: u64, created_at: &str) -> String {
    insert_sql(n)
        .replace(
            "type, payload) VALUES (",
            "type, payload, created_at) VALUES (",
        )
        .replace("');", &format!("', '{created_at}');"))
}

/// Partitions wholly behind the checkpoint are dropped, the one new rows go to is kept, and
/// nothing is dropped while the rows in it are unacknowledged.
#[test]
fn mariadb_drop_partitions_drops_only_partitions_behind_the_checkpoint() {
    let mut env = maria_env(
        "prune-parts-maria",
        MARIA_PARTITIONED,
        "[prune]\nevery = \"1s\"\nolder_than = \"0s\"\nmode = \"drop_partitions\"\n",
    );
    env.outboxd.start();
    env.broker.freeze();
    let mut script = String::from("BEGIN;");
    for n in 0..30 {
        let at = match n / 10 {
            0 => "2000-06-01 00:00:00",
            1 => "2001-06-01 00:00:00",
            _ => "",
        };
        script.push_str(&if at.is_empty() {
            insert_sql(n)
        } else {
            maria_insert_at(n, at)
        });
    }
    script.push_str("COMMIT;");
    env.db.sql_socket(&script);
    let partitions = "SELECT COUNT(*) FROM information_schema.PARTITIONS WHERE TABLE_SCHEMA = 'app' AND TABLE_NAME = 'outbox'";
    let mark = env.outboxd.log().len();
    wait_until(
        "prune rounds while the broker is frozen",
        Duration::from_secs(60),
        || rounds_since(&env.outboxd, mark) >= 3,
    );
    assert_eq!(
        maria_count(&env.db, partitions),
        3,
        "a partition of unacknowledged rows went"
    );

    env.broker.thaw();
    consume_distinct_events(&env.broker.bootstrap(), 30);
    wait_until(
        "the partitions behind the checkpoint are dropped",
        Duration::from_secs(60),
        || maria_count(&env.db, partitions) == 1,
    );
    assert_eq!(maria_count(&env.db, "SELECT COUNT(*) FROM app.outbox"), 10);
    assert!(env.outboxd.log().contains("p2001"), "{}", env.outboxd.log());
    env.outboxd.stop();
}

#[test]
fn postgres_drop_partitions_drops_only_partitions_behind_the_checkpoint() {
    let mut env: PgEnv =
        pg_rows::setup_with_schema("prunepgparts", pg_rows::PARTITIONED_SCHEMA, "");
    append_config(
        &env.outboxd,
        "[prune]\nevery = \"1s\"\nolder_than = \"0s\"\nmode = \"drop_partitions\"\n",
    );
    env.outboxd.start();
    env.broker.freeze();
    let mut script = String::from("BEGIN;");
    for n in 0..20 {
        script.push_str(&if n < 10 {
            pg_rows::insert_at_sql(n, "1999-06-01 00:00:00+00")
        } else {
            pg_rows::insert_sql(n)
        });
    }
    script.push_str("COMMIT;");
    env.pg.sql("app", &script);
    let partitions = || {
        env.pg
            .sql(
                "app",
                "SELECT COUNT(*) FROM pg_inherits WHERE inhparent = 'public.outbox'::regclass",
            )
            .trim()
            .parse::<u64>()
            .unwrap_or(u64::MAX)
    };
    let mark = env.outboxd.log().len();
    wait_until(
        "prune rounds while the broker is frozen",
        Duration::from_secs(60),
        || rounds_since(&env.outboxd, mark) >= 3,
    );
    assert_eq!(partitions(), 2, "a partition of unacknowledged rows went");

    env.broker.thaw();
    consume_distinct_events(&env.broker.bootstrap(), 20);
    wait_until(
        "the partition behind the checkpoint is dropped",
        Duration::from_secs(60),
        || partitions() == 1,
    );
    let left = env.pg.sql("app", "SELECT COUNT(*) FROM public.outbox");
    assert_eq!(left.trim(), "10");
    env.outboxd.stop();
}

/// Settings are checked by name before anything connects.
#[test]
fn bad_prune_settings_are_refused_by_name() {
    let db_url = "mysql://cdc@127.0.0.1:1/app";
    for (extra, key) in [
        ("[prune]\nevery = \"soon\"\n", "prune.every"),
        ("[prune]\nbatch = 0\n", "prune.batch"),
        ("[prune]\nmode = \"truncate\"\n", "mode"),
        ("[prune]\npartitions_ahead = 3\n", "prune.partitions_ahead"),
        (
            "[prune]\npartitions_ahead = 3\npartition_every = \"1s\"\n",
            "prune.partition_every",
        ),
        (
            "[prune]\nurl = \"postgres://x@127.0.0.1/app\"\n",
            "prune.url",
        ),
    ] {
        let outboxd = Outboxd::new(
            "prune-bad",
            &format!("{}{extra}", config_body(db_url, "127.0.0.1:1", "", "")),
        );
        let (ok, text) = output(&outboxd, &["check"]);
        assert!(!ok, "{extra}: {text}");
        assert!(text.contains(key), "{extra}: {text}");
    }
    let outboxd = Outboxd::new("prune-bad", &config_body(db_url, "127.0.0.1:1", "", ""));
    let (ok, text) = output(&outboxd, &["prune", "--older-than", "soon"]);
    assert!(!ok, "{text}");
    assert!(text.contains("--older-than \"soon\""), "{text}");
}

/// Row `n` with `created_at` set to the SQL expression `at`.
fn maria_insert_expr(n: u64, at: &str) -> String {
    maria_insert_at(n, "AT").replace("'AT'", at)
}

fn pg_insert_expr(n: u64, at: &str) -> String {
    pg_rows::insert_at_sql(n, "AT").replace("'AT'", at)
}

/// Rows stamped now, tomorrow and just before the two-day horizon (`at`), ten of each, in one
/// transaction.
fn rows_across_the_horizon(insert: fn(u64, &str) -> String, at: [&str; 3]) -> String {
    let mut script = String::from("BEGIN;");
    for n in 0..30 {
        script.push_str(&insert(n, at[n as usize / 10]));
    }
    script.push_str("COMMIT;");
    script
}

/// With `partitions_ahead`, rounds add daily partitions after the last one so that rows stamped
/// up to two days ahead have one of their own (none lands in the MAXVALUE catch-all), and later
/// rounds add nothing more.
#[test]
fn mariadb_partitions_ahead_are_created_and_rows_land_in_them() {
    // The same table with one partition before the catch-all.
    let schema = MARIA_PARTITIONED
        .replace("  PARTITION p2001 VALUES LESS THAN ('2002-01-01'),\n", "")
        .replace("PARTITION pnow", "PARTITION pmax");
    let mut env = maria_env(
        "prune-ahead-maria",
        &schema,
        "[prune]\nevery = \"1s\"\nolder_than = \"0s\"\nmode = \"drop_partitions\"\n\
         partition_every = \"1d\"\npartitions_ahead = 2\n",
    );
    // A row already in the MAXVALUE partition: splitting it would copy rows under the lock, so
    // rounds refuse (and go on deleting) until it is empty.
    env.db.sql_socket(&maria_insert_expr(99, "NOW(6)"));
    env.outboxd.start();
    wait_until("the refusal", Duration::from_secs(60), || {
        env.outboxd.log().contains("holds rows")
    });
    let ahead = "SELECT COUNT(*) FROM information_schema.PARTITIONS WHERE TABLE_SCHEMA = 'app' \
                 AND TABLE_NAME = 'outbox' AND PARTITION_NAME NOT IN ('p2000', 'pmax')";
    assert_eq!(maria_count(&env.db, ahead), 0);
    // (Inserted before the first start, so never forwarded: outboxd starts at the log's end.)
    env.db.sql_socket("DELETE FROM app.outbox;");
    wait_until("partitions created ahead", Duration::from_secs(60), || {
        maria_count(&env.db, ahead) >= 3
    });
    env.db.sql_socket(&rows_across_the_horizon(
        maria_insert_expr,
        [
            "NOW(6)",
            "NOW(6) + INTERVAL 1 DAY",
            "NOW(6) + INTERVAL 47 HOUR",
        ],
    ));
    consume_distinct_events(&env.broker.bootstrap(), 30);
    assert_eq!(
        maria_count(&env.db, "SELECT COUNT(*) FROM app.outbox PARTITION (pmax)"),
        0,
        "rows landed in the catch-all: {}",
        env.db.sql_socket("SELECT PARTITION_NAME, PARTITION_DESCRIPTION FROM information_schema.PARTITIONS WHERE TABLE_NAME = 'outbox'")
    );
    let created = maria_count(&env.db, ahead);
    let mark = env.outboxd.log().len();
    wait_until("more rounds", Duration::from_secs(60), || {
        rounds_since(&env.outboxd, mark) >= 3
    });
    // A day boundary between the two counts may add one.
    assert!(maria_count(&env.db, ahead) <= created + 1);
    assert_eq!(maria_count(&env.db, "SELECT COUNT(*) FROM app.outbox"), 30);
    let later = env.outboxd.log()[mark..].to_string();
    assert!(
        !later.contains("prune round failed") && !later.contains("could not create"),
        "{later}"
    );
    env.outboxd.stop();
}

/// Postgres: without a partition for now, inserts fail; rounds (mode = "delete" here: creating
/// ahead does not need drop_partitions) create `outbox_p<day>` partitions, the rows arrive.
#[test]
fn postgres_partitions_ahead_are_created_and_rows_land_in_them() {
    let schema = "
CREATE ROLE cdc WITH LOGIN REPLICATION;
CREATE TABLE public.outbox (
  id uuid NOT NULL,
  aggregatetype text,
  aggregateid text NOT NULL,
  type text NOT NULL,
  payload jsonb,
  created_at timestamptz(6) NOT NULL DEFAULT now(),
  PRIMARY KEY (id, created_at)
) PARTITION BY RANGE (created_at);
CREATE TABLE public.outbox_old PARTITION OF public.outbox FOR VALUES FROM (MINVALUE) TO ('2000-01-01');
ALTER TABLE public.outbox OWNER TO cdc;
ALTER TABLE public.outbox_old OWNER TO cdc;
ALTER DATABASE app SET timezone TO 'Asia/Kolkata';
GRANT SELECT ON ALL TABLES IN SCHEMA public TO cdc;
GRANT CREATE ON DATABASE app TO cdc;
GRANT CREATE ON SCHEMA public TO cdc;
";
    let mut env: PgEnv = pg_rows::setup_with_schema("prunepgahead", schema, "");
    append_config(
        &env.outboxd,
        "[prune]\nevery = \"1s\"\nolder_than = \"0s\"\npartition_every = \"1d\"\npartitions_ahead = 2\n",
    );
    env.outboxd.start();
    let partitions = || {
        env.pg
            .sql(
                "app",
                "SELECT COUNT(*) FROM pg_inherits WHERE inhparent = 'public.outbox'::regclass",
            )
            .trim()
            .parse::<u64>()
            .unwrap_or(0)
    };
    wait_until("partitions created ahead", Duration::from_secs(60), || {
        partitions() >= 4
    });
    env.pg.sql(
        "app",
        &rows_across_the_horizon(
            pg_insert_expr,
            [
                "now()",
                "now() + interval '1 day'",
                "now() + interval '47 hours'",
            ],
        ),
    );
    consume_distinct_events(&env.broker.bootstrap(), 30);
    let names = env.pg.sql(
        "app",
        "SELECT string_agg(c.relname, ' ') FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
         WHERE i.inhparent = 'public.outbox'::regclass",
    );
    assert!(names.contains("outbox_p2"), "{names}");
    // Whatever the sessions' time zone (+05:30 here), new bounds sit on UTC midnights.
    let bounds = env.pg.sql(
        "app",
        "SET timezone = 'UTC'; SELECT pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i \
         JOIN pg_class c ON c.oid = i.inhrelid \
         WHERE i.inhparent = 'public.outbox'::regclass AND c.relname LIKE 'outbox_p%'",
    );
    let uppers: Vec<&str> = bounds.lines().filter(|l| l.contains(" TO (")).collect();
    assert!(uppers.len() >= 3, "{bounds}");
    for upper in uppers {
        assert!(upper.trim().ends_with(" 00:00:00+00')"), "{bounds}");
    }
    let created = partitions();
    let mark = env.outboxd.log().len();
    wait_until("more rounds", Duration::from_secs(60), || {
        rounds_since(&env.outboxd, mark) >= 3
    });
    assert!(partitions() <= created + 1);
    let later = env.outboxd.log()[mark..].to_string();
    assert!(
        !later.contains("prune round failed") && !later.contains("could not create"),
        "{later}"
    );
    env.outboxd.stop();
}

/// `outboxd check` tries what `[prune]` will need on the server (the sample, the column, DELETE or
/// the partition layout and ALTER/DROP, CREATE for partitions ahead) and names the grant that is
/// missing; with the grants in place the lines pass. The password never shows.
#[test]
fn check_names_the_grants_prune_lacks_and_passes_once_granted() {
    let db = Mysqld::mariadb(&[]);
    db.sql_socket(MARIA_PARTITIONED);
    let broker = Broker::start();
    let maria = |name: &str, prune: &str| {
        Outboxd::new(
            name,
            &format!(
                "{}{prune}",
                config_body(&db.cdc_url(), &broker.bootstrap(), "", "")
            ),
        )
    };
    let deleting = maria("prune-check-del", "[prune]\n");
    let dropping = maria(
        "prune-check-drop",
        "[prune]\nmode = \"drop_partitions\"\npartition_every = \"1d\"\npartitions_ahead = 1\n",
    );
    for outboxd in [&deleting, &dropping] {
        let (ok, text) = output(outboxd, &["check"]);
        assert!(!ok, "{text}");
        assert!(text.contains("FAIL  prune:"), "{text}");
        assert!(text.contains("GRANT PROCESS"), "{text}");
        assert!(!text.contains(crate::rig::mysqld::CDC_PASSWORD), "{text}");
    }
    let (_, text) = output(&deleting, &["check"]);
    assert!(text.contains("DELETE command denied"), "{text}");
    let (_, text) = output(&dropping, &["check"]);
    assert!(text.contains("ALTER command denied"), "{text}");
    db.sql_socket(
        "GRANT DELETE, DROP, ALTER ON app.* TO 'cdc'@'127.0.0.1'; GRANT PROCESS ON *.* TO 'cdc'@'127.0.0.1';",
    );
    let (ok, text) = output(&deleting, &["check"]);
    assert!(ok, "{text}");
    assert!(
        text.contains("PASS  prune: app.outbox: column created_at, DELETE"),
        "{text}"
    );
    let (ok, text) = output(&dropping, &["check"]);
    assert!(ok, "{text}");
    assert!(
        text.contains("PASS  prune: app.outbox: column created_at, partitioned BY RANGE COLUMNS"),
        "{text}"
    );

    let env: PgEnv = pg_rows::setup_with_schema("prunepgcheck", pg_rows::SCHEMA, "");
    append_config(&env.outboxd, "[prune]\n");
    env.pg
        .sql("app", "REVOKE DELETE ON public.outbox FROM cdc;");
    let (ok, text) = output(&env.outboxd, &["check"]);
    assert!(!ok, "{text}");
    assert!(
        text.contains("FAIL  prune: public.outbox: the user may not DELETE"),
        "{text}"
    );
    env.pg.sql("app", "GRANT DELETE ON public.outbox TO cdc;");
    let (ok, text) = output(&env.outboxd, &["check"]);
    assert!(ok, "{text}");
    assert!(
        text.contains("PASS  prune: public.outbox: column created_at, DELETE"),
        "{text}"
    );
    append_config(&env.outboxd, "mode = \"drop_partitions\"\n");
    let (ok, text) = output(&env.outboxd, &["check"]);
    assert!(!ok, "{text}");
    assert!(
        text.contains("public.outbox is not a partitioned table"),
        "{text}"
    );
}

/// A checkpoint written against another Postgres cluster (outboxd re-pointed, the file copied)
/// is never compared with this cluster's WAL: prune deletes nothing and says why.
#[test]
fn postgres_prune_and_audit_refuse_a_checkpoint_of_another_cluster() {
    let mut first: PgEnv = pg_rows::setup_with_schema("prunepgother", pg_rows::SCHEMA, "");
    first.outboxd.start();
    pg_rows::insert_rows(&first.pg, 0, 20, 10);
    consume_distinct_events(&first.broker.bootstrap(), 20);
    first.outboxd.stop();
    let second: PgEnv = pg_rows::setup_with_schema("prunepgother", pg_rows::SCHEMA, "");
    // Far ahead of anything the new cluster has written.
    let mut checkpoint = first.outboxd.checkpoint();
    checkpoint["position"] = serde_json::json!({"lsn": "FF/0"});
    std::fs::create_dir_all(second.outboxd.checkpoint_path().parent().unwrap()).unwrap();
    std::fs::write(
        second.outboxd.checkpoint_path(),
        serde_json::to_vec(&checkpoint).unwrap(),
    )
    .unwrap();
    pg_rows::insert_rows(&second.pg, 100, 120, 10);
    let (ok, text) = prune_once(&second.outboxd, "2s");
    assert!(!ok, "{text}");
    assert!(text.contains("does not exist on this server"), "{text}");
    let left = second.pg.sql("app", "SELECT COUNT(*) FROM public.outbox");
    assert_eq!(left.trim(), "20");
    // The audit cannot judge this cluster's rows by that checkpoint either: pending, not missing.
    let out = second
        .outboxd
        .command_output(&["audit", "--format", "json", "--wait", "1s"]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        out.status.code(),
        Some(3),
        "{report:#}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(report["missing"], serde_json::json!([]), "{report:#}");
    let why = report["pending_because"].as_str().unwrap_or_default();
    assert!(why.contains("another server"), "{report:#}");
}

/// A prune user with what the old remedy named (SELECT, DELETE, PROCESS) cannot read MariaDB's
/// binlog end: `check` names `BINLOG MONITOR`, `run`'s rounds fail (counted, logged once) while
/// forwarding goes on, and granting it heals pruning at the next round, without a restart.
#[test]
fn a_prune_user_without_the_log_end_grant_is_named_by_check_and_heals_once_granted() {
    const PRUNE_PASSWORD: &str = "prune-pw-35";
    let db = Mysqld::mariadb(&[]);
    db.sql_socket(SCHEMA);
    db.sql_socket(&format!(
        "CREATE USER 'pruner'@'127.0.0.1' IDENTIFIED BY '{PRUNE_PASSWORD}';\
         GRANT SELECT, DELETE ON app.* TO 'pruner'@'127.0.0.1';\
         GRANT PROCESS ON *.* TO 'pruner'@'127.0.0.1';"
    ));
    let broker = Broker::start();
    for topic in ["outbox.event.order", "outbox.event.customer"] {
        create_topic(&broker.bootstrap(), topic, 3);
    }
    let http = crate::rig::free_port();
    let prune_url = format!("mysql://pruner:{PRUNE_PASSWORD}@127.0.0.1:{}/app", db.port);
    let body = format!(
        "{}{ROUNDS}url = \"{prune_url}\"\n",
        config_body(
            &db.cdc_url(),
            &broker.bootstrap(),
            "",
            &format!("127.0.0.1:{http}")
        )
    );
    let mut outboxd = Outboxd::new("prune-grant", &body);
    let (ok, text) = output(&outboxd, &["check"]);
    assert!(!ok, "{text}");
    assert!(
        text.contains("FAIL  prune:") && text.contains("GRANT PROCESS, BINLOG MONITOR ON *.*"),
        "{text}"
    );
    assert!(!text.contains(PRUNE_PASSWORD), "{text}");
    outboxd.start();
    insert_rows(&db, 0, 100, 10);
    consume_distinct_events(&broker.bootstrap(), 100);
    let failed = || {
        let (_, metrics) = crate::rig::http_get(http, "/metrics");
        metrics
            .lines()
            .find(|l| l.starts_with("outboxd_prune_runs_total") && l.contains("result=\"failed\""))
            .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    wait_until("three failed rounds", Duration::from_secs(60), || {
        failed() >= 3
    });
    let log = outboxd.log();
    assert_eq!(
        log.matches("prune round failed").count(),
        1,
        "the same failure is logged once, not every round:\n{log}"
    );
    assert!(log.contains("BINLOG MONITOR"), "{log}");
    assert!(!log.contains(PRUNE_PASSWORD), "{log}");
    let count = "SELECT COUNT(*) FROM app.outbox";
    assert_eq!(maria_count(&db, count), 100, "nothing deleted yet");
    db.sql_socket("GRANT BINLOG MONITOR ON *.* TO 'pruner'@'127.0.0.1';");
    wait_until(
        "the next rounds delete the forwarded rows",
        Duration::from_secs(60),
        || maria_count(&db, count) == 0,
    );
    assert!(
        outboxd.log().contains("prune works again"),
        "{}",
        outboxd.log()
    );
    outboxd.stop();
}
