//! The `outboxd` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use outboxd::checkpoint::{Access, Store};
use outboxd::config::{Config, SourceKind, StoreKind, CONFIG_ENV};
use outboxd::source::SourceIdentity;
use outboxd::Error;

/// Rows are decoded on one thread and freed on another after their acknowledgement; glibc's malloc
/// serialises that pattern on its arena locks (a fifth of the CPU in a profiled drain), mimalloc does
/// not. See BENCHMARKS.md.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `outboxd --version`: the version, and what this build can read and write to (each sink but
/// Kafka is a cargo feature).
static LONG_VERSION: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "{}\nsources: mysql, mariadb, postgres\nsinks: {}",
        env!("CARGO_PKG_VERSION"),
        outboxd::sink::built_sinks().join(", ")
    )
});

#[derive(Parser)]
#[command(
    name = "outboxd",
    version,
    long_version = LONG_VERSION.as_str(),
    about = "The transactional outbox without polling: database log -> Kafka, RabbitMQ, NATS, Redis, SQS or SNS, checkpointed after the broker's ack",
    long_about = "outboxd tails the database's own log (the MySQL/MariaDB binlog, or Postgres logical \
replication through pgoutput), keeps the INSERTs into the outbox table(s), publishes each row to \
one sink (Kafka, RabbitMQ, NATS JetStream, Redis Streams, Amazon SQS or SNS), and only after the \
broker acknowledges it writes the log position to a checkpoint. A restart resumes from the \
checkpoint: nothing committed is lost, and a duplicate after a crash carries the row's id. Records \
look like those of Debezium's Outbox Event Router.\n\n\
Configuration is one TOML file (--config, default ./outboxd.toml, or OUTBOXD_CONFIG); any key can \
be set from the environment as OUTBOXD_SECTION__KEY (e.g. OUTBOXD_SOURCE__PASSWORD).",
    after_long_help = "EXAMPLES:\n  \
outboxd schema --kind mysql > outbox.sql      # the outbox table, grants and server settings\n  \
outboxd --config orders.toml check            # is everything in place?\n  \
outboxd --config orders.toml run              # forward until SIGTERM\n  \
outboxd --config orders.toml checkpoint show  # where it is\n  \
outboxd completions bash > ~/.local/share/bash-completion/completions/outboxd\n\n\
EXIT STATUS:\n  0 success; 1 an error (its message names what broke and the fix; `check`: a FAIL); \
2 a command-line usage error.\n\n\
SEE ALSO:\n  docs/ (guides, guarantees, troubleshooting), docs/reference/configuration.md (every key), \
deploy/outboxd.example.toml"
)]
struct Cli {
    /// Config file (default ./outboxd.toml).
    #[arg(long, global = true, env = CONFIG_ENV)]
    config: Option<PathBuf>,
    /// Log format.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Clone, Copy, ValueEnum)]
enum Kind {
    Mysql,
    Postgres,
}

#[derive(Subcommand)]
enum Command {
    /// Forward outbox rows until SIGINT/SIGTERM (graceful: drain acks, final checkpoint).
    #[command(
        long_about = "Forward outbox rows until SIGINT/SIGTERM. The preflight (`check`) runs first and \
refuses to start on a misconfiguration; a server that does not answer is waited for. Without a \
checkpoint the stream starts at the log's current end (or, with source.snapshot, after sending the \
rows already in the outbox tables). On SIGTERM outboxd stops reading, waits up to \
the sink's drain_timeout_ms for the open acknowledgements, writes the final checkpoint and exits 0.\n\n\
On a terminal (text logs) a progress line every 10 s shows rows/s, records forwarded, how far behind \
the source the reading is, and the records in flight.",
        after_long_help = "EXAMPLES:\n  \
outboxd --config orders.toml run\n  \
OUTBOXD_SOURCE__PASSWORD=... outboxd --config orders.toml --log-format json run\n  \
outboxd run --skip-checks     # start although `check` reports a FAIL"
    )]
    Run {
        /// Start even if the preflight checks find a misconfiguration.
        #[arg(long)]
        skip_checks: bool,
    },
    /// Preflight: one PASS/WARN/FAIL line per requirement, with the fix for each FAIL; exit 1 on FAIL.
    #[command(
        long_about = "Preflight: connects to the database and the brokers and prints one PASS/WARN/FAIL \
line per requirement (binlog/WAL settings, privileges, the slot and publication, the outbox tables' \
columns, TLS on each connection, the checkpoint, the dead-letter topic), with the fix for each \
FAIL. Secrets are never printed. Exit status 1 when anything FAILs.",
        after_long_help = "EXAMPLES:\n  outboxd --config orders.toml check\n  \
outboxd --config orders.toml check && outboxd --config orders.toml run"
    )]
    Check,
    /// Inspect or move the pipeline's checkpoint.
    #[command(after_long_help = "EXAMPLES:\n  \
