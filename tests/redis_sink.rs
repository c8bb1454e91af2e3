//! The Redis Streams sink end to end, on a private redis-server (Debian's, append-only) and
//! MariaDB: every row one entry with its id, key, payload and headers as fields, in per-key order;
//! a key holding another type dead-lettered or stopping outboxd; kill -9 of outboxd and of Redis
//! under load lose nothing; a full server (maxmemory) delays rows but never reorders them.

use std::time::Duration;

use crate::rig::redis::{config_with_redis, Got, Redis};
use crate::rig::scenario::{
    check_per_key_order, check_records, insert_rows, kill_9_and_restart, spawn_writer, uuid_of,
    SCHEMA,
};
use crate::rig::{free_port, http_get, wait_until, Consumed, Mysqld, Outboxd};

const READ_LIMIT: Duration = Duration::from_secs(90);
const STREAMS: [&str; 2] = ["outbox.event.order", "outbox.event.customer"];

fn servers() -> (Mysqld, Redis) {
    let db = Mysqld::mariadb(&[]);
    db.sql_socket(SCHEMA);
    (db, Redis::start())
}

fn consumed(got: &[Got]) -> Vec<Consumed> {
    got.iter()
        .enumerate()
        .map(|(i, g)| g.as_consumed(i as i64))
        .collect()
}

