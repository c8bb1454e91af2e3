//! The fault schedule: which fault, for how long, after how much quiet, all drawn from one seed.
//!
//! The same seed gives the same sequence of faults and durations on every machine (the generator
//! is `fastrand`'s, pinned by Cargo.lock). The wall clock does not replay: how far the load got when
//! a fault began depends on the machine, so a failing seed reproduces its faults, not its exact
//! interleaving.

use std::time::Duration;

/// One kind of fault the nemesis can inject. Each heals before the next begins.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// `kill -9` of one outboxd instance (the supervisor starts it again).
    Kill9,
    /// SIGSTOP of one outboxd instance, SIGCONT after the hold (long holds lose a standby's lead).
    Pause,
    /// `kill -9` of the instance that holds the lead (Kafka checkpoint store with a standby).
    LeaderKill,
    /// `kill -9` of the broker, and the same node started again on its data after the hold.
    BrokerKill,
    /// SIGSTOP of the broker for the hold.
    BrokerFreeze,
    /// The database stopped (SIGTERM / `pg_ctl stop -m fast`) and started again (MariaDB: the
    /// primary the load writes to; the replicas reconnect).
    DbRestart,
    /// MariaDB: the replica outboxd reads from stopped for the hold (outboxd moves to the other
    /// one by GTID), then started again.
    ReplicaFailover,
    /// The link between outboxd and every server down for the hold.
    Partition,
    /// A share of packets dropped each way for the hold.
    Loss,
    /// A slow link (delay and queueing) for the hold.
    Slow,
    /// The checkpoint's disk full for the hold (file store on a small tmpfs).
    DiskFull,
    /// `checkpoint save` while running; after the hold every instance is stopped, `checkpoint set`
    /// moves the live checkpoint back to the saved position, and they start again: the rows since
    /// are sent once more, on purpose (an operator replaying).
    Rewind,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Kill9 => "kill -9 outboxd",
            Kind::Pause => "SIGSTOP outboxd",
            Kind::LeaderKill => "kill -9 the leader",
            Kind::BrokerKill => "kill -9 broker + restart",
            Kind::BrokerFreeze => "broker frozen",
            Kind::DbRestart => "database restart",
            Kind::ReplicaFailover => "replica failover",
            Kind::Partition => "network partition",
            Kind::Loss => "packet loss",
            Kind::Slow => "slow network",
            Kind::DiskFull => "checkpoint disk full",
            Kind::Rewind => "checkpoint rewound",
        }
    }

    /// Every kind, for `--faults` names.
    pub const ALL: [Kind; 12] = [
        Kind::Kill9,
        Kind::Pause,
        Kind::LeaderKill,
        Kind::BrokerKill,
        Kind::BrokerFreeze,
        Kind::DbRestart,
        Kind::ReplicaFailover,
        Kind::Partition,
        Kind::Loss,
        Kind::Slow,
        Kind::DiskFull,
        Kind::Rewind,
    ];

    /// The short name `scripts/soak.sh --faults` takes.
    pub fn flag(self) -> &'static str {
        match self {
            Kind::Kill9 => "kill",
            Kind::Pause => "pause",
            Kind::LeaderKill => "leader-kill",
            Kind::BrokerKill => "broker-kill",
            Kind::BrokerFreeze => "broker-freeze",
            Kind::DbRestart => "db-restart",
            Kind::ReplicaFailover => "replica-failover",
            Kind::Partition => "partition",
            Kind::Loss => "loss",
            Kind::Slow => "slow",
            Kind::DiskFull => "disk-full",
            Kind::Rewind => "rewind",
        }
    }

    /// The hold's range in seconds (a pause up to 12 s outlasts a 3 s takeover timeout).
    fn hold_range(self) -> (u64, u64) {
        match self {
            Kind::Kill9 | Kind::LeaderKill => (0, 3),
            Kind::Pause => (1, 12),
            Kind::BrokerKill => (1, 8),
            Kind::BrokerFreeze => (2, 12),
            Kind::DbRestart => (0, 4),
            Kind::ReplicaFailover => (1, 10),
            Kind::Partition => (2, 15),
            Kind::Loss => (4, 15),
            Kind::Slow => (4, 15),
            Kind::DiskFull => (2, 8),
            Kind::Rewind => (2, 10),
        }
    }
}

/// One step: quiet for `gap`, then `kind` for `hold`; `percent` is the packet loss share.
#[derive(Clone, Debug)]
pub struct Step {
    pub gap: Duration,
    pub kind: Kind,
    pub hold: Duration,
    pub percent: u32,
    /// Which outboxd instance a fault aimed at one instance hits (modulo the instances running).
    pub target: usize,
}

/// An endless schedule over `kinds` from `seed`; the caller takes steps until its time is up.
pub struct Schedule {
    rng: fastrand::Rng,
    kinds: Vec<Kind>,
}

impl Schedule {
    pub fn new(seed: u64, kinds: &[Kind]) -> Schedule {
        assert!(
            !kinds.is_empty(),
            "a schedule needs at least one kind of fault"
        );
        Schedule {
            rng: fastrand::Rng::with_seed(seed),
            kinds: kinds.to_vec(),
        }
    }

    pub fn next_step(&mut self) -> Step {
        let kind = self.kinds[self.rng.usize(..self.kinds.len())];
        let (low, high) = kind.hold_range();
        Step {
            gap: Duration::from_millis(self.rng.u64(1_000..=5_000)),
            kind,
            hold: Duration::from_millis(self.rng.u64(low * 1000..=high * 1000)),
            percent: self.rng.u32(5..=40),
            target: self.rng.usize(..16),
        }
    }
}

/// How far into `seed`'s schedule (quiet and holds added up, recoveries not counted) every kind
/// of `kinds` has been drawn once: a short run's seed must reach all of them.
pub fn all_drawn_after(seed: u64, kinds: &[Kind]) -> Duration {
    let mut schedule = Schedule::new(seed, kinds);
    let mut left: std::collections::BTreeSet<Kind> = kinds.iter().copied().collect();
    let mut elapsed = Duration::ZERO;
    while !left.is_empty() {
        let step = schedule.next_step();
        elapsed += step.gap + step.hold;
        left.remove(&step.kind);
    }
    elapsed
}

#[test]
fn the_same_seed_gives_the_same_schedule_and_every_kind_appears() {
    let kinds = [
        Kind::Kill9,
        Kind::Partition,
        Kind::BrokerFreeze,
        Kind::DbRestart,
    ];
    let draw = |seed| {
        let mut s = Schedule::new(seed, &kinds);
        (0..200).map(|_| s.next_step()).collect::<Vec<_>>()
    };
    let (a, b, c) = (draw(7), draw(7), draw(8));
    let summary = |steps: &[Step]| {
        steps
            .iter()
            .map(|s| (s.kind, s.gap, s.hold, s.percent, s.target))
            .collect::<Vec<_>>()
    };
    assert_eq!(summary(&a), summary(&b));
    assert_ne!(summary(&a), summary(&c));
    for kind in kinds {
        assert!(a.iter().any(|s| s.kind == kind), "{kind:?} never drawn");
    }
    assert!(a.iter().all(|s| s.hold <= Duration::from_secs(15)));
}