outboxd checkpoint show\n  \
outboxd checkpoint save before-migration\n  \
outboxd checkpoint set mariadb-bin.000042:1234     # or gtid:0-1-42, or an LSN like 0/16B3748\n  \
outboxd checkpoint import-debezium offset.json     # start where a Debezium connector stopped\n  \
outboxd checkpoint reset                           # next run starts at the log's end")]
    Checkpoint {
        #[command(subcommand)]
        action: CheckpointAction,
    },
    /// Forward the outbox rows in a range again, then exit; the live checkpoint is untouched.
    /// MySQL/MariaDB only (a Postgres slot only moves forward). With --binlog-file, read local
    /// binlog files instead of the server.
    #[command(after_long_help = "EXAMPLES:\n  \
outboxd replay --from before-migration                  # a saved checkpoint label, up to now\n  \
outboxd replay --from mariadb-bin.000042:4 --to gtid:0-1-900\n  \
outboxd replay --binlog-file /backup/mariadb-bin.000042 --dry-run | head")]
    Replay {
        /// A saved checkpoint label, or a position (FILE:POS, gtid:0-1-42). Required unless
        /// --binlog-file is given (then it defaults to the first file's start).
        #[arg(long, required_unless_present = "binlog_file")]
        from: Option<String>,
        /// Stop at the first transaction boundary at or past this position (default: the server's
        /// end when the replay starts, or the end of the files).
        #[arg(long)]
        to: Option<String>,
        /// Read these binlog files (in the order given) with the same decoding as the live source.
        #[arg(long = "binlog-file", value_name = "PATH")]
        binlog_file: Vec<PathBuf>,
        /// With --binlog-file: print the records as JSON lines instead of producing them.
        #[arg(long, requires = "binlog_file")]
        dry_run: bool,
    },
    /// Send the rows in the outbox tables once more (all, or those matching --where), then exit;
    /// the running pipeline and its checkpoint are untouched.
    #[command(
        long_about = "Send the rows already in the outbox tables through the normal router and sink once more, in primary-key order and chunks of source.snapshot_chunk rows, then exit (a re-send, like Debezium's signal-driven snapshot). Records carry the rows' own ids, so consumers that deduplicate by id see nothing new. A running `outboxd run` is undisturbed: progress lives in its own checkpoint (NAME.snapshot.json), so an interrupted snapshot resumes where it stopped; a finished one starts afresh the next time.",
        after_long_help = "EXAMPLES:
  outboxd snapshot                                   # every row of every outbox table
  outboxd snapshot --where \"created_at > now() - interval '1 day'\"   # Postgres
  outboxd snapshot --where \"aggregatetype = 'order'\""
    )]
    Snapshot {
        /// An SQL condition on the outbox columns choosing the rows (default: all rows).
        #[arg(long = "where", value_name = "PREDICATE")]
        predicate: Option<String>,
    },
    /// Delete forwarded rows from the outbox tables once ([prune] settings), then exit.
    #[command(
        long_about = "Delete outbox rows that outboxd has forwarded and the broker acknowledged, once, with the [prune] settings (defaults without that section: older_than 1h, batches of 1000, mode delete), then exit. It samples the server (the log end, and the oldest open transaction), waits up to --wait for the live checkpoint to cover that sample, and only then deletes (or, with mode = \"drop_partitions\", drops whole partitions behind it). If the checkpoint does not get there (outboxd not running, the broker not acknowledging, a snapshot in progress) nothing is deleted and the exit status is 1. `run` does the same every prune.every when the config has a [prune] section.",
        after_long_help = "EXAMPLES:\n  outboxd prune\n  outboxd prune --older-than 7d\n  outboxd prune --older-than 0s --wait 5m"
    )]
    Prune {
        /// Keep forwarded rows at least this long (overrides prune.older_than).
        #[arg(long, value_name = "DURATION")]
        older_than: Option<String>,
        /// How long to wait for the checkpoint to cover the sample.
        #[arg(long, value_name = "DURATION", default_value = "1m")]
        wait: String,
    },
    /// Check delivery row by row: the rows in the outbox tables against the records the broker
    /// holds (read-only); exit 1 when a row is missing or out of key order, 3 when rows could not be judged.
    #[command(
        long_about = "Check delivery row by row. Reads the rows still in the outbox tables (one read-only transaction), routes each exactly as `run` would, reads the records the broker holds on those destinations without consuming them (Kafka: partitions assigned, no consumer group joined or committed to, read_committed; NATS: an ephemeral ordered consumer per subject; Redis: XRANGE), and matches them by row id. Reports the rows that never arrived (missing), arrived more than once (duplicated), arrived out of key order, were dead-lettered, and records whose id is in no table row (pruned rows, or not outbox rows). The audit first waits up to --wait for the live checkpoint to cover the rows it read: until it does, rows without a record are pending (not yet due), not missing. Kafka, NATS JetStream and Redis Streams: RabbitMQ, SQS and SNS hand a message to one consumer and remove it, so what they hold cannot be read without taking it. Exit status: 0 when every row was judged delivered (or dead-lettered) in key order, 1 when a row is missing or out of order, 3 when nothing is but some rows could not be judged (pending, or an id that is empty or in several rows), 2 when the audit could not run.",
        after_long_help = "EXAMPLES:\n  outboxd audit\n  outboxd audit --since 24h --format json | jq .missing\n  outboxd audit --wait 0s     # outboxd is stopped: rows without a record are pending"
    )]
    Audit {
        /// Only rows (and records) stamped within this long before now (needs route.timestamp,
        /// the column the records' timestamps come from). Default: every row in the tables.
        #[arg(long, value_name = "DURATION")]
        since: Option<String>,
        /// How long to wait for the live checkpoint to cover the rows read.
        #[arg(long, value_name = "DURATION", default_value = "1m")]
        wait: String,
        /// The most rows to hold (about 250 bytes of memory each); more is refused.
        #[arg(long, value_name = "N", default_value_t = 2_000_000)]
        max_rows: u64,
        #[arg(long, value_enum, default_value = "text")]
        format: AuditFormat,
    },
    /// Print the recommended outbox table, grants and server settings.
    #[command(
        after_long_help = "EXAMPLES:\n  outboxd schema --kind mysql\n  outboxd schema --kind postgres | psql app"
    )]
    Schema {
        #[arg(long, value_enum)]
        kind: Kind,
    },
    /// Configuration tools (need no config file).
    Config {
        #[command(subcommand)]
        action: ConfigAction,
    },
    /// Print a generated reference page (docs/reference/; scripts/gen-docs.sh writes them).
    #[command(hide = true)]
    Reference {
        #[arg(value_enum)]
        page: ReferencePage,
    },
    /// Print a shell completion script (needs no config).
    #[command(after_long_help = "EXAMPLES:\n  \
