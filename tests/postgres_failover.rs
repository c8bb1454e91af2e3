//! A Postgres primary with a physical standby. Listed together in `source.url`, under load the
//! primary dies and the standby is promoted: on a failover slot (17+) outboxd continues on the new
//! primary from the standby's synchronized copy of the slot and forwards exactly the rows that
//! server has; without one it refuses to skip the changes since the checkpoint and says how to
//! re-send them. Listed alone (16+), the standby is read instead of the primary.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::postgres_pipeline::{
    insert_rows, insert_sql, mixed_script, pg_payload, setup_on, PgEnv, SCHEMA,
};
use crate::rig::scenario::{
    check_per_key_order, check_records_by, consume_distinct_events, n_of, transactions, LIMIT,
};
use crate::rig::{wait_until, Postgres};

/// The physical slot (and `application_name`) of the standby.
const STANDBY_SLOT: &str = "sb1";

/// A primary of `major` with the outbox schema, a broker, a standby, and outboxd configured with
/// both hosts (primary first). With `failover` (17+), the standby synchronizes failover slots and
/// the primary sends logical changes only once the standby has them.
fn primary_and_standby(major: u32, name: &str, failover: bool) -> (PgEnv, Postgres) {
    let env = setup_on(major, name, SCHEMA, "", &[]);
    let extra: &[&str] = if failover {
        &["sync_replication_slots = on"]
    } else {
        &[]
    };
    let standby = env.pg.start_standby(STANDBY_SLOT, extra);
    if failover {
        env.pg.sql(
            "postgres",
            &format!("ALTER SYSTEM SET synchronized_standby_slots = '{STANDBY_SLOT}'; SELECT pg_reload_conf();"),
        );
    }
    let path = env.outboxd.config_path();
    let both = format!(
        "postgres://cdc@127.0.0.1:{},127.0.0.1:{}/app",
        env.pg.port, standby.port
    );
    let body = std::fs::read_to_string(&path)
        .unwrap()
        .replace(&env.pg.url("cdc", "app"), &both);
    std::fs::write(&path, body).unwrap();
    (env, standby)
}

/// `check`'s output (stdout and stderr).
fn check(env: &PgEnv) -> String {
    let out = env.outboxd.command_output(&["check"]);
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The `n` of every outbox row `pg` holds.
fn rows_on(pg: &Postgres) -> BTreeSet<u64> {
    pg.sql("app", "SELECT payload->>'n' FROM public.outbox;")
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| l.trim().parse().unwrap())
        .collect()
}

/// Writes transactions of 5 rows from `from` on until the primary stops answering (it is stopped
/// once `kill_after` rows are committed); returns where the writes stopped.
fn write_until_the_primary_dies(pg: &Postgres, from: u64, kill_after: u64) -> u64 {
    let next = AtomicU64::new(from);
    std::thread::scope(|s| {
        let writer = s.spawn(|| loop {
            let n = next.load(Ordering::SeqCst);
            if pg
                .try_sql("app", &transactions(n, n + 5, 5, insert_sql))
                .is_err()
            {
                return n;
            }
            next.store(n + 5, Ordering::SeqCst);
        });
        wait_until("rows written under load", LIMIT, || {
            next.load(Ordering::SeqCst) >= from + kill_after
        });
        pg.stop_immediate();
        writer.join().unwrap()
    })
}

/// Waits until the standby's copy of `slot` is synchronized and persistent. A copy stays temporary
/// (and would be gone after a promotion) until the primary's slot has advanced past the standby's
/// catalog xmin: outboxd advances it as it forwards, and the writes here give it something to.
fn a_persistent_copy(primary: &Postgres, standby: &Postgres, slot: &str) {
    wait_until(
        "a persistent synchronized copy on the standby",
        LIMIT,
        || {
            primary.sql("app", "INSERT INTO public.other (note) VALUES ('tick');");
            the_slot_on(standby, slot) == "t|f|t"
        },
    );
}

fn the_slot_on(pg: &Postgres, slot: &str) -> String {
    pg.sql(
        "app",
        &format!("SELECT synced, temporary, failover FROM pg_replication_slots WHERE slot_name = '{slot}';"),
    )
    .trim()
    .to_string()
}

