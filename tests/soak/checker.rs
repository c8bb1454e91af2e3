//! The checker: what the database committed against what the topic holds, independent of outboxd
//! (it reads neither outboxd's logs nor its metrics, only the two ends).
//!
//! - lost: a row in the database's table that no record carries (and the table must hold every
//!   row whose COMMIT returned, or it is no truth to compare with);
//! - phantom: a record whose row the database does not hold (a rolled-back row, or none of ours);
//! - duplicate: a second record of a row. One is *explained* when the broker appended it between
//!   the start of a fault and a minute after its end, the replay window a fault opens; one is
//!   *replayed* when a checkpoint rewind (an operator's deliberate replay) explains it: it arrived
//!   after the rewind's restart, the row's previous copy before, and ahead of the first new row
//!   of its partition after that restart, and the partition's copies so explained are together
//!   one unbroken run of the rows it received before the restart, none long before the save (a
//!   replay from further back, or of rows picked here and there, is no rewind's). Exactly-once allows
//!   only replayed ones;
//! - order violation: a row first seen after a later row of the same key (per partition, offset
//!   order; replays of rows already seen do not count);
//! - recovery of a fault: from its end until every row whose COMMIT had returned by then arrived
//!   (faults that began meanwhile count in it: the schedule does not wait for recovery).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use outboxd::audit::matching::{Matcher, Outcome, Rank, Record};
use serde_json::{json, Value};

use super::load::{producer_of, seq_of, Log};
use super::plan::Kind;
use super::tail::Seen;
use super::world::{Exit, Injected};

pub struct Inputs<'a> {
    pub committed: &'a [u128],
    pub logs: &'a [Log],
    pub seen: &'a Seen,
    pub faults: &'a [Injected],
    pub exits: &'a [Exit],
    pub started: Instant,
    pub exactly_once: bool,
}

/// The verdict's numbers; `failures` lists every reason the run fails (empty: it passed).
pub struct Verdict {
    pub json: Value,
    pub failures: Vec<String>,
    /// Per second from the start: (rows whose COMMIT returned, rows first delivered, lag at the end).
    pub timeline: Vec<(u64, u64, u64)>,
}

pub fn check(inputs: &Inputs) -> Verdict {
    let committed: HashSet<u128> = inputs.committed.iter().copied().collect();
    let seen = inputs.seen;
    let rolled_back: HashSet<u128> = inputs
        .logs
        .iter()
        .flat_map(|l| l.rolled_back.iter().copied())
        .collect();
    let matched = matched(inputs);
    let lost: Vec<&str> = matched.missing.iter().map(|a| a.id.as_str()).collect();
    let phantom: Vec<u128> = seen
        .first
        .keys()
        .copied()
        .filter(|id| !committed.contains(id))
        .collect();
    let rolled_back_delivered = phantom.iter().filter(|id| rolled_back.contains(id)).count();
    let rolled_back_in_db = rolled_back
        .iter()
        .filter(|id| committed.contains(id))
        .count();
    // The table is the truth only if it holds every row whose COMMIT returned.
    let acked_not_in_db = inputs
        .logs
        .iter()
        .flat_map(|l| l.acked.iter())
        .filter(|(id, _)| !committed.contains(id))
        .count();
    let Duplicates {
        extra: duplicates,
        unexplained,
        replayed,
        others,
    } = duplicates(seen, inputs.faults);
    let order_violations = matched.disorder.len();
    let key_mismatches = seen.deliveries.iter().filter(|d| !d.key_ok).count();
    let (recovery, timeline) = recovery_and_timeline(inputs);

    let mut failures = Vec::new();
    let mut fail = |count: usize, what: &str| {
        if count > 0 {
            failures.push(format!("{count} {what}"));
        }
    };
    fail(lost.len(), "rows lost");
    fail(phantom.len(), "records of rows the database does not hold");
    fail(order_violations, "per-key order violations");
    fail(key_mismatches, "records with another row's key");
    fail(seen.malformed as usize, "records without a row id");
    fail(
        rolled_back_in_db,
        "rolled-back rows in the database (a load bug)",
    );
    fail(
        acked_not_in_db,
        "rows whose COMMIT returned missing from the database's table",
    );
    fail(
        usize::from(!seen.drained),
        "reader that did not reach the end of every partition (records after it were not checked)",
    );
    if inputs.exactly_once {
        fail(
            duplicates - replayed,
            "duplicates seen by a read_committed consumer (besides a rewind's replay)",
        );
    }

    let (faults_json, schedule, exits) = faults_and_exits(inputs, &recovery);
    let acked: usize = inputs.logs.iter().map(|l| l.acked.len()).sum();
    let json = json!({
        "rows_committed": committed.len(),
        "rows_acked_to_the_load": acked,
        "rows_rolled_back": rolled_back.len(),
        "rows_in_failed_calls": inputs.logs.iter().map(|l| l.ambiguous.len()).sum::<usize>(),
        "rows_acked_not_in_the_table": acked_not_in_db,
        "transactions": inputs.logs.iter().map(|l| l.transactions).sum::<u64>(),
        "records_read": seen.deliveries.len(),
        "rows_delivered": seen.first.len(),
        "lost": lost.len(),
        "lost_sample": lost.iter().take(20).collect::<Vec<_>>(),
        "phantom": phantom.len(),
        "rolled_back_delivered": rolled_back_delivered,
        "duplicates": duplicates,
        "duplicates_unexplained": unexplained,
        "duplicates_replayed_by_rewind": replayed,
        "duplicate_incidents": incidents(&others, inputs.faults),
        "order_violations": order_violations,
        "key_mismatches": key_mismatches,
        "malformed": seen.malformed,
        "re_read_by_the_checker": seen.re_read,
        "reader_reached_the_end": seen.drained,
        "reader_rebuilt": seen.rebuilt,
        "faults_injected": inputs.faults.len(),
        "faults": faults_json,
        "schedule": schedule,
        "outboxd_exits": exits,
        "failures": failures,
    });
    Verdict {
        json,
        failures,
        timeline,
    }
}

