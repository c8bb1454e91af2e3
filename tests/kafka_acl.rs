//! outboxd under Apache Kafka's StandardAuthorizer, logged in with SASL/SCRAM: what each missing
//! grant does. A refusal is an operator's problem to fix: outboxd stops naming the grant, sends
//! nothing elsewhere (a denied topic is not a missing one), and resumes losslessly once granted.

use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::ClientConfig;

use crate::rig::certs::{Ca, VALID};
use crate::rig::scenario::{consume_events, insert_rows, LIMIT, SCHEMA};
use crate::rig::{create_topic, create_topic_with, Broker, MariaDb, Outboxd};

const USER: &str = "outboxd";
const PASSWORD: &str = "acl-Pl4nted-s3cret";
const DLQ: &str = "outboxd.dlq";

/// A SASL_SSL broker with the event topics and a dead-letter topic, user [`USER`] with no grant yet,
/// and the CA (kept alive) that signed the broker's certificate.
fn sasl_broker() -> (Broker, Ca, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new(dir.path(), "outboxd test CA", "ca");
    let server = ca.server(dir.path(), "server", &["127.0.0.1"], VALID);
    let broker = Broker::start_sasl(&server);
    broker.add_scram_user(USER, PASSWORD);
    for topic in ["outbox.event.order", "outbox.event.customer", DLQ] {
        create_topic(&broker.bootstrap(), topic, 3);
    }
    (broker, ca, dir)
}

fn grant_write(broker: &Broker, topic: &str) {
    broker.acl(&[
        "--add",
        "--allow-principal",
        &format!("User:{USER}"),
        "--operation",
        "Write",
        "--topic",
        topic,
    ]);
}

/// How many records `topic` holds (its partitions' high watermarks, read as the rig's super user).
fn records_in(bootstrap: &str, topic: &str) -> i64 {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .unwrap();
    (0..3)
        .map(|p| {
            consumer
                .fetch_watermarks(topic, p, Duration::from_secs(10))
                .unwrap()
                .1
        })
        .sum()
}

#[test]
fn a_topic_without_a_write_grant_stops_run_naming_the_grant_and_nothing_is_dead_lettered() {
    let (broker, ca, _dir) = sasl_broker();
    grant_write(&broker, "outbox.event.order");
    grant_write(&broker, DLQ);
    let db = MariaDb::start(&[]);
    db.sql_socket(SCHEMA);
    let mut outboxd = Outboxd::new(
        "acl-topic",
        &format!(
            "[source]\nkind = \"mysql\"\nurl = \"{}\"\ntables = [\"app.outbox\"]\nserver_id = 99\n\
             [kafka]\n{}dead_letter_topic = \"{DLQ}\"\n[http]\nlisten = \"\"\n",
            db.cdc_url(),
            broker.sasl_client(USER, PASSWORD, &ca.pem)
        ),
    );
    outboxd.start();
    // Rows 0..20: every third is a customer event, and outbox.event.customer is not granted.
    insert_rows(&db, 0, 20, 2);
    let status = outboxd.wait_exit(LIMIT);
    let log = outboxd.log();
    assert!(!status.success(), "{log}");
    assert!(
        log.contains("outbox.event.customer")
            && log.contains("WRITE on topic outbox.event.customer"),
        "{log}"
    );
    assert!(!log.contains(PASSWORD), "{log}");
    assert_eq!(records_in(&broker.bootstrap(), DLQ), 0, "{log}");

    grant_write(&broker, "outbox.event.customer");
    outboxd.start();
    let records = consume_events(&broker.bootstrap(), 20);
    let ids: std::collections::BTreeSet<String> =
        records.iter().filter_map(|r| r.header("id")).collect();
    assert_eq!(ids.len(), 20, "{}", outboxd.log());
    outboxd.stop();
}

#[test]
fn the_kafka_checkpoint_store_runs_with_exactly_the_grants_the_readme_lists() {
    let (broker, ca, _dir) = sasl_broker();
    create_topic_with(
        &broker.bootstrap(),
        "outboxd.checkpoints",
        1,
        &[("cleanup.policy", "compact")],
    );
    // README "Running more than one instance": READ and WRITE on the checkpoint topic, WRITE on
    // the checkpoint writer's transactional id; WRITE on the event topics. No CREATE, no group.
    grant_write(&broker, "outbox.event.order");
    grant_write(&broker, "outbox.event.customer");
    for operation in ["Read", "Write"] {
        broker.acl(&[
            "--add",
            "--allow-principal",
            &format!("User:{USER}"),
            "--operation",
            operation,
            "--topic",
            "outboxd.checkpoints",
        ]);
    }
    broker.acl(&[
        "--add",
        "--allow-principal",
        &format!("User:{USER}"),
        "--operation",
        "Write",
        "--transactional-id",
        "outboxd.acl-store.checkpoint",
    ]);
    let db = MariaDb::start(&[]);
    db.sql_socket(SCHEMA);
    let mut outboxd = Outboxd::with_checkpoint(
        "acl-store",
        &format!(
            "[source]\nkind = \"mysql\"\nurl = \"{}\"\ntables = [\"app.outbox\"]\nserver_id = 99\n\
             [kafka]\n{}[http]\nlisten = \"\"\n",
            db.cdc_url(),
            broker.sasl_client(USER, PASSWORD, &ca.pem)
        ),
        "store = \"kafka\"",
    );
    let (ok, text) = crate::operate::output(&outboxd, &["check"]);
    assert!(ok, "{text}");
    outboxd.start();
    insert_rows(&db, 0, 20, 2);
    assert_eq!(
        consume_events(&broker.bootstrap(), 20).len(),
        20,
        "{}",
        outboxd.log()
    );
    outboxd.stop();
    let (ok, text) = crate::operate::output(&outboxd, &["checkpoint", "show"]);
    assert!(ok && text.contains("gtid"), "{text}");
    assert!(!outboxd.log().contains(PASSWORD));
}