fn text(out: std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn rows_reach_redis_streams_with_their_ids_keys_payloads_and_headers_in_key_order() {
    let (db, redis) = servers();
    let http = free_port();
    let mut outboxd = Outboxd::new(
        "redis-e2e",
        &config_with_redis(
            &db.cdc_url(),
            &redis.url(),
            "dead_letter_topic = \"outboxd.dlq\"",
        )
        .replace("listen = \"\"", &format!("listen = \"127.0.0.1:{http}\"")),
    );
    let check = outboxd.command_output(&["check"]);
    let ok = check.status.success();
    let shown = text(check);
    assert!(ok, "{shown}");
    for line in [
        "PASS  redis: connected to redis://127.0.0.1",
        "PASS  redis durability: appendonly yes, appendfsync always",
        "PASS  redis eviction: maxmemory-policy noeviction",
        "PASS  redis dead-letter stream: \"outboxd.dlq\" does not exist yet",
    ] {
        assert!(shown.contains(line), "{line} in\n{shown}");
    }
    outboxd.start();
    insert_rows(&db, 0, 300, 7);
    let got = redis.read(&STREAMS, 300, READ_LIMIT);
    assert_eq!(got.len(), 300, "{}", outboxd.log());
    for g in &got {
        assert!(g.field("timestamp").is_some());
        assert!(g.field("outboxd.position").is_some());
    }
    let records = consumed(&got);
    assert_eq!(
        check_records(&records, 0..300),
        0,
        "no duplicates without faults"
    );
    check_per_key_order(&records);
    wait_until("the checkpoint to pass the last row", READ_LIMIT, || {
        outboxd.checkpoint_or_null()["position"]["gtid_set"]
            == db.sql_socket("SELECT @@gtid_binlog_pos;").trim()
    });
    let (_, metrics) = http_get(http, "/metrics");
    for line in [
        r#"outboxd_events_forwarded_total{pipeline="redis-e2e",sink="redis",topic="outbox.event.order"} 200"#,
        r#"outboxd_events_forwarded_total{pipeline="redis-e2e",sink="redis",topic="outbox.event.customer"} 100"#,
        r#"outboxd_inflight_events{pipeline="redis-e2e",sink="redis"} 0"#,
    ] {
        assert!(metrics.contains(line), "{line} in\n{metrics}");
    }
    outboxd.stop();
}

#[test]
fn a_key_holding_another_type_is_dead_lettered_and_without_a_dead_letter_stream_outboxd_stops() {
    let (db, redis) = servers();
    // Customer rows (every third) route to a key that holds a string.
    redis.cmd::<()>(
        redis::cmd("SET")
            .arg("outbox.event.customer")
            .arg("not a stream"),
    );
    let mut outboxd = Outboxd::new(
        "redis-dlq",
        &config_with_redis(
            &db.cdc_url(),
            &redis.url(),
            "dead_letter_topic = \"outboxd.dlq\"",
        ),
    );
    outboxd.start();
    insert_rows(&db, 0, 900, 9);
    let orders = redis.read(&["outbox.event.order"], 600, READ_LIMIT);
    let parked = redis.read(&["outboxd.dlq"], 300, READ_LIMIT);
    assert_eq!(orders.len(), 600, "{}", outboxd.log());
    assert_eq!(parked.len(), 300, "{}", outboxd.log());
    assert!(
        !outboxd.log().contains("session ended"),
        "{}",
        outboxd.log()
    );
    for p in &parked {
        let n = u64::from_str_radix(&p.field("id").unwrap().replace('-', ""), 16).unwrap();
        assert_eq!(n % 3, 0, "only customer rows are unroutable");
        assert_eq!(p.field("id").unwrap(), uuid_of(n));
        assert_eq!(
            p.field("outboxd.stream").as_deref(),
            Some("outbox.event.customer")
        );
        assert!(p
            .field("outboxd.error")
            .unwrap()
            .starts_with("unroutable: "));
    }
    check_per_key_order(&consumed(&orders));
    outboxd.stop();

    let mut strict = Outboxd::new(
        "redis-strict",
        &config_with_redis(&db.cdc_url(), &redis.url(), ""),
    );
    strict.start();
    let before = db
        .sql_socket("SELECT @@gtid_binlog_pos;")
        .trim()
        .to_string();
    insert_rows(&db, 900, 909, 9);
    assert!(!strict.wait_exit(Duration::from_secs(60)).success());
    let log = strict.log();
    assert!(
        log.contains("key \"outbox.event.customer\" holds another type than a stream"),
        "{log}"
    );
    assert!(log.contains("set redis.dead_letter_topic"), "{log}");
    assert!(!log.contains("café"), "no row data in the log: {log}");
    assert_eq!(
        strict.checkpoint()["position"]["gtid_set"],
        before.as_str(),
        "{log}"
    );
    // (Run to its exit: it may stop before a start could see the stream open.)
    let (ok, log) = crate::tls::output(&strict, &["run", "--skip-checks"]);
    assert!(!ok && log.contains("holds another type"), "{log}");
    assert_eq!(strict.checkpoint()["position"]["gtid_set"], before.as_str());
}

#[test]
fn kill_9_of_outboxd_and_of_redis_under_load_loses_nothing_and_keeps_key_order() {
    kill_9s_under_load("redis-kill", "", "interval_ms = 200");
}

/// 6,000 rows in transactions of 1–40 under 5 `kill -9` of outboxd and one of `redis-server`
/// (`redis`/`checkpoint`: more keys of those sections); checks every row arrived in per-key
/// order and returns the duplicates and outboxd's log.
fn kill_9s_under_load(name: &str, redis_keys: &str, checkpoint: &str) -> (usize, String) {
    let (db, mut redis) = servers();
    let in_redis = checkpoint.contains("redis");
    let mut outboxd = Outboxd::with_checkpoint(
        name,
        &config_with_redis(
            &db.cdc_url(),
            &redis.url(),
            &format!("message_timeout_ms = 10000\n{redis_keys}"),
        ),
        checkpoint,
    );
    outboxd.start();
    let total = 6_000u64;
    let writer = spawn_writer(db.socket_path(), total, &[1, 9, 40], 1);
    kill_9_and_restart(&mut outboxd, 5);
    // Redis dies under load and comes back from its append-only file (fsync always): what it
    // answered is kept, what it did not is sent again from the checkpoint; a transaction open
    // at the kill is not in the file at all (entries and checkpoint go together).
    redis.kill9();
    redis.boot();
    writer.join().unwrap();
    let end = db
        .sql_socket("SELECT @@gtid_binlog_pos;")
        .trim()
        .to_string();
    wait_until(
        "the checkpoint to reach the end",
        Duration::from_secs(120),
        || {
            let stored = if in_redis {
                stored_checkpoint(&redis, name)
            } else {
                outboxd.checkpoint_or_null()
            };
            stored["position"]["gtid_set"] == end.as_str()
        },
    );
    assert_eq!(
        outboxd.checkpoint_path().exists(),
        !in_redis,
        "the checkpoint lives in Redis or in a file, not both"
    );
    let got = redis.read(&STREAMS, total as usize, READ_LIMIT);
    let records = consumed(&got);
    let duplicates = check_records(&records, 0..total);
    println!(
        "redis ({name}): {} entries for {total} rows after 5 kill -9 of outboxd and one of redis-server: {duplicates} duplicates",
        records.len()
    );
    check_per_key_order(&records);
    outboxd.stop();
    (duplicates, outboxd.log())
}

#[test]
fn a_full_redis_delays_rows_without_reordering_them_and_a_frozen_one_is_left_at_sigterm() {
    let (db, redis) = servers();
    let mut outboxd = Outboxd::new(
        "redis-oom",
        &config_with_redis(
            &db.cdc_url(),
            &redis.url(),
            "message_timeout_ms = 3000\ndrain_timeout_ms = 2000",
        ),
    );
    outboxd.start();
    insert_rows(&db, 0, 100, 10);
    assert_eq!(redis.read(&STREAMS, 100, READ_LIMIT).len(), 100);
    // Out of memory (noeviction): every batch is refused while queuing, so EXEC aborts it whole
    // and outboxd sends it again, in order, once there is room.
    redis.cmd::<()>(redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg("1"));
    insert_rows(&db, 100, 300, 10);
    wait_until("a refused batch", READ_LIMIT, || {
        outboxd.log().contains("Redis is at maxmemory")
    });
    redis.cmd::<()>(redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg("0"));
    let got = redis.read(&STREAMS, 300, READ_LIMIT);
    let records = consumed(&got);
    check_records(&records, 0..300);
    check_per_key_order(&records);
    // SIGTERM while Redis is frozen: bounded by drain_timeout_ms; the next start sends the rest.
    redis.freeze();
    insert_rows(&db, 300, 400, 10);
    nix::sys::signal::kill(outboxd.pid(), nix::sys::signal::Signal::SIGTERM).unwrap();
    outboxd.wait_exit(Duration::from_secs(30));
    redis.thaw();
    outboxd.start();
    let got = redis.read(&STREAMS, 400, READ_LIMIT);
    let records = consumed(&got);
    let duplicates = check_records(&records, 0..400);
    println!(
        "redis full, then frozen: {} entries for 400 rows, {duplicates} duplicates",
        records.len()
    );
    check_per_key_order(&records);
    outboxd.stop();
}

#[test]
fn a_redis_password_is_never_printed_and_a_refused_login_stops_without_looping() {
    const PASSWORD: &str = "planted-redis-pw-61";
    const WRONG: &str = "planted-redis-wrong-62";
    let db = Mysqld::mariadb(&[]);
    db.sql_socket(SCHEMA);
    let redis = Redis::start_with(Some(PASSWORD), &[], None);
    let no_secret = |what: &str, text: &str| {
        for secret in [PASSWORD, WRONG] {
            assert!(!text.contains(secret), "{what} printed {secret}:\n{text}");
        }
    };
    let wrong = redis.url().replace(PASSWORD, WRONG);
    let outboxd = Outboxd::new(
        "redis-secrets",
        &config_with_redis(&db.cdc_url(), &wrong, ""),
    );
    let check = text(outboxd.command_output(&["check"]));
    assert!(
        check.contains("FAIL  redis: Redis at redis://:***@127.0.0.1"),
        "{check}"
    );
    assert!(check.contains("refused the login"), "{check}");
    no_secret("check", &check);
    let (ok, log) = crate::tls::output(&outboxd, &["run", "--skip-checks"]);
    assert!(!ok, "{log}");
    assert!(log.contains("refused the login"), "{log}");
    no_secret("run", &log);
    let mut outboxd = Outboxd::new(
        "redis-secrets-env",
        &config_with_redis(&db.cdc_url(), "redis://placeholder:6379/0", ""),
    );
    let check = text(
        outboxd
            .command(&["check"])
            .env("OUTBOXD_REDIS__URL", redis.url())
            .env("RUST_LOG", "debug")
            .output()
            .unwrap(),
    );
    assert!(check.contains("PASS  redis durability"), "{check}");
    no_secret("check with the URL from the environment", &check);
    outboxd.start_with_env(
        &[],
        &[("OUTBOXD_REDIS__URL", &redis.url()), ("RUST_LOG", "debug")],
    );
    insert_rows(&db, 0, 3, 1);
    assert_eq!(
        redis
            .read(
                &["outbox.event.order", "outbox.event.customer"],
                3,
                READ_LIMIT
            )
            .len(),
        3
    );
    outboxd.stop();
    no_secret("run with debug logging", &outboxd.log());
}

#[test]
fn rediss_verifies_the_servers_certificate_against_the_ca_file_and_refuses_a_wrong_ca() {
    use crate::rig::certs::{Ca, VALID};
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "outboxd test CA", "ca");
    let other_ca = Ca::new(dir.path(), "some other CA", "other-ca");
    let server = ca.server(dir.path(), "server", &["127.0.0.1"], VALID);
    let db = Mysqld::mariadb(&[]);
    db.sql_socket(SCHEMA);
    let redis = Redis::start_with(None, &[], Some((&ca.pem, &server)));
    let pipeline = |name: &str, trusted: &std::path::Path| {
        Outboxd::new(
            name,
            &config_with_redis(
                &db.cdc_url(),
                &redis.url(),
                &format!("ca_file = \"{}\"", trusted.display()),
            ),
        )
    };
    let mut outboxd = pipeline("redis-tls", &ca.pem);
    let (ok, shown) = crate::tls::output(&outboxd, &["check"]);
    assert!(
        ok && shown.contains("PASS  redis: connected to rediss://127.0.0.1"),
        "{shown}"
    );
    outboxd.start();
    insert_rows(&db, 0, 5, 1);
    assert_eq!(redis.read(&STREAMS, 5, READ_LIMIT).len(), 5);
    outboxd.stop();
    // The checkpoint in Redis goes over the same verified TLS (its store connects on its own).
    let mut eos = Outboxd::with_checkpoint(
        "redis-tls-eos",
        &config_with_redis(
            &db.cdc_url(),
            &redis.url(),
            &format!("ca_file = \"{}\"", ca.pem.display()),
        ),
        "store = \"redis\"",
    );
    eos.start();
    insert_rows(&db, 5, 10, 1);
    assert_eq!(redis.read(&STREAMS, 10, READ_LIMIT).len(), 10);
    eos.stop();
    let end = db
        .sql_socket("SELECT @@gtid_binlog_pos;")
        .trim()
        .to_string();
    let (ok, shown) = crate::tls::output(&eos, &["checkpoint", "show"]);
    assert!(ok && shown.contains(&end), "{shown}");
    let outboxd = pipeline("redis-tls-ca", &other_ca.pem);
    let (ok, shown) = crate::tls::output(&outboxd, &["check"]);
    assert!(
        !ok && shown.contains("FAIL  redis: TLS to Redis"),
        "{shown}"
    );
    let (ok, log) = crate::tls::output(&outboxd, &["run", "--skip-checks"]);
    assert!(!ok && log.contains("TLS to Redis"), "{log}");
}