outboxd completions bash > ~/.local/share/bash-completion/completions/outboxd\n  \
outboxd completions zsh > ~/.zfunc/_outboxd   # with fpath+=(~/.zfunc) in ~/.zshrc\n  \
outboxd completions fish > ~/.config/fish/completions/outboxd.fish")]
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

#[derive(Subcommand)]
enum ConfigAction {
    /// Print the JSON Schema of the config file (for editors and validators).
    #[command(after_long_help = "EXAMPLES:\n  \
outboxd config schema > outboxd.schema.json\n  \
# Taplo (VS Code's Even Better TOML): first line of outboxd.toml\n  \
#:schema ./outboxd.schema.json")]
    Schema,
}

#[derive(Clone, Copy, ValueEnum)]
enum AuditFormat {
    Text,
    Json,
}

#[derive(Clone, Copy, ValueEnum)]
enum ReferencePage {
    Config,
    Schema,
    Cli,
    Man,
    Metrics,
}

#[derive(Subcommand)]
enum CheckpointAction {
    /// Print the live checkpoint.
    Show,
    /// Copy the live checkpoint to <dir>/<name>.saved/LABEL.json.
    Save { label: String },
    /// List saved checkpoints.
    List,
    /// Write POSITION as the live checkpoint: MySQL/MariaDB FILE:POS, a MariaDB GTID position
    /// (gtid:0-1-42) or a MySQL GTID set (gtid:UUID:1-42); Postgres an LSN like 0/16B3748.
    /// Refused while `run` runs.
    Set { position: String },
    /// Remove the live checkpoint (kept as a saved copy); the next run starts at the source's end.
    /// Refused while `run` runs.
    Reset,
    /// Start where a stopped Debezium connector would resume: read its source offset (the JSON
    /// value from Kafka Connect's offsets topic, or Debezium Server's offsets.dat; `-` reads
    /// stdin) and write the same position as the live checkpoint (the old one is saved first).
    /// Refused while `run` runs.
    ImportDebezium { file: PathBuf },
}