fn a_primary_failover_on_a_failover_slot_loses_nothing_and_keeps_key_order(major: u32) {
    let name = format!("failover{major}");
    let (mut env, standby) = primary_and_standby(major, &name, true);
    let slot = format!("outboxd_{name}");
    let before = check(&env);
    assert!(
        before.contains(&format!(
            "slot {slot} will be created at start (a failover slot)"
        )),
        "{before}"
    );
    env.outboxd.start();
    assert_eq!(
        the_slot_on(&env.pg, &slot),
        "f|f|t",
        "outboxd made a failover slot"
    );
    insert_rows(&env.pg, 0, 300, 3);
    a_persistent_copy(&env.pg, &standby, &slot);
    let ready = check(&env);
    for line in [
        format!("slot {slot} is a failover slot"),
        format!("synchronized_standby_slots = '{STANDBY_SLOT}'"),
        format!("slot {slot} here is a synchronized copy of the primary's failover slot"),
    ] {
        assert!(ready.contains(&line), "{line}: {ready}");
    }
    let stopped = write_until_the_primary_dies(&env.pg, 300, 500);
    standby.promote();
    insert_rows(&standby, 5000, 5300, 3);
    let held = rows_on(&standby);
    assert!(
        held.contains(&(stopped - 1)) && held.contains(&5299),
        "the new primary has the writes up to the failover and after it"
    );
    let records = consume_distinct_events(&env.broker.bootstrap(), held.len());
    let delivered: BTreeSet<u64> = records.iter().map(n_of).collect();
    let lost: Vec<_> = held.difference(&delivered).collect();
    let phantom: Vec<_> = delivered.difference(&held).collect();
    assert!(
        lost.is_empty() && phantom.is_empty(),
        "PostgreSQL {major}: lost {lost:?}, forwarded but not on the new primary {phantom:?}\n{}",
        env.outboxd.log()
    );
    check_per_key_order(&records);
    println!(
        "postgres {major} failover: {} rows, {} duplicates",
        held.len(),
        records.len() - delivered.len()
    );
    let log = env.outboxd.log();
    let on_the_new_primary = format!("127.0.0.1:{}/app", standby.port);
    assert!(
        log.lines()
            .any(|l| l.contains("replication stream opened") && l.contains(&on_the_new_primary)),
        "{log}"
    );
    env.outboxd.stop();
}

#[test]
fn postgres_17_primary_failover_on_a_failover_slot_loses_nothing_and_keeps_key_order() {
    a_primary_failover_on_a_failover_slot_loses_nothing_and_keeps_key_order(17);
}

#[test]
fn postgres_18_primary_failover_on_a_failover_slot_loses_nothing_and_keeps_key_order() {
    a_primary_failover_on_a_failover_slot_loses_nothing_and_keeps_key_order(18);
}

