//! The bounded window every sink publishes through: a count of records and a byte budget, both
//! semaphores, so that the source pauses (back-pressure) instead of memory growing while a broker
//! is slow. A record takes its [`Room`] before it is sent and gives it back when it is settled
//! (acknowledged, dead-lettered, or the session ends).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::{Error, Result};
use crate::route::Record;

#[derive(Clone)]
pub struct Window {
    count: Arc<Semaphore>,
    bytes: Arc<Semaphore>,
    max_bytes: u32,
    /// Records the window holds when nothing is in flight (1 while [`Window::narrowed`]).
    size: Arc<AtomicUsize>,
}

/// Room in a [`Window`] for one record; given back when dropped.
pub struct Room {
    count: OwnedSemaphorePermit,
    bytes: OwnedSemaphorePermit,
}

impl Window {
    /// `max_in_flight` records and `max_in_flight_bytes` bytes (capped at 4 GiB − 1).
    pub fn new(max_in_flight: usize, max_in_flight_bytes: u64) -> Window {
        let max_bytes = u32::try_from(max_in_flight_bytes).unwrap_or(u32::MAX);
        Window {
            count: Arc::new(Semaphore::new(max_in_flight)),
            bytes: Arc::new(Semaphore::new(max_bytes as usize)),
            max_bytes,
            size: Arc::new(AtomicUsize::new(max_in_flight)),
        }
    }

    /// A window of one record at a time (and `max_in_flight_bytes`), until [`Window::widen`].
    pub fn narrowed(max_in_flight_bytes: u64) -> Window {
        Window::new(1, max_in_flight_bytes)
    }

    /// Lets a [`Window::narrowed`] window hold `max_in_flight` records from now on (once).
    pub fn widen(&self, max_in_flight: usize) {
        if self
            .size
            .compare_exchange(1, max_in_flight, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            self.count.add_permits(max_in_flight.saturating_sub(1));
        }
    }

    /// Waits for room for `record`: one of the count, and its size (at least 1, at most the whole
    /// budget, so one record larger than the budget still goes, alone). Cancel-safe.
    pub async fn reserve(&self, record: &Record) -> Result<Room> {
        let closed = |_| Error::sink("publishing window closed");
        let count = self.count.clone().acquire_owned().await.map_err(closed)?;
        let cost = u32::try_from(record.size())
            .unwrap_or(u32::MAX)
            .clamp(1, self.max_bytes);
        let bytes = self
            .bytes
            .clone()
            .acquire_many_owned(cost)
            .await
            .map_err(closed)?;
        Ok(Room { count, bytes })
    }

    /// Nothing is in flight.
    pub fn idle(&self) -> bool {
        self.count.available_permits() >= self.size.load(Ordering::SeqCst)
    }

    /// Gives back the room of one record sent with [`Room::forget`] (`cost` is what that returned).
    pub fn give_back(&self, cost: u32) {
        self.bytes.add_permits(cost as usize);
        self.count.add_permits(1);
    }
}

impl Room {
    /// Keeps the room taken after the permits are dropped, and returns its cost; the caller gives
    /// it back with [`Window::give_back`] (Kafka's delivery report, on librdkafka's thread, carries
    /// only the cost).
    pub fn forget(self) -> u32 {
        let cost = self.bytes.num_permits() as u32;
        self.count.forget();
        self.bytes.forget();
        cost
    }
}

#[cfg(test)]
mod tests {
    use super::Window;

    #[test]
    fn a_narrowed_window_holds_one_record_until_it_is_widened_once() {
        let window = Window::narrowed(1 << 20);
        assert_eq!(window.count.available_permits(), 1);
        assert!(window.idle());
        window.widen(5);
        assert_eq!(window.count.available_permits(), 5);
        assert!(window.idle());
        window.widen(9);
        assert_eq!(window.count.available_permits(), 5, "only once");
        let full = Window::new(3, 1 << 20);
        full.widen(8);
        assert_eq!(full.count.available_permits(), 3, "a full window stays");
    }
}
