//! What only a real Apache Kafka shows about the checkpoint store, the lease and the sink: each test
//! here failed on the broker before its fix (issue #36).

use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::ClientConfig;

use crate::rig::scenario::*;
use crate::rig::{create_topic, free_port, http_get, wait_until, Broker, Mysqld, Outboxd};

const CHECKPOINTS: &str = "outboxd.checkpoints";

/// The checkpoint topic's (low, end) as a consumer with `isolation` is told: a read_committed
/// one's end is the last stable offset, which an open transaction holds back.
fn checkpoint_watermarks(broker: &Broker, isolation: &str) -> (i64, i64) {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", broker.bootstrap())
        .set("group.id", "test-watermarks")
        .set("isolation.level", isolation)
        .create()
        .unwrap();
    consumer
        .fetch_watermarks(CHECKPOINTS, 0, Duration::from_secs(10))
        .unwrap()
}

/// A MariaDB with the outbox schema, and Apache Kafka with `topics` (one partition each).
fn mariadb_and_broker_with(broker: Broker, topics: &[&str]) -> (Mysqld, Broker) {
    let db = Mysqld::mariadb(&[]);
    db.sql_socket(SCHEMA);
    for topic in topics {
        create_topic(&broker.bootstrap(), topic, 1);
    }
    (db, broker)
}

const EVENT_TOPICS: [&str; 2] = ["outbox.event.order", "outbox.event.customer"];

fn leads(outboxd: &Outboxd) -> bool {
    outboxd.log().contains("leading the pipeline")
}