/// A slot that is not a failover slot (made by hand before outboxd, as on 16 and earlier) has no
/// copy on the promoted standby: outboxd refuses to continue there, and refuses a slot made anew
/// there too (it starts after the checkpoint), instead of skipping the rows in between. The remedy
/// it names (re-send with `snapshot --where`, then accept the new slot with `checkpoint set`) loses
/// nothing.
#[test]
fn a_failover_to_a_standby_without_the_slot_is_refused_with_the_remedy_instead_of_skipping_rows() {
    let (mut env, standby) = primary_and_standby(17, "nofailover", false);
    let slot = "outboxd_nofailover";
    env.pg.sql(
        "app",
        &format!("SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput');"),
    );
    let warned = check(&env);
    assert!(
        warned.contains(&format!("slot {slot} is not a failover slot"))
            && warned.contains(&format!("slot {slot} is not on this standby")),
        "{warned}"
    );
    env.outboxd.start();
    insert_rows(&env.pg, 0, 200, 4);
    consume_distinct_events(&env.broker.bootstrap(), 200);
    let stopped = write_until_the_primary_dies(&env.pg, 200, 100);
    standby.promote();
    insert_rows(&standby, 5000, 5100, 4);
    let missing = "does not exist on this server, but a checkpoint does";
    wait_until("the refusal of the promoted standby", LIMIT, || {
        env.outboxd.log().contains(missing)
    });
    let log = env.outboxd.log();
    assert!(log.contains("outboxd snapshot --where"), "{log}");
    // A slot made anew on the new primary starts after the checkpoint: refused too.
    standby.sql(
        "app",
        &format!("SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput');"),
    );
    let new_slot = standby.sql(
        "app",
        &format!(
            "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = '{slot}';"
        ),
    );
    wait_until("the refusal of the slot made anew", LIMIT, || {
        env.outboxd.log().contains("after the checkpoint")
    });
    assert!(
        env.outboxd.child_running(),
        "outboxd waits for a host that can serve it"
    );
    env.outboxd.stop();
    let held = rows_on(&standby);
    let delivered: BTreeSet<u64> = consume_distinct_events(&env.broker.bootstrap(), 0)
        .iter()
        .map(n_of)
        .collect();
    assert!(
        delivered.iter().all(|n| *n < stopped),
        "nothing of the new primary's was forwarded from the wrong place"
    );
    // The remedy: re-send what the outbox got since the checkpoint, accept the new slot.
    let resend =
        env.outboxd
            .command_output(&["snapshot", "--where", "(payload->>'n')::int >= 200"]);
    assert!(
        resend.status.success(),
        "{}",
        String::from_utf8_lossy(&resend.stderr)
    );
    let set = env
        .outboxd
        .command_output(&["checkpoint", "set", new_slot.trim()]);
    assert!(
        set.status.success(),
        "{}",
        String::from_utf8_lossy(&set.stderr)
    );
    env.outboxd.start();
    insert_rows(&standby, 6000, 6040, 4);
    let held: BTreeSet<u64> = held.into_iter().chain(6000..6040).collect();
    let records = consume_distinct_events(&env.broker.bootstrap(), held.len());
    let delivered: BTreeSet<u64> = records.iter().map(n_of).collect();
    let lost: Vec<_> = held.difference(&delivered).collect();
    assert!(lost.is_empty(), "lost {lost:?}\n{}", env.outboxd.log());
    env.outboxd.stop();
}

/// Without `synchronized_standby_slots` outboxd is sent changes the standby has not received. A
/// standby promoted while it lags (here: stopped while outboxd forwarded 200 more rows) forks
/// before the checkpoint: starting at the checkpoint would skip its own rows between the fork and
/// the checkpoint. outboxd refuses it, naming the fork; `checkpoint set` at the fork then forwards
/// every row the new primary has.
#[test]
fn a_standby_promoted_before_it_had_what_outboxd_forwarded_is_refused_naming_the_fork() {
    let (mut env, standby) = primary_and_standby(17, "fork", true);
    env.pg.sql(
        "postgres",
        "ALTER SYSTEM RESET synchronized_standby_slots; SELECT pg_reload_conf();",
    );
    let slot = "outboxd_fork";
    env.outboxd.start();
    insert_rows(&env.pg, 0, 100, 4);
    a_persistent_copy(&env.pg, &standby, slot);
    standby.stop_fast();
    insert_rows(&env.pg, 100, 300, 4);
    let end = lsn_of(&env.pg.sql("app", "SELECT pg_current_wal_lsn();"));
    consume_distinct_events(&env.broker.bootstrap(), 300);
    wait_until("the checkpoint past the standby's end", LIMIT, || {
        lsn_of(
            env.outboxd.checkpoint()["position"]["lsn"]
                .as_str()
                .unwrap(),
        ) >= end
    });
    assert_eq!(env.outboxd.checkpoint()["source"]["timeline"], 1);
    env.pg.stop_immediate();
    standby.start_again();
    standby.promote();
    insert_rows(&standby, 5000, 5100, 4);
    let fork = "left timeline 1 at ";
    wait_until("the refusal naming the fork", LIMIT, || {
        env.outboxd.log().contains(fork)
    });
    env.outboxd.stop();
    let log = env.outboxd.log();
    let at = log[log.find(fork).unwrap() + fork.len()..]
        .split(',')
        .next()
        .unwrap()
        .to_string();
    assert!(log.contains("before the checkpoint"), "{log}");
    let set = env.outboxd.command_output(&["checkpoint", "set", &at]);
    assert!(
        set.status.success(),
        "{}",
        String::from_utf8_lossy(&set.stderr)
    );
    env.outboxd.start();
    let held = rows_on(&standby);
    assert!(
        held.contains(&5099) && !held.contains(&299),
        "the fork lost the rows the standby never had"
    );
    let records = consume_distinct_events(&env.broker.bootstrap(), 300 + 100);
    let delivered: BTreeSet<u64> = records.iter().map(n_of).collect();
    let lost: Vec<_> = held.difference(&delivered).collect();
    assert!(lost.is_empty(), "lost {lost:?}\n{}", env.outboxd.log());
    env.outboxd.stop();
}

