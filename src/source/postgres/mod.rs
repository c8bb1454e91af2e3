//! Postgres source: logical replication through the built-in `pgoutput` plugin.
//!
//! The wire codec lives apart from the connection so it can be tested on captured bytes alone, and so
//! nothing protocol-shaped leaks past this module.

pub mod pgoutput;
