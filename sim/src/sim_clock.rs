//! The mapping between simulated time and wall time (`--time-scale`).
//!
//! The scheduler works in simulated seconds so that the latency model reads like a real
//! GPU's; the engine loop sleeps in wall time. One place owns the conversion.

use std::time::{Duration, Instant};

/// Simulated seconds since the pod started, scaled to wall time by `scale`
/// (wall seconds per simulated second).
#[derive(Debug, Clone, Copy)]
pub struct SimClock {
    epoch: Instant,
    scale: f64,
}

impl SimClock {
    /// A clock starting now.
    pub fn new(scale: f64) -> Self {
        Self {
            epoch: Instant::now(),
            scale: if scale.is_finite() && scale > 0.0 {
                scale
            } else {
                1.0
            },
        }
    }

    /// Current simulated time.
    pub fn now(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64() / self.scale
    }

    /// The wall instant at which simulated time `t` is reached.
    pub fn instant_at(&self, t: f64) -> Instant {
        self.epoch + self.wall(t)
    }

    /// The wall duration of `t` simulated seconds.
    pub fn wall(&self, t: f64) -> Duration {
        Duration::try_from_secs_f64((t * self.scale).max(0.0)).unwrap_or(Duration::MAX / 4)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scales() {
        let c = SimClock::new(0.1);
        assert_eq!(c.wall(1.0), Duration::from_millis(100));
        assert!(c.instant_at(10.0) >= c.instant_at(1.0));
        assert_eq!(SimClock::new(0.0).wall(1.0), Duration::from_secs(1));
    }
}