fn main() -> ExitCode {
    // Fault-injection points for the reliability tests; inert unless built with `failpoints`.
    #[cfg(feature = "failpoints")]
    let _faults = fail::FailScenario::setup();
    let cli = Cli::parse();
    init_logging(cli.log_format);
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("outboxd: {}", outboxd::secrets::scrub(&e.to_string()));
            ExitCode::FAILURE
        }
    }
}

fn init_logging(format: LogFormat) {
    // lapin logs every message RabbitMQ returns, payload and all, and the closing of channels
    // outboxd closes itself as errors: what matters reaches outboxd as results, and row data
    // never belongs in a log. async-nats logs each connect and each error it also returns, at
    // INFO and ERROR: outboxd reports those itself, with a remedy.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,lapin=off,async_nats=off"))
        .add_directive(
            "lapin::returned_messages=off"
                .parse()
                .expect("a valid log directive"),
        );
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(outboxd::secrets::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// What a shutdown may take beyond the drain deadline: the final checkpoint write, with one new
/// writer in place of a stuck one (Kafka store), and the lead's release.
const SHUTDOWN_MARGIN: std::time::Duration = std::time::Duration::from_secs(90);

/// How long after SIGTERM/SIGINT the process exits whatever happens: the drain deadline plus
/// [`SHUTDOWN_MARGIN`], and with the Kafka checkpoint store three takeover timeouts more. There,
/// during a broker outage, up to three checkpoint-topic writes run one after the other, each
/// retrying until the lead would lapse (at most a takeover timeout after it began): the periodic
/// writer's write in flight, a renewal that waited for the writer (its commit moves the lead's
/// deadline), and the final write. Without them a long `takeover_timeout_ms` made an outage at
/// SIGTERM end in a spurious "did not finish" ERROR.
fn shutdown_bound(config: &Config) -> std::time::Duration {
    let writes = match config.checkpoint.store {
        StoreKind::Kafka => {
            3 * std::time::Duration::from_millis(config.checkpoint.takeover_timeout_ms)
        }
        StoreKind::File | StoreKind::Redis => std::time::Duration::ZERO,
    };
    std::time::Duration::from_millis(config.delivery().drain_timeout_ms) + SHUTDOWN_MARGIN + writes
}

/// A watch channel that turns true on SIGINT/SIGTERM. From then on the process exits within
/// [`shutdown_bound`] whatever happens: a shutdown stuck on something no
/// deadline covers ends like a `kill -9` (which every checkpoint store survives), with an ERROR
/// that says so, rather than waiting for the orchestrator's SIGKILL (or forever without one).
fn shutdown_signal(config: &Config) -> tokio::sync::watch::Receiver<bool> {
    let bound = shutdown_bound(config);
    let (stop, stopped) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM received"),
            _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received"),
        }
        let _ = stop.send(true);
        // A thread of its own: the runtime may be what is stuck.
        std::thread::spawn(move || {
            std::thread::sleep(bound);
            tracing::error!(
                waited = ?bound,
                "the shutdown did not finish within its bound (the drain deadline plus {SHUTDOWN_MARGIN:?}, and three checkpoint.takeover_timeout_ms with the Kafka checkpoint store); exiting now (as after kill -9: the last checkpoint written stands, and what followed it is sent again on restart). This is a bug: please report it with this log"
            );
            std::process::exit(1);
        });
    });
    stopped
}

