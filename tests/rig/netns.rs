//! A network namespace of the test's own, joined to the host by a veth pair, so that faults can
//! be put on exactly one path: everything outboxd sends and receives, and nothing else.
//!
//! The servers bind the host end's address ([`NetNs::host_ip`]); outboxd runs inside the namespace
//! ([`NetNs::wrapper`]) and reaches them over the veth. The test's own clients connect to the same
//! address from the host side, where it is local: their traffic never crosses the veth, so a
//! fault on the link never hides a row from the checker.
//!
//! Faults, each undone by [`NetNs::heal`]:
//! - partition: the host end of the link down (no packet either way; TCP connections stall and
//!   resume when it comes back, as they would behind a failed switch);
//! - loss: nftables inside the namespace drops a share of packets each way (`numgen random`);
//! - slow link: a token bucket (`tc tbf`) on both ends, so packets queue (delay) and, past the
//!   bucket's latency bound, drop.
//!
//! `tc netem` (delay with jitter, reordering) is used when the kernel has it; this machine's
//! kernel does not (`CONFIG_NET_SCH_NETEM` is off), so [`NetNs::slow`] falls back to `tbf`.
//! Needs root (or CAP_NET_ADMIN), `ip`, `tc` and `nft` (scripts/install-test-deps.sh installs
//! iproute2 and nftables).

use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

static NEXT: AtomicU32 = AtomicU32::new(0);

pub struct NetNs {
    name: String,
    host_if: String,
    ns_if: String,
    host_ip: String,
    ns_ip: String,
    netem: bool,
}

