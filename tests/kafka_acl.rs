//! outboxd under Apache Kafka's StandardAuthorizer, logged in with SASL/SCRAM: what each missing
//! grant does. A refusal is an operator's problem to fix: outboxd stops naming the grant, sends
//! nothing elsewhere (a denied topic is not a missing one), and resumes losslessly once granted.

use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::ClientConfig;

use crate::rig::certs::{Ca, VALID};
use crate::rig::scenario::{config_with_kafka, consume_events, insert_rows, LIMIT, SCHEMA};
use crate::rig::{consume, create_topic, create_topic_with, wait_until, Broker, Mysqld, Outboxd};
use crate::tls::output;

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

/// Waits until `check` passes: the authorizer applies a grant a moment after AclCommand returns.
fn until_check_passes(outboxd: &Outboxd) {
    let mut text = String::new();
    wait_until(
        "check to pass once the grants apply",
        Duration::from_secs(30),
        || {
            let (ok, out) = output(outboxd, &["check"]);
            text = out;
            ok
        },
    );
    assert!(!text.contains(PASSWORD), "{text}");
}

/// Kafka's AclCommand adding or removing (`--add` / `--remove --force`) one grant for [`USER`].
fn acl(broker: &Broker, change: &[&str], operation: &str, resource: &[&str]) {
    let principal = format!("User:{USER}");
    let mut args: Vec<&str> = change.to_vec();
    args.extend(["--allow-principal", &principal, "--operation", operation]);
    args.extend(resource);
    broker.acl(&args);
}

fn grant_write(broker: &Broker, topic: &str) {
    acl(broker, &["--add"], "Write", &["--topic", topic]);
}

/// What README lists for the Kafka checkpoint store of pipeline `name`: READ and WRITE on the
/// checkpoint topic, WRITE on the checkpoint writer's transactional id; and WRITE on the event
/// topics.
fn grant_checkpoint_store(broker: &Broker, name: &str) {
    grant_write(broker, "outbox.event.order");
    grant_write(broker, "outbox.event.customer");
    acl(
        broker,
        &["--add"],
        "Read",
        &["--topic", "outboxd.checkpoints"],
    );
    grant_write(broker, "outboxd.checkpoints");
    acl(
        broker,
        &["--add"],
        "Write",
        &["--transactional-id", &format!("outboxd.{name}.checkpoint")],
    );
    grant_index_group(broker, name);
}

/// READ on the group whose offset is the checkpoint's index.
fn grant_index_group(broker: &Broker, name: &str) {
    acl(
        broker,
        &["--add"],
        "Read",
        &["--group", &format!("outboxd.{name}.reader")],
    );
}

/// The Kafka checkpoint store's topic, made by the rig (a principal without CREATE cannot).
fn checkpoint_topic(broker: &Broker) {
    create_topic_with(
        &broker.bootstrap(),
        "outboxd.checkpoints",
        1,
        &[("cleanup.policy", "compact")],
    );
}