/// The config's JSON Schema, pretty-printed, one trailing newline.
fn print_schema() {
    let schema = outboxd::reference::config::schema();
    let text = serde_json::to_string_pretty(&schema).expect("a schema is always JSON");
    print_out(format!("{text}\n").as_bytes());
}

/// `outboxd audit`: exit 0 when it passed, 1 when rows are missing or out of order, 2 when it could
/// not run.
fn audit(
    config: &Config,
    since: Option<String>,
    wait: &str,
    max_rows: u64,
    format: AuditFormat,
) -> ExitCode {
    let duration = |flag: &str, text: &str| {
        humantime::parse_duration(text.trim()).map_err(|e| {
            Error::config(format!("{flag} {text:?}: {e}"))
                .remedy("write a duration like \"30s\", \"1h\" or \"7d\"")
        })
    };
    let result = (|| {
        let options = outboxd::audit::Options {
            since: since.map(|s| duration("--since", &s)).transpose()?,
            wait: duration("--wait", wait)?,
            max_rows,
            progress: std::io::IsTerminal::is_terminal(&std::io::stderr()),
        };
        outboxd::runtime::build()?.block_on(outboxd::audit::run(config, &options))
    })();
    match result {
        Ok(report) => {
            let text = match format {
                AuditFormat::Text => report.text(),
                AuditFormat::Json => format!("{}\n", report.json()),
            };
            let written = {
                use std::io::Write;
                let mut out = std::io::stdout().lock();
                // Notes are scrubbed where they are made (`audit::run`).
                out.write_all(text.as_bytes()).and_then(|()| out.flush())
            };
            if let Err(e) = written {
                eprintln!("outboxd: audit could not write its report: {e}");
                return ExitCode::from(2);
            }
            match report.verdict() {
                outboxd::audit::Verdict::Pass => ExitCode::SUCCESS,
                outboxd::audit::Verdict::Fail => ExitCode::from(1),
                outboxd::audit::Verdict::Inconclusive => ExitCode::from(3),
            }
        }
        Err(e) => {
            eprintln!("outboxd: {}", outboxd::secrets::scrub(&e.to_string()));
            ExitCode::from(2)
        }
    }
}

/// Writes a generated page to stdout; a reader that stops early (`| head`) is not an error.
fn print_out(bytes: &[u8]) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(bytes).and_then(|()| out.flush());
}

