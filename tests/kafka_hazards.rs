//! What only a real Apache Kafka shows about the checkpoint store, the lease and the sink: each test
//! here failed on the broker before its fix (issue #36).

use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::ClientConfig;

use crate::rig::scenario::*;
use crate::rig::{create_topic, free_port, http_get, wait_until, Broker, MariaDb, Outboxd};

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
    let db = MariaDb::start(&[]);
    db.sql_socket(SCHEMA);
    let broker = Broker::start();
    for topic in [
        "outbox.event.order",
        "outbox.event.customer",
        "b.order",
        "b.customer",
    ] {
        create_topic(&broker.bootstrap(), topic, 3);
    }
    let checkpoint = "store = \"kafka\"\ntakeover_timeout_ms = 1500\n";
    let instance = || {
        let port = free_port();
        let body = config_body(&db.cdc_url(), &broker.bootstrap(), "", &format!("127.0.0.1:{port}"));
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

    let b_body = config_body(&db.cdc_url(), &broker.bootstrap(), "exactly_once = true", "")
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

    // Ten takeover timeouts: every renewal of A's leader lands behind B's open transaction.
    let watched = Instant::now();
    while watched.elapsed() < Duration::from_secs(15) {
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

/// Kafka 4 refuses a record stamped more than an hour ahead of the broker's clock
/// (`message.timestamp.after.max.ms`). A `route.timestamp` column two hours ahead must not stop
/// the pipeline: the record goes out stamped with outboxd's clock, counted and logged; rows with
/// sane times keep theirs.
#[test]
fn a_timestamp_two_hours_ahead_is_clamped_to_now_and_counted() {
    let db = MariaDb::start(&[]);
    db.sql_socket(SCHEMA);
    let broker = Broker::start();
    for topic in ["outbox.event.order", "outbox.event.customer"] {
        create_topic(&broker.bootstrap(), topic, 3);
    }
    let port = free_port();
    let body = config_body(&db.cdc_url(), &broker.bootstrap(), "", &format!("127.0.0.1:{port}"))
        + "[route]\ntimestamp = \"created_at\"\n";
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