fn lsn_of(text: &str) -> u64 {
    let (hi, lo) = text.trim().split_once('/').unwrap();
    (u64::from_str_radix(hi, 16).unwrap() << 32) | u64::from_str_radix(lo, 16).unwrap()
}

/// How this test's outboxd learns of the primary behind the standby it reads.
#[derive(Clone, Copy, PartialEq)]
enum Primary {
    /// Not at all: the heartbeat cannot be written, `check` says what that costs.
    Unknown,
    /// `source.primary_url`: the heartbeat is written there and comes back through the standby.
    Named,
}

/// outboxd reads a standby (16+) listed alone in `source.url`: the publication made on the primary,
/// the slot on the standby (its creation waits for the primary's next record of running
/// transactions), rows committed on the primary in mixed transactions arrive once in key order,
/// and after a kill -9 the rest arrive from the checkpoint. With `source.primary_url` the heartbeat
/// is written on the primary, so a quiet standby stays ready (`/readyz`) for many heartbeat
/// intervals and its slot is confirmed past the primary's WAL; without it `check` warns that it
/// would not.
fn reading_a_standby_forwards_every_row_and_resumes_after_a_kill(major: u32, primary: Primary) {
    let name = format!("readstandby{major}");
    let mut env = setup_on(major, &name, SCHEMA, "", &[]);
    // A short wal_sender_timeout: the silence check gives a standby's walsender that much (plus
    // three heartbeat intervals) once heartbeats stop, so the primary's absence below would end the
    // stream within seconds were that all it got.
    let extra: &[&str] = match primary {
        Primary::Unknown => &[],
        Primary::Named => &["wal_sender_timeout = 5s"],
    };
    let standby = env.pg.start_standby(STANDBY_SLOT, extra);
    let port = crate::rig::free_port();
    let path = env.outboxd.config_path();
    let mut body = std::fs::read_to_string(&path)
        .unwrap()
        .replace(&env.pg.url("cdc", "app"), &standby.url("cdc", "app"))
        .replace("listen = \"\"", &format!("listen = \"127.0.0.1:{port}\""));
    if primary == Primary::Named {
        body = body.replace(
            "[kafka]",
            &format!("primary_url = \"{}\"\n[kafka]", env.pg.url("cdc", "app")),
        );
    }
    std::fs::write(&path, body).unwrap();
    let publication = format!("outboxd_{name}");
    let missing = check(&env);
    assert!(
        missing.contains("FAIL") && missing.contains("a standby cannot create it"),
        "{missing}"
    );
    env.pg.sql(
        "app",
        &format!("CREATE PUBLICATION {publication} FOR TABLE public.outbox WITH (publish = 'insert', publish_via_partition_root = true);"),
    );
    wait_until("the standby to replay the publication", LIMIT, || {
        standby
            .sql(
                "app",
                &format!("SELECT count(*) FROM pg_publication WHERE pubname = '{publication}';"),
            )
            .trim()
            == "1"
    });
    let ready = check(&env);
    assert!(!ready.contains("FAIL"), "{ready}");
    match primary {
        Primary::Unknown => assert!(
            ready.contains("source.primary_url is not set")
                && ready.contains("/readyz answers 503"),
            "{ready}"
        ),
        Primary::Named => assert!(
            ready.contains("the heartbeat is written on the primary"),
            "{ready}"
        ),
    }
    env.outboxd.spawn(&[]);
    wait_until("the slot on the standby and the stream", LIMIT, || {
        env.pg.sql("postgres", "SELECT pg_log_standby_snapshot();");
        env.outboxd.log().contains("replication stream opened")
    });
    env.pg.sql("app", &mixed_script());
    consume_distinct_events(&env.broker.bootstrap(), 500);
    env.outboxd.kill9();
    insert_rows(&env.pg, 1000, 1100, 5);
    env.outboxd.start();
    let records = consume_distinct_events(&env.broker.bootstrap(), 1100);
    check_records_by(&records, 0..1100, pg_payload);
    check_per_key_order(&records);
    let on_primary = env.pg.sql(
        "app",
        &format!("SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'outboxd_{name}';"),
    );
    assert_eq!(on_primary.trim(), "0", "no slot on the primary");
    if primary == Primary::Named {
        // Quiet now: only the heartbeats written on the primary come through. The standby's slot is
        // confirmed past where the primary's WAL ends now, and readiness holds all along, for
        // many times the three heartbeat intervals (3 s here) it allows a silent stream.
        let end = lsn_of(&env.pg.sql("postgres", "SELECT pg_current_wal_lsn();"));
        let slot = format!(
            "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = 'outboxd_{name}';"
        );
        wait_until(
            "the slot on the standby to pass the primary's end",
            LIMIT,
            || {
                assert_eq!(
                    crate::rig::http_get(port, "/readyz").0,
                    200,
                    "{}",
                    env.outboxd.log()
                );
                lsn_of(&standby.sql("postgres", &slot)) > end
            },
        );
        for _ in 0..60 {
            assert_eq!(
                crate::rig::http_get(port, "/readyz").0,
                200,
                "a quiet standby read with source.primary_url stays ready\n{}",
                env.outboxd.log()
            );
            std::thread::sleep(std::time::Duration::from_millis(150));
        }
        the_primary_away_keeps_the_stream(&mut env, port);
        a_wrong_primary_is_named_and_refused(&mut env, &standby);
        a_promotion_under_the_session_beats_on_the_promoted(&mut env, &standby, port);
    }
    env.outboxd.stop();
}