#[test]
fn postgres_rows_reach_redis_in_key_order_across_kill_9s() {
    postgres_across_kill_9s("redis-pg", "");
}

#[test]
fn postgres_rows_reach_redis_exactly_once_across_kill_9s_with_the_checkpoint_in_redis() {
    let duplicates = postgres_across_kill_9s("redis-pg-eos", "store = \"redis\"");
    assert_eq!(duplicates, 0, "exactly once");
}

/// Postgres rows into Redis across 3 kill -9 of outboxd (`checkpoint`: keys of `[checkpoint]`);
/// returns the duplicates.
fn postgres_across_kill_9s(name: &str, checkpoint: &str) -> usize {
    use crate::postgres_pipeline::{insert_rows as pg_insert, pg_payload, SCHEMA as PG_SCHEMA};
    use crate::rig::scenario::check_records_by;
    let pg = crate::rig::Postgres::start(&[]);
    pg.sql("postgres", "CREATE DATABASE app;");
    pg.sql("app", PG_SCHEMA);
    let redis = Redis::start();
    let body = format!(
        "[source]\nkind = \"postgres\"\nurl = \"{}\"\ntables = [\"public.outbox\"]\nslot = \"outboxd_redis\"\n\
         publication = \"outboxd_redis\"\nheartbeat_interval_ms = 1000\n\
         [redis]\nurl = \"{}\"\n[http]\nlisten = \"\"\n",
        pg.url("cdc", "app"),
        redis.url()
    );
    let mut outboxd = Outboxd::with_checkpoint(name, &body, checkpoint);
    outboxd.start();
    let total = 3_000u64;
    std::thread::scope(|scope| {
        scope.spawn(|| {
            for from in (0..total).step_by(50) {
                pg_insert(&pg, from, from + 50, 5);
            }
        });
        kill_9_and_restart(&mut outboxd, 3);
    });
    let got = redis.read(&STREAMS, total as usize, READ_LIMIT);
    let records = consumed(&got);
    let duplicates = check_records_by(&records, 0..total, pg_payload);
    println!(
        "redis from postgres ({name}): {} entries for {total} rows after 3 kill -9: {duplicates} duplicates",
        records.len()
    );
    check_per_key_order(&records);
    outboxd.stop();
    duplicates
}