/// The faults by kind (count, longest recovery), each fault as scheduled, and the exits.
fn faults_and_exits(
    inputs: &Inputs,
    recovery: &[Duration],
) -> (Vec<Value>, Vec<Value>, Vec<Value>) {
    let mut by_kind: BTreeMap<Kind, (usize, Duration)> = BTreeMap::new();
    for (fault, took) in inputs.faults.iter().zip(recovery) {
        let entry = by_kind.entry(fault.kind).or_default();
        entry.0 += 1;
        entry.1 = entry.1.max(*took);
    }
    let faults_json: Vec<Value> = by_kind
        .iter()
        .map(|(kind, (count, longest))| {
            json!({"kind": kind.name(), "count": count, "longest_recovery_s": secs(*longest)})
        })
        .collect();
    let schedule: Vec<Value> = inputs
        .faults
        .iter()
        .zip(recovery)
        .map(|(f, took)| {
            json!({
                "at_s": secs(f.started - inputs.started),
                "at_epoch_ms": f.started_ms,
                "kind": f.kind.name(),
                "detail": f.detail,
                "held_s": secs(f.ended - f.started),
                "recovery_s": secs(*took),
            })
        })
        .collect();
    let exits: Vec<Value> = inputs
        .exits
        .iter()
        .map(|e| {
            json!({
                "at_s": secs(e.at - inputs.started),
                "instance": e.instance,
                "status": e.status,
                "last_error": e.last_error,
            })
        })
        .collect();
    (faults_json, schedule, exits)
}

fn secs(d: Duration) -> f64 {
    (d.as_secs_f64() * 10.0).round() / 10.0
}

struct Duplicates {
    /// Copies beyond the first.
    extra: usize,
    /// Of those, appended outside every fault's window.
    unexplained: usize,
    /// Of those, a rewind's replay (see [`replayed_by_rewind`]).
    replayed: usize,
    /// The others, in append order: what the report shows of each.
    others: Vec<Copy>,
}

/// A copy that no rewind explains, and the copy of its row before it.
struct Copy {
    id: u128,
    partition: i32,
    offset: i64,
    appended_ms: i64,
    previous: (i32, i64, i64),
}