/// How many sessions outboxd has opened so far.
fn sessions(env: &PgEnv) -> usize {
    env.outboxd
        .log()
        .matches("replication stream opened")
        .count()
}

/// Stops the primary of the standby read, and waits for outboxd's WARN that it cannot write the
/// heartbeat there.
fn the_primary_stops(env: &PgEnv) {
    env.pg.stop_fast();
    wait_until("the WARN about the primary", LIMIT, || {
        env.outboxd
            .log()
            .contains("cannot write the heartbeat on source.primary_url")
    });
}

/// The primary stops: its heartbeat cannot be written (one WARN), and the silence is then judged
/// as without a heartbeat (keepalives, 100 s), not three intervals: the stream stays open, though
/// nothing comes through it. Back, the heartbeat resumes on the primary and readiness with it.
fn the_primary_away_keeps_the_stream(env: &mut PgEnv, port: u16) {
    let before = sessions(env);
    the_primary_stops(env);
    // Nothing to await: the property is that nothing happens. Without the wider allowance the
    // stream would have ended about 12 s after its last message (three intervals, then the
    // standby's 5 s wal_sender_timeout plus three intervals); the primary's shutdown may still
    // have sent it something after the WARN.
    std::thread::sleep(std::time::Duration::from_secs(20));
    let log = env.outboxd.log();
    assert!(!log.contains("treated as dead"), "{log}");
    assert_eq!(sessions(env), before, "{log}");
    env.pg.start_again();
    wait_until(
        "the heartbeat on the primary again, and readiness",
        LIMIT,
        || {
            env.outboxd
                .log()
                .contains("the heartbeat is written on the primary again")
                && crate::rig::http_get(port, "/readyz").0 == 200
        },
    );
}

