//! References generated from the code: the configuration (from the config structs' schema), the
//! command line (from the clap definitions) and the metrics (from the registry). `outboxd reference
//! <config|cli|man|metrics>` prints each, `scripts/gen-docs.sh` writes them into `docs/reference/`,
//! and a test fails when a checked-in file differs from what the code makes: a key, flag or metric
//! added without regenerating, or a doc comment changed.

pub mod cli;
pub mod config;
pub mod metrics;