fn duplicates(seen: &Seen, faults: &[Injected]) -> Duplicates {
    let mut ordered: Vec<_> = seen.deliveries.iter().collect();
    ordered.sort_by_key(|d| (d.partition, d.offset));
    // Each rewind's restart, with when its `checkpoint save` ran.
    let rewinds: Vec<(i64, i64)> = faults
        .iter()
        .filter_map(|f| f.restarted_ms.map(|r| (r, f.started_ms)))
        .collect();
    let restarts: Vec<i64> = rewinds.iter().map(|&(r, _)| r).collect();
    // Per partition and rewind: the offset of the first row never seen before that arrived
    // after the restart. The source sends in commit order, so a replay comes before it. And per
    // partition, the first copies in offset order (id, append time).
    let mut new_after: HashMap<(i32, i64), i64> = HashMap::new();
    let mut firsts: HashMap<i32, Vec<(u128, i64)>> = HashMap::new();
    let mut previous: HashMap<u128, i64> = HashMap::new();
    for d in &ordered {
        if previous.insert(d.id, d.appended_ms).is_none() {
            firsts
                .entry(d.partition)
                .or_default()
                .push((d.id, d.appended_ms));
            for &r in restarts.iter().filter(|&&r| d.appended_ms >= r) {
                new_after.entry((d.partition, r)).or_insert(d.offset);
            }
        }
    }
    let mut counts = Duplicates {
        extra: 0,
        unexplained: 0,
        replayed: 0,
        others: Vec::new(),
    };
    // Copies that look like a rewind's replay, by partition and restart, in offset order.
    let mut candidates: BTreeMap<(i32, i64), Vec<Copy>> = BTreeMap::new();
    let mut previous: HashMap<u128, (i32, i64, i64)> = HashMap::new();
    for d in ordered {
        let Some(earlier) = previous.insert(d.id, (d.partition, d.offset, d.appended_ms)) else {
            continue;
        };
        counts.extra += 1;
        let in_window = faults
            .iter()
            .any(|f| f.started_ms <= d.appended_ms && d.appended_ms <= f.ended_ms + 60_000);
        if !in_window {
            counts.unexplained += 1;
        }
        let copy = Copy {
            id: d.id,
            partition: d.partition,
            offset: d.offset,
            appended_ms: d.appended_ms,
            previous: earlier,
        };
        match replayed_by_rewind(d, earlier.2, &restarts, &new_after) {
            Some(restart) => candidates
                .entry((d.partition, restart))
                .or_default()
                .push(copy),
            None => counts.others.push(copy),
        }
    }
    for ((partition, restart), copies) in candidates {
        let saved_ms = rewinds
            .iter()
            .find(|&&(r, _)| r == restart)
            .map_or(i64::MIN, |&(_, saved)| saved);
        let before: Vec<(u128, i64)> = firsts[&partition]
            .iter()
            .copied()
            .filter(|&(_, at)| at < restart)
            .collect();
        if is_a_replayed_tail(&copies, &before, saved_ms) {
            counts.replayed += copies.len();
        } else {
            counts.others.extend(copies);
        }
    }
    counts.others.sort_by_key(|c| c.appended_ms);
    counts
}

/// A rewind replays everything after the saved position once: in a partition, its copies are
/// one unbroken run of the rows first delivered there before the restart (in any order: on
/// Postgres a session may start at the slot, ahead of the saved position, and the next one after a
/// database restart from the saved position), usually the last ones, or the first part of them when
/// the next rewind stopped the replay early; none of them first delivered long before the save
/// (the live checkpoint trails deliveries by far less than [`CHECKPOINT_LAG_MS`]). Copies that are
/// not are no replay.
fn is_a_replayed_tail(copies: &[Copy], before: &[(u128, i64)], saved_ms: i64) -> bool {
    let replayed: HashSet<u128> = copies.iter().map(|c| c.id).collect();
    let Some(start) = before.iter().position(|(id, _)| replayed.contains(id)) else {
        return false;
    };
    let Some(run) = before.get(start..start + copies.len()) else {
        return false;
    };
    run.iter().all(|(id, _)| replayed.contains(id))
        && run[0].1 >= saved_ms.saturating_sub(CHECKPOINT_LAG_MS)
}

/// How far the saved checkpoint may trail the rows delivered when it was saved.
const CHECKPOINT_LAG_MS: i64 = 120_000;

