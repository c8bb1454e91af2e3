//! Operating outboxd: `check`, `run`'s preflight, checkpoint commands, `replay`, `schema`.

use crate::rig;

use crate::on_both_servers;
use crate::rig::scenario::*;
use crate::rig::{wait_until, Broker, Mysqld, Outboxd};

/// Runs `outboxd ARGS`; (success, stdout + stderr).
pub(crate) fn output(outboxd: &Outboxd, args: &[&str]) -> (bool, String) {
    output_with_env(outboxd, args, &[])
}

/// A pipeline reading `url`, producing to a fresh broker.
fn pipeline_on(name: &str, url: &str) -> (Broker, Outboxd) {
    let broker = Broker::start();
    let outboxd = Outboxd::new(name, &config_body(url, &broker.bootstrap(), "", ""));
    (broker, outboxd)
}

on_both_servers! {
fn check_passes_on_a_correct_setup(flavor: Flavor) {
    let env = setup_on(flavor, "check-ok", "");
    let (ok, text) = output(&env.outboxd, &["check"]);
    assert!(ok, "{text}");
    assert!(!text.contains("FAIL"), "{text}");
    for line in [
        "binlog_format = ROW",
        "binlog_row_image = FULL",
        "has the routed columns",
        "the user may read the binlog",
        "reachable",
    ] {
        assert!(text.contains(line), "missing {line:?} in:\n{text}");
    }
}
}

on_both_servers! {
fn check_and_run_refuse_statement_based_binlogs(flavor: Flavor) {
    let db = Mysqld::start(flavor, &[]);
    db.sql_socket(SCHEMA);
    db.sql_socket("SET GLOBAL binlog_format = 'STATEMENT';");
    let (_broker, outboxd) = pipeline_on("stmt", &db.cdc_url());
    let (ok, text) = output(&outboxd, &["check"]);
    assert!(!ok, "{text}");
    assert!(
        text.contains("FAIL  mysql: binlog_format = STATEMENT"),
        "{text}"
    );
    assert!(text.contains("SET GLOBAL binlog_format = 'ROW'"), "{text}");
    let (ok, text) = output(&outboxd, &["run"]);
    assert!(!ok, "{text}");
    assert!(
        text.contains("preflight") && text.contains("binlog_format"),
        "{text}"
    );
}
}

on_both_servers! {
fn check_fails_when_the_binlog_is_off(flavor: Flavor) {
    let db = Mysqld::start(flavor, &["skip-log-bin"]);
    db.sql_socket(SCHEMA);
    let (_broker, outboxd) = pipeline_on("nolog", &db.cdc_url());
    let (ok, text) = output(&outboxd, &["check"]);
    assert!(!ok, "{text}");
    assert!(text.contains("FAIL  mysql: log_bin = OFF"), "{text}");
}
}

on_both_servers! {
fn check_fails_for_a_user_without_replication_privileges(flavor: Flavor) {
    let db = Mysqld::start(flavor, &[]);
    db.sql_socket(SCHEMA);
    db.sql_socket(&format!(
        "CREATE USER 'weak'@'127.0.0.1' IDENTIFIED BY '{}'; GRANT SELECT ON *.* TO 'weak'@'127.0.0.1';",
        rig::mysqld::CDC_PASSWORD
    ));
    let url = format!("mysql://weak@127.0.0.1:{}/app", db.port);
    let (_broker, outboxd) = pipeline_on("weak", &url);
    let (ok, text) = output(&outboxd, &["check"]);
    assert!(!ok, "{text}");
    assert!(text.contains("lacks REPLICATION SLAVE"), "{text}");
    assert!(text.contains("GRANT REPLICATION SLAVE"), "{text}");
}
}

on_both_servers! {
fn check_fails_on_a_replica_that_does_not_log_replicated_rows(flavor: Flavor) {
    // Off by default on MariaDB, on by default on MySQL.
    let (off, variable) = match flavor {
        Flavor::MariaDb => ("log-slave-updates=OFF", "log_slave_updates"),
        Flavor::MySql => ("log-replica-updates=OFF", "log_replica_updates"),
    };
    let primary = Mysqld::start(flavor, &[]);
    let replica = Mysqld::start_replica(&primary, 2, &[off]);
    primary.sql_socket(SCHEMA);
    replica.catch_up(&primary);
    let (_broker, outboxd) = pipeline_on("replica", &replica.cdc_url());
    let (ok, text) = output(&outboxd, &["check"]);
    assert!(!ok, "{text}");
    assert!(
        text.contains(&format!(
            "FAIL  mysql: this server is a replica with {variable} = OFF"
        )),
        "{text}"
    );
    assert!(text.contains(&format!("{variable}=ON")), "{text}");
}
}