#[test]
fn a_user_without_multi_is_refused_by_check_and_stops_run_instead_of_storing_batches_again() {
    let (db, redis) = servers();
    // Without MULTI, Redis would run each XADD of a batch alone and refuse only the EXEC: a retry
    // would store the batch again, and again.
    redis.cmd::<()>(
        redis::cmd("ACL")
            .arg("SETUSER")
            .arg("outboxd")
            .arg("on")
            .arg(">user-pw-1")
            .arg("~*")
            .arg("+@all")
            .arg("-multi"),
    );
    let url = format!("redis://outboxd:user-pw-1@127.0.0.1:{}/0", redis.port);
    let outboxd = Outboxd::new("redis-nomulti", &config_with_redis(&db.cdc_url(), &url, ""));
    let check = text(outboxd.command_output(&["check"]));
    assert!(
        check.contains("FAIL  redis transactions: MULTI/EXEC refused"),
        "{check}"
    );
    // run: refused at its first session, before any batch (a stop, not a retry).
    insert_rows(&db, 0, 10, 10);
    let (ok, log) = crate::tls::output(&outboxd, &["run", "--skip-checks"]);
    assert!(!ok && log.contains("Redis refused MULTI"), "{log}");
    // Nothing was stored: no batch ran without its MULTI.
    assert!(redis.read(&STREAMS, 0, Duration::from_secs(3)).is_empty());
}

