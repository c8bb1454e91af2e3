//! TLS end to end: a MariaDB and a PostgreSQL that accept only TLS and want a client certificate,
//! and a broker reached only through a TLS terminator, with certificates made here (`rig::certs`).
//! Rows flow under `verify-full`; each certificate problem fails `check` and `run` with its own
//! message and fix; planted secrets never appear in what outboxd prints.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use crate::on_both_servers;
use crate::rig::certs::{Ca, Issued, EXPIRED, VALID};
use crate::rig::mysqld::CDC_PASSWORD;
use crate::rig::scenario::{config_with_kafka, consume_events, insert_rows, SCHEMA};
use crate::rig::{
    consume, consume_using, create_topic, create_topic_using, wait_until, Broker, Flavor, Mysqld,
    Outboxd, Postgres,
};

/// `outboxd ARGS`, bounded: (success, stdout + stderr). A run that does not exit in 60 s is killed
/// and reported as such, so a retry loop fails the test instead of hanging it.
pub(crate) fn output(outboxd: &Outboxd, args: &[&str]) -> (bool, String) {
    let log = outboxd.dir_path().join("bounded.log");
    let mut child = outboxd
        .command(args)
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(std::fs::File::options().append(true).open(&log).unwrap())
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let mut status = None;
    let start = std::time::Instant::now();
    while status.is_none() && start.elapsed() < Duration::from_secs(60) {
        status = child.try_wait().unwrap();
        if status.is_none() {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    match status {
        Some(s) => (s.success(), text),
        None => {
            let _ = child.kill();
            let _ = child.wait();
            panic!("outboxd {args:?} did not exit within 60 s (a retry loop?):\n{text}");
        }
    }
}

/// The certificates of one test: the server's CA, a second CA nobody uses, a server certificate for
/// 127.0.0.1 only, an expired one, and a client certificate for `cdc`.
struct Certs {
    _dir: tempfile::TempDir,
    ca: Ca,
    other_ca: Ca,
    server: Issued,
    expired: Issued,
    client: Issued,
    /// A client certificate for `cdc` from the other CA (the servers do not trust it).
    stranger: Issued,
}

fn certs() -> Certs {
    let dir = tempfile::Builder::new()
        .prefix("outboxd-certs-")
        .tempdir()
        .unwrap();
    let ca = Ca::new(dir.path(), "outboxd test CA", "ca");
    let other_ca = Ca::new(dir.path(), "some other CA", "other-ca");
    let server = ca.server(dir.path(), "server", &["127.0.0.1"], VALID);
    let expired = ca.server(dir.path(), "expired", &["127.0.0.1"], EXPIRED);
    let client = ca.client(dir.path(), "client", "cdc");
    let stranger = other_ca.client(dir.path(), "stranger", "cdc");
    Certs {
        _dir: dir,
        ca,
        other_ca,
        server,
        expired,
        client,
        stranger,
    }
}

/// Neither the password nor the client key's PEM body appear in `text`.
fn assert_no_secrets(text: &str, c: &Certs) {
    assert!(!text.contains(CDC_PASSWORD), "the password leaked:\n{text}");
    let key = std::fs::read_to_string(&c.client.key).unwrap();
    for line in key.lines().filter(|l| !l.starts_with("-----")) {
        assert!(!text.contains(line), "the client key leaked:\n{text}");
    }
}

/// `source.tls` with `mode` and the client certificate, no CA.
fn client_only(mode: &str, c: &Certs) -> String {
    format!(
        "tls = {{ mode = \"{mode}\", cert = \"{}\", key = \"{}\" }}",
        c.client.cert.display(),
        c.client.key.display()
    )
}

/// Each case `(what, config body, expected text)` fails `check` and `run` with its own message,
/// and no secret shows.
fn each_fails_with_its_own_message(outboxd: &Outboxd, cases: &[(&str, String, &str)], c: &Certs) {
    for (what, body, expected) in cases {
        outboxd.rewrite_config(body);
        for command in ["check", "run"] {
            let (ok, text) = output(outboxd, &[command]);
            assert!(!ok, "{what}: {command} succeeded:\n{text}");
            assert!(text.contains(expected), "{what}: {command}:\n{text}");
            assert_no_secrets(&text, c);
        }
    }
}

/// `outboxd check` passes and prints `line`.
fn check_passes_with(outboxd: &Outboxd, body: &str, line: &str) {
    outboxd.rewrite_config(body);
    let (ok, text) = output(outboxd, &["check"]);
    assert!(ok && text.contains(line), "expected {line:?}:\n{text}");
}

fn tls_line(mode: &str, ca: &Path, client: &Issued) -> String {
    format!(
        "tls = {{ mode = \"{mode}\", ca = \"{}\", cert = \"{}\", key = \"{}\" }}",
        ca.display(),
        client.cert.display(),
        client.key.display()
    )
}

fn mysql_body(url: &str, tls: &str, bootstrap: &str) -> String {
    format!(
        "[source]\nkind = \"mysql\"\nurl = \"{url}\"\ntables = [\"app.outbox\"]\nserver_id = 99\nheartbeat_interval_ms = 1000\n{tls}\n\
         [kafka]\nbrokers = \"{bootstrap}\"\n[http]\nlisten = \"\"\n"
    )
}

/// A MariaDB that refuses plain text over TCP, whose `cdc` account needs a client certificate.
fn tls_mariadb(c: &Certs) -> Mysqld {
    tls_server(Flavor::MariaDb, c)
}

/// [`tls_mariadb`] of `flavor`.
fn tls_server(flavor: Flavor, c: &Certs) -> Mysqld {
    let monitor = match flavor {
        Flavor::MariaDb => ", BINLOG MONITOR",
        Flavor::MySql => "",
    };
    let db = Mysqld::start(
        flavor,
        &[
            &format!("ssl-ca={}", c.ca.pem.display()),
            &format!("ssl-cert={}", c.server.cert.display()),
            &format!("ssl-key={}", c.server.key.display()),
            "require-secure-transport=ON",
        ],
    );
    db.sql_socket(SCHEMA);
    db.sql_socket(&format!(
        "ALTER USER 'cdc'@'127.0.0.1' REQUIRE X509; \
         CREATE USER 'plain'@'127.0.0.1' IDENTIFIED BY '{CDC_PASSWORD}'; \
         GRANT REPLICATION SLAVE, REPLICATION CLIENT{monitor}, SELECT ON *.* TO 'plain'@'127.0.0.1';"
    ));
    db
}

on_both_servers! {
fn over_tls_only_with_a_client_certificate_rows_flow_under_verify_full(flavor: Flavor) {
    let c = certs();
    let db = tls_server(flavor, &c);
    let broker = Broker::start();
    for topic in ["outbox.event.order", "outbox.event.customer"] {
        create_topic(&broker.bootstrap(), topic, 3);
    }
    let body = mysql_body(
        &db.cdc_url(),
        &tls_line("verify-full", &c.ca.pem, &c.client),
        &broker.bootstrap(),
    );
    let mut outboxd = Outboxd::new("tls-maria", &body);
    let (ok, text) = output(&outboxd, &["check"]);
    assert!(ok, "{text}");
    assert!(text.contains("PASS  mysql: TLS TLSv1."), "{text}");
    assert!(
        text.contains("verify-full: chain verified against")
            && text.contains("server name 127.0.0.1 verified, client certificate sent"),
        "{text}"
    );
    assert!(!text.contains(CDC_PASSWORD), "the password leaked:\n{text}");

    outboxd.start();
    insert_rows(&db, 0, 50, 5);
    // The server refuses plain text over TCP, so the binlog stream that delivered these is TLS.
    assert_eq!(consume_events(&broker.bootstrap(), 50).len(), 50);
    outboxd.stop();
    assert!(!outboxd.log().contains(CDC_PASSWORD));
}
}

#[test]
fn mariadb_certificate_problems_each_fail_check_and_run_with_their_own_message() {
    let c = certs();
    let db = tls_mariadb(&c);
    let broker = Broker::start();
    let outboxd = Outboxd::new("tls-maria-bad", "");
    let cases: Vec<(&str, String, &str)> = vec![
        (
            "wrong CA",
            mysql_body(
                &db.cdc_url(),
                &tls_line("verify-full", &c.other_ca.pem, &c.client),
                &broker.bootstrap(),
            ),
            "not signed by a CA in source.tls.ca",
        ),
        (
            "wrong host name",
            mysql_body(
                &format!("mysql://cdc@localhost:{}/app", db.port),
                &tls_line("verify-full", &c.ca.pem, &c.client),
                &broker.bootstrap(),
            ),
            "not valid for the host name \"localhost\"",
        ),
        (
            "plain text against require_secure_transport",
            mysql_body(
                &format!("mysql://plain@127.0.0.1:{}/app", db.port),
                "",
                &broker.bootstrap(),
            ),
            // MariaDB answers "access denied" (no error of its own): the hint is in the fix.
            "refuses plain text this way too: then set source.tls",
        ),
        (
            "no client certificate for a REQUIRE X509 account",
            mysql_body(
                &format!(
                    "{}?ssl-mode=VERIFY_IDENTITY&ssl-ca={}",
                    db.cdc_url(),
                    c.ca.pem.display()
                ),
                "",
                &broker.bootstrap(),
            ),
            "REQUIRE X509 also needs source.tls.cert and key",
        ),
        (
            "a client certificate from a CA the server does not trust",
            mysql_body(
                &db.cdc_url(),
                &tls_line("verify-full", &c.ca.pem, &c.stranger),
                &broker.bootstrap(),
            ),
            "the server refused our client certificate",
        ),
        (
            "verify-ca still checks the chain",
            mysql_body(
                &format!("mysql://cdc@localhost:{}/app", db.port),
                &tls_line("verify-ca", &c.other_ca.pem, &c.client),
                &broker.bootstrap(),
            ),
            "not signed by a CA in source.tls.ca",
        ),
    ];
    each_fails_with_its_own_message(&outboxd, &cases, &c);
    // What each weaker mode accepts, against a server that refuses plain text (so a pass is TLS):
    // verify-ca skips the name, require (no ca) the chain, prefer uses TLS when offered.
    let localhost = format!("mysql://cdc@localhost:{}/app", db.port);
    for (url, tls, line) in [
        (
            &localhost,
            tls_line("verify-ca", &c.ca.pem, &c.client),
            "verify-ca: chain verified against",
        ),
        (
            &db.cdc_url(),
            client_only("require", &c),
            "require: certificate not checked, client certificate sent",
        ),
        (
            &db.cdc_url(),
            client_only("prefer", &c),
            "prefer: certificate not checked, client certificate sent",
        ),
    ] {
        check_passes_with(&outboxd, &mysql_body(url, &tls, &broker.bootstrap()), line);
    }
    // An expired server certificate: the server reloads its files.
    std::fs::copy(&c.expired.cert, &c.server.cert).unwrap();
    std::fs::copy(&c.expired.key, &c.server.key).unwrap();
    db.sql_socket("FLUSH SSL;");
    outboxd.rewrite_config(&mysql_body(
        &db.cdc_url(),
        &tls_line("verify-full", &c.ca.pem, &c.client),
        &broker.bootstrap(),
    ));
    for command in ["check", "run"] {
        let (ok, text) = output(&outboxd, &[command]);
        assert!(!ok, "{text}");
        assert!(
            text.contains("the server's certificate has expired"),
            "{command}:\n{text}"
        );
    }
}

/// The outboxd side of a TLS-only PostgreSQL: the `cdc` role, the outbox, the broker topics.
const PG_SCHEMA: &str = "
CREATE ROLE cdc WITH LOGIN REPLICATION;
CREATE TABLE public.outbox (
  id uuid PRIMARY KEY,
  aggregatetype text,
  aggregateid text NOT NULL,
  type text NOT NULL,
  payload jsonb
);
ALTER TABLE public.outbox OWNER TO cdc;
";

/// A PostgreSQL whose TCP connections must be TLS and present a client certificate named `cdc`
/// (replication connections too).
fn tls_postgres(c: &Certs) -> Postgres {
    let pg = Postgres::start(&[]);
    pg.sql("postgres", "CREATE DATABASE app;");
    pg.sql("app", PG_SCHEMA);
    pg.sql("postgres", "GRANT CREATE ON DATABASE app TO cdc;");
    pg.sql(
        "postgres",
        &format!("ALTER ROLE cdc PASSWORD '{CDC_PASSWORD}';"),
    );
    pg.enable_tls(
        &c.server.cert,
        &c.server.key,
        &c.ca.pem,
        &[
            "hostnossl all all 0.0.0.0/0 reject",
            "hostnossl replication all 0.0.0.0/0 reject",
            "hostssl all cdc 127.0.0.1/32 scram-sha-256 clientcert=verify-full",
        ],
    );
    pg
}

fn pg_body(url: &str, tls: &str, bootstrap: &str) -> String {
    format!(
        "[source]\nkind = \"postgres\"\nurl = \"{url}\"\ntables = [\"public.outbox\"]\nslot = \"outboxd_tls\"\n\
         publication = \"outboxd_tls\"\nheartbeat_interval_ms = 1000\n{tls}\n\
         [kafka]\nbrokers = \"{bootstrap}\"\n[http]\nlisten = \"\"\n"
    )
}

#[test]
fn postgres_over_tls_only_with_a_client_certificate_forwards_rows_under_verify_full() {
    let c = certs();
    let pg = tls_postgres(&c);
    let broker = Broker::start();
    create_topic(&broker.bootstrap(), "outbox.event.order", 3);
    let body = pg_body(
        &pg.url("cdc", "app"),
        &tls_line("verify-full", &c.ca.pem, &c.client),
        &broker.bootstrap(),
    );
    let mut outboxd = Outboxd::new("tls-pg", &body);
    let (ok, text) = output(&outboxd, &["check"]);
    assert!(ok, "{text}");
    assert!(
        text.contains("PASS  postgres: TLS TLSv1.")
            && text.contains("on the control and replication connections to 127.0.0.1")
            && text.contains("server name 127.0.0.1 verified, client certificate sent"),
        "{text}"
    );
    outboxd.start();
    let inserts: String = (0..20)
        .map(|n| {
            format!(
                "INSERT INTO public.outbox (id, aggregatetype, aggregateid, type, payload) VALUES ('{}', 'order', 'o{n}', 'Created', '{{\"n\": {n}}}');\n",
                crate::rig::scenario::uuid_of(n)
            )
        })
        .collect();
    pg.sql("app", &inserts);
    let records = consume(
        &broker.bootstrap(),
        "outbox.event.order",
        20,
        Duration::from_secs(60),
    );
    assert_eq!(records.len(), 20);
    // Both of outboxd's connections are encrypted.
    let encrypted = pg.sql(
        "app",
        "SELECT count(*) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) WHERE a.usename = 'cdc' AND s.ssl;",
    );
    assert_eq!(
        encrypted.trim(),
        "2",
        "control and replication connections use TLS"
    );
    outboxd.stop();
}

#[test]
fn postgres_certificate_problems_each_fail_check_and_run_with_their_own_message() {
    let c = certs();
    let pg = tls_postgres(&c);
    let broker = Broker::start();
    let outboxd = Outboxd::new("tls-pg-bad", "");
    let url = pg.url("cdc", "app");
    let cases: Vec<(&str, String, &str)> = vec![
        (
            "wrong CA",
            pg_body(
                &url,
                &tls_line("verify-full", &c.other_ca.pem, &c.client),
                &broker.bootstrap(),
            ),
            "not signed by a CA in source.tls.ca",
        ),
        (
            "wrong host name",
            pg_body(
                &format!("postgres://cdc@localhost:{}/app", pg.port),
                &tls_line("verify-full", &c.ca.pem, &c.client),
                &broker.bootstrap(),
            ),
            "not valid for the host name \"localhost\"",
        ),
        (
            "plain text against a TLS-only server",
            pg_body(&url, "", &broker.bootstrap()),
            "the server accepts only TLS connections",
        ),
        (
            "no client certificate",
            pg_body(
                &format!(
                    "{url}?sslmode=verify-full&sslrootcert={}",
                    c.ca.pem.display()
                ),
                "",
                &broker.bootstrap(),
            ),
            "wants a client certificate",
        ),
        (
            "a client certificate from a CA the server does not trust",
            pg_body(
                &url,
                &tls_line("verify-full", &c.ca.pem, &c.stranger),
                &broker.bootstrap(),
            ),
            "the server refused our client certificate",
        ),
        (
            "verify-ca still checks the chain",
            pg_body(
                &format!("postgres://cdc@localhost:{}/app", pg.port),
                &tls_line("verify-ca", &c.other_ca.pem, &c.client),
                &broker.bootstrap(),
            ),
            "not signed by a CA in source.tls.ca",
        ),
    ];
    each_fails_with_its_own_message(&outboxd, &cases, &c);
    let localhost = format!("postgres://cdc@localhost:{}/app", pg.port);
    for (url, tls, line) in [
        (
            &localhost,
            tls_line("verify-ca", &c.ca.pem, &c.client),
            "verify-ca: chain verified against",
        ),
        (
            &url,
            client_only("require", &c),
            "require: certificate not checked, client certificate sent",
        ),
        (
            &url,
            client_only("prefer", &c),
            "prefer: certificate not checked, client certificate sent",
        ),
    ] {
        check_passes_with(&outboxd, &pg_body(url, &tls, &broker.bootstrap()), line);
    }
    // An expired server certificate, loaded by a configuration reload (asynchronous: wait for it).
    pg.replace_tls_files(&c.expired.cert, &c.expired.key, &c.ca.pem);
    outboxd.rewrite_config(&pg_body(
        &url,
        &tls_line("verify-full", &c.ca.pem, &c.client),
        &broker.bootstrap(),
    ));
    wait_until(
        "the expired certificate to be served",
        Duration::from_secs(30),
        || {
            output(&outboxd, &["check"])
                .1
                .contains("the server's certificate has expired")
        },
    );
    let (ok, text) = output(&outboxd, &["run"]);
    assert!(
        !ok && text.contains("the server's certificate has expired"),
        "{text}"
    );
}

#[test]
fn kafka_reached_only_through_tls_works_with_the_right_ca_and_fails_clearly_with_a_wrong_one() {
    let c = certs();
    let broker = Broker::start_tls(&c.server);
    let bootstrap = broker.tls_bootstrap();
    let ca = c.ca.pem.display().to_string();
    let client = [
        ("bootstrap.servers", bootstrap.as_str()),
        ("security.protocol", "ssl"),
        ("ssl.ca.location", ca.as_str()),
    ];
    for topic in ["outbox.event.order", "outbox.event.customer"] {
        create_topic_using(&client, topic, 3, &[]);
    }
    let db = Mysqld::mariadb(&[]);
    db.sql_socket(SCHEMA);
    let kafka = |ca: &Path| {
        format!(
            "[source]\nkind = \"mysql\"\nurl = \"{}\"\ntables = [\"app.outbox\"]\nserver_id = 99\n\
             [kafka]\nbrokers = \"{bootstrap}\"\nproperties = {{ \"security.protocol\" = \"SSL\", \"ssl.ca.location\" = \"{}\" }}\n\
             [http]\nlisten = \"\"\n",
            db.cdc_url(),
            ca.display()
        )
    };
    let mut outboxd = Outboxd::new("tls-kafka", &kafka(&c.ca.pem));
    let (ok, text) = output(&outboxd, &["check"]);
    assert!(ok, "{text}");
    assert!(
        text.contains(&format!(
            "PASS  kafka: TLS (ssl) to the brokers: certificates verified against {}, broker names verified",
            c.ca.pem.display()
        )),
        "{text}"
    );
    outboxd.start();
    insert_rows(&db, 0, 20, 2);
    // Rows 0..20: every third is a customer event (rig::scenario::event).
    let order = consume_using(&client, "outbox.event.order", 13, Duration::from_secs(60));
    let customer = consume_using(&client, "outbox.event.customer", 7, Duration::from_secs(60));
    assert_eq!((order.len(), customer.len()), (13, 7));
    outboxd.stop();

    outboxd.rewrite_config(&kafka(&c.other_ca.pem));
    for command in ["check", "run"] {
        let (ok, text) = output(&outboxd, &[command]);
        assert!(!ok, "{command}: {text}");
        assert!(
            text.contains(&format!("TLS to {bootstrap} failed"))
                && text.contains("certificate verify failed")
                && text.contains("check ssl.ca.location"),
            "{command}: {text}"
        );
    }
}

#[test]
fn a_server_without_tls_is_used_in_plain_text_under_prefer_and_refused_under_require() {
    let broker = Broker::start();
    let db = Mysqld::mariadb(&[]);
    db.sql_socket(SCHEMA);
    let pg = Postgres::start(&[]);
    pg.sql("postgres", "CREATE DATABASE app;");
    pg.sql("app", PG_SCHEMA);
    let bodies = [
        (
            "mysql",
            mysql_body(
                &db.cdc_url(),
                "tls = { mode = \"prefer\" }",
                &broker.bootstrap(),
            ),
            mysql_body(
                &db.cdc_url(),
                "tls = { mode = \"require\" }",
                &broker.bootstrap(),
            ),
        ),
        (
            "postgres",
            pg_body(
                &format!("{}?sslmode=prefer", pg.url("cdc", "app")),
                "",
                &broker.bootstrap(),
            ),
            pg_body(
                &format!("{}?sslmode=require", pg.url("cdc", "app")),
                "",
                &broker.bootstrap(),
            ),
        ),
    ];
    let outboxd = Outboxd::new("tls-none", "");
    for (kind, prefer, require) in bodies {
        outboxd.rewrite_config(&prefer);
        let (ok, text) = output(&outboxd, &["check"]);
        assert!(ok, "{kind} prefer: {text}");
        assert!(
            text.contains(&format!(
                "WARN  {kind}: the server at 127.0.0.1 does not offer TLS"
            )),
            "{kind} prefer: {text}"
        );
        outboxd.rewrite_config(&require);
        for command in ["check", "run"] {
            let (ok, text) = output(&outboxd, &[command]);
            assert!(!ok, "{kind} require: {command}: {text}");
            assert!(
                text.contains("does not offer TLS, and source.tls mode require requires it"),
                "{kind} require: {command}: {text}"
            );
        }
    }
}

#[test]
fn kafka_whose_certificate_names_another_host_is_refused_by_check_and_run() {
    let c = certs();
    let dir = tempfile::Builder::new()
        .prefix("outboxd-certs-")
        .tempdir()
        .unwrap();
    // Signed by the CA outboxd trusts, but for a name that is not the broker's address.
    let elsewhere =
        c.ca.server(dir.path(), "elsewhere", &["elsewhere.invalid"], VALID);
    let broker = Broker::start_tls(&elsewhere);
    let bootstrap = broker.tls_bootstrap();
    let db = Mysqld::mariadb(&[]);
    db.sql_socket(SCHEMA);
    let outboxd = Outboxd::new(
        "tls-kafka-name",
        &format!(
            "[source]\nkind = \"mysql\"\nurl = \"{}\"\ntables = [\"app.outbox\"]\nserver_id = 99\n\
             [kafka]\nbrokers = \"{bootstrap}\"\nproperties = {{ \"security.protocol\" = \"SSL\", \"ssl.ca.location\" = \"{}\" }}\n\
             [http]\nlisten = \"\"\n",
            db.cdc_url(),
            c.ca.pem.display()
        ),
    );
    for command in ["check", "run"] {
        let (ok, text) = output(&outboxd, &[command]);
        assert!(!ok, "{command}: {text}");
        assert!(
            text.contains(&format!("TLS to {bootstrap} failed"))
                && text.contains("the brokers' names match their certificates"),
            "{command}: {text}"
        );
    }
}

const SASL_PASSWORD: &str = "scram-Pl4nted-s3cret";

#[test]
fn kafka_over_sasl_ssl_with_scram_sha_512_delivers_and_a_wrong_password_is_refused_without_printing_it(
) {
    let c = certs();
    let broker = Broker::start_sasl(&c.server);
    broker.add_scram_user("outboxd", SASL_PASSWORD);
    for topic in ["outbox.event.order", "outbox.event.customer"] {
        create_topic(&broker.bootstrap(), topic, 3);
        // WRITE implies DESCRIBE: all the event topics need (README "To Kafka").
        broker.acl(&[
            "--add",
            "--allow-principal",
            "User:outboxd",
            "--operation",
            "Write",
            "--topic",
            topic,
        ]);
    }
    let bootstrap = broker.tls_bootstrap();
    let db = Mysqld::mariadb(&[]);
    db.sql_socket(SCHEMA);
    let config = |password: &str| {
        config_with_kafka(
            &db.cdc_url(),
            &broker.sasl_client("outboxd", password, &c.ca.pem),
            "",
        )
    };
    let mut outboxd = Outboxd::new("sasl-kafka", &config(SASL_PASSWORD));
    // The authorizer applies the grants a moment after AclCommand returns.
    let granted = "PASS  kafka: the brokers grant outboxd's principal what it needs on 2 topic(s)";
    let mut text = String::new();
    wait_until(granted, Duration::from_secs(30), || {
        let (ok, out) = output(&outboxd, &["check"]);
        text = out;
        ok && text.contains(granted)
    });
    assert!(!text.contains(SASL_PASSWORD), "{text}");
    outboxd.start();
    insert_rows(&db, 0, 20, 2);
    // Read back as the rig (PLAINTEXT, a super user): 13 order and 7 customer events.
    assert_eq!(consume_events(&broker.bootstrap(), 20).len(), 20);
    outboxd.stop();
    assert!(!outboxd.log().contains(SASL_PASSWORD));

    let wrong = "wrong-Pl4nted-s3cret";
    outboxd.rewrite_config(&config(wrong));
    for command in ["check", "run"] {
        let (ok, text) = output(&outboxd, &[command]);
        assert!(!ok, "{command}: {text}");
        assert!(
            text.contains("SASL authentication") && text.contains(&bootstrap),
            "{command}: {text}"
        );
        assert!(
            !text.contains(wrong) && !text.contains(SASL_PASSWORD),
            "{command}: {text}"
        );
    }
    // A mechanism the listener does not enable is refused for good too.
    outboxd.rewrite_config(&config(SASL_PASSWORD).replace("SCRAM-SHA-512", "SCRAM-SHA-256"));
    for command in ["check", "run"] {
        let (ok, text) = output(&outboxd, &[command]);
        assert!(
            !ok && text.contains(&format!("SASL authentication to {bootstrap} failed")),
            "{command}: {text}"
        );
    }
}
