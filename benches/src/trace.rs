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
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use kvroute_core::LocalHash;
use serde::Deserialize;

use crate::workload::{hash_prompt, pseudo_token, OpStream, SimConfig, Simulator};

/// Tokens behind one trace block id.
pub const TRACE_BLOCK_TOKENS: usize = 512;

/// Content stream of [`pseudo_token`] for trace blocks.
const STREAM_TRACE: u64 = 4;

/// Why a trace could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("cannot read trace {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}:{line}: not a trace row: {source}")]
    Parse {
        path: PathBuf,
        line: usize,
        source: serde_json::Error,
    },
    #[error("{path}:{line}: input_length {input_length} exceeds {ids} blocks of 512 tokens")]
    TooLong {
        path: PathBuf,
        line: usize,
        input_length: usize,
        ids: usize,
    },
    #[error("block size {block_size} does not divide the trace's 512-token blocks")]
    BlockSize { block_size: usize },
}

/// One request of the trace (other fields of the row are ignored).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct TraceRow {
    /// Prompt length in tokens.
    pub input_length: usize,
    /// Remapped ids of the prompt's 512-token blocks, the last possibly partial.
    pub hash_ids: Vec<u64>,
}

impl TraceRow {
    /// The prompt's tokens, fully expanded (what [`TraceExpander`] avoids doing).
    pub fn tokens(&self) -> Vec<u32> {
        self.hash_ids
            .iter()
            .flat_map(|&id| block_tokens(id))
            .take(self.input_length)
            .collect()
    }
}

/// The 512 pseudo-tokens of trace block `id`.
pub fn block_tokens(id: u64) -> impl Iterator<Item = u32> {
    (0..TRACE_BLOCK_TOKENS as u64).map(move |position| pseudo_token(STREAM_TRACE, id, position))
}

/// Read the first `limit` rows (all when `None`) of a JSON-lines trace.
pub fn read_trace(path: &Path, limit: Option<usize>) -> Result<Vec<TraceRow>, TraceError> {
    let io = |source| TraceError::Io {
        path: path.to_owned(),
        source,
    };
    let reader = BufReader::new(File::open(path).map_err(io)?);
    let mut rows = Vec::new();
    for (index, line) in reader.lines().enumerate() {
        if limit.is_some_and(|limit| rows.len() >= limit) {
            break;
        }
        let line = line.map_err(io)?;
        if line.trim().is_empty() {
            continue;
        }
        let row: TraceRow = serde_json::from_str(&line).map_err(|source| TraceError::Parse {
            path: path.to_owned(),
            line: index + 1,
            source,
        })?;
        if row.input_length > row.hash_ids.len() * TRACE_BLOCK_TOKENS {
            return Err(TraceError::TooLong {
                path: path.to_owned(),
                line: index + 1,
                input_length: row.input_length,
                ids: row.hash_ids.len(),
            });
        }
        rows.push(row);
    }
    Ok(rows)
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
    pub fn new(block_size: usize) -> Result<Self, TraceError> {
        if block_size == 0 || TRACE_BLOCK_TOKENS % block_size != 0 {
            return Err(TraceError::BlockSize { block_size });
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
) -> Result<OpStream, TraceError> {
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
                input_length: 1_300,
                hash_ids: vec![0, 1, 2],
            },
            TraceRow {
                input_length: 1_024,
                hash_ids: vec![0, 1],
            },
            TraceRow {
                input_length: 700,
                hash_ids: vec![0, 5],
            },
            TraceRow {
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
            input_length: 1_024,
            hash_ids: vec![0, 1],
        });
        let b = expander.local_hashes(&TraceRow {
            input_length: 1_024,
            hash_ids: vec![0, 2],
        });
        assert_eq!(a[..8], b[..8]);
        assert_ne!(a[8..], b[8..]);
    }
}
