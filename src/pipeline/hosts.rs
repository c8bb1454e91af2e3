//! Which host of a multi-host `source.url` the next session reads, and when to give up.
//!
//! Several hosts are replicas of one topology, listed so that losing one does not stop the
//! pipeline. So a host that *refuses* to serve outboxd (its binlog lacks the checkpoint's
//! transactions, it does not log replicated rows, the user may not read it there, the checkpoint's
//! file offset means nothing there) is one more host lost, not a reason to stop: the next session
//! tries the next host. Stopping on the first refusal made a crash loop of it, because a restarted
//! process begins at the first host again and never reached the second.
//!
//! outboxd stops only when every host refused in a row, since the last session that got anywhere
//! (forwarded a row, or lasted a minute): then no host can serve it, and the error names each one's
//! reason. A host that merely failed (down, unreachable, silent) is worth waiting for, so one
//! failure of that kind between refusals keeps the loop going, with the usual backoff.
//!
//! Only the source's own errors move outboxd: after the broker or the checkpoint store ended a
//! session, the next replica may lag behind the checkpoint and be waited for, so it stays put. And
//! of the source's permanent errors only a host's refusal ([`Error::is_host_refusal`]: met while
//! connecting, or the binlog the checkpoint needs is not there) moves it: an event that cannot be
//! decoded, or a row the config forbids, is the same on every host, and stops outboxd at once
//! with its own remedy (were it passed over, a session that forwarded part of its transaction
//! would count as progress, and the rotation would never end).

use crate::error::{Error, Kind};
use crate::source::config::redact_url;

pub(super) struct Hosts {
    urls: Vec<String>,
    current: usize,
    /// Each host's refusal since the last session that got anywhere.
    refusals: Vec<Option<Error>>,
}

impl Hosts {
    pub fn new(urls: Vec<String>) -> Hosts {
        let refusals = vec![None; urls.len()];
        Hosts {
            urls,
            current: 0,
            refusals,
        }
    }

    /// The host the next session reads, when there is a choice (one host: the configured URL).
    pub fn url(&self) -> Option<&str> {
        (self.urls.len() > 1).then(|| self.urls[self.current].as_str())
    }

    /// A session ended with `error`; `progressed`: it forwarded rows or lasted a while. `Ok`: open
    /// another session (on the host [`Hosts::url`] names now); `Err`: stop with this error.
    pub fn after(&mut self, error: Error, progressed: bool) -> Result<(), Error> {
        if progressed {
            self.refusals.iter_mut().for_each(|r| *r = None);
        }
        let moves =
            error.kind() == Kind::Source && (error.is_transient() || error.is_host_refusal());
        if self.urls.len() < 2 || !moves {
            return if error.is_transient() {
                Ok(())
            } else {
                Err(error)
            };
        }
        let here = redact_url(&self.urls[self.current]);
        if error.is_transient() {
            self.refusals[self.current] = None;
        } else {
            tracing::error!(host = %here, error = %error, "this source host refuses to serve outboxd; trying the next one");
            self.refusals[self.current] = Some(error);
            if self.refusals.iter().all(Option::is_some) {
                return Err(self.every_host_refused());
            }
        }
        self.current = (self.current + 1) % self.urls.len();
        tracing::warn!(next = %redact_url(&self.urls[self.current]), "moving to the next source host");
        Ok(())
    }

    fn every_host_refused(&self) -> Error {
        let mut message = String::from("every host in source.url refused to serve outboxd:");
        for (url, refusal) in self.urls.iter().zip(&self.refusals) {
            if let Some(e) = refusal {
                message.push_str(&format!("\n  {}: {e}", redact_url(url)));
            }
        }
        Error::source(message).remedy(
            "fix at least one host as its error says; outboxd then reads it (the others stay listed for failover)",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn three() -> Hosts {
        Hosts::new(vec![
            "mysql://cdc:pw@a:3306/app".into(),
            "mysql://cdc:pw@b:3306/app".into(),
            "mysql://cdc:pw@c:3306/app".into(),
        ])
    }

    fn refused(what: &str) -> Error {
        Error::source(what.to_string())
            .remedy("fix it")
            .refused_by_host()
    }

    fn down() -> Error {
        Error::source("connection refused").transient()
    }

    #[test]
    fn a_refusing_host_is_passed_over_and_only_refusals_from_every_host_in_a_row_stop() {
        let mut hosts = three();
        assert!(hosts.url().unwrap().contains("@a:"));
        hosts.after(refused("a purged"), false).unwrap();
        assert!(hosts.url().unwrap().contains("@b:"));
        hosts
            .after(refused("b no log_slave_updates"), false)
            .unwrap();
        let stop = hosts.after(refused("c access denied"), false).unwrap_err();
        assert!(!stop.is_transient());
        for said in [
            "a purged",
            "b no log_slave_updates",
            "c access denied",
            "@a:",
            "@c:",
        ] {
            assert!(stop.message().contains(said), "{said}: {}", stop.message());
        }
        assert!(!stop.message().contains("pw"), "{}", stop.message());
    }

    #[test]
    fn a_host_that_is_only_down_keeps_outboxd_waiting_for_it() {
        let mut hosts = three();
        hosts.after(refused("a purged"), false).unwrap();
        hosts.after(down(), false).unwrap();
        hosts.after(refused("c purged"), false).unwrap();
        // Back at a, which refuses again: b was down, not refusing, so outboxd keeps trying it.
        hosts.after(refused("a purged"), false).unwrap();
        assert!(hosts.url().unwrap().contains("@b:"));
    }

    #[test]
    fn a_session_that_got_somewhere_forgets_earlier_refusals() {
        let mut hosts = three();
        hosts.after(refused("a purged"), false).unwrap();
        hosts.after(refused("b purged"), false).unwrap();
        // c forwarded rows for a while, then hit something it cannot serve.
        hosts.after(refused("c purged"), true).unwrap();
        hosts.after(refused("a purged"), false).unwrap();
        assert!(hosts.after(refused("b purged"), false).is_err());
    }

    #[test]
    fn other_stages_neither_move_nor_spare_a_permanent_error() {
        let mut hosts = three();
        hosts
            .after(Error::sink("broker down").transient(), false)
            .unwrap();
        assert!(hosts.url().unwrap().contains("@a:"), "a sink error stays");
        assert!(hosts.after(Error::config("bad"), false).is_err());
        let undecodable = Error::source("cannot decode the event at mysql-bin.000003:4");
        assert!(
            hosts.after(undecodable, false).is_err(),
            "the same on every host: stop at once"
        );
        let mut one = Hosts::new(vec!["mysql://a/app".into()]);
        assert_eq!(one.url(), None);
        one.after(down(), false).unwrap();
        assert!(one.after(refused("purged"), false).is_err());
    }
}
