//! Named fault-injection points for the reliability tests (the `fail` crate). They compile to nothing
//! unless the `failpoints` feature is on (test builds only); with it, `FAILPOINTS="name=return"` (or
//! `"3*off->return"`: the fourth time) makes the process abort right there, exactly like `kill -9`
//! at the worst moment, which a test cannot time from outside.

/// `fail::fail_point!` with the `failpoints` feature; nothing without it, so a build without the
/// feature does not compile the `fail` crate (nor the random-number crates it brings).
#[macro_export]
macro_rules! fault_point {
    ($($point:tt)*) => {
        #[cfg(feature = "failpoints")]
        fail::fail_point!($($point)*);
    };
}

/// After a record was handed to the producer, before Kafka acknowledged it.
pub const AFTER_PRODUCE_BEFORE_ACK: &str = "after_produce_before_ack";
/// After acknowledgements made a new position safe, before the checkpoint write started.
pub const AFTER_ACK_BEFORE_CHECKPOINT: &str = "after_ack_before_checkpoint";
/// After the new checkpoint was written and synced to its temp file, before the rename.
pub const DURING_CHECKPOINT_RENAME: &str = "during_checkpoint_rename";
/// Exactly-once: the checkpoint record is in the Kafka transaction, the commit not yet asked for.
pub const BEFORE_TRANSACTION_COMMIT: &str = "before_transaction_commit";

/// Inside the live MySQL source, where third-party code decodes each event: panics (as a malformed
/// event could make mysql_common do).
pub const LIVE_DECODE: &str = "live_decode";

/// Fails the first checkpoint write of a pipeline's first start (before the store sees it), once
/// the file named by the fail point's argument exists: `first_write_fails=1*return(PATH)`. The
/// test commits rows meanwhile, after the source chose its start.
pub fn first_write_fails() -> crate::error::Result<()> {
    crate::fault_point!("first_write_fails", |path: Option<String>| {
        let path = std::path::PathBuf::from(path.unwrap_or_default());
        while !path.exists() {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        Err(crate::error::Error::checkpoint("fail point first_write_fails").transient())
    });
    Ok(())
}

/// Inside the checkpoint index's librdkafka call: hangs there for 10 minutes (as librdkafka does
/// when its group coordinator is gone), once, the first time it is reached after the file named by
/// the argument exists (`index_send_hangs_when_released=return(PATH)`): the test picks the moment.
pub const INDEX_SEND_HANGS_WHEN_RELEASED: &str = "index_send_hangs_when_released";

/// Hangs here once the fail point `name`'s file exists (see [`INDEX_SEND_HANGS_WHEN_RELEASED`]).
pub fn hang_once_released(name: &str) {
    let _ = name;
    crate::fault_point!(name, |path: Option<String>| {
        static FIRED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        let released = path.is_some_and(|path| std::path::Path::new(&path).exists());
        if released && !FIRED.swap(true, std::sync::atomic::Ordering::SeqCst) {
            eprintln!("fail point {name}: hanging");
            std::thread::sleep(std::time::Duration::from_secs(600));
        }
    });
}

/// Inside a lead renewal, with the checkpoint writer held: holds it for 15 s before the renewal's
/// transaction begins (as a write that retried that long holds it), once, the first time it is
/// reached after the file named by the argument exists
/// (`renewal_held_when_released=return(PATH)`).
pub const RENEWAL_HELD_WHEN_RELEASED: &str = "renewal_held_when_released";

/// Holds the caller here for 15 s once the fail point's file exists (see
/// [`RENEWAL_HELD_WHEN_RELEASED`]).
pub fn renewal_held_once_released() {
    crate::fault_point!(RENEWAL_HELD_WHEN_RELEASED, |path: Option<String>| {
        static FIRED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        let released = path.is_some_and(|path| std::path::Path::new(&path).exists());
        if released && !FIRED.swap(true, std::sync::atomic::Ordering::SeqCst) {
            eprintln!("fail point {RENEWAL_HELD_WHEN_RELEASED}: holding");
            std::thread::sleep(std::time::Duration::from_secs(15));
        }
    });
}

/// At the start of a session's end (after the signal, before the drain): hangs the thread, and
/// with it outboxd's one async worker, for 10 minutes (`shutdown_hangs=return`).
pub const SHUTDOWN_HANGS: &str = "shutdown_hangs";

/// Hangs the calling thread for 10 minutes when the fail point `name` is active.
pub fn hang_point(name: &str) {
    let _ = name;
    crate::fault_point!(name, |_| {
        eprintln!("fail point {name}: hanging");
        std::thread::sleep(std::time::Duration::from_secs(600));
    });
}

/// Panics here when the fail point `name` is active (a stand-in for a panic in third-party code).
pub fn panic_point(name: &str) {
    let _ = name;
    crate::fault_point!(name, |_| panic!("fail point {name}: panicking"));
}

/// Aborts the process here when the fail point `name` is active.
pub fn crash_point(name: &str) {
    // Without the `failpoints` feature the macro expands to nothing.
    let _ = name;
    crate::fault_point!(name, |_| {
        eprintln!("fail point {name}: aborting");
        std::process::abort()
    });
}
