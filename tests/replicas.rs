//! Replica-first: outboxd reading MariaDB or MySQL replicas, moving between them by GTID.

use crate::on_both_servers;
use crate::rig;

use crate::rig::scenario::{
    check_records, config_body, consume_events, insert_rows, LIMIT, SCHEMA,
};
use crate::rig::{create_topic, wait_until, Broker, Flavor, Mysqld, Outboxd};

struct Topology {
    primary: Mysqld,
    r1: Mysqld,
    r2: Mysqld,
    broker: Broker,
}

/// A MariaDB primary and two replicas that log what they replicate, the outbox schema created on
/// the primary.
fn servers() -> (Mysqld, Mysqld, Mysqld) {
    servers_of(Flavor::MariaDb)
}

/// [`servers`] of `flavor` (MySQL: GTID replicas with SOURCE_AUTO_POSITION).
fn servers_of(flavor: Flavor) -> (Mysqld, Mysqld, Mysqld) {
    let primary = Mysqld::start(flavor, &[]);
    let logs = match flavor {
        Flavor::MariaDb => "log-slave-updates=ON",
        Flavor::MySql => "log-replica-updates=ON",
    };
    let r1 = Mysqld::start_replica(&primary, 2, &[logs]);
    let r2 = Mysqld::start_replica(&primary, 3, &[logs]);
    primary.sql_socket(SCHEMA);
    r1.catch_up(&primary);
    r2.catch_up(&primary);
    (primary, r1, r2)
}

/// [`servers_of`] and a broker with the event topics.
fn topology(flavor: Flavor) -> Topology {
    let (primary, r1, r2) = servers_of(flavor);
    let broker = Broker::start();
    for topic in ["outbox.event.order", "outbox.event.customer"] {
        create_topic(&broker.bootstrap(), topic, 3);
    }
    Topology {
        primary,
        r1,
        r2,
        broker,
    }
}

fn url(hosts: &[&Mysqld]) -> String {
    let list: Vec<String> = hosts
        .iter()
        .map(|h| format!("127.0.0.1:{}", h.port))
        .collect();
    format!("mysql://cdc@{}/app", list.join(","))
}

on_both_servers! {
fn rows_written_on_the_primary_arrive_once_through_a_replica_and_survive_losing_it(flavor: Flavor) {
    let mut t = topology(flavor);
    let mut outboxd = Outboxd::new(
        "replicas",
        &config_body(&url(&[&t.r1, &t.r2]), &t.broker.bootstrap(), "", ""),
    );
    outboxd.start();
    insert_rows(&t.primary, 0, 200, 4);
    let records = consume_events(&t.broker.bootstrap(), 200);
    assert_eq!(
        check_records(&records, 0..200),
        0,
        "a clean run through a replica is exactly once"
    );

    // Lose R1 while the primary keeps writing: outboxd moves to R2 and resumes by GTID.
    let socket = t.primary.socket_path();
    let writer = std::thread::spawn(move || {
        for batch in 0..20u64 {
            let mut script = String::new();
            for n in 200 + batch * 20..220 + batch * 20 {
                script.push_str(&format!("BEGIN;{}COMMIT;", rig::scenario::insert_sql(n)));
            }
            rig::mysqld::sql_at(&socket, &script);
        }
    });
    wait_until("rows beyond 300 to be forwarded", LIMIT, || {
        consume_events(&t.broker.bootstrap(), 0).len() >= 300
    });
    t.r1.stop();
    let recovery = std::time::Instant::now();
    writer.join().unwrap();
    t.r2.catch_up(&t.primary);
    let records = consume_events(&t.broker.bootstrap(), 600);
    rig::scenario::report(
        "replica lost",
        "replica R1 stopped mid-load; outboxd moves to R2 by GTID",
        600,
        &records,
        recovery,
    );
    let duplicates = check_records(&records, 0..600);
    println!("replica loss: {duplicates} duplicates over 600 rows");
    assert!(
        outboxd.log().contains("moving to the next source host"),
        "{}",
        outboxd.log()
    );
    assert!(
        outboxd.log().contains("resuming by GTID"),
        "{}",
        outboxd.log()
    );
    outboxd.stop();
}
}

on_both_servers! {
fn a_checkpoint_written_on_one_replica_resumes_on_another_by_gtid(flavor: Flavor) {
    let t = topology(flavor);
    let mut outboxd = Outboxd::new(
        "moved",
        &config_body(&url(&[&t.r1]), &t.broker.bootstrap(), "", ""),
    );
    outboxd.start();
    insert_rows(&t.primary, 0, 100, 5);
    assert_eq!(consume_events(&t.broker.bootstrap(), 100).len(), 100);
    outboxd.stop();
    insert_rows(&t.primary, 100, 200, 5);
    t.r2.catch_up(&t.primary);
    // R2's binlog offsets no longer match R1's: a FILE:POS resume there could not pass.
    t.r2.sql_socket("FLUSH BINARY LOGS;");
    outboxd.rewrite_config(&config_body(&url(&[&t.r2]), &t.broker.bootstrap(), "", ""));
    outboxd.start();
    let records = consume_events(&t.broker.bootstrap(), 200);
    assert_eq!(check_records(&records, 0..200), 0, "{}", outboxd.log());
    let log = outboxd.log();
    assert!(
        log.contains("resuming by GTID") && log.contains("binlog stream opened") && log.contains("\"gtid\""),
        "{log}"
    );
    outboxd.stop();
    assert_eq!(
        outboxd.checkpoint()["source"]["server_id"],
        3,
        "the checkpoint now names R2"
    );
}
}