/// Copies no rewind explains, grouped into incidents (appended within 2 s of the one before),
/// each with where its copies and their earlier copies sit and the faults of the minute before:
/// what it takes to find the cause in the instances' logs after a long run.
fn incidents(others: &[Copy], faults: &[Injected]) -> Vec<Value> {
    let mut groups: Vec<&[Copy]> = Vec::new();
    let mut start = 0;
    for i in 1..=others.len() {
        if i == others.len() || others[i].appended_ms - others[i - 1].appended_ms > 2_000 {
            if i > start {
                groups.push(&others[start..i]);
            }
            start = i;
        }
    }
    groups
        .iter()
        .take(50)
        .map(|group| {
            let first = group[0].appended_ms;
            let last = group[group.len() - 1].appended_ms;
            let mut partitions: BTreeMap<i32, (i64, i64, i64, i64)> = BTreeMap::new();
            for c in *group {
                let e = partitions.entry(c.partition).or_insert((
                    i64::MAX,
                    i64::MIN,
                    i64::MAX,
                    i64::MIN,
                ));
                *e = (
                    e.0.min(c.offset),
                    e.1.max(c.offset),
                    e.2.min(c.previous.1),
                    e.3.max(c.previous.1),
                );
            }
            let earlier_ms = group.iter().map(|c| c.previous.2);
            let nearby: Vec<Value> = faults
                .iter()
                .filter(|f| f.ended_ms + 60_000 >= first && f.started_ms <= last)
                .map(|f| json!({"kind": f.kind.name(), "at_epoch_ms": f.started_ms, "ended_epoch_ms": f.ended_ms, "detail": f.detail}))
                .collect();
            json!({
                "copies": group.len(),
                "appended_epoch_ms": [first, last],
                "earlier_copies_appended_epoch_ms": [earlier_ms.clone().min(), earlier_ms.max()],
                "earlier_copies_elsewhere": group.iter().filter(|c| c.previous.0 != c.partition).count(),
                "offsets_by_partition": partitions.iter().map(|(p, (lo, hi, plo, phi))| {
                    json!({"partition": p, "copies": [lo, hi], "earlier_copies": [plo, phi]})
                }).collect::<Vec<_>>(),
                "sample_rows": group.iter().take(3).map(|c| format!("{:032x}", c.id)).collect::<Vec<_>>(),
                "faults_since_a_minute_before": nearby,
            })
        })
        .collect()
}

/// The restart of the rewind whose replay a copy may be: the last rewind restarted before the
/// copy arrived, when the row's previous copy arrived before that restart (one replay per
/// rewind) and the copy comes before the first new row of its partition after the restart.
/// [`is_a_replayed_tail`] then checks the copies of each partition together.
fn replayed_by_rewind(
    d: &super::tail::Delivery,
    previous_ms: i64,
    restarts: &[i64],
    new_after: &HashMap<(i32, i64), i64>,
) -> Option<i64> {
    let &restart = restarts.iter().filter(|&&r| r <= d.appended_ms).max()?;
    (previous_ms < restart
        && new_after
            .get(&(d.partition, restart))
            .is_none_or(|&first_new| d.offset < first_new))
    .then_some(restart)
}

/// Rows first seen after a later row of their key, in each partition's offset order.
/// The committed rows matched with the records read, as `outboxd audit` matches them (one
/// implementation): rows lost, and first appearances out of key order. A row's key is its
/// producer's `seq % 8` (see `load`), its rank its sequence number.
fn matched(inputs: &Inputs) -> Outcome {
    let mut matcher = Matcher::new();
    for id in inputs.committed {
        matcher.expect(&format!("{id:032x}"), Some(""), "");
    }
    let mut ordered: Vec<_> = inputs.seen.deliveries.iter().collect();
    ordered.sort_by_key(|d| (d.partition, d.offset));
    for d in ordered {
        let id = format!("{:032x}", d.id);
        let key = format!("{}/{}", producer_of(d.id), seq_of(d.id) % 8);
        let rank = Rank::new("", u128::from(seq_of(d.id)));
        matcher.observe(Record {
            id: Some(&id),
            topic: "",
            partition: d.partition,
            offset: d.offset,
            key: Some(key.as_bytes()),
            rank: Some(&rank),
        });
    }
    matcher.finish()
}

