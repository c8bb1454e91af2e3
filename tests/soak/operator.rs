//! The operator: does what outboxd's remedy for a hanging Kafka transaction says, and only when
//! Kafka's own tool confirms it.
//!
//! outboxd names a transaction that has held its checkpoint topic's readers longer than any of its
//! own may stay open, with the offset it began at (`… --start-offset N`). A person would then run
//! `kafka-transactions.sh find-hanging`, which lists only transactions their coordinator has lost,
//! and abort what it lists. So does this: a named offset that `find-hanging` does not list is not
//! touched (it is counted, and looked at again later), so a transaction that outboxd itself
//! left open wrongly, which its coordinator would know, is never aborted away.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use crate::rig::Broker;

const TOOL: &str = "org.apache.kafka.tools.TransactionsCommand";
const CHECKPOINTS: &str = "outboxd.checkpoints";

/// A hanging transaction outboxd named, `find-hanging` listed and the operator aborted.
pub struct Aborted {
    pub at: Instant,
    pub offset: i64,
}

#[derive(Default)]
pub struct Operator {
    looked: Option<Instant>,
    /// When each named offset was last checked with `find-hanging`.
    tried: HashMap<i64, Instant>,
    pub aborted: Vec<Aborted>,
    /// Named by outboxd, never listed by `find-hanging` (so never aborted).
    pub unconfirmed: BTreeSet<i64>,
    /// Every command run and what it printed.
    pub transcript: String,
}

impl Operator {
    /// Every 5 s: the offsets outboxd named in `logs`; each not aborted yet (and not checked in
    /// the last 30 s) is checked with `find-hanging` and aborted when listed.
    pub fn look(&mut self, broker: &Broker, logs: impl Iterator<Item = String>) {
        if self
            .looked
            .is_some_and(|at| at.elapsed() < Duration::from_secs(5))
        {
            return;
        }
        self.looked = Some(Instant::now());
        let named: BTreeSet<i64> = logs.flat_map(|log| named_offsets(&log)).collect();
        for offset in named {
            let recently = self
                .tried
                .get(&offset)
                .is_some_and(|at| at.elapsed() < Duration::from_secs(30));
            if recently || self.aborted.iter().any(|a| a.offset == offset) {
                continue;
            }
            self.tried.insert(offset, Instant::now());
            if self.end(broker, offset) {
                self.unconfirmed.remove(&offset);
                self.aborted.push(Aborted {
                    at: Instant::now(),
                    offset,
                });
                println!("soak: outboxd named a hanging Kafka transaction at offset {offset} of {CHECKPOINTS}; find-hanging listed it and the operator aborted it");
            } else {
                self.unconfirmed.insert(offset);
            }
        }
    }

    /// `find-hanging` on the checkpoint partition; when it lists `offset`, aborts it and what
    /// the same producer left hanging elsewhere (exactly-once: event-topic partitions).
    fn end(&mut self, broker: &Broker, offset: i64) -> bool {
        let (_, listed) = self.tool(
            broker,
            &[
                "find-hanging",
                "--topic",
                CHECKPOINTS,
                "--partition",
                "0",
                "--max-transaction-timeout",
                "1",
            ],
        );
        let start = offset.to_string();
        let Some(producer) = rows(&listed)
            .into_iter()
            .find(|row| row.get("StartOffset") == Some(&start))
            .and_then(|row| row.get("ProducerId").cloned())
        else {
            return false;
        };
        let abort = |topic: &str, partition: &str, start: &str| {
            vec![
                "abort".to_string(),
                "--topic".into(),
                topic.into(),
                "--partition".into(),
                partition.into(),
                "--start-offset".into(),
                start.into(),
            ]
        };
        let (ok, _) = self.tool_owned(broker, abort(CHECKPOINTS, "0", &start));
        if !ok {
            return false;
        }
        let (_, elsewhere) = self.tool(
            broker,
            &[
                "find-hanging",
                "--broker-id",
                "1",
                "--max-transaction-timeout",
                "1",
            ],
        );
        for row in rows(&elsewhere) {
            if row.get("ProducerId") == Some(&producer) && row["Topic"] != CHECKPOINTS {
                self.tool_owned(
                    broker,
                    abort(&row["Topic"], &row["Partition"], &row["StartOffset"]),
                );
            }
        }
        true
    }

    fn tool(&mut self, broker: &Broker, args: &[&str]) -> (bool, String) {
        let out = broker.tool_output(TOOL, args);
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        self.transcript.push_str(&format!(
            "$ kafka-transactions {}\n{stdout}{}\n",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        ));
        (out.status.success(), stdout)
    }

    fn tool_owned(&mut self, broker: &Broker, args: Vec<String>) -> (bool, String) {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.tool(broker, &args)
    }
}

/// The offsets outboxd named in `log` (`… --start-offset N`).
fn named_offsets(log: &str) -> Vec<i64> {
    log.lines()
        .filter_map(|line| {
            let (_, rest) = line.split_once(" --start-offset ")?;
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            digits.parse().ok()
        })
        .collect()
}

/// `find-hanging`'s table as rows keyed by its header (Topic, Partition, ProducerId, …).
fn rows(table: &str) -> Vec<HashMap<String, String>> {
    let mut lines = table
        .lines()
        .skip_while(|l| !l.split_whitespace().any(|w| w == "StartOffset"));
    let Some(header) = lines.next() else {
        return Vec::new();
    };
    let names: Vec<&str> = header.split_whitespace().collect();
    lines
        .map(|l| {
            names
                .iter()
                .zip(l.split_whitespace())
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect::<HashMap<_, _>>()
        })
        .filter(|row| row.len() == names.len())
        .collect()
}

/// What Kafka's own tool says of the open transactions, the hanging ones, the checkpoint topic's
/// producers and the soak pipeline's two transactional ids (saved beside a run's logs).
pub fn transactions_view(broker: &Broker) -> String {
    let mut transactions = String::new();
    for args in [
        &["list"][..],
        &[
            "find-hanging",
            "--broker-id",
            "1",
            "--max-transaction-timeout",
            "1",
        ],
        &[
            "describe-producers",
            "--topic",
            "outboxd.checkpoints",
            "--partition",
            "0",
        ],
        &["describe", "--transactional-id", "outboxd.soak.records"],
        &["describe", "--transactional-id", "outboxd.soak.checkpoint"],
    ] {
        let out = broker.tool_output(TOOL, args);
        transactions.push_str(&format!(
            "$ kafka-transactions {}\n{}{}\n",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    transactions
}

#[test]
fn find_hanging_rows_and_named_offsets_are_read() {
    let table = "Topic               Partition ProducerId ProducerEpoch CoordinatorEpoch StartOffset LastTimestamp Duration(min)\n\
                 outboxd.checkpoints 0         7          3             1                103         1790000000000 5\n";
    let listed = rows(table);
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0]["StartOffset"], "103");
    assert_eq!(listed[0]["ProducerId"], "7");
    // With nothing hanging, the tool prints its header alone.
    assert!(rows(table.lines().next().unwrap()).is_empty());
    let log = "x remedy: … then `kafka-transactions.sh abort --topic outboxd.checkpoints --partition 0 --start-offset 103`, and …";
    assert_eq!(named_offsets(log), vec![103]);
}