/// Pipeline B (exactly-once, no standby) crashes inside its commit and leaves a transaction open
/// on the checkpoint topic's only partition for its whole timeout (60 s). Pipeline A's renewals
/// land behind it, where a read_committed reader cannot see them: A's standby, and one started
/// meanwhile, must still hear A's healthy leader and never take over.
#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "needs --features failpoints")]
fn another_pipelines_open_transaction_does_not_move_the_lead_of_a_healthy_leader() {
    use outboxd::fault::BEFORE_TRANSACTION_COMMIT;
    let (db, broker) = mariadb_and_broker_with(
        Broker::start(),
        &[
            "outbox.event.order",
            "outbox.event.customer",
            "b.order",
            "b.customer",
        ],
    );
    let checkpoint = "store = \"kafka\"\ntakeover_timeout_ms = 3000\n";
    let instance = || {
        let port = free_port();
        let body = config_body(
            &db.cdc_url(),
            &broker.bootstrap(),
            "",
            &format!("127.0.0.1:{port}"),
        );
        (Outboxd::with_checkpoint("lease-a", &body, checkpoint), port)
    };
    let (mut leader, leader_port) = instance();
    let (mut standby, _) = instance();
    let (mut late, _) = instance();
    leader.start();
    wait_until("A's leader to be ready", LIMIT, || {
        http_get(leader_port, "/readyz") == (200, "ready: leader\n".into())
    });
    standby.start_until(&[], &[], &["standing by"]);

    let b_body = config_body(
        &db.cdc_url(),
        &broker.bootstrap(),
        "exactly_once = true",
        "",
    )
    .replace("server_id = 99", "server_id = 98")
        + "[route]\ntopic = \"b.${routedByValue}\"\n";
    let mut b = Outboxd::with_checkpoint("lease-b", &b_body, checkpoint);
    b.start_with_env(
        &[],
        &[("FAILPOINTS", &format!("{BEFORE_TRANSACTION_COMMIT}=return"))],
    );
    insert_rows(&db, 0, 20, 1);
    assert!(!b.wait_exit(LIMIT).success(), "{}", b.log());
    late.start_until(&[], &[], &["standing by", "leading the pipeline"]);

    // Seven takeover timeouts: every renewal of A's leader lands behind B's open transaction.
    let watched = Instant::now();
    while watched.elapsed() < Duration::from_secs(21) {
        for (who, outboxd) in [("the standby", &standby), ("the late instance", &late)] {
            assert!(
                !leads(outboxd),
                "{who} took the lead from a healthy leader while another pipeline's transaction was open:\n{}",
                outboxd.log()
            );
        }
        assert!(
            !leader.log().contains("lead was taken over"),
            "{}",
            leader.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // The hazard was there all along: B's transaction still holds the last stable offset.
    let (_, stable) = checkpoint_watermarks(&broker, "read_committed");
    let (_, written) = checkpoint_watermarks(&broker, "read_uncommitted");
    assert!(
        stable < written,
        "B's transaction no longer held the topic back (stable {stable}, written {written})"
    );
    // A's leader still forwards.
    insert_rows(&db, 100, 130, 1);
    let records = consume_distinct_events(&broker.bootstrap(), 50);
    assert_eq!(records.len(), 50, "{}", leader.log());
    for outboxd in [&mut late, &mut standby, &mut leader] {
        outboxd.stop();
    }
}

/// Apache Kafka can lose track of an open transaction (a hanging transaction: seen once in a few
/// runs of the exactly-once fault schedule, after a single broker's `kill -9`), and then no
/// committed-only reader passes it, ever. The leader's read of its checkpoint waits at it: outboxd
/// must say, once it is open longer than any of its own transactions may be, that it is hanging,
/// with the commands that find and abort it; keep retrying; and carry on once it is aborted. Here
/// a client that is not outboxd holds a transaction open for 10 minutes (a real hanging one cannot
/// be made on purpose), and outboxd's transactions time out after 10 s.
#[test]
fn a_transaction_open_past_every_timeout_is_named_with_its_abort_command_and_the_pipeline_resumes()
{
    use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
    let (db, broker) = mariadb_and_broker_with(Broker::start(), &EVENT_TOPICS);
    crate::rig::create_topic_with(
        &broker.bootstrap(),
        CHECKPOINTS,
        1,
        &[("cleanup.policy", "compact")],
    );
    let holder: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", broker.bootstrap())
        .set("transactional.id", "test.holder")
        .set("transaction.timeout.ms", "600000")
        .create()
        .unwrap();
    holder.init_transactions(LIMIT).unwrap();
    holder.begin_transaction().unwrap();
    holder
        .send(
            BaseRecord::to(CHECKPOINTS)
                .partition(0)
                .key("holder")
                .payload("open"),
        )
        .unwrap();
    holder.flush(LIMIT).unwrap();
    let (_, open_at) = checkpoint_watermarks(&broker, "read_committed");

    let body = config_body(
        &db.cdc_url(),
        &broker.bootstrap(),
        "[kafka.properties]\n\"transaction.timeout.ms\" = \"10000\"",
        "",
    );
    let mut outboxd = Outboxd::with_checkpoint("held", &body, "store = \"kafka\"\n");
    outboxd.start_until(&[], &[], &["leading the pipeline"]);
    let abort = format!("abort --topic {CHECKPOINTS} --partition 0 --start-offset {open_at}");
    let named = Instant::now();
    let told = |log: String| log.contains("holds a hanging transaction") && log.contains(&abort);
    while !told(outboxd.log()) {
        assert!(
            named.elapsed() < LIMIT,
            "outboxd never named the hanging transaction ({abort}):\n{}",
            outboxd.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let log = outboxd.log();
    assert!(
        log.contains("ERROR")
            && log.contains("hanging transaction")
            && log.contains("find-hanging"),
        "{log}"
    );
    assert!(
        outboxd.exited().is_none() && !log.contains("stream opened"),
        "outboxd must keep retrying, and begin nothing before it reads its checkpoint:\n{log}"
    );
    for topic in EVENT_TOPICS {
        assert_eq!(
            crate::rig::kafka::topic_end(&broker.bootstrap(), topic),
            0,
            "nothing is forwarded before the checkpoint is read"
        );
    }

    // The remedy's find-hanging runs as printed; it lists nothing here, as this transaction's
    // coordinator still has it (a lost one would be listed).
    let find =
        format!("find-hanging --topic {CHECKPOINTS} --partition 0 --max-transaction-timeout 1");
    assert!(log.contains(&find), "{log}");
    let out = broker.tool_output(
        "org.apache.kafka.tools.TransactionsCommand",
        &find.split(' ').collect::<Vec<_>>(),
    );
    let listed = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && !listed.contains("outboxd.checkpoints"),
        "{listed}"
    );
    // The operator aborts it (here by the same command a lost one takes).
    let out = broker.tool_output(
        "org.apache.kafka.tools.TransactionsCommand",
        &abort.split(' ').collect::<Vec<_>>(),
    );
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    wait_until("the stream to open", LIMIT, || {
        outboxd.log().contains("stream opened")
    });
    insert_rows(&db, 0, 10, 1);
    assert_eq!(
        consume_events(&broker.bootstrap(), 10).len(),
        10,
        "{}",
        outboxd.log()
    );
    outboxd.stop();
}

/// Kafka 4 refuses a record stamped more than an hour ahead of the broker's clock
/// (`message.timestamp.after.max.ms`). A `route.timestamp` column two hours ahead must not stop
/// the pipeline: the record goes out stamped with outboxd's clock, counted and logged; rows with
/// sane times keep theirs.
#[test]
fn a_timestamp_two_hours_ahead_is_clamped_to_now_and_counted() {
    let (db, broker) = mariadb_and_broker_with(Broker::start(), &EVENT_TOPICS);
    let port = free_port();
    let body = config_body(
        &db.cdc_url(),
        &broker.bootstrap(),
        "",
        &format!("127.0.0.1:{port}"),
    ) + "[route]\ntimestamp = \"created_at\"\n";
    let mut outboxd = Outboxd::new("future", &body);
    outboxd.start();
    let before = chrono::Utc::now().timestamp_millis();
    let insert = |n: u64, at: &str| {
        let (id, kind, key, payload) = event(n);
        format!(
            "INSERT INTO app.outbox (id, aggregatetype, aggregateid, type, payload, created_at) VALUES (UNHEX('{id}'), '{kind}', '{key}', 'Created', '{payload}', {at});"
        )
    };
    // Rows 0..20 from a clock two hours fast, 20..40 at a fixed past time.
    db.sql_socket(&transactions(0, 20, 4, |n| {
        insert(n, "UTC_TIMESTAMP(6) + INTERVAL 2 HOUR")
    }));
    db.sql_socket(&transactions(20, 40, 4, |n| {
        insert(n, "'2024-05-01 12:00:00.250'")
    }));
    let records = consume_events(&broker.bootstrap(), 40);
    let after = chrono::Utc::now().timestamp_millis();
    assert_eq!(records.len(), 40, "{}", outboxd.log());
    check_records(&records, 0..40);
    check_per_key_order(&records);
    for record in &records {
        let ts = record.timestamp.unwrap();
        if n_of(record) < 20 {
            assert!(
                (before - 1_000..=after).contains(&ts),
                "row {} stamped {ts}, not outboxd's clock ({before}..{after})",
                n_of(record)
            );
        } else {
            assert_eq!(ts, 1_714_564_800_250, "row {}", n_of(record));
        }
    }
    wait_until("the clamp to be counted", Duration::from_secs(10), || {
        http_get(port, "/metrics").1.contains(
            r#"outboxd_timestamps_clamped_total{pipeline="future",sink="kafka",topic="outbox.event.order"}"#,
        )
    });
    let metrics = http_get(port, "/metrics").1;
    let clamped: u64 = metrics
        .lines()
        .filter(|l| l.starts_with("outboxd_timestamps_clamped_total{"))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
        .sum();
    assert_eq!(clamped, 20, "{metrics}");
    assert!(
        outboxd.log().contains("stamped with outboxd's clock"),
        "{}",
        outboxd.log()
    );
    outboxd.stop();
}

/// The topic's settings as the broker describes them.
fn topic_configs(broker: &Broker, topic: &str) -> std::collections::HashMap<String, String> {
    use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
    use rdkafka::client::DefaultClientContext;
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", broker.bootstrap())
        .create()
        .unwrap();
    let described = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(admin.describe_configs(
            [&ResourceSpecifier::Topic(topic)],
            &AdminOptions::new().request_timeout(Some(Duration::from_secs(10))),
        ))
        .unwrap();
    let resource = described.into_iter().next().unwrap().unwrap();
    resource
        .entries
        .into_iter()
        .filter_map(|e| Some((e.name, e.value?)))
        .collect()
}

/// A checkpoint topic with one replica, or one that elects a lagging replica, comes back without
/// the newest checkpoints after a broker loses its disk, and a compacted topic whose segment never
/// rolls is never compacted. outboxd creates the topic as durable as the cluster allows, with an
/// hour's segments, and `check` says how the topic keeps checkpoints and warns on the rest; it also
/// says when the brokers create topics on first use (a mistyped route makes a topic, not a dead
/// letter).
#[test]
fn the_checkpoint_topic_is_created_durable_and_check_reports_how_it_keeps_checkpoints() {
    use crate::operate::output;
    let (db, broker) = mariadb_and_broker_with(
        Broker::start(),
        &[
            "outbox.event.order",
            "outbox.event.customer",
            "dead.letters",
        ],
    );
    let body = config_body(&db.cdc_url(), &broker.bootstrap(), "", "");
    let mut outboxd = Outboxd::with_checkpoint("durable", &body, "store = \"kafka\"\n");
    let (_, before) = output(&outboxd, &["check"]);
    assert!(
        before.contains("PASS  checkpoint topic: outboxd.checkpoints does not exist yet; `run` creates it compacted with 1 replica(s), min.insync.replicas 1 and segment.ms 3600000"),
        "{before}"
    );
    outboxd.start();
    let configs = topic_configs(&broker, CHECKPOINTS);
    for (key, value) in [
        ("cleanup.policy", "compact"),
        ("segment.ms", "3600000"),
        ("min.insync.replicas", "1"),
        ("unclean.leader.election.enable", "false"),
    ] {
        assert_eq!(configs.get(key).map(String::as_str), Some(value), "{key}");
    }
    let (ok, shown) = output(&outboxd, &["check"]);
    assert!(ok, "{shown}");
    assert!(
        shown.contains("PASS  checkpoint topic: outboxd.checkpoints: 1 replica(s) on a cluster of 1 broker(s), min.insync.replicas 1"),
        "{shown}"
    );
    assert!(!shown.contains("WARN  checkpoint topic"), "{shown}");
    // Kafka's default: the brokers create topics on first use. Said, not warned, without a
    // dead-letter topic.
    assert!(
        shown.contains("PASS  kafka: the brokers create a topic on first use"),
        "{shown}"
    );
    outboxd.stop();

    // A topic made by hand with Kafka's defaults and unclean leader election.
    crate::rig::kafka::create_topic_with(
        &broker.bootstrap(),
        "hand.checkpoints",
        1,
        &[
            ("cleanup.policy", "compact"),
            ("unclean.leader.election.enable", "true"),
        ],
    );
    let body = config_body(
        &db.cdc_url(),
        &broker.bootstrap(),
        "dead_letter_topic = \"dead.letters\"",
        "",
    );
    let by_hand = Outboxd::with_checkpoint(
        "by-hand",
        &body,
        "store = \"kafka\"\ntopic = \"hand.checkpoints\"\n",
    );
    let (ok, shown) = output(&by_hand, &["check"]);
    assert!(ok, "warnings do not fail check: {shown}");
    assert!(
        shown.contains("WARN  checkpoint topic: hand.checkpoints allows unclean leader election"),
        "{shown}"
    );
    assert!(
        shown.contains("WARN  checkpoint topic: hand.checkpoints has segment.ms 604800000"),
        "{shown}"
    );
    assert!(
        shown.contains("WARN  kafka: the brokers create a topic on first use (auto.create.topics.enable=true): a row routed to a topic nobody created (a mistyped aggregatetype) makes a new topic, not a dead letter"),
        "{shown}"
    );
    // Asking the producer not to create topics settles it.
    let body = config_body(
        &db.cdc_url(),
        &broker.bootstrap(),
        "dead_letter_topic = \"dead.letters\"\n[kafka.properties]\n\"allow.auto.create.topics\" = \"false\"",
        "",
    );
    let asked = Outboxd::with_checkpoint("asked", &body, "");
    let (ok, shown) = output(&asked, &["check"]);
    assert!(ok, "{shown}");
    assert!(!shown.contains("create a topic on first use"), "{shown}");
}

/// KRaft lists a topic a moment after CreateTopics returns: until then a metadata read sees no
/// partitions, and outboxd exited with "has 0 partitions; outboxd needs exactly one", a config
/// error nothing retries. The fail point answers "no partitions" to the first four reads (the
/// first before the topic is created); outboxd must wait for the topic and forward.
#[test]
fn a_new_checkpoint_topic_listed_without_partitions_for_a_moment_is_waited_for() {
    let (db, broker) = mariadb_and_broker_with(Broker::start(), &EVENT_TOPICS);
    let body = config_body(&db.cdc_url(), &broker.bootstrap(), "", "");
    let mut outboxd = Outboxd::with_checkpoint(
        "lagging",
        &body,
        "store = \"kafka\"\ntopic = \"lagging.checkpoints\"\n",
    );
    outboxd.start_with_env(
        &[],
        &[("FAILPOINTS", "checkpoint_topic_partitions_lag=4*return")],
    );
    insert_rows(&db, 0, 10, 1);
    assert_eq!(consume_events(&broker.bootstrap(), 10).len(), 10);
    outboxd.stop();
    assert!(!outboxd
        .log()
        .contains("partitions; outboxd needs exactly one"));
}

/// The checkpoint writer's transactions used a fixed 60 s timeout: brokers whose
/// `transaction.max.timeout.ms` is lower refused it, and the remedy spoke of grants. It now takes
/// `kafka.properties`' `transaction.timeout.ms`, and the refusal names the brokers' limit.
#[test]
fn the_checkpoint_writer_takes_the_configured_transaction_timeout_and_names_the_brokers_limit() {
    let (db, broker) = mariadb_and_broker_with(
        Broker::start_with("transaction.max.timeout.ms=20000"),
        &EVENT_TOPICS,
    );
    let body = config_body(&db.cdc_url(), &broker.bootstrap(), "", "");
    let outboxd = Outboxd::with_checkpoint("txn-timeout", &body, "store = \"kafka\"\n");
    let log = run_to_exit(&outboxd);
    assert!(
        log.contains("transaction.max.timeout.ms is below the checkpoint writer's transaction.timeout.ms (60000 ms)"),
        "{log}"
    );
    assert!(!log.contains("grant outboxd's principal"), "{log}");
    let body = config_body(
        &db.cdc_url(),
        &broker.bootstrap(),
        "[kafka.properties]\n\"transaction.timeout.ms\" = \"20000\"",
        "",
    );
    let mut outboxd = Outboxd::with_checkpoint("txn-timeout", &body, "store = \"kafka\"\n");
    outboxd.start();
    insert_rows(&db, 0, 10, 1);
    assert_eq!(consume_events(&broker.bootstrap(), 10).len(), 10);
    outboxd.stop();
}

/// `outboxd run`'s output once it exited (which it must, within a minute, and not successfully).
fn run_to_exit(outboxd: &Outboxd) -> String {
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut child = outboxd
        .command(&["run"])
        .stdout(std::process::Stdio::null())
        .stderr(log.reopen().unwrap())
        .spawn()
        .unwrap();
    let mut status = None;
    let waited = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        wait_until("outboxd run to exit", Duration::from_secs(60), || {
            status = child.try_wait().unwrap();
            status.is_some()
        })
    }));
    if waited.is_err() {
        let _ = child.kill();
        let _ = child.wait();
        panic!(
            "outboxd run did not exit (a retry loop?):\n{}",
            std::fs::read_to_string(log.path()).unwrap_or_default()
        );
    }
    assert!(!status.unwrap().success());
    std::fs::read_to_string(log.path()).unwrap()
}

