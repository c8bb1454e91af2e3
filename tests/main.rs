//! The integration tests, one binary (the rig is compiled once): real MariaDB, PostgreSQL and a
//! Kafka-protocol broker on loopback ports, and the real `outboxd` binary (see `rig`).

mod rig;

mod audit;
mod aws;
mod beside_debezium;
mod binlog_files;
mod debezium;
mod deploy_files;
mod docs;
mod exactly_once;
mod failpoints;
mod faults;
mod kafka_acl;
mod kafka_hazards;
mod mysql_pipeline;
mod nats;
mod network;
mod operate;
mod partitioning;
mod postgres_failover;
mod postgres_pipeline;
mod prune;
mod rabbitmq;
mod redis_sink;
mod replicas;
mod snapshot;
mod soak;
mod standby;
mod tls;
