//! Crashes at the three moments a test cannot time from outside, injected through fail points
//! (`--features failpoints`; `scripts/test.sh` enables it): the process aborts like `kill -9`, is
//! started again, and every committed row must arrive.

use std::time::Instant;

use crate::rig::scenario::*;
use outboxd::fault::{
    AFTER_ACK_BEFORE_CHECKPOINT, AFTER_PRODUCE_BEFORE_ACK, DURING_CHECKPOINT_RENAME,
};

fn crash_at(point: &str, schedule: &str) {
    let name = point.replace('_', "-");
    let mut env = setup(&name, "max_in_flight = 50");
    env.outboxd
        .start_with_env(&[], &[("FAILPOINTS", &format!("{point}={schedule}"))]);
    insert_rows(&env.db, 0, 300, 3);
    let status = env.outboxd.wait_exit(LIMIT);
    assert!(!status.success(), "the fail point {point} did not fire");
    assert!(
        env.outboxd.log().contains(&format!("fail point {point}")),
        "{}",
        env.outboxd.log()
    );
    // The checkpoint survived whole, and the restart cleans what the crash left.
    env.outboxd.checkpoint();
    let restarted = Instant::now();
    env.outboxd.start();
    let records = consume_distinct_events(&env.broker.bootstrap(), 300);
    let duplicates = check_records(&records, 0..300);
    report(
        point,
        &format!("abort at {point} ({schedule})"),
        300,
        &records,
        restarted,
    );
    assert!(duplicates <= 50 + 3 + 300, "{duplicates}");
    check_per_key_order(&records);
    let leftovers = leftover_temp_files(&env.outboxd.dir_path().join("checkpoints"));
    assert!(leftovers.is_empty(), "{leftovers:?}");
    env.outboxd.stop();
}

#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "needs --features failpoints")]
fn a_crash_after_produce_before_ack_loses_nothing() {
    crash_at(AFTER_PRODUCE_BEFORE_ACK, "120*off->return");
}

#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "needs --features failpoints")]
fn a_crash_after_ack_before_the_checkpoint_write_loses_nothing() {
    crash_at(AFTER_ACK_BEFORE_CHECKPOINT, "3*off->return");
}

#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "needs --features failpoints")]
fn a_crash_during_the_checkpoint_rename_loses_nothing_and_leaves_a_whole_checkpoint() {
    crash_at(DURING_CHECKPOINT_RENAME, "1*off->return");
}

#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "needs --features failpoints")]
fn a_panic_while_decoding_the_live_stream_stops_with_a_remedy_instead_of_a_reconnect_loop() {
    let mut env = setup("decode-panic", "");
    env.outboxd.start_with_env(
        &[],
        &[(
            "FAILPOINTS",
            &format!("{}=8*off->return", outboxd::fault::LIVE_DECODE),
        )],
    );
    insert_rows(&env.db, 0, 1, 1);
    let status = env.outboxd.wait_exit(LIMIT);
    assert!(!status.success());
    let log = env.outboxd.log();
    assert!(log.contains("panicked") && log.contains("remedy"), "{log}");
    assert!(!log.contains("reconnecting"), "{log}");
}

/// A first start's first checkpoint write that fails (the store out of reach for a moment) must not
/// move the start: the next session resumes from the position the first one chose, not from the
/// binlog's end again, which would skip the rows committed in between. The fail point holds the
/// write until the test has committed rows after the stream opened.
#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "needs --features failpoints")]
fn a_failed_first_checkpoint_write_skips_no_row_committed_meanwhile() {
    let mut env = setup("first-write", "");
    let release = env.outboxd.dir_path().join("release-the-first-write");
    env.outboxd.start_with_env(
        &[],
        &[(
            "FAILPOINTS",
            &format!("first_write_fails=1*return({})", release.display()),
        )],
    );
    crate::rig::wait_until("the binlog stream to open", LIMIT, || {
        env.outboxd.log().contains("binlog stream opened")
    });
    insert_rows(&env.db, 0, 10, 1);
    std::fs::write(&release, "").unwrap();
    insert_rows(&env.db, 10, 20, 1);
    let records = consume_distinct_events(&env.broker.bootstrap(), 20);
    check_records(&records, 0..20);
    let log = env.outboxd.log();
    assert!(
        log.contains("fail point first_write_fails")
            && log.contains("resuming from this process's first start"),
        "{log}"
    );
    env.outboxd.stop();
}

/// A shutdown stuck where no deadline reaches (here the whole async runtime, hung by a fail point
/// at the start of the session's end) still ends: at its bound (with the file store, the drain
/// deadline plus 90 s) outboxd exits 1 with an ERROR saying so, like a `kill -9`, and a restart
/// forwards what followed the checkpoint.
/// (A process that never ends holds an orchestrator, or CI, until its own limit.)
#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "needs --features failpoints")]
fn a_shutdown_that_hangs_still_ends_at_its_bound_with_an_error() {
    let mut env = setup("stuck-shutdown", "drain_timeout_ms = 1000");
    env.outboxd
        .start_with_env(&[], &[("FAILPOINTS", "shutdown_hangs=return")]);
    insert_rows(&env.db, 0, 10, 1);
    check_records(&consume_distinct_events(&env.broker.bootstrap(), 10), 0..10);
    let status = env.outboxd.terminate();
    let log = env.outboxd.log();
    assert_eq!(status.code(), Some(1), "{status}\n{log}");
    assert!(
        log.contains("fail point shutdown_hangs: hanging")
            && log.contains("the shutdown did not finish within its bound"),
        "{log}"
    );
    env.outboxd.start();
    insert_rows(&env.db, 10, 20, 1);
    check_records(&consume_distinct_events(&env.broker.bootstrap(), 20), 0..20);
    env.outboxd.stop();
}
