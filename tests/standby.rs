//! Checkpoints in Kafka (`checkpoint.store = "kafka"`) and several instances of one pipeline, one
//! leading, the others standing by. On Apache Kafka (the checkpoint writer is transactional, which
//! is what fences an old leader).

use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};

use crate::operate::output;
use crate::rig::broker::Broker;
use crate::rig::certs::{Ca, VALID};
use crate::rig::kafka::{consume_to_end, ROUND};
use crate::rig::mysqld::Mysqld;
use crate::rig::outboxd::Outboxd;
use crate::rig::scenario::*;
use crate::rig::{create_topic, free_port, http_get, wait_until};

const TOPIC: &str = "outboxd.checkpoints";

struct KafkaEnv {
    db: Mysqld,
    broker: Broker,
    instances: Vec<(Outboxd, u16)>,
}

/// MariaDB, Apache Kafka and `count` instances of pipeline `name` sharing a Kafka checkpoint, each
/// with its own HTTP port (`checkpoint` holds more keys of that section).
fn kafka_env(name: &str, count: usize, checkpoint: &str) -> KafkaEnv {
    let db = Mysqld::mariadb(&[]);
    db.sql_socket(SCHEMA);
    let broker = Broker::start();
    for topic in ["outbox.event.order", "outbox.event.customer"] {
        create_topic(&broker.bootstrap(), topic, 3);
    }
    let instances = (0..count)
        .map(|_| {
            let port = free_port();
            let body = config_body(
                &db.cdc_url(),
                &broker.bootstrap(),
                "max_in_flight = 1000",
                &format!("127.0.0.1:{port}"),
            );
            let outboxd = Outboxd::with_checkpoint(
                name,
                &body,
                &format!("store = \"kafka\"\ntopic = \"{TOPIC}\"\n{checkpoint}"),
            );
            (outboxd, port)
        })
        .collect();
    KafkaEnv {
        db,
        broker,
        instances,
    }
}

/// The committed checkpoint records of pipeline `name`, oldest first: (writer, document).
pub(crate) fn committed_checkpoints(
    broker: &Broker,
    name: &str,
) -> Vec<(String, serde_json::Value)> {
    consume_to_end(
        &[
            ("bootstrap.servers", &broker.bootstrap()),
            ("isolation.level", "read_committed"),
        ],
        TOPIC,
        ROUND,
    )
    .into_iter()
    .filter(|r| r.key.as_deref() == Some(name.as_bytes()))
    .filter_map(|r| {
        let writer = r.header("outboxd.instance").unwrap_or_default();
        let value = serde_json::from_slice(r.value.as_deref()?).unwrap();
        Some((writer, value))
    })
    .collect()
}

/// Asserts that the committed checkpoints never move backwards, judged by the GTID state (a
/// session resumed by GTID reports the file's start until the next event names its offset).
pub(crate) fn assert_monotonic(checkpoints: &[(String, serde_json::Value)]) {
    let key = |c: &serde_json::Value| {
        let gtid = c["position"]["gtid_set"].as_str().unwrap_or("0-1-0");
        gtid.rsplit('-').next().unwrap().parse::<u64>().unwrap()
    };
    for pair in checkpoints.windows(2) {
        assert!(
            key(&pair[0].1) <= key(&pair[1].1),
            "the checkpoint moved backwards: {} ({}) then {} ({})",
            pair[0].1["position"],
            pair[0].0,
            pair[1].1["position"],
            pair[1].0
        );
    }
}

fn lead_count(outboxd: &Outboxd) -> usize {
    outboxd.log().matches("leading the pipeline").count()
}

fn leads(outboxd: &Outboxd) -> bool {
    lead_count(outboxd) > 0
}