/// Each fault's recovery time, and the per-second timeline.
fn recovery_and_timeline(inputs: &Inputs) -> (Vec<Duration>, Vec<(u64, u64, u64)>) {
    let mut acked: Vec<(Instant, Option<Instant>)> = inputs
        .logs
        .iter()
        .flat_map(|l| l.acked.iter())
        .map(|(id, at)| (*at, inputs.seen.first.get(id).copied()))
        .collect();
    acked.sort_by_key(|(at, _)| *at);
    // The latest first arrival among rows acked up to each index.
    let mut latest = Vec::with_capacity(acked.len());
    let mut top: Option<Instant> = None;
    for (_, arrived) in &acked {
        top = top.max(*arrived);
        latest.push(top);
    }
    let recovery = inputs
        .faults
        .iter()
        .map(|f| {
            let n = acked.partition_point(|(at, _)| *at <= f.ended);
            match n.checked_sub(1).and_then(|i| latest[i]) {
                Some(arrived) => arrived.saturating_duration_since(f.ended),
                None => Duration::ZERO,
            }
        })
        .collect();
    let second = |at: Instant| at.saturating_duration_since(inputs.started).as_secs();
    let end = acked
        .iter()
        .flat_map(|(a, b)| [Some(*a), *b])
        .flatten()
        .map(second)
        .max()
        .unwrap_or(0);
    let mut commits = vec![0u64; end as usize + 1];
    let mut arrivals = vec![0u64; end as usize + 1];
    for (at, arrived) in &acked {
        commits[second(*at) as usize] += 1;
        if let Some(arrived) = arrived {
            arrivals[second(*arrived) as usize] += 1;
        }
    }
    let (mut c, mut a) = (0u64, 0u64);
    let timeline = commits
        .iter()
        .zip(&arrivals)
        .map(|(x, y)| {
            c += x;
            a += y;
            (*x, *y, c.saturating_sub(a))
        })
        .collect();
    (recovery, timeline)
}

/// A rewind excuses one replayed copy per row, after its restart and ahead of the first new row;
/// a copy before the restart, after a new row, or a second one for the same rewind is a duplicate.
#[test]
fn only_a_rewinds_replay_is_excused() {
    use super::tail::Delivery;
    let at = |partition: i32, id: u128, offset: i64, appended_ms: i64| Delivery {
        id,
        partition,
        offset,
        appended_ms,
        key_ok: true,
    };
    let now = Instant::now();
    let rewind = Injected {
        kind: Kind::Rewind,
        started: now,
        ended: now,
        started_ms: 1_000,
        ended_ms: 2_000,
        detail: String::new(),
        restarted_ms: Some(2_000),
    };
    let seen = Seen {
        deliveries: vec![
            at(0, 1, 0, 500),
            at(0, 2, 1, 600),
            at(0, 3, 2, 1_500),
            at(0, 2, 3, 1_600), // before the restart: not a replay
            at(0, 2, 4, 2_100), // replayed: 2 and 3 are partition 0's last rows before
            at(0, 3, 5, 2_150), // replayed
            at(0, 4, 6, 2_200), // the first new row
            at(0, 3, 7, 2_300), // after the first new row
            at(1, 10, 0, 500),
            at(1, 11, 1, 600),
            at(1, 12, 2, 700),
            at(1, 10, 3, 2_100), // 10 and 12 without 11: no unbroken run, no replay
            at(1, 12, 4, 2_120),
            at(2, 20, 0, -200_000),
            at(2, 20, 1, 2_100), // the last row, but delivered long before the save
            at(3, 30, 0, 1_200),
            at(3, 31, 1, 1_300),
            at(3, 32, 2, 1_400),
            at(3, 30, 3, 2_100), // a replay stopped early: 30 and 31, the start of the run
            at(3, 31, 4, 2_150),
        ],
        ..Seen::default()
    };
    let counts = duplicates(&seen, std::slice::from_ref(&rewind));
    assert_eq!(counts.extra, 9);
    assert_eq!(counts.replayed, 4);
    // The other five make one incident (appended within 2 s of each other), the rewind nearby.
    let shown = incidents(&counts.others, &[rewind]);
    assert_eq!(shown.len(), 1, "{shown:?}");
    assert_eq!(shown[0]["copies"], 5);
    assert_eq!(shown[0]["offsets_by_partition"][0]["copies"], json!([3, 7]));
    assert_eq!(
        shown[0]["offsets_by_partition"][0]["earlier_copies"],
        json!([1, 5])
    );
    assert_eq!(shown[0]["offsets_by_partition"][1]["copies"], json!([3, 4]));
    assert_eq!(
        shown[0]["faults_since_a_minute_before"][0]["kind"],
        "checkpoint rewound"
    );
}