/// `check` FAILs a `primary_url` that is a standby, or the primary of another cluster. `run` past
/// its checks keeps trying a standby there, and WARNs once that retrying will not help for another
/// cluster's primary (its heartbeat would never come back), and keeps reading.
fn a_wrong_primary_is_named_and_refused(env: &mut PgEnv, standby: &Postgres) {
    let path = env.outboxd.config_path();
    let right = std::fs::read_to_string(&path).unwrap();
    let with_primary = |url: &str| {
        let body: Vec<String> = right
            .lines()
            .map(|line| match line.starts_with("primary_url = ") {
                true => format!("primary_url = \"{url}\""),
                false => line.to_string(),
            })
            .collect();
        std::fs::write(&path, body.join("\n")).unwrap();
    };
    with_primary(&standby.url("cdc", "app"));
    let on_standby = check(env);
    assert!(
        on_standby.contains("FAIL") && on_standby.contains("is a standby too"),
        "{on_standby}"
    );
    // Past the checks a standby there is retried, not refused for the session: during a
    // switchover the name points at a standby for a while.
    env.outboxd.stop();
    env.outboxd.start_with(&["--skip-checks"]);
    wait_until("the retried standby as primary_url", LIMIT, || {
        let log = env.outboxd.log();
        log.contains("is in recovery (a standby)") && log.contains("outboxd keeps trying")
    });
    assert!(
        !env.outboxd.log().contains("retrying will not help"),
        "{}",
        env.outboxd.log()
    );
    // Its pg_control_system() revoked: the system identifier comes from IDENTIFY_SYSTEM instead.
    let other = Postgres::start_major(18, &[]);
    other.sql(
        "postgres",
        "CREATE ROLE cdc LOGIN REPLICATION; REVOKE EXECUTE ON FUNCTION pg_control_system() FROM PUBLIC;",
    );
    with_primary(&other.url("cdc", "postgres"));
    let elsewhere = check(env);
    assert!(
        elsewhere.contains("FAIL") && elsewhere.contains("is another cluster"),
        "{elsewhere}"
    );
    // `run` refuses to start on it as `check` does; past the checks, the session refuses it too.
    env.outboxd.stop();
    env.outboxd.start_with(&["--skip-checks"]);
    wait_until("the refusal of another cluster's primary", LIMIT, || {
        let log = env.outboxd.log();
        log.contains("is another cluster") && log.contains("retrying will not help")
    });
    wait_until("nothing left connected to the other cluster", LIMIT, || {
        other
            .sql(
                "postgres",
                "SELECT count(*) FROM pg_stat_activity WHERE usename = 'cdc';",
            )
            .trim()
            == "0"
    });
    // Still read: rows committed on the primary arrive.
    insert_rows(&env.pg, 1100, 1105, 5);
    consume_distinct_events(&env.broker.bootstrap(), 1105);
    env.outboxd.stop();
    std::fs::write(&path, right).unwrap();
    env.outboxd.start();
}

/// The standby read is promoted while outboxd reads it (its primary gone): the session notices at
/// its next tick and writes the heartbeat on the promoted server, so it is ready again without a
/// reconnect, and rows committed there arrive.
fn a_promotion_under_the_session_beats_on_the_promoted(
    env: &mut PgEnv,
    standby: &Postgres,
    port: u16,
) {
    let before = sessions(env);
    the_primary_stops(env);
    standby.promote();
    wait_until("the promotion noticed, and readiness", LIMIT, || {
        env.outboxd.log().contains("the standby read was promoted")
            && crate::rig::http_get(port, "/readyz").0 == 200
    });
    insert_rows(standby, 1105, 1115, 5);
    let records = consume_distinct_events(&env.broker.bootstrap(), 1115);
    check_records_by(&records, 0..1115, pg_payload);
    assert_eq!(sessions(env), before, "{}", env.outboxd.log());
}

#[test]
fn postgres_16_standby_is_read_and_every_row_arrives_once_in_key_order() {
    reading_a_standby_forwards_every_row_and_resumes_after_a_kill(16, Primary::Unknown);
}

#[test]
fn postgres_18_standby_is_read_with_its_primary_named_and_stays_ready_while_quiet() {
    reading_a_standby_forwards_every_row_and_resumes_after_a_kill(18, Primary::Named);
}