#[test]
fn kafka_checkpoint_survives_ten_kill_9s_under_load_and_loses_nothing() {
    // A restart after kill -9 waits out the takeover timeout (the killed instance led lately).
    let mut env = kafka_env("kafkastore", 1, "takeover_timeout_ms = 1500");
    let outboxd = &mut env.instances[0].0;
    outboxd.start();
    let total = 20_000u64;
    let writer = spawn_writer(env.db.socket_path(), total, &[1, 7, 50, 200], 20);
    kill_9_and_restart(outboxd, 10);
    writer.join().unwrap();
    let records = consume_distinct_events(&env.broker.bootstrap(), total as usize);
    let duplicates = check_records(&records, 0..total);
    println!(
        "kafka checkpoint store: {} records for {total} rows, {duplicates} duplicates over 10 kill -9",
        records.len()
    );
    check_per_key_order(&records);
    outboxd.stop();
    let checkpoints = committed_checkpoints(&env.broker, "kafkastore");
    // Restarted instances resumed and checkpointed (how many of the eleven wrote one before
    // their kill depends on the machine's load), and the last write names the last row.
    let writers: std::collections::BTreeSet<_> = checkpoints.iter().map(|(w, _)| w).collect();
    assert!(writers.len() >= 2, "{checkpoints:?}");
    let end = env.db.sql_socket("SELECT @@gtid_binlog_pos;");
    assert_eq!(
        checkpoints.last().unwrap().1["position"]["gtid_set"],
        end.trim(),
        "{checkpoints:?}"
    );
    assert_monotonic(&checkpoints);
    assert_eq!(
        checkpoints.last().unwrap().1["name"],
        "kafkastore",
        "the record's value is the file store's JSON"
    );
    let files: Vec<_> = std::fs::read_dir(outboxd.dir_path().join("checkpoints"))
        .unwrap()
        .collect();
    assert!(files.is_empty(), "nothing is written to disk: {files:?}");
}