#[test]
fn replay_from_a_saved_label_redelivers_exactly_the_rows_after_it_and_leaves_the_live_checkpoint_alone(
) {
    let mut env = setup("replay", "");
    env.outboxd.start();
    insert_rows(&env.db, 0, 10, 1);
    let after_ten = env
        .db
        .sql_socket("SELECT @@gtid_binlog_pos;")
        .trim()
        .to_string();
    wait_until("the checkpoint to reach row 10", LIMIT, || {
        env.outboxd.checkpoint_or_null()["position"]["gtid_set"] == after_ten.as_str()
    });
    let (ok, text) = output(&env.outboxd, &["checkpoint", "save", "ten"]);
    assert!(ok, "{text}");
    insert_rows(&env.db, 10, 20, 1);
    let after_twenty = env
        .db
        .sql_socket("SELECT @@gtid_binlog_pos;")
        .trim()
        .to_string();
    insert_rows(&env.db, 20, 30, 1);
    assert_eq!(consume_all(&env, 30).len(), 30);
    env.outboxd.stop();
    let live_before = std::fs::read(env.outboxd.checkpoint_path()).unwrap();

    let (ok, text) = output(&env.outboxd, &["checkpoint", "list"]);
    assert!(ok && text.contains("ten"), "{text}");
    let to = format!("gtid:{after_twenty}");
    let (ok, text) = output(&env.outboxd, &["replay", "--from", "ten", "--to", &to]);
    assert!(ok, "{text}");
    assert!(text.contains("replayed 10 record(s)"), "{text}");
    let records = consume_all(&env, 40);
    assert_eq!(records.len(), 40);
    let mut counts = std::collections::HashMap::new();
    for r in &records {
        *counts.entry(n_of(r)).or_insert(0) += 1;
    }
    for n in 0..30 {
        let expected = if (10..20).contains(&n) { 2 } else { 1 };
        assert_eq!(counts[&n], expected, "row {n}");
    }
    assert_eq!(
        std::fs::read(env.outboxd.checkpoint_path()).unwrap(),
        live_before,
        "replay must not touch the live checkpoint"
    );

    // Without --to it runs to the server's end as of its start.
    let (ok, text) = output(&env.outboxd, &["replay", "--from", "ten"]);
    assert!(ok, "{text}");
    assert!(text.contains("replayed 20 record(s)"), "{text}");
    assert_eq!(
        std::fs::read(env.outboxd.checkpoint_path()).unwrap(),
        live_before
    );
}

#[test]
fn checkpoint_set_and_reset_are_refused_while_run_holds_the_pipeline() {
    let mut env = setup("lock", "");
    env.outboxd.start();
    for args in [
        &["checkpoint", "set", "mariadb-bin.000001:4"][..],
        &["checkpoint", "reset"][..],
    ] {
        let (ok, text) = output(&env.outboxd, args);
        assert!(!ok, "{args:?}: {text}");
        assert!(text.contains("already running"), "{text}");
    }
    env.outboxd.stop();
    let (ok, text) = output(&env.outboxd, &["checkpoint", "set", "mariadb-bin.000001:4"]);
    assert!(ok, "{text}");
    assert_eq!(env.outboxd.checkpoint()["position"]["pos"], 4);
    let (ok, text) = output(&env.outboxd, &["checkpoint", "reset"]);
    assert!(ok && text.contains("before-reset-"), "{text}");
    assert!(!env.outboxd.checkpoint_path().exists());
    let (ok, text) = output(&env.outboxd, &["checkpoint", "list"]);
    assert!(
        ok && text.contains("before-set-") && text.contains("before-reset-"),
        "{text}"
    );
    let (ok, text) = output(&env.outboxd, &["checkpoint", "set", "not-a-position"]);
    assert!(!ok && text.contains("FILE:POS"), "{text}");
}