#[test]
fn with_wait_replicas_nothing_is_checkpointed_until_a_replica_has_it() {
    let (db, redis) = servers();
    let port = redis.port.to_string();
    let mut replica = Redis::start_with(None, &["--replicaof", "127.0.0.1", &port], None);
    wait_until("the replica to be in sync", READ_LIMIT, || {
        redis
            .cmd::<String>(redis::cmd("INFO").arg("replication"))
            .contains("connected_slaves:1")
    });
    let mut outboxd = Outboxd::new(
        "redis-wait",
        &config_with_redis(
            &db.cdc_url(),
            &redis.url(),
            "wait_replicas = 1\nmessage_timeout_ms = 2000",
        ),
    );
    outboxd.start();
    insert_rows(&db, 0, 10, 10);
    wait_until("the checkpoint to pass the rows", READ_LIMIT, || {
        outboxd.checkpoint_or_null()["position"]["gtid_set"]
            == db.sql_socket("SELECT @@gtid_binlog_pos;").trim()
    });
    // The replica gone: the primary stores the next rows, but WAIT reaches no replica, so they are
    // never counted delivered and the checkpoint stays put.
    replica.kill9();
    let before = outboxd.checkpoint()["position"].clone();
    insert_rows(&db, 10, 20, 10);
    wait_until("WAIT to fall short", READ_LIMIT, || {
        outboxd.log().contains("replicas had a batch")
    });
    assert_eq!(outboxd.checkpoint()["position"], before);
    // Back: the rows are sent again, reach the replica, and the checkpoint moves on.
    replica.boot();
    wait_until("the checkpoint to pass the rows", READ_LIMIT, || {
        outboxd.checkpoint_or_null()["position"]["gtid_set"]
            == db.sql_socket("SELECT @@gtid_binlog_pos;").trim()
    });
    let records = consumed(&redis.read(&STREAMS, 20, READ_LIMIT));
    check_records(&records, 0..20);
    check_per_key_order(&records);
    outboxd.stop();
}