#[test]
fn a_standby_takes_over_from_a_killed_leader_and_loses_nothing() {
    let mut env = kafka_env("standby", 2, "");
    env.instances[0].0.start();
    env.instances[1].0.start_until(&[], &[], &["standing by"]);
    let (a_port, b_port) = (env.instances[0].1, env.instances[1].1);
    wait_until("the leader to be ready", Duration::from_secs(30), || {
        http_get(a_port, "/readyz") == (200, "ready: leader\n".into())
    });
    let (status, body) = http_get(b_port, "/readyz");
    assert_eq!(
        status, 200,
        "a standby is ready (rolling updates wait on it)"
    );
    assert!(body.contains("standby"), "{body}");
    assert!(http_get(a_port, "/metrics")
        .1
        .contains(r#"outboxd_leader{pipeline="standby",sink="kafka"} 1"#));
    assert!(http_get(b_port, "/metrics")
        .1
        .contains(r#"outboxd_leader{pipeline="standby",sink="kafka"} 0"#));
    assert!(!leads(&env.instances[1].0), "{}", env.instances[1].0.log());

    let total = 10_000u64;
    let writer = spawn_writer(env.db.socket_path(), total, &[1, 7, 50], 10);
    wait_until(
        "rows to flow through the leader",
        Duration::from_secs(60),
        || committed_checkpoints(&env.broker, "standby").len() > 5,
    );
    let killed = Instant::now();
    env.instances[0].0.kill9();
    wait_until("the standby to take over", Duration::from_secs(60), || {
        leads(&env.instances[1].0)
    });
    println!(
        "standby: took over {:.1} s after the leader's kill -9 (takeover_timeout_ms = 6000)",
        killed.elapsed().as_secs_f64()
    );
    writer.join().unwrap();
    let records = consume_distinct_events(&env.broker.bootstrap(), total as usize);
    let duplicates = check_records(&records, 0..total);
    println!(
        "standby: {} records for {total} rows, {duplicates} duplicates",
        records.len()
    );
    check_per_key_order(&records);
    wait_until(
        "the new leader to be ready",
        Duration::from_secs(30),
        || http_get(b_port, "/readyz") == (200, "ready: leader\n".into()),
    );
    env.instances[1].0.stop();
    assert_monotonic(&committed_checkpoints(&env.broker, "standby"));
    // Reaching the end of the checkpoint topic is how every read of it ends, not a problem: no
    // warning in either log (librdkafka reports it wrapped as a "global" error too).
    for (instance, _) in &env.instances {
        assert!(
            !instance.log().contains("PartitionEOF"),
            "{}",
            instance.log()
        );
    }
}

#[test]
fn a_frozen_leader_that_wakes_up_writes_no_checkpoint_and_stands_by() {
    let mut env = kafka_env("frozen", 2, "");
    env.instances[0].0.start();
    // Its release (at the clean stop below) stays open 3 s between reaching the log and its
    // commit: a standby that acted on the written record would fence the commit.
    env.instances[1].0.start_until(
        &[],
        &[("FAILPOINTS", "release_commit_delayed=sleep(3000)")],
        &["standing by"],
    );
    insert_rows(&env.db, 0, 500, 5);
    assert_eq!(
        consume_distinct_events(&env.broker.bootstrap(), 500).len(),
        500
    );
    let old = env.instances[0].0.pid();
    let old_writer = format!(":{old}");
    kill(old, Signal::SIGSTOP).unwrap();
    wait_until("the standby to take over", Duration::from_secs(60), || {
        leads(&env.instances[1].0)
    });
    insert_rows(&env.db, 500, 1000, 5);
    wait_until(
        "the new leader to checkpoint",
        Duration::from_secs(60),
        || {
            committed_checkpoints(&env.broker, "frozen")
                .iter()
                .any(|(writer, _)| !writer.ends_with(&old_writer))
        },
    );
    let by_old_before = committed_checkpoints(&env.broker, "frozen")
        .iter()
        .filter(|(writer, _)| writer.ends_with(&old_writer))
        .count();
    let woken_at = chrono::Utc::now();
    kill(old, Signal::SIGCONT).unwrap();
    wait_until(
        "the woken leader to stand by",
        Duration::from_secs(60),
        || {
            env.instances[0].0.log().matches("standing by").count() >= 1
                && env.instances[0]
                    .0
                    .log()
                    .contains("lost the pipeline's lead")
                || env.instances[0].0.log().contains("fenced")
        },
    );
    insert_rows(&env.db, 1000, 1500, 5);
    let records = consume_distinct_events(&env.broker.bootstrap(), 1500);
    check_records(&records, 0..1500);
    check_per_key_order(&records);
    let checkpoints = committed_checkpoints(&env.broker, "frozen");
    let by_old_after = checkpoints
        .iter()
        .filter(|(writer, _)| writer.ends_with(&old_writer))
        .count();
    assert_eq!(
        by_old_before,
        by_old_after,
        "the woken leader (woken at {woken_at}) committed a checkpoint: {:?}\n{}",
        checkpoints
            .iter()
            .filter(|(writer, _)| writer.ends_with(&old_writer))
            .map(|(_, c)| (c["position"]["gtid_set"].clone(), c["updated_at"].clone()))
            .collect::<Vec<_>>(),
        env.instances[0].0.log()
    );
    assert_monotonic(&checkpoints);
    assert!(
        env.instances[0].0.child_running(),
        "the old leader stands by, it does not exit:\n{}",
        env.instances[0].0.log()
    );
    assert_eq!(
        lead_count(&env.instances[0].0),
        1,
        "{}",
        env.instances[0].0.log()
    );
    // A clean stop releases the lead: the standby takes it without waiting out the timeout, and
    // only once the release is committed (a routine stop logs no warning and no error).
    let stopped_at = env.instances[1].0.log().len();
    env.instances[1].0.stop();
    let log = env.instances[1].0.log();
    let stopping = &log[stopped_at..];
    assert!(stopping.contains("released the pipeline's lead"), "{log}");
    assert!(
        !stopping.contains(" WARN ") && !stopping.contains(" ERROR "),
        "{stopping}"
    );
    wait_until(
        "the standby to take the released lead",
        Duration::from_secs(60),
        || lead_count(&env.instances[0].0) == 2,
    );
    assert!(
        env.instances[0].0.log().contains("the lead is free"),
        "{}",
        env.instances[0].0.log()
    );
    insert_rows(&env.db, 1500, 1600, 5);
    check_records(
        &consume_distinct_events(&env.broker.bootstrap(), 1600),
        0..1600,
    );
    env.instances[0].0.stop();
    assert_monotonic(&committed_checkpoints(&env.broker, "frozen"));
}

#[test]
fn checkpoint_commands_work_against_the_kafka_store() {
    let mut env = kafka_env("kafkacli", 1, "");
    let outboxd = &mut env.instances[0].0;
    outboxd.start();
    insert_rows(&env.db, 0, 100, 10);
    assert_eq!(
        consume_distinct_events(&env.broker.bootstrap(), 100).len(),
        100
    );
    let (ok, text) = output(outboxd, &["checkpoint", "set", "mariadb-bin.000001:4"]);
    assert!(
        !ok && text.contains("running"),
        "refused while running: {text}"
    );
    outboxd.stop();
    let (ok, text) = output(outboxd, &["checkpoint", "show"]);
    assert!(
        ok && text.contains("\"kafkacli\"") && text.contains("mariadb-bin"),
        "{text}"
    );
    let (ok, text) = output(outboxd, &["checkpoint", "save", "before-deploy"]);
    assert!(ok && text.contains("before-deploy"), "{text}");
    let (ok, text) = output(outboxd, &["checkpoint", "set", "mariadb-bin.000001:4"]);
    assert!(ok && text.contains("before-set-"), "{text}");
    let (ok, text) = output(outboxd, &["checkpoint", "show"]);
    assert!(ok && text.contains("\"pos\": 4"), "{text}");
    let (ok, text) = output(outboxd, &["checkpoint", "reset"]);
    assert!(ok && text.contains("before-reset-"), "{text}");
    let (ok, text) = output(outboxd, &["checkpoint", "show"]);
    assert!(
        ok && text.contains("no checkpoint at Kafka topic"),
        "{text}"
    );
    let (ok, text) = output(outboxd, &["checkpoint", "list"]);
    assert!(
        ok && text.contains("before-deploy")
            && text.contains("before-set-")
            && text.contains("before-reset-"),
        "{text}"
    );
    let files: Vec<_> = std::fs::read_dir(outboxd.dir_path().join("checkpoints"))
        .unwrap()
        .collect();
    assert!(files.is_empty(), "nothing is written to disk: {files:?}");
}

#[test]
fn a_checkpoint_topic_that_could_lose_the_checkpoint_is_refused_by_name() {
    let env = kafka_env("badtopic", 1, "");
    let outboxd = &env.instances[0].0;
    // `check` and `checkpoint show` never create the topic.
    let (ok, text) = output(outboxd, &["checkpoint", "show"]);
    assert!(
        ok && text.contains("no checkpoint at Kafka topic"),
        "{text}"
    );
    create_topic(&env.broker.bootstrap(), TOPIC, 3);
    // `checkpoint show` opens the topic as `run` does (a `run` that did not refuse would not end).
    let (ok, text) = output(outboxd, &["checkpoint", "show"]);
    assert!(!ok, "{text}");
    assert!(
        text.contains("has 3 partitions") && text.contains("--partitions 1"),
        "{text}"
    );
    let deleting = "outboxd.checkpoints.deleting";
    crate::rig::create_topic_with(
        &env.broker.bootstrap(),
        deleting,
        1,
        &[("cleanup.policy", "delete")],
    );
    let body = std::fs::read_to_string(outboxd.config_path())
        .unwrap()
        .replace(
            &format!("topic = \"{TOPIC}\""),
            &format!("topic = \"{deleting}\""),
        );
    std::fs::write(outboxd.config_path(), body).unwrap();
    let (ok, text) = output(outboxd, &["checkpoint", "show"]);
    assert!(!ok, "{text}");
    assert!(
        text.contains("cleanup.policy=delete") && text.contains("cleanup.policy=compact"),
        "{text}"
    );
}

#[test]
fn the_kafka_store_without_a_grant_on_its_transactional_id_stops_with_the_grant_to_give() {
    // Apache Kafka always has transactions; what users meet instead is a principal without the
    // grant on the checkpoint writer's transactional id. Everything else is granted here.
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "outboxd test CA", "ca");
    let server = ca.server(dir.path(), "server", &["127.0.0.1"], VALID);
    let broker = Broker::start_sasl(&server);
    broker.add_scram_user("outboxd", "scram-secret");
    for (kind, name) in [("--topic", "*"), ("--group", "*")] {
        broker.acl(&[
            "--add",
            "--allow-principal",
            "User:outboxd",
            "--operation",
            "All",
            kind,
            name,
        ]);
    }
    let db = Mysqld::mariadb(&[]);
    db.sql_socket(SCHEMA);
    let body = config_with_kafka(
        &db.cdc_url(),
        &broker.sasl_client("outboxd", "scram-secret", &ca.pem),
        "",
    );
    let outboxd = Outboxd::with_checkpoint("nogrant", &body, "store = \"kafka\"");
    // check passes (it cannot ask about a transactional id) once the authorizer has the grants.
    wait_until("check to pass", Duration::from_secs(30), || {
        crate::operate::output(&outboxd, &["check"]).0
    });
    let mut child = outboxd
        .command(&["run"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut status = None;
    wait_until("outboxd to stop", Duration::from_secs(60), || {
        status = child.try_wait().unwrap();
        status.is_some()
    });
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!status.unwrap().success(), "{text}");
    assert!(
        text.contains("cannot become the checkpoint writer")
            && text.contains("Transactional Id authorization failed")
            && text.contains("grant outboxd's principal WRITE and DESCRIBE on the transactional id outboxd.nogrant.checkpoint"),
        "{text}"
    );
    assert!(!text.contains("scram-secret"), "{text}");
}

/// Postgres lets one connection use a replication slot, and a frozen (SIGSTOPped) leader keeps its
/// walsender; with `wal_sender_timeout = 0` the server never ends it. The new leader fenced the
/// frozen one when it took the lead, so it ends that connection and streams (before, it retried
/// "replication slot … is active for PID …" until the server freed the slot: here, for good).
#[test]
fn a_new_leader_ends_the_walsender_a_frozen_leader_still_holds_and_streams() {
    use crate::postgres_pipeline::{insert_sql, pg_payload, SCHEMA as PG_SCHEMA};
    use crate::rig::Postgres;
    let pg = Postgres::start(&["wal_sender_timeout = 0"]);
    pg.sql("postgres", "CREATE DATABASE app;");
    pg.sql("app", PG_SCHEMA);
    let broker = Broker::start();
    for topic in ["outbox.event.order", "outbox.event.customer"] {
        create_topic(&broker.bootstrap(), topic, 3);
    }
    let body = format!(
        "[source]\nkind = \"postgres\"\nurl = \"{}\"\ntables = [\"public.outbox\"]\nslot = \"outboxd_lead\"\n\
         publication = \"outboxd_lead\"\nheartbeat_interval_ms = 1000\n\
         [kafka]\nbrokers = \"{}\"\n[http]\nlisten = \"\"\n",
        pg.url("cdc", "app"),
        broker.bootstrap()
    );
    let checkpoint = format!("store = \"kafka\"\ntopic = \"{TOPIC}\"\ntakeover_timeout_ms = 1500");
    let mut leader = Outboxd::with_checkpoint("pg-lead", &body, &checkpoint);
    let mut standby = Outboxd::with_checkpoint("pg-lead", &body, &checkpoint);
    leader.start();
    standby.start_until(&[], &[], &["standing by"]);
    pg.sql("app", &transactions(0, 100, 5, insert_sql));
    assert_eq!(
        consume_distinct_events(&broker.bootstrap(), 100).len(),
        100,
        "{}",
        leader.log()
    );
    let frozen = leader.pid();
    kill(frozen, Signal::SIGSTOP).unwrap();
    wait_until("the standby to take over", Duration::from_secs(60), || {
        leads(&standby)
    });
    pg.sql("app", &transactions(100, 200, 5, insert_sql));
    let records = consume_distinct_events(&broker.bootstrap(), 200);
    kill(frozen, Signal::SIGCONT).unwrap();
    let log = standby.log();
    check_records_by(&records, 0..200, pg_payload);
    check_per_key_order(&records);
    assert!(
        log.contains("the replication slot was held by another connection"),
        "{log}"
    );
    // The woken leader lost the lead: it must not end the new leader's connection in turn.
    pg.sql("app", &transactions(200, 300, 5, insert_sql));
    let records = consume_distinct_events(&broker.bootstrap(), 300);
    check_records_by(&records, 0..300, pg_payload);
    assert!(
        !leader
            .log()
            .contains("the replication slot was held by another connection"),
        "{}",
        leader.log()
    );
    standby.stop();
    leader.terminate();
}
