//! The `outboxd` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use outboxd::checkpoint::Store;
use outboxd::config::{Config, CONFIG_ENV};
use outboxd::Error;

#[derive(Parser)]
#[command(
    name = "outboxd",
    version,
    about = "Transactional outbox forwarder: database log -> Kafka, checkpointed after ack"
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

#[derive(Subcommand)]
enum Command {
    /// Forward outbox rows until SIGINT/SIGTERM (graceful: drain acks, final checkpoint).
    Run,
    /// Inspect the pipeline's checkpoint.
    Checkpoint {
        #[command(subcommand)]
        action: CheckpointAction,
    },
}

#[derive(Subcommand)]
enum CheckpointAction {
    /// Print the checkpoint file.
    Show,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("outboxd: {e}");
            ExitCode::FAILURE
        }
    }
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn run(cli: Cli) -> Result<(), Error> {
    let path = cli.config.unwrap_or_else(|| PathBuf::from("outboxd.toml"));
    let config = Config::load(&path)?;
    match cli.command {
        Command::Run => {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .map_err(|e| Error::config(format!("cannot start the async runtime: {e}")))?;
            runtime.block_on(async {
                let (stop, stopped) = tokio::sync::watch::channel(false);
                tokio::spawn(async move {
                    wait_for_signal().await;
                    let _ = stop.send(true);
                });
                outboxd::pipeline::run(config, stopped).await
            })
        }
        Command::Checkpoint {
            action: CheckpointAction::Show,
        } => {
            let store = Store::open_unlocked(&config.checkpoint.dir, &config.name)?;
            match store.load()? {
                Some(checkpoint) => {
                    println!(
                        "{}",
                        serde_json::to_string_pretty(&checkpoint).expect("serializable")
                    );
                    Ok(())
                }
                None => {
                    println!(
                        "no checkpoint at {} (a run starts at the source's current end)",
                        store.path().display()
                    );
                    Ok(())
                }
            }
        }
    }
}

async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received"),
    }
}
