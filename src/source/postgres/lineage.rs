//! Whether a server's history holds the checkpoint.
//!
//! A promotion starts a new timeline at a *switch point*: the promoted standby's WAL up to there is
//! the old primary's, and everything after it is its own. Its LSNs past the switch point name other
//! changes than the old primary's LSNs there. So a checkpoint written on timeline 1 at LSN `C`
//! means the same on a server of timeline 2 only when timeline 1 ended at or after `C` in that
//! server's history. Otherwise outboxd forwarded changes from the old primary that this server
//! never had, and starting at `C` would skip this server's own changes between the switch point
//! and `C` without a word. That happens when a standby is promoted before it received what outboxd
//! was sent (no `synchronized_standby_slots`). A server on an *older* timeline than the
//! checkpoint's is behind a promotion: an old primary that came back, or a standby of one.
//!
//! The decision is pure (the history file's text in, a verdict out); the session asks the server
//! for the file (`TIMELINE_HISTORY`) only when the timelines differ.

use super::lsn::parse_lsn;

#[derive(Debug, PartialEq, Eq)]
pub enum Lineage {
    /// The checkpoint's timeline, or one whose history holds the checkpoint.
    Holds,
    /// The server is on an older timeline than the checkpoint's.
    Behind,
    /// The checkpoint's timeline ended at `at`, before the checkpoint.
    Forked { at: u64 },
    /// The server's history does not pass through the checkpoint's timeline.
    Unrelated,
}

/// Where `timeline` ended in a history file (`parent<TAB>switch point<TAB>reason` per line).
pub fn switch_point(history: &str, timeline: u32) -> Option<u64> {
    history.lines().find_map(|line| {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            return None;
        }
        let mut fields = line.split_whitespace();
        let parent: u32 = fields.next()?.parse().ok()?;
        let at = parse_lsn(fields.next()?)?;
        (parent == timeline).then_some(at)
    })
}

/// The verdict for a checkpoint at `checkpoint` written on `stored`, on a server of `server`
/// whose history file is `history` (needed only when `server > stored`).
pub fn judge(stored: u32, server: u32, checkpoint: u64, history: Option<&str>) -> Lineage {
    if server == stored {
        return Lineage::Holds;
    }
    if server < stored {
        return Lineage::Behind;
    }
    match history.and_then(|h| switch_point(h, stored)) {
        Some(at) if checkpoint > at => Lineage::Forked { at },
        Some(_) => Lineage::Holds,
        None => Lineage::Unrelated,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HISTORY: &str =
        "1\t0/5000148\tno recovery target specified\n\n2\t0/7000000\tbefore 2026-12-02\n";

    #[test]
    fn a_checkpoint_before_the_switch_point_holds_and_one_after_it_is_forked() {
        assert_eq!(switch_point(HISTORY, 1), Some(0x5000148));
        assert_eq!(switch_point(HISTORY, 2), Some(0x7000000));
        assert_eq!(switch_point(HISTORY, 4), None);
        assert_eq!(judge(1, 3, 0x5000148, Some(HISTORY)), Lineage::Holds);
        assert_eq!(
            judge(1, 3, 0x5000149, Some(HISTORY)),
            Lineage::Forked { at: 0x5000148 }
        );
        assert_eq!(judge(2, 3, 0x6000000, Some(HISTORY)), Lineage::Holds);
        assert_eq!(judge(3, 3, u64::MAX, None), Lineage::Holds);
        assert_eq!(judge(3, 2, 0, None), Lineage::Behind);
        assert_eq!(judge(5, 7, 0, Some(HISTORY)), Lineage::Unrelated);
        assert_eq!(switch_point("# comment\ngarbage\n", 1), None);
    }
}
