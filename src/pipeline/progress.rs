//! A progress line for a person watching `outboxd run` on a terminal: how fast rows go out, how far
//! behind the source the forwarded transactions are, and what is in flight. Logs stay for machines
//! (and the line is never printed with `--log-format json` or when stderr is not a terminal).

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::metrics::Metrics;

/// How often the line is printed.
pub const EVERY: Duration = Duration::from_secs(10);

/// Prints the line every [`EVERY`] until aborted.
pub async fn report(metrics: Arc<Metrics>) {
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + EVERY, EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last = (Instant::now(), metrics.forwarded_total());
    loop {
        tick.tick().await;
        let now = (Instant::now(), metrics.forwarded_total());
        let rate = (now.1 - last.1) as f64 / now.0.duration_since(last.0).as_secs_f64().max(0.001);
        last = now;
        // A closed terminal is no reason to stop forwarding.
        let _ = writeln!(
            std::io::stderr(),
            "{}",
            line(
                rate,
                now.1,
                metrics.source_lag_seconds(),
                metrics.inflight_now()
            )
        );
    }
}

/// `outboxd: 1,234 rows/s · 98,765 forwarded · 12.3 s behind the source · 40 in flight`
fn line(rate: f64, total: u64, lag: Option<f64>, inflight: i64) -> String {
    // The lag is that of what was read; with records still unacknowledged it is not "caught up".
    let behind = match lag {
        None => "nothing read yet".to_string(),
        Some(l) if l < 1.0 && inflight == 0 => "caught up".to_string(),
        Some(l) if l < 1.0 => "read up to now".to_string(),
        Some(l) if l < 120.0 => format!("{l:.1} s behind the source"),
        Some(l) if l < 7200.0 => format!("{:.1} min behind the source", l / 60.0),
        Some(l) => format!("{:.1} h behind the source", l / 3600.0),
    };
    format!(
        "outboxd: {} rows/s · {} forwarded · {behind} · {inflight} in flight",
        grouped(rate.round() as u64),
        grouped(total)
    )
}

/// 1234567 -> "1,234,567".
fn grouped(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_reads_like_a_sentence() {
        assert_eq!(
            line(1234.4, 98_765, Some(12.34), 40),
            "outboxd: 1,234 rows/s · 98,765 forwarded · 12.3 s behind the source · 40 in flight"
        );
        assert!(line(0.0, 0, None, 0).contains("nothing read yet"));
        assert!(line(5.0, 10, Some(0.2), 0).contains("caught up"));
        // A broker that does not acknowledge: everything read, nothing caught up.
        assert!(line(0.0, 10, Some(0.2), 40).contains("read up to now · 40 in flight"));
        assert!(line(5.0, 10, Some(600.0), 0).contains("10.0 min behind"));
    }
}