#[test]
fn schema_prints_debezium_compatible_ddl_with_grants() {
    let outboxd = Outboxd::new("schema", "");
    for (kind, needles) in [
        (
            "mysql",
            &[
                "BINARY(16)",
                "aggregatetype",
                "GRANT REPLICATION SLAVE",
                "DELETE",
                // The prune user's grants, per server kind.
                "GRANT PROCESS, BINLOG MONITOR ON *.*",
                "GRANT PROCESS, REPLICATION CLIENT ON *.*",
            ][..],
        ),
        (
            "postgres",
            &[
                "uuid",
                "jsonb",
                "REPLICATION",
                "publish = 'insert'",
                "GRANT DELETE ON outbox",
            ][..],
        ),
    ] {
        let (ok, text) = output(&outboxd, &["schema", "--kind", kind]);
        assert!(ok, "{text}");
        for needle in needles {
            assert!(text.contains(needle), "{kind}: {needle} missing in {text}");
        }
    }
}

/// Secret values planted in every place a secret may live.
const PLANTED: [&str; 14] = [
    "planted-pg-hosts-pw-84",
    "planted-pg-primary-pw-85",
    "planted-amqp-pw-81",
    "planted-aws-secret-82",
    "planted-aws-token-83",
    "planted-redis-pw-80",
    "planted-nats-token-77",
    "planted-nats-pw-78",
    "planted-nats-token-79",
    "planted-sasl-pw-71",
    "planted-keypw-73",
    "planted-url-pw-74",
    "planted-file-pw-76",
    "planted-oauth-cfg-75",
];

fn assert_no_secret(what: &str, text: &str) {
    for secret in PLANTED {
        assert!(
            !text.contains(secret),
            "{what} printed the secret {secret}:\n{text}"
        );
    }
}

