//! How long handing a prompt's KV cache from a prefill engine to a decode engine takes: the
//! blocks' bytes, from the model's shape, over the link between them, plus the link's latency.

use std::time::Duration;

/// The KV cache's shape and the link it crosses.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvTransfer {
    /// The model's layers.
    pub layers: u32,
    /// Its key-value heads (grouped-query attention: fewer than its attention heads).
    pub kv_heads: u32,
    /// Dimensions per head.
    pub head_dim: u32,
    /// Bytes per value (2 for BF16, 1 for FP8).
    pub dtype_bytes: u32,
    /// The link's bandwidth, in gigabytes (10⁹ bytes) per second.
    pub link_gbytes_per_s: f64,
    /// Fixed cost of one transfer (the connector's handshake and its first round trip).
    pub latency: Duration,
}

impl Default for KvTransfer {
    /// Llama-3.1-8B in BF16 (131,072 bytes a token, `shared/sim-calibration.md`) over a
    /// 400 Gb/s RDMA NIC (50 GB/s), 1 ms a transfer.
    fn default() -> Self {
        KvTransfer {
            layers: 32,
            kv_heads: 8,
            head_dim: 128,
            dtype_bytes: 2,
            link_gbytes_per_s: 50.0,
            latency: Duration::from_millis(1),
        }
    }
}

impl KvTransfer {
    /// Why this transfer cannot be modelled: a link that is not a positive bandwidth, or a
    /// cache shape of no bytes.
    pub fn check(&self) -> Result<(), &'static str> {
        if !(self.link_gbytes_per_s.is_finite() && self.link_gbytes_per_s > 0.0) {
            return Err("the KV link's bandwidth must be a positive number");
        }
        if self.bytes_per_token() == 0 {
            return Err(
                "the KV cache's layers, heads, head size and dtype bytes must be at least 1",
            );
        }
        Ok(())
    }

    /// Bytes of KV cache per token: keys and values of every layer's heads.
    pub fn bytes_per_token(&self) -> u64 {
        2 * u64::from(self.layers)
            * u64::from(self.kv_heads)
            * u64::from(self.head_dim)
            * u64::from(self.dtype_bytes)
    }

    /// How long handing over the KV of `tokens` tokens takes (the latency alone for none; a
    /// link of no bandwidth never ends, capped at an hour).
    pub fn duration(&self, tokens: u64) -> Duration {
        let bytes = (tokens * self.bytes_per_token()) as f64;
        let rate = self.link_gbytes_per_s * 1e9;
        let seconds = if rate > 0.0 { bytes / rate } else { 3_600.0 };
        self.latency + Duration::from_secs_f64(seconds.min(3_600.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_8b_model_moves_128_kib_a_token() {
        let t = KvTransfer::default();
        assert_eq!(t.bytes_per_token(), 131_072);
        // 4,096 tokens: 512 MiB at 50 GB/s, 10.7 ms, plus 1 ms.
        let d = t.duration(4_096);
        assert!((d.as_secs_f64() - 0.011_737).abs() < 1e-5, "{d:?}");
        assert_eq!(t.duration(0), t.latency);
        let stuck = KvTransfer {
            link_gbytes_per_s: 0.0,
            ..t
        };
        assert_eq!(stuck.duration(1), t.latency + Duration::from_secs(3_600));
    }
}
