//! Is this server a replica, and does it write what it replicates to its own binlog?
//!
//! A replica without `log_slave_updates` (`log_replica_updates` on MySQL) streams a binlog that
//! holds none of the replicated outbox rows: reading it loses every row, silently. `check` says so,
//! and every session asks again before it opens the stream, because the variable changes with a
//! restart of the replica, and because a host of a multi-host `source.url` that fails the check is
//! passed over rather than read.

use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Row};

use crate::error::{Error, Result};

/// What the server says about replication: a replica or not, and its status row when readable.
pub(super) struct Replication {
    pub is_replica: bool,
    /// `SHOW REPLICA STATUS` (needs SLAVE MONITOR / REPLICATION CLIENT); `None` without the grant.
    pub status: Option<Row>,
}

impl Replication {
    pub async fn read(conn: &mut Conn) -> Replication {
        // Without the monitoring grant, fall back to signs anyone can read, so a missing
        // privilege never passes a replica off as a primary.
        let status: mysql_async::Result<Option<Row>> =
            match conn.query_first("SHOW REPLICA STATUS").await {
                Ok(row) => Ok(row),
                Err(_) => conn.query_first("SHOW SLAVE STATUS").await,
            };
        match status {
            Ok(Some(row)) => Replication {
                is_replica: true,
                status: Some(row),
            },
            // MariaDB replicating through named connections only shows none for the default one.
            Ok(None) => match conn.query_first("SHOW ALL SLAVES STATUS").await {
                Ok(Some(row)) => Replication {
                    is_replica: true,
                    status: Some(row),
                },
                _ => Replication {
                    is_replica: false,
                    status: None,
                },
            },
            Err(_) => Replication {
                is_replica: replica_signs(conn).await,
                status: None,
            },
        }
    }
}

/// `Some(true)` when the server logs what it replicates; `None` when it would not say.
pub(super) async fn logs_replicated_rows(conn: &mut Conn) -> Option<bool> {
    let updates: Option<u8> = match conn.query_first("SELECT @@log_replica_updates").await {
        Ok(v) => v,
        Err(_) => conn
            .query_first("SELECT @@log_slave_updates")
            .await
            .ok()
            .flatten(),
    };
    updates.map(|u| u == 1)
}

/// The problem and remedy of a replica that does not log what it replicates.
pub(super) fn without_updates(is_mariadb: bool) -> (String, String) {
    let var = if is_mariadb {
        "log_slave_updates"
    } else {
        "log_replica_updates"
    };
    (
        format!("this server is a replica with {var} = OFF: replicated outbox rows never reach its binlog, so outboxd would see none of them"),
        format!("set {var}=ON in the replica's config file and restart it (the variable is read-only at runtime)"),
    )
}

/// Refuses a replica whose binlog lacks the replicated rows (one query when the variable is on),
/// and says whether the server is a replica whose status can be watched ([`Stall`]).
pub(super) async fn require_replicated_rows(
    conn: &mut Conn,
    server: &str,
    is_mariadb: bool,
) -> Result<bool> {
    let replication = Replication::read(conn).await;
    if !replication.is_replica {
        return Ok(false);
    }
    if logs_replicated_rows(conn).await != Some(true) {
        let (problem, remedy) = without_updates(is_mariadb);
        return Err(Error::source(format!("{server}: {problem}")).remedy(remedy));
    }
    Ok(replication.status.is_some())
}

/// How many heartbeat periods a replica may go without replicating before the session ends.
pub(super) const STALL_PERIODS: u32 = 12;

/// How many times that an IO thread may reconnect to its source before it counts as stopped.
const CONNECTING_PATIENCE: u32 = 10;

/// A replica that stopped replicating (an error in its SQL thread, `STOP REPLICA`) still
/// heartbeats, so the stream looks healthy while no new row will ever come. Its status is read once
/// per heartbeat period (bounded by the control connection's timeout); once it has sent everything
/// it had (nothing but heartbeats since), not replicating for [`STALL_PERIODS`] periods in a row
/// ends the session with a transient error, so outboxd moves to the next host of `source.url`
/// (with one host it reconnects and asks again, which keeps saying so in the log). An IO thread
/// that is only reconnecting to its source (the primary restarts) while the SQL thread runs is no
/// stall: every replica waits alike.
pub(super) struct Stall {
    every: std::time::Duration,
    patience: std::time::Duration,
    next_probe: tokio::time::Instant,
    since: Option<tokio::time::Instant>,
    /// Since when the IO thread has been reconnecting to its source.
    connecting: Option<tokio::time::Instant>,
}

impl Stall {
    pub fn new(heartbeat: std::time::Duration) -> Stall {
        let every = heartbeat.max(std::time::Duration::from_secs(1));
        Stall {
            every,
            patience: every * STALL_PERIODS,
            next_probe: tokio::time::Instant::now() + every,
            since: None,
            connecting: None,
        }
    }

    /// The stream delivered an event other than a heartbeat: the replica still had something to
    /// send, so no stall counts before it.
    pub fn event(&mut self) {
        self.since = None;
    }

