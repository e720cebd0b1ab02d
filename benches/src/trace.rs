//! Mooncake-format traces: rows of remapped 512-token block ids turned into prompts.
//!
//! A row's `hash_ids` name its prompt's 512-token blocks; two rows sharing their first k ids
//! share their first k * 512 tokens. Each id expands into 512 pseudo-tokens derived from (id,
//! position in the block), and the last block is cut so the prompt has `input_length` tokens
//! (format: `shared/traces/README.md`).
//!
//! Hashing is per id, not per row. A block size B that divides 512 cuts every id's tokens into
//! the same 512 / B blocks wherever the id appears, and a block's local hash depends on its
//! tokens alone, so [`TraceExpander`] hashes each id's 512 tokens once and a row's local hashes
//! are the concatenation of its ids' cached hashes, cut to the row's full blocks. The test below
//! checks this against hashing the fully expanded prompt.

use std::collections::HashMap;

use kvroute_core::LocalHash;

pub use kvroute_sim::workload::{
    block_tokens, read_trace, TraceError, TraceRow, TRACE_BLOCK_TOKENS,
};

use crate::workload::{hash_prompt, OpStream, SimConfig, Simulator};

/// The block size does not divide the trace's 512-token blocks.
#[derive(Debug, thiserror::Error)]
#[error("block size {block_size} does not divide the trace's 512-token blocks")]
pub struct BlockSizeError {
    /// The block size asked for.
    pub block_size: usize,
}

/// Turns trace rows into local hashes, hashing each block id's tokens once.
#[derive(Debug)]
pub struct TraceExpander {
    block_size: usize,
    /// Local hashes per trace block id.
    per_id: usize,
    /// Where an id's `per_id` hashes start in `hashes`.
    offsets: HashMap<u64, usize>,
    hashes: Vec<LocalHash>,
}

impl TraceExpander {
    pub fn new(block_size: usize) -> Result<Self, BlockSizeError> {
        if block_size == 0 || !TRACE_BLOCK_TOKENS.is_multiple_of(block_size) {
            return Err(BlockSizeError { block_size });
        }
        Ok(TraceExpander {
            block_size,
            per_id: TRACE_BLOCK_TOKENS / block_size,
            offsets: HashMap::new(),
            hashes: Vec::new(),
        })
    }

    /// Local hashes of the row's full blocks.
    pub fn local_hashes(&mut self, row: &TraceRow) -> Vec<LocalHash> {
        let full_blocks = row.input_length / self.block_size;
        let mut out = Vec::with_capacity(full_blocks);
        for &id in &row.hash_ids {
            let left = full_blocks - out.len();
            if left == 0 {
                break;
            }
            let start = self.offset_of(id);
            out.extend_from_slice(&self.hashes[start..start + self.per_id.min(left)]);
        }
        out
    }

    fn offset_of(&mut self, id: u64) -> usize {
        if let Some(&start) = self.offsets.get(&id) {
            return start;
        }
        let tokens: Vec<u32> = block_tokens(id).collect();
        let start = self.hashes.len();
        self.hashes.extend(hash_prompt(&tokens, self.block_size));
        self.offsets.insert(id, start);
        start
    }
}

/// Simulate a trace on a fleet.
pub fn trace_stream(
    rows: &[TraceRow],
    sim: SimConfig,
    block_size: usize,
) -> Result<OpStream, BlockSizeError> {
    let mut expander = TraceExpander::new(block_size)?;
    let mut simulator = Simulator::new(sim);
    for row in rows {
        simulator.request(row.input_length, expander.local_hashes(row));
    }
    Ok(simulator.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_expansion_equals_full_hashing() {
        let rows = [
            TraceRow {
                timestamp: 0,
                output_length: 0,
                input_length: 1_300,
                hash_ids: vec![0, 1, 2],
            },
            TraceRow {
                timestamp: 0,
                output_length: 0,
                input_length: 1_024,
                hash_ids: vec![0, 1],
            },
            TraceRow {
                timestamp: 0,
                output_length: 0,
                input_length: 700,
                hash_ids: vec![0, 5],
            },
            TraceRow {
                timestamp: 0,
                output_length: 0,
                input_length: 40,
                hash_ids: vec![9],
            },
        ];
        for block_size in [16, 64, 512] {
            let mut expander = TraceExpander::new(block_size).unwrap();
            for row in &rows {
                assert_eq!(
                    expander.local_hashes(row),
                    hash_prompt(&row.tokens(), block_size),
                    "block size {block_size}, row {row:?}"
                );
            }
        }
        assert!(TraceExpander::new(48).is_err());
    }

    #[test]
    fn shared_ids_share_blocks() {
        let mut expander = TraceExpander::new(64).unwrap();
        let a = expander.local_hashes(&TraceRow {
            timestamp: 0,
            output_length: 0,
            input_length: 1_024,
            hash_ids: vec![0, 1],
        });
        let b = expander.local_hashes(&TraceRow {
            timestamp: 0,
            output_length: 0,
            input_length: 1_024,
            hash_ids: vec![0, 2],
        });
        assert_eq!(a[..8], b[..8]);
        assert_ne!(a[8..], b[8..]);
    }
}