/// Runs `outboxd ARGS` with extra environment; (success, stdout + stderr).
fn output_with_env(outboxd: &Outboxd, args: &[&str], env: &[(&str, &str)]) -> (bool, String) {
    let out = outboxd
        .command(args)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// stdout + stderr of `outboxd ARGS` without the rig's database password in the environment (the
/// config's own password, planted, is used).
fn output_without_password_env(outboxd: &Outboxd, args: &[&str]) -> String {
    let out = outboxd
        .command(args)
        .env_remove("OUTBOXD_SOURCE__PASSWORD")
        .output()
        .unwrap();
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn no_command_prints_a_planted_secret() {
    let mut env = setup("secrets", "");
    let bootstrap = env.broker.bootstrap();
    // Kafka credentials: the README's own environment spelling, and properties in the file, with
    // librdkafka's security debugging on (it logs configuration).
    let kafka = "[kafka.properties]\n\"security.protocol\" = \"SASL_PLAINTEXT\"\n\"sasl.mechanism\" = \"PLAIN\"\n\
                 \"sasl.username\" = \"outboxd\"\n\"ssl.key.password\" = \"planted-keypw-73\"\n\
                 \"sasl.oauthbearer.config\" = \"principal=x secret=planted-oauth-cfg-75\"\ndebug = \"security,broker,conf\"\n\
                 \"message.timeout.ms\" = \"3000\"\n";
    env.outboxd
        .rewrite_config(&config_body(&env.db.cdc_url(), &bootstrap, kafka, ""));
    let sasl = [(
        "OUTBOXD_KAFKA__PROPERTIES__SASL.PASSWORD",
        "planted-sasl-pw-71",
    )];
    for args in [
        &["check"][..],
        &["checkpoint", "show"],
        &["audit", "--wait", "1s"],
        &[
            "replay",
            "--from",
            "mariadb-bin.000001:4",
            "--to",
            "mariadb-bin.000001:4",
        ],
    ] {
        let (_, text) = output_with_env(&env.outboxd, args, &sasl);
        assert_no_secret(&format!("{args:?}"), &text);
    }
    // `run` against a broker that refuses the SASL login: everything it logs, text and JSON.
    for (n, format) in [(0, "text"), (1, "json")] {
        env.outboxd
            .start_with_env(&["--skip-checks", "--log-format", format], &sasl);
        insert_rows(&env.db, n, n + 1, 1);
        wait_until("librdkafka to report on the SASL login", LIMIT, || {
            let log = env.outboxd.log().to_lowercase();
            log.contains("sasl") && (log.contains("fail") || log.contains("error"))
        });
        let log = env.outboxd.log();
        env.outboxd.kill9();
        assert_no_secret(&format!("run --log-format {format}"), &log);
    }
    // Database passwords: wrong ones, in the URL and in a password file, so logins fail and the
    // errors are printed.
    let url = env
        .db
        .cdc_url()
        .replace("mysql://cdc@", "mysql://cdc:planted-url-pw-74@");
    env.outboxd
        .rewrite_config(&config_body(&url, &bootstrap, "", ""));
    for args in [&["check"][..], &["run"], &["audit"]] {
        let text = output_without_password_env(&env.outboxd, args);
        assert!(
            text.contains("refused the login") || text.contains("Access denied"),
            "{text}"
        );
        assert_no_secret(&format!("{args:?} with a URL password"), &text);
    }
    let file = env.outboxd.dir_path().join("db-password");
    std::fs::write(&file, "planted-file-pw-76\n").unwrap();
    env.outboxd
        .rewrite_config(&config_body(&env.db.cdc_url(), &bootstrap, "", "").replace(
            "[source]\n",
            &format!("[source]\npassword_file = \"{}\"\n", file.display()),
        ));
    for args in [&["check"][..], &["run"], &["audit"]] {
        let text = output_without_password_env(&env.outboxd, args);
        assert_no_secret(&format!("{args:?} with a password file"), &text);
    }
    // NATS: a token in the URL, a password in a second server's URL, and nats.token from the
    // environment, against a port nothing answers (check prints what it cannot reach, run logs
    // its retries).
    let port = rig::free_port();
    env.outboxd.rewrite_config(&format!(
        "[source]\nkind = \"mysql\"\nurl = \"{}\"\ntables = [\"app.outbox\"]\nserver_id = 99\n\
         [nats]\nurl = \"nats://planted-nats-token-77@127.0.0.1:{port},nats://u:planted-nats-pw-78@127.0.0.1:{port}\"\n[http]\nlisten = \"\"\n",
        env.db.cdc_url()
    ));
    let token = [("OUTBOXD_NATS__TOKEN", "planted-nats-token-79")];
    let (ok, text) = output_with_env(&env.outboxd, &["check"], &token);
    assert!(
        !ok && text.contains("cannot reach NATS at nats://***@127.0.0.1"),
        "{text}"
    );
    assert_no_secret("check with NATS credentials", &text);
    env.outboxd.start_until(
        &["--skip-checks"],
        &[token[0], ("RUST_LOG", "debug")],
        &["cannot reach NATS"],
    );
    let log = env.outboxd.log();
    env.outboxd.kill9();
    assert_no_secret("run with NATS credentials", &log);
    // Redis: a password in the URL, against a port nothing answers.
    env.outboxd.rewrite_config(&format!(
        "[source]\nkind = \"mysql\"\nurl = \"{}\"\ntables = [\"app.outbox\"]\nserver_id = 99\n\
         [redis]\nurl = \"redis://outboxd:planted-redis-pw-80@127.0.0.1:{port}/0\"\n[http]\nlisten = \"\"\n",
        env.db.cdc_url()
    ));
    let (ok, text) = output_with_env(&env.outboxd, &["check"], &[]);
    assert!(
        !ok && text.contains("cannot reach Redis at redis://outboxd:***@127.0.0.1"),
        "{text}"
    );
    assert_no_secret("check with a Redis password", &text);
    env.outboxd.start_until(
        &["--skip-checks"],
        &[("RUST_LOG", "debug")],
        &["cannot reach Redis"],
    );
    let log = env.outboxd.log();
    env.outboxd.kill9();
    assert_no_secret("run with a Redis password", &log);
    // RabbitMQ: a password in the URL, against a port nothing answers.
    env.outboxd.rewrite_config(&format!(
        "[source]\nkind = \"mysql\"\nurl = \"{}\"\ntables = [\"app.outbox\"]\nserver_id = 99\n\
         [rabbitmq]\nurl = \"amqp://outboxd:planted-amqp-pw-81@127.0.0.1:{port}/%2f\"\nexchange = \"outbox\"\n[http]\nlisten = \"\"\n",
        env.db.cdc_url()
    ));
    let (ok, text) = output_with_env(&env.outboxd, &["check"], &[]);
    assert!(!ok && text.contains("RabbitMQ"), "{text}");
    assert_no_secret("check with a RabbitMQ password", &text);
    env.outboxd.start_until(
        &["--skip-checks"],
        &[("RUST_LOG", "debug")],
        &["cannot reach RabbitMQ"],
    );
    let log = env.outboxd.log();
    env.outboxd.kill9();
    assert_no_secret("run with a RabbitMQ password", &log);
    // SQS: credentials from the standard environment variables, against an endpoint nothing
    // answers, with every library's trace on.
    env.outboxd.rewrite_config(&format!(
        "[source]\nkind = \"mysql\"\nurl = \"{}\"\ntables = [\"app.outbox\"]\nserver_id = 99\n\
         [route]\ntopic = \"outbox-${{routedByValue}}\"\n\
         [sqs]\nregion = \"us-east-1\"\nendpoint_url = \"http://127.0.0.1:{port}\"\ndead_letter_topic = \"outboxd-dlq\"\n[http]\nlisten = \"\"\n",
        env.db.cdc_url()
    ));
    let aws = [
        ("AWS_ACCESS_KEY_ID", "AKIAPLANTED0000000000"),
        ("AWS_SECRET_ACCESS_KEY", "planted-aws-secret-82"),
        ("AWS_SESSION_TOKEN", "planted-aws-token-83"),
        ("RUST_LOG", "trace"),
    ];
    // The dead-letter queue is looked up by check and at every start: nothing answers.
    let (ok, text) = output_with_env(&env.outboxd, &["check"], &aws);
    assert!(!ok && text.contains("outboxd-dlq"), "{text}");
    assert_no_secret("check with AWS credentials", &text);
    env.outboxd
        .start_until(&["--skip-checks"], &aws, &["reconnecting"]);
    let log = env.outboxd.log();
    env.outboxd.kill9();
    assert_no_secret("run with AWS credentials", &log);
    // A Postgres URL carrying its password as a query parameter is refused by the parameter's name.
    env.outboxd.rewrite_config(&format!(
        "[source]\nkind = \"postgres\"\nurl = \"postgres://cdc@127.0.0.1:1/app?password=planted-url-pw-74\"\ntables = [\"public.outbox\"]\n[kafka]\nbrokers = \"{bootstrap}\"\n[http]\nlisten = \"\"\n"
    ));
    for args in [&["check"][..], &["run"]] {
        let (ok, text) = output_with_env(&env.outboxd, args, &[]);
        assert!(!ok);
        assert!(text.contains("password as a query parameter"), "{text}");
        assert_no_secret(&format!("{args:?} with a Postgres URL password"), &text);
    }
    // A primary_url that is not one server's URL is refused without showing its password.
    env.outboxd.rewrite_config(&format!(
        "[source]\nkind = \"postgres\"\nurl = \"postgres://cdc@127.0.0.1:{port}/app\"\nprimary_url = \"postgres://cdc:planted-pg-primary-pw-85@127.0.0.1:{port},127.0.0.1:{port}/app\"\ntables = [\"public.outbox\"]\n[kafka]\nbrokers = \"{bootstrap}\"\n[http]\nlisten = \"\"\n"
    ));
    let (ok, text) = output_with_env(&env.outboxd, &["check"], &[]);
    assert!(!ok && text.contains("source.primary_url"), "{text}");
    assert_no_secret("check with a bad primary_url", &text);
    // A Postgres primary and standby in one URL with a password (and a primary_url with one),
    // where nothing answers: check names each host, run rotates through them.
    env.outboxd.rewrite_config(&format!(
        "[source]\nkind = \"postgres\"\nurl = \"postgres://cdc:planted-pg-hosts-pw-84@127.0.0.1:{port},127.0.0.1:{port}/app\"\nprimary_url = \"postgres://cdc:planted-pg-primary-pw-85@127.0.0.1:{port}/app\"\ntables = [\"public.outbox\"]\n[kafka]\nbrokers = \"{bootstrap}\"\n[http]\nlisten = \"\"\n"
    ));
    let (ok, text) = output_with_env(&env.outboxd, &["check"], &[]);
    assert!(
        !ok && text.contains(&format!("postgres 127.0.0.1:{port}")),
        "{text}"
    );
    assert_no_secret("check with Postgres hosts", &text);
    env.outboxd.start_until(
        &["--skip-checks"],
        &[("RUST_LOG", "debug")],
        &["moving to the next source host"],
    );
    let log = env.outboxd.log();
    env.outboxd.kill9();
    assert_no_secret("run with Postgres hosts", &log);
}

#[test]
fn help_reads_like_a_man_page_and_completions_need_no_config() {
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_outboxd"))
            .args(args)
            .env_remove("OUTBOXD_CONFIG")
            .current_dir(std::env::temp_dir())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    // What the binary can read and write to: every sink with the default features.
    let version = run(&["--version"]);
    assert!(
        version.contains("sinks: kafka, rabbitmq, nats, redis, sqs, sns")
            && version.contains("sources: mysql, mariadb, postgres"),
        "{version}"
    );
    let help = run(&["--help"]);
    for needle in [
        "EXAMPLES:",
        "EXIT STATUS:",
        "OUTBOXD_SOURCE__PASSWORD",
        "completions",
    ] {
        assert!(help.contains(needle), "--help lacks {needle:?}:\n{help}");
    }
    for sub in [
        "run",
        "check",
        "checkpoint",
        "replay",
        "schema",
        "completions",
    ] {
        let text = run(&[sub, "--help"]);
        assert!(
            text.contains("EXAMPLES:"),
            "{sub} --help has no examples:\n{text}"
        );
    }
    for (shell, needle) in [
        ("bash", "_outboxd()"),
        ("zsh", "#compdef outboxd"),
        ("fish", "complete -c outboxd"),
    ] {
        let script = run(&["completions", shell]);
        assert!(
            script.contains(needle) && script.contains("import-debezium"),
            "{shell}:\n{script}"
        );
    }
}

#[test]
fn run_on_a_terminal_prints_a_progress_line_a_person_can_read() {
    use std::os::unix::process::CommandExt;
    let env = setup("progress", "");
    let screen = env.outboxd.dir_path().join("terminal.txt");
    // `script` (util-linux, in every Debian) gives outboxd a pseudo-terminal and records it.
    let command = format!(
        "exec {} --config {} run",
        env.outboxd.binary.display(),
        env.outboxd.config_path().display()
    );
    let child = std::process::Command::new("script")
        .args(["-q", "-f", "-e", "-c", &command])
        .arg(&screen)
        .env("OUTBOXD_SOURCE__PASSWORD", rig::mysqld::CDC_PASSWORD)
        .env_remove("OUTBOXD_CONFIG")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .spawn()
        .unwrap();
    // Whatever happens below, `script` and the outboxd under it go away with the test.
    struct Group(std::process::Child);
    impl Drop for Group {
        fn drop(&mut self) {
            let group = nix::unistd::Pid::from_raw(self.0.id() as i32);
            let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL);
            let _ = self.0.wait();
        }
    }
    let mut child = Group(child);
    wait_until(
        "the stream to open",
        std::time::Duration::from_secs(60),
        || rig::file_contains(&screen, "stream opened"),
    );
    insert_rows(&env.db, 0, 20, 5);
    assert_eq!(consume_all(&env, 20).len(), 20);
    // The line counts the rows (not just heartbeats).
    wait_until(
        "a progress line",
        std::time::Duration::from_secs(60),
        || rig::file_contains(&screen, "· 20 forwarded · "),
    );
    let text = std::fs::read_to_string(&screen).unwrap();
    let line = text
        .lines()
        .find(|l| l.contains("· 20 forwarded · "))
        .unwrap();
    assert!(
        line.contains("rows/s")
            && (line.contains("behind the source") || line.contains("caught up"))
            && line.contains("in flight"),
        "{line}"
    );
    // SIGTERM reaches outboxd through script; it exits cleanly, and script passes the status on.
    let group = nix::unistd::Pid::from_raw(child.0.id() as i32);
    let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGTERM);
    let status = child.0.wait().unwrap();
    assert!(
        status.success(),
        "{status}: {}",
        std::fs::read_to_string(&screen).unwrap_or_default()
    );
}
