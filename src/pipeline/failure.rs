//! The session's failure signal.
//!
//! A session ends at the first error from any of its parts that do not return to the main loop: a
//! delivery report (librdkafka's thread), the delivery watchdog, the checkpoint writer. The first one
//! is kept; later ones are consequences. The main loop checks [`Failure::is_set`] for every change
//! without a lock or a future, and waits on [`Failure::wait`] only when it has to wait anyway.

use std::sync::{Arc, OnceLock};

use tokio::sync::Notify;

use crate::checkpoint::Checkpointer;
use crate::error::Error;
use crate::sink::{Acks, Ticket};

#[derive(Default)]
pub(super) struct Failure {
    error: OnceLock<Error>,
    notify: Notify,
}

impl Failure {
    /// Records `error` unless a failure was recorded before.
    pub fn fail(&self, error: Error) {
        if self.error.set(error).is_ok() {
            self.notify.notify_waiters();
        }
    }

    pub fn get(&self) -> Option<&Error> {
        self.error.get()
    }

    pub fn is_set(&self) -> bool {
        self.error.get().is_some()
    }

    /// Waits until a failure is recorded.
    pub async fn wait(&self) -> Error {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(e) = self.get() {
                return e.clone();
            }
            notified.await;
        }
    }
}

/// Where the sink reports: acks to the checkpoint, failures to the session.
pub(super) struct SessionAcks {
    pub checkpointer: Arc<Checkpointer>,
    pub failure: Arc<Failure>,
}

impl Acks for SessionAcks {
    fn acked(&self, ticket: Ticket) {
        self.checkpointer.ack(ticket);
    }

    fn failed(&self, error: Error) {
        self.failure.fail(error);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_first_failure_is_kept_and_wakes_a_waiter() {
        let failure = Arc::new(Failure::default());
        let waiter = tokio::spawn({
            let failure = failure.clone();
            async move { failure.wait().await }
        });
        tokio::task::yield_now().await;
        failure.fail(Error::sink("first"));
        failure.fail(Error::sink("second"));
        assert_eq!(waiter.await.unwrap().message(), "first");
        assert!(failure.is_set());
        assert_eq!(failure.wait().await.message(), "first");
    }
}
