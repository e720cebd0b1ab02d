//! Worker health as the embedder observes it: marks that steer selection and never refuse.
//!
//! The router cannot see a worker's sockets or its token stream; the embedder can. It marks a
//! worker [`Health::Unreachable`] (its connection dropped, its KV events went silent) or
//! [`Health::Wedged`] (it holds requests and a growing queue without producing a token), and
//! back [`Health::Healthy`] when that passes. A marked worker's ranks are left out of selection
//! while any other candidate for the request is healthy; when every candidate is marked, the
//! least loaded of them serves (a request is never refused for health), and the decision says
//! so. Each veto is counted by its reason.
//!
//! The mark lives in each rank's state as one byte, read with the load counters.

/// A worker's observed health.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Health {
    /// Serving normally: no mark.
    #[default]
    Healthy,
    /// The connection is lost or its events went silent.
    Unreachable,
    /// It holds requests without producing tokens.
    Wedged,
}

impl Health {
    /// The byte stored in a rank's state.
    pub(crate) fn to_u8(self) -> u8 {
        match self {
            Health::Healthy => 0,
            Health::Unreachable => 1,
            Health::Wedged => 2,
        }
    }

    /// The health a stored byte names (an unknown byte reads as healthy: never refuse).
    pub(crate) fn from_u8(x: u8) -> Self {
        match x {
            1 => Health::Unreachable,
            2 => Health::Wedged,
            _ => Health::Healthy,
        }
    }

    /// True unless marked.
    pub fn is_healthy(self) -> bool {
        self == Health::Healthy
    }
}

#[cfg(test)]
mod tests;