/// The live checkpoint `checkpoint.store = "redis"` keeps for pipeline `name`.
fn stored_checkpoint(redis: &Redis, name: &str) -> serde_json::Value {
    let body: Option<String> =
        redis.cmd(redis::cmd("GET").arg(format!("outboxd:checkpoint:{name}")));
    body.map_or(serde_json::Value::Null, |b| {
        serde_json::from_str(&b).unwrap()
    })
}

#[test]
fn with_the_checkpoint_in_redis_kill_9s_of_outboxd_and_of_redis_leave_every_row_exactly_once() {
    let (duplicates, log) = kill_9s_under_load(
        "redis-eos",
        "transaction_interval_ms = 50",
        "store = \"redis\"",
    );
    assert_eq!(
        duplicates, 0,
        "exactly once: no duplicates after 5 kill -9 of outboxd and one of redis-server\n{log}"
    );
}

#[test]
fn a_checkpoint_changed_under_a_running_instance_stops_it_before_it_commits_again() {
    let (db, redis) = servers();
    let mut outboxd = Outboxd::with_checkpoint(
        "redis-fence",
        &config_with_redis(&db.cdc_url(), &redis.url(), ""),
        "store = \"redis\"",
    );
    // An evicting policy could drop the checkpoint key: with the checkpoint in Redis, a FAIL.
    redis.cmd::<()>(
        redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory-policy")
            .arg("allkeys-lru"),
    );
    let check = text(outboxd.command_output(&["check"]));
    assert!(check.contains("FAIL  redis eviction"), "{check}");
    redis.cmd::<()>(
        redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory-policy")
            .arg("noeviction"),
    );
    outboxd.start();
    insert_rows(&db, 0, 100, 10);
    assert_eq!(redis.read(&STREAMS, 100, READ_LIMIT).len(), 100);
    let end = db
        .sql_socket("SELECT @@gtid_binlog_pos;")
        .trim()
        .to_string();
    wait_until(
        "the checkpoint in Redis to pass the rows",
        READ_LIMIT,
        || stored_checkpoint(&redis, "redis-fence")["position"]["gtid_set"] == end.as_str(),
    );
    // The operator's commands read and write the checkpoint in Redis.
    let show = text(outboxd.command_output(&["checkpoint", "show"]));
    assert!(show.contains(&format!("\"gtid_set\": \"{end}\"")), "{show}");
    let saved = outboxd.command_output(&["checkpoint", "save", "before-set"]);
    assert!(saved.status.success(), "{}", text(saved));
    let list = text(outboxd.command_output(&["checkpoint", "list"]));
    assert!(list.contains("before-set"), "{list}");
    // Another writer moves the checkpoint (to where it is: only the writer changes). The
    // running instance finds out at its next commit, applies nothing, and stops.
    let set = outboxd.command_output(&["checkpoint", "set", &format!("gtid:{end}")]);
    assert!(set.status.success(), "{}", text(set));
    insert_rows(&db, 100, 110, 10);
    let status = outboxd.wait_exit(Duration::from_secs(60));
    assert!(!status.success(), "{}", outboxd.log());
    assert!(
        outboxd
            .log()
            .contains("the checkpoint in Redis changed under this instance"),
        "{}",
        outboxd.log()
    );
    assert_eq!(
        redis.read(&STREAMS, 100, Duration::from_secs(2)).len(),
        100,
        "the fenced instance applied nothing"
    );
    // Started again, it resumes from the checkpoint that was set: every row once.
    outboxd.start();
    let records = consumed(&redis.read(&STREAMS, 110, READ_LIMIT));
    assert_eq!(check_records(&records, 0..110), 0, "{}", outboxd.log());
    check_per_key_order(&records);
    outboxd.stop();
}