/// Runs `args` (the first is the program); panics with its stderr and `why` when it fails.
fn run(args: &[&str], why: &str) {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("{}: {e} ({why})", args[0]));
    assert!(
        out.status.success(),
        "{} failed ({why}): {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl NetNs {
    /// A fresh namespace and veth pair on a /30 of 10.64.0.0/10 picked from the process id and a
    /// counter (two test processes side by side get different ones).
    pub fn create() -> NetNs {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let tag = format!("{}{n}", pid % 100_000);
        // 10.64.0.0/10: 22 bits, /30 blocks: 2^20 of them.
        let block = (pid.wrapping_mul(64) + n) % (1 << 20);
        let base = (10u32 << 24) | (64 << 16) | (block << 2);
        let ip = |last: u32| {
            let a = base + last;
            format!(
                "{}.{}.{}.{}",
                a >> 24,
                (a >> 16) & 255,
                (a >> 8) & 255,
                a & 255
            )
        };
        let ns = NetNs {
            name: format!("outboxd-{tag}"),
            host_if: format!("obh{tag}"),
            ns_if: format!("obn{tag}"),
            host_ip: ip(1),
            ns_ip: ip(2),
            netem: netem_available(&tag),
        };
        let why = "network faults need root (or CAP_NET_ADMIN) and iproute2; scripts/install-test-deps.sh installs it";
        run(&["ip", "netns", "add", &ns.name], why);
        run(
            &[
                "ip",
                "link",
                "add",
                &ns.host_if,
                "type",
                "veth",
                "peer",
                "name",
                &ns.ns_if,
            ],
            why,
        );
        run(&["ip", "link", "set", &ns.ns_if, "netns", &ns.name], why);
        run(
            &[
                "ip",
                "addr",
                "add",
                &format!("{}/30", ns.host_ip),
                "dev",
                &ns.host_if,
            ],
            why,
        );
        run(&["ip", "link", "set", &ns.host_if, "up"], why);
        ns.exec(&["ip", "link", "set", "lo", "up"]);
        ns.exec(&[
            "ip",
            "addr",
            "add",
            &format!("{}/30", ns.ns_ip),
            "dev",
            &ns.ns_if,
        ]);
        ns.exec(&["ip", "link", "set", &ns.ns_if, "up"]);
        ns
    }

    /// The host end's address: servers bind it, outboxd dials it.
    pub fn host_ip(&self) -> &str {
        &self.host_ip
    }

    /// The namespace end's address (what servers see outboxd connect from).
    pub fn ns_ip(&self) -> &str {
        &self.ns_ip
    }

    /// The command prefix that runs a program inside the namespace.
    pub fn wrapper(&self) -> Vec<String> {
        ["ip", "netns", "exec", &self.name]
            .iter()
            .map(|s| s.to_string())
            .collect()
    }

    fn exec(&self, args: &[&str]) {
        let mut all = vec!["ip", "netns", "exec", &self.name];
        all.extend_from_slice(args);
        run(&all, "a command inside the test's network namespace");
    }

    /// The link down (`true`) or up again (`false`).
    pub fn partition(&self, down: bool) {
        let state = if down { "down" } else { "up" };
        run(&["ip", "link", "set", &self.host_if, state], "partition");
    }

    /// Drops `percent` of packets each way (nftables inside the namespace).
    pub fn loss(&self, percent: u32) {
        self.exec(&["nft", "add", "table", "inet", "chaos"]);
        for (chain, hook) in [("out", "output"), ("in", "input")] {
            self.exec(&[
                "nft",
                "add",
                "chain",
                "inet",
                "chaos",
                chain,
                &format!("{{ type filter hook {hook} priority 0; }}"),
            ]);
            self.exec(&[
                "nft",
                "add",
                "rule",
                "inet",
                "chaos",
                chain,
                "numgen",
                "random",
                "mod",
                "100",
                "lt",
                &percent.to_string(),
                "drop",
            ]);
        }
    }

    /// A slow link both ways: `netem delay` when the kernel has it, else a token bucket of
    /// `kbit` kbit/s whose queue delays packets up to 2 s and drops the rest.
    pub fn slow(&self, delay_ms: u32, kbit: u32) {
        let shaping: Vec<String> = if self.netem {
            format!("netem delay {delay_ms}ms {}ms", delay_ms / 4)
        } else {
            format!("tbf rate {kbit}kbit burst 16kb latency 2s")
        }
        .split(' ')
        .map(str::to_string)
        .collect();
        let shaping: Vec<&str> = shaping.iter().map(String::as_str).collect();
        let mut host = vec!["tc", "qdisc", "add", "dev", &self.host_if, "root"];
        host.extend_from_slice(&shaping);
        run(&host, "a slow link");
        let mut inner = vec!["tc", "qdisc", "add", "dev", &self.ns_if, "root"];
        inner.extend_from_slice(&shaping);
        self.exec(&inner);
    }

    /// Undoes every fault: link up, no loss rules, no shaping.
    pub fn heal(&self) {
        let quiet = |args: &[&str]| {
            let _ = Command::new(args[0]).args(&args[1..]).output();
        };
        quiet(&["ip", "link", "set", &self.host_if, "up"]);
        quiet(&[
            "ip", "netns", "exec", &self.name, "nft", "delete", "table", "inet", "chaos",
        ]);
        quiet(&["tc", "qdisc", "del", "dev", &self.host_if, "root"]);
        quiet(&[
            "ip",
            "netns",
            "exec",
            &self.name,
            "tc",
            "qdisc",
            "del",
            "dev",
            &self.ns_if,
            "root",
        ]);
    }
}

/// Whether `tc netem` exists here (a throwaway qdisc on a throwaway namespace's loopback).
fn netem_available(tag: &str) -> bool {
    let probe = format!("outboxd-probe-{tag}");
    let ok = Command::new("ip")
        .args(["netns", "add", &probe])
        .status()
        .is_ok_and(|s| s.success())
        && Command::new("ip")
            .args([
                "netns", "exec", &probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                "delay", "1ms",
            ])
            .output()
            .is_ok_and(|o| o.status.success());
    let _ = Command::new("ip").args(["netns", "del", &probe]).output();
    ok
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "del", &self.host_if])
            .output();
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}