#[test]
fn a_frozen_replica_is_left_for_the_next_one_and_nothing_is_lost() {
    let t = topology(Flavor::MariaDb);
    let mut outboxd = Outboxd::new(
        "frozen",
        &config_body(&url(&[&t.r1, &t.r2]), &t.broker.bootstrap(), "", ""),
    );
    outboxd.start();
    insert_rows(&t.primary, 0, 50, 5);
    assert_eq!(consume_events(&t.broker.bootstrap(), 50).len(), 50);
    t.r1.freeze();
    insert_rows(&t.primary, 50, 100, 5);
    t.r2.catch_up(&t.primary);
    let records = consume_events(&t.broker.bootstrap(), 100);
    check_records(&records, 0..100);
    assert!(
        outboxd.log().contains("no binlog event or heartbeat"),
        "{}",
        outboxd.log()
    );
    t.r1.thaw();
    outboxd.stop();
}

#[test]
fn run_refuses_a_replica_that_does_not_log_replicated_rows() {
    let primary = Mysqld::mariadb(&[]);
    let replica = Mysqld::start_replica(&primary, 2, &[]);
    primary.sql_socket(SCHEMA);
    replica.catch_up(&primary);
    let broker = Broker::start();
    let outboxd = Outboxd::new(
        "noupdates",
        &config_body(&url(&[&replica]), &broker.bootstrap(), "", ""),
    );
    let out = outboxd.command_output(&["run"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("log_slave_updates = OFF") && stderr.contains("log_slave_updates=ON"),
        "{stderr}"
    );
}

on_both_servers! {
fn a_replica_behind_the_checkpoint_is_waited_for_and_nothing_is_lost(flavor: Flavor) {
    let t = topology(flavor);
    // R1 stops applying: it will lack the transactions outboxd reads on the primary next.
    t.r1.sql_socket("STOP REPLICA;");
    let mut outboxd = Outboxd::new(
        "lagging",
        &config_body(&url(&[&t.primary]), &t.broker.bootstrap(), "", ""),
    );
    outboxd.start();
    insert_rows(&t.primary, 0, 50, 5);
    assert_eq!(consume_events(&t.broker.bootstrap(), 50).len(), 50);
    outboxd.stop();
    // Moved to the lagging replica: its binlog has not reached the checkpoint's GTID yet.
    outboxd.rewrite_config(&config_body(&url(&[&t.r1]), &t.broker.bootstrap(), "", ""));
    outboxd.start();
    // MariaDB refuses a GTID it has not reached (error 1236), and outboxd waits; MySQL accepts a
    // set naming another server's transactions it lacks and sends them once it has them.
    if flavor == Flavor::MariaDb {
        wait_until("outboxd to say the server is behind", LIMIT, || {
            outboxd.log().contains("behind the checkpoint")
        });
    } else {
        wait_until("outboxd to resume on the lagging replica", LIMIT, || {
            outboxd.log().contains("resuming by GTID")
        });
    }
    assert!(outboxd.child_running(), "{}", outboxd.log());
    assert!(
        !outboxd.log().contains("checkpoint set"),
        "a remedy that moves the checkpoint would lose rows:\n{}",
        outboxd.log()
    );
    insert_rows(&t.primary, 50, 60, 5);
    let recovery = std::time::Instant::now();
    t.r1.sql_socket("START REPLICA;");
    t.r1.catch_up(&t.primary);
    let records = consume_events(&t.broker.bootstrap(), 60);
    rig::scenario::report(
        "lagging replica",
        "outboxd moved to a replica behind its checkpoint (MariaDB 1236); the replica resumes and catches up",
        60,
        &records,
        recovery,
    );
    check_records(&records, 0..60);
    outboxd.stop();
}
}

/// A session the sink ended (Redis gone for a moment) is no reason to leave a healthy replica:
/// the next one may lag behind the checkpoint, and outboxd would wait for it. Found by the fault
/// schedule with Redis, where every sink error moved outboxd to the other replica.
#[test]
fn a_sink_outage_does_not_move_outboxd_to_another_replica() {
    use crate::rig::redis::{config_with_redis, Redis};
    let (primary, r1, r2) = servers();
    let mut redis = Redis::start();
    let mut outboxd = Outboxd::new(
        "sinkblip",
        &config_with_redis(&url(&[&r1, &r2]), &redis.url(), ""),
    );
    outboxd.start();
    insert_rows(&primary, 0, 20, 5);
    let streams = ["outbox.event.order", "outbox.event.customer"];
    assert_eq!(redis.read(&streams, 20, LIMIT).len(), 20);
    redis.kill9();
    insert_rows(&primary, 20, 40, 5);
    wait_until("the sink's error to end a session", LIMIT, || {
        outboxd.log().contains("session ended")
    });
    redis.boot();
    assert!(
        redis.read(&streams, 40, LIMIT).len() >= 40,
        "{}",
        outboxd.log()
    );
    assert!(
        !outboxd.log().contains("moving to the next source host"),
        "a sink error moved outboxd off a healthy replica:\n{}",
        outboxd.log()
    );
    outboxd.stop();
}

/// A host of the list that cannot serve outboxd (here a replica that does not log what it
/// replicates, so reading it would lose every row) is passed over, at start and by each session,
/// and never read; only every host refusing stops outboxd, naming each one's reason. Before, `run`
/// refused to start while any host failed its checks, and a session's refusal ended the process,
/// whose restart began at the same first host: one bad replica stopped the pipeline for good.
#[test]
fn a_host_that_cannot_serve_outboxd_is_passed_over_and_only_every_host_refusing_stops_it() {
    let (primary, r1, _r2) = servers();
    let blind = Mysqld::start_replica(&primary, 4, &[]);
    // It replicates from the primary's position now, after the schema: give it its own copy.
    blind.sql_socket(&format!("SET SESSION sql_log_bin = 0;{SCHEMA}"));
    blind.catch_up(&primary);
    let broker = Broker::start();
    for topic in ["outbox.event.order", "outbox.event.customer"] {
        create_topic(&broker.bootstrap(), topic, 3);
    }
    let mut outboxd = Outboxd::new(
        "passover",
        &config_body(&url(&[&blind, &r1]), &broker.bootstrap(), "", ""),
    );
    let check = outboxd.command_output(&["check"]);
    let said = String::from_utf8_lossy(&check.stdout);
    assert!(
        !check.status.success(),
        "check must FAIL the blind host:\n{said}"
    );
    let blind_host = format!("mysql 127.0.0.1:{}", blind.port);
    for line in ["log_slave_updates = OFF", "`run` starts anyway"] {
        assert!(
            said.lines()
                .any(|l| l.contains(&blind_host) && l.contains(line)),
            "{line}:\n{said}"
        );
    }
    outboxd.start();
    insert_rows(&primary, 0, 50, 5);
    r1.catch_up(&primary);
    let records = consume_events(&broker.bootstrap(), 50);
    assert_eq!(check_records(&records, 0..50), 0, "{}", outboxd.log());
    let log = outboxd.log();
    assert!(
        log.contains("refuses to serve outboxd") && log.contains("log_slave_updates = OFF"),
        "{log}"
    );
    outboxd.stop();

    // Every host refusing (the blind one twice; `--skip-checks` lets the sessions meet it).
    outboxd.rewrite_config(&config_body(
        &url(&[&blind, &blind]),
        &broker.bootstrap(),
        "",
        "",
    ));
    let run = outboxd.command_output(&["run", "--skip-checks"]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success(), "{stderr}");
    assert!(
        stderr.contains("every host in source.url refused")
            && stderr.matches("log_slave_updates = OFF").count() >= 2,
        "{stderr}"
    );
    assert!(!stderr.contains(rig::mysqld::CDC_PASSWORD), "{stderr}");
}

/// A replica that stopped replicating still answers and heartbeats, so its stream looked healthy
/// while no new row would ever come: outboxd stayed on it for good. Now a replica not replicating
/// for 12 heartbeat periods (12 s here) ends the session, and the next host serves the rows.
#[test]
fn a_replica_that_stopped_replicating_is_left_for_one_that_has_the_new_rows() {
    let t = topology(Flavor::MariaDb);
    // Reading a replica's status needs SLAVE MONITOR (README "Requirements"); without it the
    // stall goes unnoticed and `check` WARNs.
    for r in [&t.r1, &t.r2] {
        r.sql_socket(
            "SET SESSION sql_log_bin = 0; GRANT SLAVE MONITOR ON *.* TO 'cdc'@'127.0.0.1';",
        );
    }
    let mut outboxd = Outboxd::new(
        "stalled",
        &config_body(&url(&[&t.r1, &t.r2]), &t.broker.bootstrap(), "", ""),
    );
    outboxd.start();
    insert_rows(&t.primary, 0, 20, 5);
    assert_eq!(consume_events(&t.broker.bootstrap(), 20).len(), 20);
    t.r1.sql_socket("STOP REPLICA;");
    insert_rows(&t.primary, 20, 60, 5);
    t.r2.catch_up(&t.primary);
    let records = consume_events(&t.broker.bootstrap(), 60);
    check_records(&records, 0..60);
    let log = outboxd.log();
    assert!(log.contains("has not been replicating"), "{log}");
    assert!(log.contains("moving to the next source host"), "{log}");
    t.r1.sql_socket("START REPLICA;");
    outboxd.stop();
}