/// Sets the flag when dropped, also when the test panics (the writer thread then stops).
struct StopOnDrop(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Rows written in transactions of 5 at a steady pace until `stop` is set; returns how many.
fn steady_writer(
    db: &Mysqld,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<u64> {
    let socket = db.socket_path();
    std::thread::spawn(move || {
        let mut n = 0;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            crate::rig::mysqld::sql_at(&socket, &transactions(n, n + 20, 5, insert_sql));
            n += 20;
            // Pacing the load across the restarts, not waiting for anything.
            std::thread::sleep(Duration::from_millis(50));
        }
        n
    })
}

/// A rolling restart of a three-broker cluster under load, one broker at a time, as an operator
/// upgrades Kafka: the checkpoint partition's leader and the transaction coordinator move, and
/// for a moment the brokers answer NOT_LEADER, NOT_ENOUGH_REPLICAS or COORDINATOR_LOAD_IN_PROGRESS.
/// The leader must ride that out within its lease (no lead change), nothing may be lost, and the
/// checkpoint topic outboxd created has three replicas, two in sync. Then the broker leading the
/// checkpoint partition is killed outright (its partitions move once its session times out): the
/// same, with a takeover timeout longer than the brokers' failover.
#[test]
fn a_rolling_restart_of_a_three_broker_cluster_moves_no_lead_and_loses_nothing() {
    use crate::operate::output;
    use crate::rig::cluster::Cluster;
    let db = Mysqld::mariadb(&[]);
    db.sql_socket(SCHEMA);
    let mut cluster = Cluster::start();
    for topic in ["outbox.event.order", "outbox.event.customer"] {
        cluster.create_topic(topic, 3);
    }
    let instance = || {
        let port = free_port();
        let body = config_body(
            &db.cdc_url(),
            &cluster.bootstrap(),
            "",
            &format!("127.0.0.1:{port}"),
        );
        // Longer than the brokers' own failover after a kill -9 (their session timeout, 9 s) and
        // than the 16 s outage below, with room for what the product needs to keep its lead
        // through it: a write that retries through the outage and the coordinators' recovery
        // after it (up to 34 s measured here under load) and then gets stuck in librdkafka needs
        // 25 s more for a new writer in place (README "Broker restarts"); 60 s once left 13 s.
        (
            Outboxd::with_checkpoint(
                "rolling",
                &body,
                "store = \"kafka\"\ntakeover_timeout_ms = 90000\n",
            ),
            port,
        )
    };
    let (mut leader, leader_port) = instance();
    let (mut standby, _) = instance();
    leader.start();
    wait_until("the leader to be ready", LIMIT, || {
        http_get(leader_port, "/readyz") == (200, "ready: leader\n".into())
    });
    standby.start_until(&[], &[], &["standing by"]);
    // What the product promises is for a settled lead: in its first renewal period a write stuck
    // in librdkafka gives the lead up instead of getting a new writer (docs "Broker restarts").
    wait_until("the lead to settle", LIMIT, || {
        leader.log().contains("the lead is settled")
    });
    let (ok, shown) = output(&leader, &["check"]);
    assert!(ok, "{shown}");
    assert!(
        shown.contains("PASS  checkpoint topic: outboxd.checkpoints: 3 replica(s) on a cluster of 3 broker(s), min.insync.replicas 2"),
        "{shown}"
    );

    let stop = StopOnDrop(std::sync::Arc::new(std::sync::atomic::AtomicBool::new(
        false,
    )));
    let writer = steady_writer(&db, stop.0.clone());
    let bootstrap = cluster.bootstrap();
    let written = || {
        ["outbox.event.order", "outbox.event.customer"]
            .iter()
            .map(|t| crate::rig::topic_end(&bootstrap, t))
            .sum::<usize>()
    };
    // One at a time, controlled; then the checkpoint partition's leader killed outright; then two
    // of the three frozen together for 16 s (no quorum, no two replicas in sync: every write
    // waits, longer than one commit's 15 s, shorter than the lease).
    for step in 0..5 {
        let before = written();
        match step {
            0..=2 => cluster.restart(step),
            3 => {
                let leading = cluster.leader_of("outboxd.checkpoints", 0);
                cluster.restart_killed(leading);
            }
            _ => {
                cluster.freeze(0, true);
                cluster.freeze(1, true);
                // The outage's length, not a wait for a condition.
                std::thread::sleep(Duration::from_secs(16));
                cluster.freeze(0, false);
                cluster.freeze(1, false);
            }
        }
        // Rows flow again before the next broker goes.
        wait_until("rows to flow after the restart", LIMIT, || {
            written() > before + 100
        });
    }
    drop(stop);
    let total = writer.join().unwrap();
    let records = consume_distinct_events(&cluster.bootstrap(), total as usize);
    let duplicates = check_records(&records, 0..total);
    check_per_key_order(&records);
    let leads = leader.log().matches("leading the pipeline").count();
    let standby_leads = standby.log().matches("leading the pipeline").count();
    println!(
        "rolling restart of 3 brokers: {} records for {total} rows, {duplicates} duplicates, lead taken {leads} + {standby_leads} times",
        records.len()
    );
    assert_eq!(
        (leads, standby_leads, duplicates),
        (1, 0, 0),
        "the lead moved (or the session restarted) during a rolling restart:\n{}\n--- standby ---\n{}",
        leader.log(),
        standby.log()
    );
    // The outages did make a write fail, or get stuck in librdkafka (which, before the fixes,
    // gave the lead up at once), and the same lead wrote again (a write that failed during the
    // last broker's restart may still be retrying when every row has arrived).
    wait_until(
        "the failed checkpoint write to be written again",
        Duration::from_secs(90),
        || {
            let log = leader.log();
            assert!(
                !log.contains("giving up the lead") && !log.contains("lost the pipeline's lead"),
                "{log}"
            );
            log.contains("wrote to the checkpoint topic again")
        },
    );
    // No write still retrying when SIGTERM comes: the last one has landed.
    checkpoint_at_binlog_end(&db, &leader);
    standby.stop();
    leader.stop();
}

/// Waits until the Kafka checkpoint of `outboxd`'s pipeline names MariaDB's last transaction.
fn checkpoint_at_binlog_end(db: &Mysqld, outboxd: &Outboxd) {
    let end = db
        .sql_socket("SELECT @@gtid_binlog_pos;")
        .trim()
        .to_string();
    wait_until(
        "the checkpoint to name the last row",
        Duration::from_secs(120),
        || {
            let (ok, text) = show(outboxd);
            ok && text.contains(&format!("\"gtid_set\": \"{end}\""))
        },
    );
}

/// `outboxd checkpoint show`: whether it succeeded, its stdout, then its stderr (which says how the
/// checkpoint was found).
fn show(outboxd: &Outboxd) -> (bool, String) {
    let out = outboxd.command_output(&["checkpoint", "show"]);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// The live checkpoint's offset is committed with it, as the offset of consumer group
/// `outboxd.<name>.reader`: reading it takes one lookup and one record, however many records other
/// pipelines wrote after it (the topic compacts only hourly, and not past an open transaction).
/// Before the index, `checkpoint show` read back through every one of them.
#[test]
fn the_checkpoint_is_read_through_its_index_however_many_records_follow_it() {
    use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
    let (db, broker) = mariadb_and_broker_with(Broker::start(), &EVENT_TOPICS);
    let body = config_body(&db.cdc_url(), &broker.bootstrap(), "", "");
    let mut outboxd = Outboxd::with_checkpoint("quiet", &body, "store = \"kafka\"\n");
    outboxd.start();
    insert_rows(&db, 0, 10, 1);
    assert_eq!(consume_events(&broker.bootstrap(), 10).len(), 10);
    outboxd.stop();
    // Another pipeline's renewals, 20,000 of them, after this one's checkpoint.
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", broker.bootstrap())
        .set("linger.ms", "20")
        .create()
        .unwrap();
    let body = br#"{"instance":"elsewhere:1","renewed_at_ms":0,"released":false}"#;
    for _ in 0..20_000 {
        let mut record = BaseRecord::<str, [u8]>::to(CHECKPOINTS)
            .key("busy/lead")
            .payload(&body[..]);
        while let Err((_, back)) = producer.send(record) {
            producer.poll(Duration::from_millis(10));
            record = back;
        }
    }
    producer.flush(Duration::from_secs(30)).unwrap();
    let (_, end) = checkpoint_watermarks(&broker, "read_uncommitted");
    assert!(end > 20_000);
    let (ok, text) = show(&outboxd);
    assert!(ok && text.contains("gtid"), "{text}");
    assert!(
        text.contains("found through its index (consumer group outboxd.quiet.reader)"),
        "{text}"
    );
}

/// A broker that loses the checkpoint topic's data (its partition's directory gone, as when the
/// disk of a one-replica topic fails) brings the topic back empty. That read as a first start: the
/// MySQL source began at the binlog's end and skipped every row written since the lost checkpoint.
/// The checkpoint's index lives in `__consumer_offsets`, apart from the topic, and says the
/// pipeline ran before: `check` FAILs and `run` refuses, naming what was lost and what to do.
#[test]
fn a_checkpoint_topic_that_lost_its_data_is_not_read_as_a_first_start() {
    let (db, mut broker) = mariadb_and_broker_with(Broker::start(), &EVENT_TOPICS);
    let body = config_body(&db.cdc_url(), &broker.bootstrap(), "", "");
    let mut outboxd = Outboxd::with_checkpoint("lost", &body, "store = \"kafka\"\n");
    outboxd.start();
    insert_rows(&db, 0, 10, 1);
    assert_eq!(consume_events(&broker.bootstrap(), 10).len(), 10);
    outboxd.stop();
    insert_rows(&db, 10, 20, 1);
    broker.kill9();
    std::fs::remove_dir_all(broker.data_dir().join(format!("{CHECKPOINTS}-0"))).unwrap();
    broker.resume();
    let says = "the checkpoint topic outboxd.checkpoints lost pipeline \"lost\"'s checkpoint";
    let (ok, text) = crate::tls::output(&outboxd, &["check"]);
    assert!(!ok && text.contains(says), "{text}");
    let log = run_to_exit(&outboxd);
    assert!(
        log.contains(says) && log.contains("outboxd checkpoint set"),
        "{log}"
    );
    // Starting anew is the operator's decision, and then it is a first start.
    let (ok, text) = crate::tls::output(&outboxd, &["checkpoint", "reset"]);
    assert!(ok, "{text}");
    let (ok, text) = crate::tls::output(&outboxd, &["checkpoint", "show"]);
    assert!(ok && text.contains("no checkpoint at"), "{text}");
}

/// Adding the index's entry to a checkpoint's transaction can fail for a moment (the group's
/// coordinator moving): the write is retried. The retry must add the entry again: a checkpoint
/// committed without it leaves the index naming an older record, and a restart resumes there.
#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "needs --features failpoints")]
fn a_checkpoint_write_retried_after_its_index_failed_is_still_indexed() {
    let (db, broker) = mariadb_and_broker_with(Broker::start(), &EVENT_TOPICS);
    let body = config_body(&db.cdc_url(), &broker.bootstrap(), "", "");
    let mut outboxd = Outboxd::with_checkpoint("retried", &body, "store = \"kafka\"\n");
    outboxd.start_with_env(&[], &[("FAILPOINTS", "checkpoint_index_send_fails=return")]);
    insert_rows(&db, 0, 10, 1);
    assert_eq!(consume_events(&broker.bootstrap(), 10).len(), 10);
    outboxd.stop();
    assert!(
        outboxd
            .log()
            .contains("writing to the checkpoint topic failed for now"),
        "{}",
        outboxd.log()
    );
    let (ok, text) = show(&outboxd);
    assert!(ok && text.contains("gtid"), "{text}");
    assert!(
        text.contains("found through its index (consumer group outboxd.retried.reader)"),
        "{text}"
    );
}

/// librdkafka's `send_offsets_to_transaction` can wait far past its timeout while the group
/// coordinator it cached is gone (confluentinc/librdkafka#5456 and #5511; seen here in a rolling
/// restart of three brokers, where a SIGTERM then waited 10 minutes). The fail point holds the
/// next index entry's call for 10 minutes: the write must give that writer up, write again with a
/// new one, and stop cleanly, not hold the lead, the checkpoint and the shutdown until it returns.
#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "needs --features failpoints")]
fn a_checkpoint_write_stuck_in_librdkafka_is_given_up_and_written_again() {
    let (db, broker) = mariadb_and_broker_with(Broker::start(), &EVENT_TOPICS);
    let body = config_body(&db.cdc_url(), &broker.bootstrap(), "", "");
    let mut outboxd = Outboxd::with_checkpoint("stuck", &body, "store = \"kafka\"\n");
    outboxd.start();
    insert_rows(&db, 0, 10, 1);
    checkpoint_at_binlog_end(&db, &outboxd);
    outboxd.stop();
    // Resumed (so no first write), the first entry is the next checkpoint's.
    outboxd.start_with_env(&[], &[("FAILPOINTS", "index_send_hangs=1*sleep(600000)")]);
    insert_rows(&db, 10, 20, 1);
    checkpoint_at_binlog_end(&db, &outboxd);
    outboxd.stop();
    // A 6 s lead is too short to make a new writer inside it: the lead is given up and taken
    // again. (A settled lead with room gets a new writer in place instead: the rolling-restart test
    // above needs that under load; no fail point here can wait for the lead to settle.)
    assert!(
        outboxd.log().contains("did not return within"),
        "{}",
        outboxd.log()
    );
    let records = consume_distinct_events(&broker.bootstrap(), 20);
    check_records(&records, 0..20);
}

/// The same stuck call on a lead that has settled (a renewal begun 20 s after the takeover
/// committed) with room left before it could lapse: a new writer takes the stuck one's place at
/// once, the same instance writes again, and the lead does not move. (The rolling-restart test
/// meets this path only when a broker's restart happens to strand a call.)
#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "needs --features failpoints")]
fn a_checkpoint_write_stuck_on_a_settled_lead_gets_a_new_writer_in_place() {
    let (db, broker, outboxd) = settled_lead_with_hangs("inplace", 60_000, &[]);
    std::fs::write(outboxd.dir_path().join(HANG), "").unwrap();
    insert_rows(&db, 0, 10, 1);
    written_in_place(&db, &broker, outboxd);
}

/// The fail point file that makes the next checkpoint index call hang.
const HANG: &str = "hang-the-index";

/// MariaDB, a broker and an outboxd with the Kafka checkpoint store (`takeover_ms`), whose index
/// call hangs once after the file [`HANG`] exists in its directory, and whose `more` fail points
/// (`(name, file)`) fire once their file exists there; returned once the lead has settled.
fn settled_lead_with_hangs(
    name: &str,
    takeover_ms: u64,
    more: &[(&str, &str)],
) -> (Mysqld, Broker, Outboxd) {
    let (db, broker) = mariadb_and_broker_with(Broker::start(), &EVENT_TOPICS);
    let body = config_body(&db.cdc_url(), &broker.bootstrap(), "", "");
    let mut outboxd = Outboxd::with_checkpoint(
        name,
        &body,
        &format!("store = \"kafka\"\ntakeover_timeout_ms = {takeover_ms}\n"),
    );
    let dir = outboxd.dir_path();
    let points: Vec<String> = [(outboxd::fault::INDEX_SEND_HANGS_WHEN_RELEASED, HANG)]
        .iter()
        .chain(more)
        .map(|(point, file)| format!("{point}=return({})", dir.join(file).display()))
        .collect();
    outboxd.start_with_env(&[], &[("FAILPOINTS", &points.join(";"))]);
    wait_until("the lead to settle", Duration::from_secs(120), || {
        outboxd.log().contains("the lead is settled")
    });
    (db, broker, outboxd)
}

/// After rows 0..10 made a checkpoint write hang: its new writer writes in place and the lead
/// never moves; rows 10..20 reach the checkpoint; every row arrived.
fn written_in_place(db: &Mysqld, broker: &Broker, mut outboxd: Outboxd) {
    wait_until(
        "the stuck write's new writer to write",
        Duration::from_secs(120),
        || {
            let log = outboxd.log();
            assert!(
                !log.contains("giving up the lead") && !log.contains("was taken over"),
                "{log}"
            );
            log.contains("wrote to the checkpoint topic again")
        },
    );
    insert_rows(db, 10, 20, 1);
    checkpoint_at_binlog_end(db, &outboxd);
    outboxd.stop();
    let log = outboxd.log();
    assert!(
        log.contains("fail point index_send_hangs_when_released: hanging")
            && log.contains("a new writer takes its place and writes again")
            && log.matches("leading the pipeline").count() == 1
            && !log.contains("giving up the lead"),
        "{log}"
    );
    check_records(&consume_distinct_events(&broker.bootstrap(), 20), 0..20);
}

/// A renewal that got the writer late (a write that retried held it, as a broker restarting makes
/// one do) renews the lead from when its transaction began, not from when it was asked for: a
/// checkpoint write stuck right after it still finds room for a new writer in place. Counted from
/// the asking, 45 − 15 − 12.5 = 17.5 s were left and the lead was given up (the rolling-restart
/// test's failure at its final write).
#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "needs --features failpoints")]
fn a_renewal_that_waited_for_the_writer_renews_the_lead_from_its_own_start() {
    const HOLD: &str = "hold-the-renewal";
    let (db, broker, outboxd) = settled_lead_with_hangs(
        "latewrite",
        45_000,
        &[(outboxd::fault::RENEWAL_HELD_WHEN_RELEASED, HOLD)],
    );
    std::fs::write(outboxd.dir_path().join(HOLD), "").unwrap();
    wait_until(
        "a renewal to hold the writer",
        Duration::from_secs(60),
        || {
            outboxd
                .log()
                .contains("fail point renewal_held_when_released: holding")
        },
    );
    // The write these rows cause waits for the held writer, then gets stuck.
    std::fs::write(outboxd.dir_path().join(HANG), "").unwrap();
    insert_rows(&db, 0, 10, 1);
    written_in_place(&db, &broker, outboxd);
    // The held renewal's record says when its transaction began, not when it was asked for (15 s
    // earlier): an instance starting now must not read the lead as 15 s older than it is.
    let lags = lead_record_lags(&broker, "latewrite");
    assert!(
        lags.len() >= 3 && lags.iter().all(|&lag| lag < 5_000),
        "milliseconds from each lead record's stamp to its write: {lags:?}"
    );
}

/// For each lead record of pipeline `name` on the checkpoint topic, written or not: how long after
/// the time it names (`renewed_at_ms`) it was sent (its CreateTime), in milliseconds.
fn lead_record_lags(broker: &Broker, name: &str) -> Vec<i64> {
    let client = [
        ("bootstrap.servers", broker.bootstrap()),
        ("isolation.level", "read_uncommitted".to_string()),
    ];
    let client: Vec<(&str, &str)> = client.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let key = format!("{name}/lead");
    crate::rig::consume_to_end(&client, CHECKPOINTS, Duration::from_secs(60))
        .iter()
        .filter(|record| record.key.as_deref() == Some(key.as_bytes()))
        .map(|record| {
            let body: serde_json::Value =
                serde_json::from_slice(record.value.as_deref().unwrap()).unwrap();
            record.timestamp.unwrap() - body["renewed_at_ms"].as_i64().unwrap()
        })
        .collect()
}

/// An outboxd without the index (a standby on the older version during a rolling upgrade, or a
/// rollback) writes checkpoints the index does not name; once the record the index names is gone
/// (compacted: here, deleted), that must not read as a lost checkpoint: the newest record on the
/// topic is the checkpoint, and outboxd says the index was behind.
#[test]
fn an_index_left_behind_by_a_writer_without_it_yields_to_the_newest_record() {
    use rdkafka::admin::{AdminClient, AdminOptions};
    use rdkafka::client::DefaultClientContext;
    use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
    use rdkafka::{Offset, TopicPartitionList};
    let (db, broker) = mariadb_and_broker_with(Broker::start(), &EVENT_TOPICS);
    let body = config_body(&db.cdc_url(), &broker.bootstrap(), "", "");
    let mut outboxd = Outboxd::with_checkpoint("behind", &body, "store = \"kafka\"\n");
    outboxd.start();
    insert_rows(&db, 0, 10, 1);
    assert_eq!(consume_events(&broker.bootstrap(), 10).len(), 10);
    outboxd.stop();
    let out = outboxd.command_output(&["checkpoint", "show"]);
    let mut checkpoint: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    checkpoint["updated_at"] = "2031-01-01T00:00:00Z".into();
    // What a writer without the index does: the record alone.
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", broker.bootstrap())
        .create()
        .unwrap();
    let value = serde_json::to_vec(&checkpoint).unwrap();
    producer
        .send(
            BaseRecord::<str, [u8]>::to(CHECKPOINTS)
                .key("behind")
                .payload(&value),
        )
        .unwrap();
    producer.flush(Duration::from_secs(10)).unwrap();
    let (_, end) = checkpoint_watermarks(&broker, "read_uncommitted");
    // Everything before the new record goes, the indexed one with it.
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", broker.bootstrap())
        .create()
        .unwrap();
    let mut before = TopicPartitionList::new();
    before
        .add_partition_offset(CHECKPOINTS, 0, Offset::Offset(end - 1))
        .unwrap();
    // Kafka deletes records only from a topic whose policy includes `delete`: for a moment.
    let policy = |value: &str| {
        let out = broker.tool_output(
            "kafka.admin.ConfigCommand",
            &[
                "--alter",
                "--entity-type",
                "topics",
                "--entity-name",
                CHECKPOINTS,
                "--add-config",
                &format!("cleanup.policy={value}"),
            ],
        );
        assert!(out.status.success(), "{out:?}");
    };
    policy("[compact,delete]");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let deleted = runtime
        .block_on(admin.delete_records(&before, &AdminOptions::new()))
        .unwrap();
    assert!(
        deleted.elements().iter().all(|p| p.error().is_ok()),
        "{deleted:?}"
    );
    policy("compact");
    let out = outboxd.command_output(&["checkpoint", "show"]);
    let (shown, said) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success() && shown.contains("2031-01-01T00:00:00Z"),
        "{shown}{said}"
    );
    assert!(
        said.contains("the checkpoint's index named an older record than the newest one"),
        "{said}"
    );
}

/// `checkpoint set` fences every writer, reads and saves the old checkpoint, then writes: its write
/// had only what was left of one `takeover_timeout_ms` after the fencing, so a short timeout (1 s,
/// as the benchmark uses) failed it with "Flush error: OperationTimedOut".
#[test]
fn checkpoint_set_works_with_a_short_takeover_timeout() {
    let (db, broker) = mariadb_and_broker_with(Broker::start(), &EVENT_TOPICS);
    let body = config_body(&db.cdc_url(), &broker.bootstrap(), "", "");
    let mut outboxd = Outboxd::with_checkpoint(
        "short",
        &body,
        "store = \"kafka\"\ntakeover_timeout_ms = 1000\n",
    );
    outboxd.start();
    insert_rows(&db, 0, 10, 1);
    assert_eq!(consume_events(&broker.bootstrap(), 10).len(), 10);
    outboxd.stop();
    let position = format!("gtid:{}", db.sql_socket("SELECT @@gtid_binlog_pos;").trim());
    for _ in 0..3 {
        let out = outboxd.command_output(&["checkpoint", "set", &position]);
        assert!(out.status.success(), "{out:?}");
    }
}