/// A MariaDB with the outbox schema, and pipeline `name` reading it, logged in to `broker` as
/// [`USER`] (`kafka` holds more `[kafka]` keys), with the Kafka checkpoint store when `kafka_store`.
fn pipeline(
    name: &str,
    broker: &Broker,
    ca: &Ca,
    kafka: &str,
    kafka_store: bool,
) -> (Mysqld, Outboxd) {
    let db = Mysqld::mariadb(&[]);
    db.sql_socket(SCHEMA);
    let body = config_with_kafka(
        &db.cdc_url(),
        &format!("{}{kafka}", broker.sasl_client(USER, PASSWORD, &ca.pem)),
        "",
    );
    let outboxd = if kafka_store {
        Outboxd::with_checkpoint(name, &body, "store = \"kafka\"")
    } else {
        Outboxd::new(name, &body)
    };
    (db, outboxd)
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
    let (db, mut outboxd) = pipeline(
        "acl-topic",
        &broker,
        &ca,
        &format!("dead_letter_topic = \"{DLQ}\""),
        false,
    );
    until_check_passes(&outboxd);
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
    let all = "what it needs on 3 topic(s)";
    wait_until(all, Duration::from_secs(30), || {
        output(&outboxd, &["check"]).1.contains(all)
    });
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
    checkpoint_topic(&broker);
    // README "Running more than one instance": no CREATE; READ on the index's group only.
    grant_checkpoint_store(&broker, "acl-store");
    grant_write(&broker, DLQ);
    let (db, mut outboxd) = pipeline(
        "acl-store",
        &broker,
        &ca,
        &format!("dead_letter_topic = \"{DLQ}\""),
        true,
    );
    until_check_passes(&outboxd);
    outboxd.start();
    insert_rows(&db, 0, 20, 2);
    // WRITE is all the dead-letter topic needs.
    db.sql_socket(
        "INSERT INTO app.outbox (id, aggregatetype, aggregateid, type, payload) \
         VALUES (UNHEX('000000000000000000000000000000aa'), 'not a topic!', 'k', 'Bad', '{}');",
    );
    assert_eq!(
        consume(&broker.bootstrap(), DLQ, 1, LIMIT).len(),
        1,
        "{}",
        outboxd.log()
    );
    assert_eq!(
        consume_events(&broker.bootstrap(), 20).len(),
        20,
        "{}",
        outboxd.log()
    );
    outboxd.stop();
    let (ok, text) = output(&outboxd, &["checkpoint", "show"]);
    assert!(ok && text.contains("gtid"), "{text}");
    let log = outboxd.log();
    // Without DESCRIBE_CONFIGS the topic's policy cannot be read: a warning, not a stop.
    assert!(
        log.contains("the brokers did not say the checkpoint topic's cleanup.policy"),
        "{log}"
    );
    assert!(!log.contains(PASSWORD));
}

#[test]
fn check_names_each_missing_grant_and_run_refuses_to_start() {
    let (broker, ca, _dir) = sasl_broker();
    checkpoint_topic(&broker);
    // Everything README lists, and DESCRIBE on the customer topic besides (a principal that may
    // see a topic without writing to it: the case check can tell).
    let grants: [(&str, &[&str]); 7] = [
        ("Write", &["--topic", "outbox.event.order"]),
        ("Write", &["--topic", "outbox.event.customer"]),
        ("Write", &["--topic", DLQ]),
        ("Read", &["--topic", "outboxd.checkpoints"]),
        ("Write", &["--topic", "outboxd.checkpoints"]),
        (
            "Write",
            &["--transactional-id", "outboxd.acl-check.checkpoint"],
        ),
        ("Read", &["--group", "outboxd.acl-check.reader"]),
    ];
    for (operation, resource) in grants {
        acl(&broker, &["--add"], operation, resource);
    }
    acl(
        &broker,
        &["--add"],
        "Describe",
        &["--topic", "outbox.event.customer"],
    );
    let (_db, outboxd) = pipeline(
        "acl-check",
        &broker,
        &ca,
        &format!("dead_letter_topic = \"{DLQ}\""),
        true,
    );
    until_check_passes(&outboxd);
    let (ok, text) = output(&outboxd, &["check"]);
    assert!(ok, "{text}");
    assert!(
        text.contains(
            "PASS  kafka: the brokers grant outboxd's principal what it needs on 4 topic(s)"
        ),
        "{text}"
    );
    // An existing topic the route could name but outboxd may not write: a warning (it may be
    // another pipeline's), and check passes.
    acl(&broker, &["--remove", "--force"], grants[1].0, grants[1].1);
    let says = "WARN  kafka: outboxd's principal lacks WRITE on 1 existing topic(s) the route could name: outbox.event.customer";
    wait_until(says, Duration::from_secs(30), || {
        let (ok, text) = output(&outboxd, &["check"]);
        ok && text.contains(says)
    });
    acl(&broker, &["--add"], grants[1].0, grants[1].1);
    // What outboxd certainly uses: a FAIL, and run refuses to start.
    for (operation, resource, subject, says) in [
        (
            grants[2].0,
            grants[2].1,
            "kafka",
            "lacks WRITE on the dead-letter topic outboxd.dlq (it may not even describe it)",
        ),
        (
            grants[3].0,
            grants[3].1,
            "kafka",
            "lacks READ on the checkpoint topic outboxd.checkpoints",
        ),
        (
            grants[4].0,
            grants[4].1,
            "kafka",
            "lacks WRITE on the checkpoint topic outboxd.checkpoints",
        ),
        (
            grants[6].0,
            grants[6].1,
            "checkpoint",
            "lacks READ on consumer group outboxd.acl-check.reader, where the checkpoint's index is kept",
        ),
    ] {
        acl(&broker, &["--remove", "--force"], operation, resource);
        // The authorizer applies a change a moment after the command returns.
        let mut text = String::new();
        wait_until(says, Duration::from_secs(30), || {
            text = output(&outboxd, &["check"]).1;
            text.contains(says)
        });
        assert!(
            text.contains(&format!("FAIL  {subject}: outboxd's principal {says}"))
                && text.contains("fix: grant it: kafka-acls.sh"),
            "{text}"
        );
        let (ok, run) = output(&outboxd, &["run"]);
        assert!(!ok && run.contains(says), "run: {run}");
        assert!(!run.contains(PASSWORD) && !text.contains(PASSWORD));
        acl(&broker, &["--add"], operation, resource);
        wait_until("the grant to be back", Duration::from_secs(30), || {
            output(&outboxd, &["check"]).0
        });
    }
}

