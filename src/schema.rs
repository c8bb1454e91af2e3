//! `outboxd schema`: the recommended outbox table, the reader's grants, and the tip that keeps the
//! table empty. Column names are Debezium's, so the default `[route]` needs no configuration.

use crate::config::SourceKind;

pub fn ddl(kind: SourceKind) -> &'static str {
    match kind {
        SourceKind::Mysql => MYSQL,
        SourceKind::Postgres => POSTGRES,
    }
}

const MYSQL: &str = r#"-- outboxd: recommended outbox table for MySQL 8+/MariaDB 10.5+ (Debezium column names).
CREATE TABLE outbox (
  id            BINARY(16)   NOT NULL PRIMARY KEY,  -- header "id" (rendered as canonical UUID text)
  aggregatetype VARCHAR(255) NOT NULL,              -- topic: outbox.event.<aggregatetype>
  aggregateid   VARCHAR(255) NOT NULL,              -- record key: per-key order = commit order
  type          VARCHAR(255) NOT NULL,              -- e.g. OrderCreated (route.headers = { eventType = "type" })
  payload       JSON,                               -- record value, as stored; NULL = tombstone
  created_at    DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4;

-- In the business transaction (id: a UUID as 16 bytes; MySQL 8: UUID_TO_BIN(UUID())):
--   INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload)
--   VALUES (UNHEX(REPLACE(UUID(), '-', '')), 'order', '42', 'OrderCreated', '{"orderId":42}');
-- Keep the table empty: outboxd forwards INSERTs only and ignores DELETEs, so the application may
-- DELETE the row right after inserting it (same transaction), or a job may delete old rows.

-- Server settings (my.cnf): log_bin, binlog_format=ROW, binlog_row_image=FULL,
-- binlog_row_metadata=FULL (recommended), on a replica log_slave_updates/log_replica_updates=ON,
-- MariaDB log_bin_compress=OFF.

-- The reader outboxd connects as:
CREATE USER 'outboxd'@'%' IDENTIFIED BY 'change-me';
GRANT REPLICATION SLAVE, REPLICATION CLIENT, SELECT ON *.* TO 'outboxd'@'%';
-- MariaDB 10.5+ also needs:
-- GRANT BINLOG MONITOR, SLAVE MONITOR ON *.* TO 'outboxd'@'%';   -- SLAVE MONITOR: replica checks
-- Oracle MySQL, for a snapshot (source.snapshot or `outboxd snapshot`: a brief LOCK TABLES … READ
-- pairs the read with the binlog position; MariaDB needs no lock):
-- GRANT LOCK TABLES ON app.* TO 'outboxd'@'%';

-- With [prune] (deleting forwarded rows), the user in prune.url, or the reader above, also needs:
-- GRANT SELECT, DELETE ON app.outbox TO 'outboxd'@'%';   -- and DROP, ALTER for drop_partitions / partitions_ahead
-- GRANT PROCESS, BINLOG MONITOR ON *.* TO 'outboxd'@'%';  -- MariaDB 10.5+ (open transactions, binlog end)
-- GRANT PROCESS, REPLICATION CLIENT ON *.* TO 'outboxd'@'%';  -- MySQL instead
"#;

const POSTGRES: &str = r#"-- outboxd: recommended outbox table for PostgreSQL 14+ (Debezium column names).
CREATE TABLE outbox (
  id            uuid         NOT NULL PRIMARY KEY,  -- header "id"
  aggregatetype text         NOT NULL,              -- topic: outbox.event.<aggregatetype>
  aggregateid   text         NOT NULL,              -- record key: per-key order = commit order
  type          text         NOT NULL,
  payload       jsonb,                              -- record value as JSON text; NULL = tombstone
  created_at    timestamptz  NOT NULL DEFAULT now()
);

-- In the business transaction:
--   INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload)
--   VALUES (gen_random_uuid(), 'order', '42', 'OrderCreated', '{"orderId":42}');
-- Keep the table empty: only INSERTs are published (publish = 'insert'), so the application may
-- DELETE the row in the same transaction.

-- Server settings (postgresql.conf): wal_level = logical, max_replication_slots >= 1,
-- max_wal_senders >= 1. The slot and publication are created by outboxd when missing:
--   CREATE PUBLICATION outboxd FOR TABLE outbox WITH (publish = 'insert', publish_via_partition_root = true);

-- The reader outboxd connects as:
CREATE ROLE outboxd WITH LOGIN REPLICATION PASSWORD 'change-me';
GRANT SELECT ON outbox TO outboxd;
-- Creating the publication needs ownership of the table (or create it yourself as the owner).

-- With [prune] (deleting forwarded rows), the role in prune.url, or the reader above, also needs:
-- GRANT DELETE ON outbox TO outboxd;   -- drop_partitions: own the table; partitions_ahead: CREATE on its schema
"#;