#[test]
fn with_the_checkpoint_in_redis_a_key_of_another_type_is_dead_lettered_inside_the_transaction() {
    let (db, redis) = servers();
    // Inside EXEC an XADD to a string key would fail alone while the checkpoint is stored: the
    // sink asks each stream's type before, and parks such rows in the same transaction.
    redis.cmd::<()>(
        redis::cmd("SET")
            .arg("outbox.event.customer")
            .arg("not a stream"),
    );
    let http = free_port();
    let mut outboxd = Outboxd::with_checkpoint(
        "redis-eos-dlq",
        &config_with_redis(
            &db.cdc_url(),
            &redis.url(),
            "dead_letter_topic = \"outboxd.dlq\"",
        )
        .replace("listen = \"\"", &format!("listen = \"127.0.0.1:{http}\"")),
        "store = \"redis\"",
    );
    outboxd.start();
    insert_rows(&db, 0, 90, 9);
    let orders = redis.read(&["outbox.event.order"], 60, READ_LIMIT);
    let parked = redis.read(&["outboxd.dlq"], 30, READ_LIMIT);
    assert_eq!((orders.len(), parked.len()), (60, 30), "{}", outboxd.log());
    for p in &parked {
        assert_eq!(
            p.field("outboxd.stream").as_deref(),
            Some("outbox.event.customer")
        );
    }
    let end = db
        .sql_socket("SELECT @@gtid_binlog_pos;")
        .trim()
        .to_string();
    wait_until(
        "the checkpoint in Redis to pass the rows",
        READ_LIMIT,
        || stored_checkpoint(&redis, "redis-eos-dlq")["position"]["gtid_set"] == end.as_str(),
    );
    assert!(
        !outboxd.log().contains("session ended"),
        "{}",
        outboxd.log()
    );
    // Dead letters count under the stream they landed in, and as dead letters.
    let (_, metrics) = http_get(http, "/metrics");
    for line in [
        r#"outboxd_events_forwarded_total{pipeline="redis-eos-dlq",sink="redis",topic="outbox.event.order"} 60"#,
        r#"outboxd_events_forwarded_total{pipeline="redis-eos-dlq",sink="redis",topic="outboxd.dlq"} 30"#,
        r#"outboxd_dead_letter_total{pipeline="redis-eos-dlq",sink="redis",reason="unroutable"} 30"#,
    ] {
        assert!(metrics.contains(line), "{line} in\n{metrics}");
    }
    assert!(
        metrics.contains(r#"outboxd_transactions_total{pipeline="redis-eos-dlq",sink="redis",result="committed"}"#),
        "{metrics}"
    );
    outboxd.stop();
}

#[test]
fn with_the_checkpoint_in_redis_an_entry_refused_inside_exec_keeps_the_checkpoint_before_it() {
    let (db, redis) = servers();
    let mut outboxd = Outboxd::with_checkpoint(
        "redis-eos-guard",
        &config_with_redis(&db.cdc_url(), &redis.url(), ""),
        "store = \"redis\"",
    );
    outboxd.start();
    insert_rows(&db, 0, 30, 10);
    assert_eq!(redis.read(&STREAMS, 30, READ_LIMIT).len(), 30);
    let before = db
        .sql_socket("SELECT @@gtid_binlog_pos;")
        .trim()
        .to_string();
    wait_until(
        "the checkpoint in Redis to pass the rows",
        READ_LIMIT,
        || stored_checkpoint(&redis, "redis-eos-guard")["position"]["gtid_set"] == before.as_str(),
    );
    // The order stream's IDs exhausted: its XADDs pass the type check and are queued, then fail
    // inside EXEC while the customer rows of the same transaction are applied. The guard keeps
    // the checkpoint before the transaction, and outboxd stops naming the rows.
    redis.cmd::<()>(
        redis::cmd("XSETID")
            .arg("outbox.event.order")
            .arg("18446744073709551615-18446744073709551615"),
    );
    insert_rows(&db, 30, 40, 10);
    let status = outboxd.wait_exit(Duration::from_secs(60));
    assert!(!status.success(), "{}", outboxd.log());
    assert!(
        outboxd
            .log()
            .contains("Redis refused entries inside a transaction"),
        "{}",
        outboxd.log()
    );
    assert_eq!(
        stored_checkpoint(&redis, "redis-eos-guard")["position"]["gtid_set"],
        before.as_str(),
        "the checkpoint did not move past the refused rows"
    );
    // Fixed (the exhausted stream removed), the restart sends the transaction again: every row
    // arrives; the customer rows applied with the refused transaction come twice.
    redis.cmd::<()>(redis::cmd("DEL").arg("outbox.event.order"));
    outboxd.start();
    let orders = redis.read(&["outbox.event.order"], 6, READ_LIMIT);
    let order_ids: std::collections::BTreeSet<String> =
        orders.iter().filter_map(|g| g.field("id")).collect();
    let expected: std::collections::BTreeSet<String> =
        (30..40).filter(|n| n % 3 != 0).map(uuid_of).collect();
    assert_eq!(order_ids, expected, "{}", outboxd.log());
    let customers = redis.read(&["outbox.event.customer"], 10 + 4 + 4, READ_LIMIT);
    assert_eq!(
        customers.len(),
        18,
        "10 before, 4 applied with the refused transaction, 4 again"
    );
    outboxd.stop();
}

/// With the checkpoint in Redis, a source transaction ten times the window still flows (an
/// entry's `QUEUED` frees its room; the transaction commits only at its end) and lands once.
#[test]
fn with_the_checkpoint_in_redis_a_source_transaction_larger_than_the_window_lands_once() {
    let (db, redis) = servers();
    let mut outboxd = Outboxd::with_checkpoint(
        "redis-eos-large",
        &config_with_redis(&db.cdc_url(), &redis.url(), "max_in_flight = 50"),
        "store = \"redis\"",
    );
    outboxd.start();
    insert_rows(&db, 0, 500, 500);
    insert_rows(&db, 500, 520, 5);
    let got = redis.read(&STREAMS, 520, READ_LIMIT);
    assert_eq!(got.len(), 520, "{}", outboxd.log());
    let records = consumed(&got);
    assert_eq!(check_records(&records, 0..520), 0, "{}", outboxd.log());
    check_per_key_order(&records);
    wait_until("the checkpoint to pass the last row", READ_LIMIT, || {
        stored_checkpoint(&redis, "redis-eos-large")["position"]["gtid_set"]
            == db.sql_socket("SELECT @@gtid_binlog_pos;").trim()
    });
    outboxd.stop();
}