fn run(cli: Cli) -> Result<ExitCode, Error> {
    if let Command::Completions { shell } = cli.command {
        use clap::CommandFactory;
        clap_complete::generate(
            shell,
            &mut Cli::command(),
            "outboxd",
            &mut std::io::stdout(),
        );
        return Ok(ExitCode::SUCCESS);
    }
    if let Command::Config {
        action: ConfigAction::Schema,
    } = cli.command
    {
        print_schema();
        return Ok(ExitCode::SUCCESS);
    }
    if let Command::Reference { page } = cli.command {
        use clap::CommandFactory;
        use outboxd::reference;
        match page {
            ReferencePage::Config => print_out(reference::config::markdown().as_bytes()),
            ReferencePage::Schema => print_schema(),
            ReferencePage::Cli => {
                print_out(reference::cli::markdown(&Cli::command()).as_bytes());
            }
            ReferencePage::Man => print_out(&reference::cli::man(&Cli::command())),
            ReferencePage::Metrics => print_out(reference::metrics::markdown().as_bytes()),
        }
        return Ok(ExitCode::SUCCESS);
    }
    if let Command::Schema { kind } = cli.command {
        let kind = match kind {
            Kind::Mysql => SourceKind::Mysql,
            Kind::Postgres => SourceKind::Postgres,
        };
        print!("{}", outboxd::schema::ddl(kind));
        return Ok(ExitCode::SUCCESS);
    }
    let path = cli.config.unwrap_or_else(|| PathBuf::from("outboxd.toml"));
    // Loading registers the config's secrets for scrubbing (see `outboxd::secrets`).
    let config = match Config::load(&path) {
        Ok(config) => config,
        // audit's "could not run" is 2 (1 says rows are missing).
        Err(e) if matches!(cli.command, Command::Audit { .. }) => {
            eprintln!("outboxd: {}", outboxd::secrets::scrub(&e.to_string()));
            return Ok(ExitCode::from(2));
        }
        Err(e) => return Err(e),
    };
    match cli.command {
        Command::Schema { .. }
        | Command::Completions { .. }
        | Command::Config { .. }
        | Command::Reference { .. } => unreachable!("handled above"),
        Command::Run { skip_checks } => {
            let runtime = outboxd::runtime::build()?;
            let result = runtime.block_on(async {
            if !skip_checks {
                let report = outboxd::check::run(&config).await;
                for item in report.advisory() {
                    tracing::warn!("{}", outboxd::secrets::scrub(&item.to_string()));
                }
                let blocking = report.blocking();
                if !blocking.is_empty() {
                    for item in &blocking {
                        eprintln!("{}", outboxd::secrets::scrub(&item.to_string()));
                    }
                    return Err(Error::config(format!(
                        "preflight found {} misconfiguration(s); not starting",
                        blocking.len()
                    ))
                    .remedy("fix the items above (`outboxd check` shows every item), or pass --skip-checks"));
                }
            }
            // On a worker thread, not the thread blocked in `block_on`: the reader task then wakes
            // the session on the same worker (no thread to unpark per hand-over).
            // A progress line for people: text logs on a terminal only.
            let progress = matches!(cli.log_format, LogFormat::Text)
                && std::io::IsTerminal::is_terminal(&std::io::stderr());
            let stopped = shutdown_signal(&config);
            match tokio::spawn(outboxd::pipeline::run(config, stopped, progress)).await {
                Ok(result) => result?,
                Err(e) => std::panic::resume_unwind(e.into_panic()),
            }
            Ok(ExitCode::SUCCESS)
        });
            // A librdkafka call still blocking a thread past the drain deadline (a commit behind a
            // frozen broker) must not hold the exit: the session gave up on it already.
            runtime.shutdown_timeout(std::time::Duration::from_secs(1));
            result
        }
        Command::Check => outboxd::runtime::build()?.block_on(async {
            let report = outboxd::check::run(&config).await;
            for item in &report.items {
                println!("{}", outboxd::secrets::scrub(&item.to_string()));
            }
            Ok(if report.failed() {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            })
        }),
        Command::Replay {
            from,
            to,
            binlog_file,
            dry_run,
        } if !binlog_file.is_empty() => {
            if config.source.kind() != SourceKind::Mysql {
                return Err(Error::config("--binlog-file needs source.kind = \"mysql\"")
                    .remedy("binlog files come from MySQL/MariaDB servers"));
            }
            let parse = |p: Option<String>| {
                p.map(|p| outboxd::source::parse_position(SourceKind::Mysql, &p))
                    .transpose()
            };
            let (from, to) = (parse(from)?, parse(to)?);
            if dry_run {
                let mut out = std::io::BufWriter::new(std::io::stdout().lock());
                let rows = outboxd::dry_run::binlog_files(
                    &config,
                    binlog_file,
                    from.as_ref(),
                    to.as_ref(),
                    &mut out,
                )?;
                drop(out);
                eprintln!("{rows} outbox row(s)");
                return Ok(ExitCode::SUCCESS);
            }
            outboxd::runtime::build()?.block_on(async {
                let count = outboxd::pipeline::replay_files(
                    &config,
                    binlog_file,
                    from,
                    to,
                    shutdown_signal(&config),
                )
                .await?;
                println!("replayed {count} record(s)");
                Ok(ExitCode::SUCCESS)
            })
        }
        Command::Replay { from, to, .. } => {
            let store = Store::open(&config, &config.name, Access::Read)?;
            let from = from.expect("clap requires --from without --binlog-file");
            let from = starting_point(&store, &config, &from)?;
            let to = to
                .map(|t| outboxd::source::parse_position(config.source.kind(), &t))
                .transpose()?;
            outboxd::runtime::build()?.block_on(async {
                let count =
                    outboxd::pipeline::replay(&config, from, to, shutdown_signal(&config)).await?;
                println!("replayed {count} record(s)");
                Ok(ExitCode::SUCCESS)
            })
        }
        Command::Snapshot { predicate } => outboxd::runtime::build()?.block_on(async {
            let count =
                outboxd::pipeline::snapshot(&config, predicate, shutdown_signal(&config)).await?;
            println!("sent {count} record(s)");
            Ok(ExitCode::SUCCESS)
        }),
        Command::Audit {
            since,
            wait,
            max_rows,
            format,
        } => Ok(audit(&config, since, &wait, max_rows, format)),
        Command::Prune { older_than, wait } => outboxd::runtime::build()?.block_on(async {
            let mut settings = config.prune.clone().unwrap_or_default();
            if let Some(older_than) = older_than {
                humantime::parse_duration(older_than.trim()).map_err(|e| {
                    outboxd::error::Error::config(format!("--older-than {older_than:?}: {e}"))
                        .remedy("write a duration like \"0s\", \"1h\" or \"7d\"")
                })?;
                settings.older_than = older_than;
            }
            let prune = settings.settings(&config.source)?;
            let wait = humantime::parse_duration(&wait).map_err(|e| {
                outboxd::error::Error::config(format!("--wait {wait:?}: {e}"))
                    .remedy("write a duration like \"30s\" or \"5m\"")
            })?;
            let store = Store::open(&config, &config.name, Access::Read)?;
            let metrics = outboxd::metrics::Metrics::new(
                &config.name,
                config.sink().name(),
                std::time::Duration::from_secs(1),
            );
            match outboxd::retention::round(&prune, &store, &metrics, wait).await? {
                outboxd::retention::Outcome::Pruned {
                    deleted,
                    dropped,
                    created,
                } => {
                    for partition in created {
                        println!("created partition {partition}");
                    }
                    println!("deleted {deleted} row(s)");
                    for partition in dropped {
                        println!("dropped partition {partition}");
                    }
                    Ok(ExitCode::SUCCESS)
                }
                outboxd::retention::Outcome::Waiting { reason, created } => {
                    for partition in created {
                        println!("created partition {partition}");
                    }
                    Err(outboxd::error::Error::checkpoint(
                    format!("prune deleted nothing: {reason}"),
                )
                .remedy("prune deletes only rows the checkpoint covers: is `outboxd run` running and Kafka acknowledging? Try again, or give a longer --wait"))
                }
            }
        }),
        Command::Checkpoint { action } => {
            checkpoint_command(&config, action)?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// `--from`: a saved label if one exists by that name, else a position.
fn starting_point(
    store: &Store,
    config: &Config,
    from: &str,
) -> Result<(SourceIdentity, outboxd::source::Position), Error> {
    if store.list_saved()?.iter().any(|(label, _)| label == from) {
        let saved = store.load_saved(from)?;
        return Ok((saved.source.clone(), saved.position.clone()));
    }
    let position = outboxd::source::parse_position(config.source.kind(), from).map_err(|e| {
        Error::config(format!(
            "--from {from:?} is neither a saved label nor a position"
        ))
        .remedy(e.remedy_text().unwrap_or("").to_string())
    })?;
    Ok((anonymous_identity(config), position))
}

fn anonymous_identity(config: &Config) -> SourceIdentity {
    SourceIdentity::anonymous(config.source.kind())
}

fn checkpoint_command(config: &Config, action: CheckpointAction) -> Result<(), Error> {
    match action {
        CheckpointAction::Show => {
            let store = Store::open(config, &config.name, Access::Read)?;
            match store.load()? {
                Some(c) => {
                    println!("{}", serde_json::to_string_pretty(&c).expect("json"));
                    if let Some(found) = store.found() {
                        eprintln!("({found})");
                    }
                }
                None => println!(
                    "no checkpoint at {} ({})",
                    store.describe(),
                    config.source.first_start()
                ),
            }
        }
        CheckpointAction::Save { label } => {
            let store = Store::open(config, &config.name, Access::Read)?;
            let (path, c) = store.save(&label)?;
            println!("saved {} as {label:?} ({path})", c.position);
        }
        CheckpointAction::List => {
            let store = Store::open(config, &config.name, Access::Read)?;
            let saved = store.list_saved()?;
            if saved.is_empty() {
                println!("no saved checkpoints in {}", store.saved_where());
            }
            for (label, c) in saved {
                println!("{label}\t{}\t{}", c.position, c.updated_at);
            }
        }
        CheckpointAction::Set { position } => {
            let store = Store::open(config, &config.name, Access::Exclusive)?;
            let position = outboxd::source::parse_position(config.source.kind(), &position)?;
            // A position set by hand is the operator's word for the configured server: it names no
            // server, so the next run takes it there (keeping the old identity would refuse it again
            // when that identity is the "checkpoint from another server" being fixed).
            let identity = anonymous_identity(config);
            if let Ok(Some(_)) = store.load() {
                let label = format!("before-set-{}", chrono::Utc::now().format("%Y%m%dT%H%M%SZ"));
                store.save(&label)?;
                println!("previous checkpoint saved as {label:?}");
            }
            let c = store.write(&identity, &position)?;
            println!("checkpoint set to {} ({})", c.position, store.describe());
        }
        CheckpointAction::ImportDebezium { file } => {
            let input = if file.as_os_str() == "-" {
                let mut buf = Vec::new();
                std::io::Read::read_to_end(&mut std::io::stdin(), &mut buf)
                    .map_err(|e| Error::config(format!("cannot read stdin: {e}")))?;
                buf
            } else {
                std::fs::read(&file).map_err(|e| {
                    Error::config(format!("cannot read {}: {e}", file.display()))
                        .remedy("give the file holding the Debezium offset, or - for stdin")
                })?
            };
            let imported = outboxd::checkpoint::debezium::import(config.source.kind(), &input)?;
            let store = Store::open(config, &config.name, Access::Exclusive)?;
            if let Ok(Some(_)) = store.load() {
                let label = format!(
                    "before-import-{}",
                    chrono::Utc::now().format("%Y%m%dT%H%M%SZ")
                );
                store.save(&label)?;
                println!("previous checkpoint saved as {label:?}");
            }
            let c = store.write(&anonymous_identity(config), &imported.position)?;
            for note in imported.notes {
                println!("{note}");
            }
            println!(
                "checkpoint set to {} ({}); start outboxd after the Debezium connector is stopped",
                c.position,
                store.describe()
            );
        }
        CheckpointAction::Reset => {
            let store = Store::open(config, &config.name, Access::Exclusive)?;
            match store.reset()? {
                Some(label) if label.is_empty() => println!(
                    "the lost checkpoint is removed for good; {}",
                    config
                        .source
                        .first_start()
                        .replacen("a run", "the next run", 1)
                ),
                Some(label) => println!(
                    "checkpoint removed (saved as {label:?}); {}",
                    config
                        .source
                        .first_start()
                        .replacen("a run", "the next run", 1)
                ),
                None => println!("no checkpoint to reset"),
            }
        }
    }
    Ok(())
}
