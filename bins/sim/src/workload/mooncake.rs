//! Mooncake-format traces: one JSON object per line, each naming its prompt's 512-token
//! blocks by remapped id (format: the trace's README; two rows sharing their first k ids share
//! their first k × 512 tokens).
//!
//! Each id expands into 512 pseudo-tokens derived from (id, position in the block), and the
//! last block is cut so the prompt has `input_length` tokens. Any block size dividing 512 then
//! sees the trace's sharing structure.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::tokens::pseudo_token;

/// Tokens behind one trace block id.
pub const TRACE_BLOCK_TOKENS: usize = 512;

/// Content stream of [`pseudo_token`] for trace blocks.
const STREAM_TRACE: u64 = 4;

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be opened or read.
    #[error("cannot read trace {path}: {source}")]
    Io {
        /// The trace.
        path: PathBuf,
        /// The reader's error.
        source: std::io::Error,
    },
    /// A line is not a trace row.
    #[error("{path}:{line}: not a trace row: {source}")]
    Parse {
        /// The trace.
        path: PathBuf,
        /// The line, from 1.
        line: usize,
        /// The parser's error.
        source: serde_json::Error,
    },
    /// A row's prompt is longer than its blocks, or empty.
    #[error("{path}:{line}: input_length {input_length} does not fit {ids} blocks of 512 tokens")]
    Length {
        /// The trace.
        path: PathBuf,
        /// The line, from 1.
        line: usize,
        /// The row's prompt length.
        input_length: usize,
        /// The row's block ids.
        ids: usize,
    },
}

/// One request of the trace (other fields of the row are ignored).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct TraceRow {
    /// Arrival, in milliseconds from the trace's start (0 when absent).
    #[serde(default)]
    pub timestamp: u64,
    /// Prompt length in tokens.
    pub input_length: usize,
    /// Tokens generated (0 when absent).
    #[serde(default)]
    pub output_length: usize,
    /// Remapped ids of the prompt's 512-token blocks, the last possibly partial.
    pub hash_ids: Vec<u64>,
}

impl TraceRow {
    /// The prompt's tokens, fully expanded.
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

/// Reads the first `limit` rows (all when `None`) of a JSON-lines trace; blank lines are
/// skipped.
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
        if row.input_length == 0 || row.input_length > row.hash_ids.len() * TRACE_BLOCK_TOKENS {
            return Err(TraceError::Length {
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