#[test]
fn exactly_once_runs_with_exactly_the_grants_the_readme_lists_and_names_the_records_id_without_it()
{
    let (broker, ca, _dir) = sasl_broker();
    checkpoint_topic(&broker);
    // README "Exactly once", Grants: the checkpoint store's grants, plus WRITE on the records'
    // transactional id. WRITE implies DESCRIBE in Kafka's authorizer.
    grant_checkpoint_store(&broker, "acl-eos");
    let (db, mut outboxd) = pipeline("acl-eos", &broker, &ca, "exactly_once = true", true);
    until_check_passes(&outboxd);
    // Without the records' transactional id: run stops naming it (check cannot ask about
    // transactional ids, so the checkpoint writer's grant may still be on its way: until then
    // run names that one).
    let records_id =
        "taking over the pipeline's Kafka transactions (transactional id outboxd.acl-eos.records)";
    let mut run = String::new();
    wait_until("run to name the records' transactional id", LIMIT, || {
        let (ok, text) = output(&outboxd, &["run"]);
        assert!(!ok, "run: {text}");
        run = text;
        run.contains(records_id)
    });
    assert!(
        run.contains(
            "grant outboxd's principal WRITE and DESCRIBE on the transactional id outboxd.acl-eos.records"
        ),
        "run: {run}"
    );
    assert!(!run.contains(PASSWORD), "{run}");
    acl(
        &broker,
        &["--add"],
        "Write",
        &["--transactional-id", "outboxd.acl-eos.records"],
    );
    // The authorizer applies it a moment later: a start may still be refused, then try again.
    let mut refused = Vec::new();
    wait_until("run to open the stream once granted", LIMIT, || {
        if !outboxd.started() {
            outboxd.spawn(&[]);
        }
        if outboxd.exited().is_some() {
            refused.push(outboxd.log());
            assert!(refused.len() < 20, "refused runs: {refused:#?}");
            return false;
        }
        // The records' transactions are taken over before the stream opens.
        outboxd.log().contains("stream opened")
    });
    insert_rows(&db, 0, 20, 2);
    // A read_committed consumer (the rig's) sees every row once.
    let records = consume_events(&broker.bootstrap(), 20);
    let ids: std::collections::BTreeSet<String> =
        records.iter().filter_map(|r| r.header("id")).collect();
    assert_eq!((records.len(), ids.len()), (20, 20), "{}", outboxd.log());
    outboxd.stop();
    for log in refused.iter().chain([&outboxd.log()]) {
        assert!(!log.contains(PASSWORD), "{log}");
    }
}