    /// Reads the replica's status when a period has passed since the last read, waiting at most
    /// `limit` for the answer (a control connection to a frozen server may never answer).
    pub async fn probe(
        &mut self,
        conn: &mut Conn,
        server: &str,
        limit: std::time::Duration,
    ) -> Result<()> {
        let now = tokio::time::Instant::now();
        if now < self.next_probe {
            return Ok(());
        }
        self.next_probe = now + self.every;
        let status = match tokio::time::timeout(limit, Replication::read(conn)).await {
            Ok(read) => read.status,
            Err(_) => {
                return Err(Error::source(format!(
                    "{server} did not answer a replication status query within {limit:?}; the connection is treated as dead"
                ))
                .remedy("outboxd reconnects by itself; if this repeats, check the server and the network path to it")
                .transient())
            }
        };
        let Some(status) = status else {
            // Not readable now (the grant gone, or named replication connections only).
            return Ok(());
        };
        let field = |names: &[&str]| -> String {
            names
                .iter()
                .find_map(|n| {
                    status
                        .get_opt::<Option<String>, _>(*n)
                        .and_then(|r| r.ok())
                        .flatten()
                })
                .unwrap_or_default()
        };
        let io = field(&["Replica_IO_Running", "Slave_IO_Running"]);
        let sql = field(&["Replica_SQL_Running", "Slave_SQL_Running"]);
        let running = self.io_running(now, &io) && sql == "Yes";
        let why = || {
            let errors: Vec<String> = [field(&["Last_IO_Error"]), field(&["Last_SQL_Error"])]
                .into_iter()
                .filter(|e| !e.is_empty())
                .collect();
            format!(
                "IO thread: {io}, SQL thread: {sql}; last error: {}",
                if errors.is_empty() {
                    "none".into()
                } else {
                    errors.join("; ")
                }
            )
        };
        self.judge(now, running, server, why)
    }

    /// Whether the IO thread counts as running. "Connecting": the replica waits for its source,
    /// as every replica of it does; for a while (a primary's restart), not for days (its
    /// credentials or its route are wrong).
    fn io_running(&mut self, now: tokio::time::Instant, io: &str) -> bool {
        if io != "Connecting" {
            self.connecting = None;
            return io == "Yes";
        }
        let since = *self.connecting.get_or_insert(now);
        now - since < self.patience * CONNECTING_PATIENCE
    }

    fn judge(
        &mut self,
        now: tokio::time::Instant,
        running: bool,
        server: &str,
        why: impl FnOnce() -> String,
    ) -> Result<()> {
        if running {
            self.since = None;
            return Ok(());
        }
        let since = *self.since.get_or_insert(now);
        let stalled = now - since;
        if stalled < self.patience {
            return Ok(());
        }
        Err(Error::source(format!(
            "{server} has not been replicating for {stalled:?} ({}): its binlog gets no new rows",
            why()
        ))
        .remedy("outboxd moves to the next host in source.url (with one host it reconnects and asks again); START REPLICA on that server, or fix what its last error says")
        .transient())
    }
}

/// Replica signs readable without monitoring privileges: running replication threads, a MariaDB
/// replica GTID position, or MySQL's replication configuration table.
async fn replica_signs(conn: &mut Conn) -> bool {
    let running: Option<(String, String)> = conn
        .query_first("SHOW GLOBAL STATUS LIKE 'Slaves_running'")
        .await
        .ok()
        .flatten();
    if running.is_some_and(|(_, v)| v != "0") {
        return true;
    }
    let slave_pos: Option<String> = conn
        .query_first("SELECT @@gtid_slave_pos")
        .await
        .ok()
        .flatten();
    if slave_pos.is_some_and(|p| !p.is_empty()) {
        return true;
    }
    let configured: Option<u64> = conn
        .query_first("SELECT COUNT(*) FROM performance_schema.replication_connection_configuration")
        .await
        .ok()
        .flatten();
    configured.is_some_and(|n| n > 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_replica_not_replicating_for_twelve_periods_in_a_row_ends_the_session() {
        let mut stall = Stall::new(Duration::from_secs(1));
        let t0 = tokio::time::Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert!(stall.judge(at(0), false, "r1", String::new).is_ok());
        assert!(stall.judge(at(11), false, "r1", String::new).is_ok());
        // Replicating again resets the count.
        assert!(stall.judge(at(12), true, "r1", String::new).is_ok());
        assert!(stall.judge(at(13), false, "r1", String::new).is_ok());
        assert!(stall.judge(at(24), false, "r1", String::new).is_ok());
        // An event still arriving (its backlog) restarts the count too.
        stall.event();
        assert!(stall.judge(at(25), false, "r1", String::new).is_ok());
        assert!(stall.judge(at(36), false, "r1", String::new).is_ok());
        let e = stall
            .judge(at(37), false, "r1", || "IO thread: No".into())
            .unwrap_err();
        assert!(e.is_transient());
        // Reconnecting to its source counts as running, for ten times the patience.
        let mut stall = Stall::new(Duration::from_secs(1));
        assert!(stall.io_running(at(0), "Connecting"));
        assert!(stall.io_running(at(119), "Connecting"));
        assert!(!stall.io_running(at(120), "Connecting"));
        assert!(stall.io_running(at(121), "Yes"));
        assert!(
            stall.io_running(at(122), "Connecting"),
            "a new reconnect, a new grace"
        );
        assert!(!stall.io_running(at(123), "No"));
        assert!(
            e.message()
                .contains("r1 has not been replicating for 12s (IO thread: No)"),
            "{}",
            e.message()
        );
    }
}
