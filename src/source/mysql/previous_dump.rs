//! Ends this process's previous binlog dump thread before a new one is asked for.
//!
//! ## Why
//! When the network between outboxd and the server fails while the server is sending, the server's
//! dump thread stays blocked in a write to the dead connection until `net_write_timeout` (60 s by
//! default) runs out. MariaDB and MySQL then refuse to start a new dump for the same replica server
//! id: the new request waits behind the old thread (the server only asks the old thread to stop, at
//! a level that does not shut its socket). outboxd's stream stays silent, its liveness check gives
//! it up after three heartbeats, and the reconnects repeat until the server gives up the old one:
//! a 5 s partition cost a minute (found by the soak, pinned by
//! `network::after_a_partition_the_previous_dump_thread_is_ended_and_the_stream_resumes`).
//!
//! So each stream's connection id is remembered per server, and before the next dump on that
//! server outboxd runs `KILL CONNECTION` on it, which shuts the old socket and ends the thread at
//! once. A user may always kill its own connections, so no grant is needed. The id is only killed
//! while it is still a binlog dump of outboxd's own user: after a server restart ids start again,
//! and an id must not end someone else's session. (Another pipeline sharing the user and the
//! server could, after a restart, hold the same id; it would reconnect by itself.)
//!
//! The memory is process-wide because the pipeline opens a new source for every session; a
//! process runs one pipeline, and a restarted process needs none of it (the kernel closed the old
//! socket, and the server's write fails at once).

use std::collections::HashMap;
use std::sync::Mutex;

use mysql_async::prelude::Queryable;
use mysql_async::Conn;

/// Server (url and identity) → the connection id of the last dump opened on it.
static LAST: Mutex<Option<HashMap<String, u32>>> = Mutex::new(None);

/// Remembers `id` as the dump connection on `server`.
pub(super) fn remember(server: &str, id: u32) {
    LAST.lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashMap::new)
        .insert(server.to_string(), id);
}

/// Ends the dump remembered for `server`, when it is still a binlog dump of this user. Errors are
/// logged, not returned: at worst the new stream waits as it did before.
pub(super) async fn end(control: &mut Conn, server: &str) {
    let Some(id) = LAST
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .and_then(|m| m.get(server).copied())
    else {
        return;
    };
    let still_ours: Result<Option<u32>, _> = control
        .exec_first(
            "SELECT ID FROM information_schema.PROCESSLIST WHERE ID = ? AND COMMAND LIKE 'Binlog Dump%' \
             AND USER = SUBSTRING_INDEX(CURRENT_USER(), '@', 1)",
            (id,),
        )
        .await;
    match still_ours {
        Ok(Some(_)) => match control.query_drop(format!("KILL CONNECTION {id}")).await {
            Ok(()) => tracing::info!(
                connection = id,
                "ended this pipeline's previous binlog dump on the server (it was still sending to a lost connection)"
            ),
            // It ended between the two statements.
            Err(mysql_async::Error::Server(e)) if e.code == 1094 => {}
            Err(e) => tracing::warn!(connection = id, error = %e, "could not end this pipeline's previous binlog dump; the new stream may wait until the server times it out (net_write_timeout)"),
        },
        Ok(None) => {}
        Err(e) => tracing::warn!(connection = id, error = %e, "could not look up this pipeline's previous binlog dump"),
    }
}
