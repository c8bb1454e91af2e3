//! Ack tracking: the highest boundary with everything before it acknowledged.
//!
//! Records get consecutive tickets in source order. Kafka acknowledges them in any order across
//! partitions, so the tracker keeps one flag per ticket still in flight (a window no larger than
//! `kafka.max_in_flight`) and the boundaries (`Commit`/`Idle` positions) tagged with the ticket count
//! at the moment they were seen. When the lowest unacknowledged ticket passes a boundary's tag, that
//! boundary is safe. Consecutive boundaries with no record between them collapse into the last one,
//! so a busy database with a quiet outbox does not grow the queue.

use std::collections::VecDeque;
use std::sync::Mutex;

use tokio::sync::Notify;

use crate::sink::Ticket;
use crate::source::Position;

#[derive(Default)]
struct State {
    /// Tickets below `base` are all acknowledged.
    base: u64,
    /// Ack flags for tickets `base..base + acked.len()`.
    acked: VecDeque<bool>,
    /// (tickets issued when the boundary was seen, position).
    boundaries: VecDeque<(u64, Position)>,
    /// Safe position not yet taken by the writer.
    safe: Option<Position>,
    /// When each ticket in `acked` was issued (the front is the oldest unacknowledged one).
    issued_at: VecDeque<std::time::Instant>,
}

impl State {
    fn issued(&self) -> u64 {
        self.base + self.acked.len() as u64
    }

    fn advance(&mut self) {
        while self.acked.front() == Some(&true) {
            self.acked.pop_front();
            self.issued_at.pop_front();
            self.base += 1;
        }
        while self
            .boundaries
            .front()
            .is_some_and(|(tag, _)| *tag <= self.base)
        {
            let (_, position) = self.boundaries.pop_front().expect("checked");
            self.safe = Some(position);
        }
    }
}

#[derive(Default)]
pub struct Tracker {
    state: Mutex<State>,
    /// Woken when nothing is in flight any more (a draining session waits on it).
    idle: Notify,
}

impl Tracker {
    pub fn new() -> Self {
        Self::default()
    }

    /// Hands out the next ticket (call in source order).
    pub fn issue(&self) -> Ticket {
        let mut s = self.state.lock().expect("tracker lock");
        let ticket = Ticket(s.issued());
        s.acked.push_back(false);
        s.issued_at.push_back(std::time::Instant::now());
        ticket
    }

    /// A transaction boundary: every ticket issued so far belongs at or before it.
    pub fn boundary(&self, position: Position) {
        let mut s = self.state.lock().expect("tracker lock");
        let tag = s.issued();
        match s.boundaries.back_mut() {
            Some((last_tag, last)) if *last_tag == tag => *last = position,
            _ => s.boundaries.push_back((tag, position)),
        }
        s.advance();
    }

    /// Kafka acknowledged `ticket`.
    pub fn ack(&self, ticket: Ticket) {
        let mut s = self.state.lock().expect("tracker lock");
        if let Some(offset) = ticket.0.checked_sub(s.base) {
            if let Some(flag) = s.acked.get_mut(offset as usize) {
                *flag = true;
            }
        }
        s.advance();
        let idle = s.acked.is_empty();
        drop(s);
        if idle {
            self.idle.notify_waiters();
        }
    }

    /// Takes the newest safe position not taken before.
    pub fn take_safe(&self) -> Option<Position> {
        self.state.lock().expect("tracker lock").safe.take()
    }

    /// When the oldest unacknowledged record was issued; `None` when nothing is in flight. (Acks of
    /// other records do not move it: a partition without a leader must not hide behind partitions
    /// that still answer.)
    pub fn oldest_unacked_since(&self) -> Option<std::time::Instant> {
        let s = self.state.lock().expect("tracker lock");
        s.issued_at.front().copied()
    }

    /// Records issued and not yet acknowledged.
    pub fn in_flight(&self) -> u64 {
        let s = self.state.lock().expect("tracker lock");
        s.acked.iter().filter(|a| !**a).count() as u64
    }

    /// Waits until every issued ticket is acknowledged.
    pub async fn drained(&self) {
        loop {
            let notified = self.idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                if self.state.lock().expect("tracker lock").acked.is_empty() {
                    return;
                }
            }
            notified.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pos(n: u64) -> Position {
        Position::Lsn(crate::source::postgres::Lsn(n))
    }

    #[test]
    fn the_oldest_unacked_record_keeps_its_age_while_later_ones_are_acked() {
        let t = Tracker::new();
        assert_eq!(t.oldest_unacked_since(), None);
        let a = t.issue();
        let since = t.oldest_unacked_since();
        let b = t.issue();
        t.ack(b);
        assert_eq!(
            t.oldest_unacked_since(),
            since,
            "acking b must not reset a's age"
        );
        t.ack(a);
        assert_eq!(t.oldest_unacked_since(), None);
    }

    #[test]
    fn boundary_waits_for_every_earlier_ack_in_any_order() {
        let t = Tracker::new();
        let a = t.issue();
        let b = t.issue();
        t.boundary(pos(1));
        let c = t.issue();
        t.boundary(pos(2));
        assert_eq!(t.take_safe(), None);
        t.ack(b);
        assert_eq!(t.take_safe(), None, "a is still in flight");
        t.ack(c);
        assert_eq!(t.take_safe(), None, "a blocks both boundaries");
        t.ack(a);
        assert_eq!(
            t.take_safe(),
            Some(pos(2)),
            "one take covers every ack (group commit)"
        );
        assert_eq!(t.take_safe(), None);
        assert_eq!(t.in_flight(), 0);
    }

    #[test]
    fn idle_boundaries_with_nothing_in_flight_are_safe_at_once_and_collapse() {
        let t = Tracker::new();
        t.boundary(pos(1));
        assert_eq!(t.take_safe(), Some(pos(1)));
        let a = t.issue();
        t.boundary(pos(2));
        t.boundary(pos(3));
        t.boundary(pos(4));
        t.ack(a);
        assert_eq!(t.take_safe(), Some(pos(4)));
    }

    #[test]
    fn rows_after_the_last_boundary_hold_nothing_back() {
        let t = Tracker::new();
        let a = t.issue();
        t.boundary(pos(1));
        let _open = t.issue();
        t.ack(a);
        assert_eq!(t.take_safe(), Some(pos(1)));
    }

    #[tokio::test]
    async fn drained_wakes_up_when_the_last_ticket_is_acked() {
        let t = std::sync::Arc::new(Tracker::new());
        let a = t.issue();
        let waiter = tokio::spawn({
            let t = t.clone();
            async move { t.drained().await }
        });
        t.ack(a);
        waiter.await.unwrap();
        t.drained().await;
    }
}
