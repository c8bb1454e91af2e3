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
//! So each stream's connection id is remembered per server, with the client address the server
//! saw for it (`HOST`, `ip:port`), and before the next dump on that server outboxd runs `KILL
//! CONNECTION` on it, which shuts the old socket and ends the thread at once. A user may always
//! kill its own connections, so no grant is needed. The id is only killed while the server still
//! shows it as a binlog dump from that very address: after a server restart ids start again, and
//! an id must never end another session (a real replica, Debezium, another pipeline), which a
//! fresh connection from the same ephemeral port and with the same id would need to be.
//! (Tested on MariaDB; MySQL's dump threads block the same way and its `KILL` works the same.)
//!
//! The memory is process-wide because the pipeline opens a new source for every session; a
//! process runs one pipeline. It does not help across processes: an instance started after a
//! `kill -9` during a partition, or a standby taking over on another host, waits behind the old
//! dump as before (until the server's retransmission meets the closed socket, or
//! `net_write_timeout`).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use mysql_async::prelude::Queryable;
use mysql_async::Conn;

/// Server (url and identity) → the connection id and client address of the last dump opened on it.
static LAST: Mutex<Option<HashMap<String, (u32, String)>>> = Mutex::new(None);

/// The client address (`HOST`) the server shows for `conn` itself; `None` when it cannot be read
/// (then nothing is remembered, and nothing is ever killed for this stream).
pub(super) async fn own_host(conn: &mut Conn, limit: Duration) -> Option<String> {
    let query = conn.query_first::<String, _>(
        "SELECT HOST FROM information_schema.PROCESSLIST WHERE ID = CONNECTION_ID()",
    );
    match tokio::time::timeout(limit, query).await {
        // `ip:port` over TCP; a socket connection's `localhost` names no single connection.
        Ok(Ok(Some(host))) if host.contains(':') => Some(host),
        _ => None,
    }
}

/// Remembers `id` (seen by the server from `host`) as the dump connection on `server`.
pub(super) fn remember(server: &str, id: u32, host: String) {
    LAST.lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashMap::new)
        .insert(server.to_string(), (id, host));
}

fn forget(server: &str) {
    if let Some(map) = LAST.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
        map.remove(server);
    }
}

/// Ends the dump remembered for `server`, when the server still shows it as a binlog dump from the
/// same client address. Bounded by `limit`; errors are logged, not returned: at worst the new
/// stream waits as it did before.
pub(super) async fn end(control: &mut Conn, server: &str, limit: Duration) {
    if tokio::time::timeout(limit, end_unbounded(control, server))
        .await
        .is_err()
    {
        tracing::warn!("looking up this pipeline's previous binlog dump timed out; the new stream may wait until the server ends it (net_write_timeout)");
    }
}

async fn end_unbounded(control: &mut Conn, server: &str) {
    let Some((id, host)) = LAST
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .and_then(|m| m.get(server).cloned())
    else {
        return;
    };
    let still_ours: Result<Option<u32>, _> = control
        .exec_first(
            "SELECT ID FROM information_schema.PROCESSLIST WHERE ID = ? AND HOST = ? \
             AND COMMAND LIKE 'Binlog Dump%'",
            (id, host.as_str()),
        )
        .await;
    match still_ours {
        Ok(Some(_)) => match control.query_drop(format!("KILL CONNECTION {id}")).await {
            Ok(()) => {
                forget(server);
                tracing::info!(
                    connection = id,
                    "ended this pipeline's previous binlog dump on the server (it was still sending to a lost connection)"
                )
            }
            // It ended between the two statements.
            Err(mysql_async::Error::Server(e)) if e.code == 1094 => forget(server),
            Err(e) => {
                tracing::warn!(connection = id, error = %e, "could not end this pipeline's previous binlog dump; the new stream may wait until the server times it out (net_write_timeout)")
            }
        },
        Ok(None) => forget(server),
        Err(e) => {
            tracing::warn!(connection = id, error = %e, "could not look up this pipeline's previous binlog dump")
        }
    }
}
