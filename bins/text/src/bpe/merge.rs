//! Byte-pair merges over one pre-token's bytes: start from a token per byte, and merge the
//! adjacent pair whose merge ranks first (the leftmost pair among equals) until no pair has a
//! merge, as the tokenizer's BPE model does.
//!
//! Most pre-tokens are a token of the vocabulary that the merges rebuild whole; those are
//! found by one lookup ([`Merges::whole`], checked when the table is built). Others are merged
//! by a scan per merge when short, and with a heap of candidate pairs when long (a run of
//! thousands of punctuation marks is one pre-token), so a pre-token of n bytes costs
//! O(n log n) at worst.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use rustc_hash::FxHashMap;

/// Up to this many bytes, a pre-token is merged by scanning its pairs.
const SCAN_BYTES: usize = 48;

/// A BPE model's merges, by token ids.
#[derive(Debug)]
pub(crate) struct Merges {
    /// The token of each byte.
    bytes: [u32; 256],
    /// (left, right) → (rank, merged token).
    pairs: FxHashMap<(u32, u32), (u32, u32)>,
    /// Pre-tokens that are one token: their bytes → the token.
    whole: FxHashMap<Box<[u8]>, u32>,
}

impl Merges {
    /// The model of `vocab` (each token's bytes and id) and `merges` (pairs of tokens' bytes,
    /// by rank). `ignore_merges`: a pre-token that is a token is that token, whatever the
    /// merges would make of it (Llama 3). `None` when a byte has no token.
    pub(crate) fn new(
        vocab: &[(Vec<u8>, u32)],
        merges: &[(Vec<u8>, Vec<u8>)],
        ignore_merges: bool,
    ) -> Option<Self> {
        let ids: FxHashMap<&[u8], u32> = vocab.iter().map(|(t, id)| (t.as_slice(), *id)).collect();
        let mut bytes = [0u32; 256];
        for (b, slot) in bytes.iter_mut().enumerate() {
            *slot = *ids.get([b as u8].as_slice())?;
        }
        let mut pairs = FxHashMap::default();
        for (rank, (a, b)) in merges.iter().enumerate() {
            let joined = [a.as_slice(), b.as_slice()].concat();
            // The tokenizer refuses a merge whose parts or result are not tokens; the first
            // rank of a pair counts.
            if let (Some(&l), Some(&r), Some(&m)) = (
                ids.get(a.as_slice()),
                ids.get(b.as_slice()),
                ids.get(joined.as_slice()),
            ) {
                pairs.entry((l, r)).or_insert((rank as u32, m));
            }
        }
        let mut model = Merges {
            bytes,
            pairs,
            whole: FxHashMap::default(),
        };
        let mut out = Vec::new();
        let whole = vocab
            .iter()
            .filter(|(token, id)| {
                ignore_merges || {
                    out.clear();
                    model.merge(token, &mut out);
                    out == [*id]
                }
            })
            .map(|(token, id)| (token.clone().into_boxed_slice(), *id))
            .collect();
        model.whole = whole;
        Some(model)
    }

    /// Appends the tokens of one pre-token.
    pub(crate) fn encode(&self, piece: &[u8], out: &mut Vec<u32>) {
        match self.whole.get(piece) {
            Some(&id) => out.push(id),
            None => self.merge(piece, out),
        }
    }

    fn rank(&self, l: u32, r: u32) -> Option<(u32, u32)> {
        self.pairs.get(&(l, r)).copied()
    }

    /// The merges applied to `piece`'s bytes.
    fn merge(&self, piece: &[u8], out: &mut Vec<u32>) {
        if piece.len() <= SCAN_BYTES {
            self.merge_scan(piece, out);
        } else {
            self.merge_heap(piece, out);
        }
    }

    /// Merges by scanning the pairs' ranks for the first-ranked after each merge; a merge
    /// looks up only the two pairs it changes.
    fn merge_scan(&self, piece: &[u8], out: &mut Vec<u32>) {
        const NO_MERGE: (u32, u32) = (u32::MAX, 0);
        let start = out.len();
        out.extend(piece.iter().map(|&b| self.bytes[usize::from(b)]));
        let rank_of = |ids: &[u32], i: usize| self.rank(ids[i], ids[i + 1]).unwrap_or(NO_MERGE);
        // The rank and merged token of each pair (symbol i and i + 1), on the stack.
        let mut slots = [NO_MERGE; SCAN_BYTES];
        let mut len = piece.len().saturating_sub(1);
        for (i, slot) in slots.iter_mut().enumerate().take(len) {
            *slot = rank_of(&out[start..], i);
        }
        loop {
            let pairs = &mut slots[..len];
            let mut best: Option<(u32, usize)> = None;
            for (i, &(rank, _)) in pairs.iter().enumerate() {
                if rank != u32::MAX && best.is_none_or(|(r, _)| rank < r) {
                    best = Some((rank, i));
                }
            }
            let Some((_, i)) = best else { return };
            out[start + i] = pairs[i].1;
            out.remove(start + i + 1);
            pairs.copy_within(i + 1.., i);
            len -= 1;
            let symbols = &out[start..];
            if i > 0 {
                slots[i - 1] = rank_of(symbols, i - 1);
            }
            if i < len {
                slots[i] = rank_of(symbols, i);
            }
        }
    }

    /// Merges with a heap of candidate pairs: (rank, left symbol), the lowest first; a symbol
    /// list linked both ways; a candidate is dropped when its pair no longer stands.
    fn merge_heap(&self, piece: &[u8], out: &mut Vec<u32>) {
        const NONE: usize = usize::MAX;
        struct Symbol {
            id: u32,
            prev: usize,
            next: usize,
            alive: bool,
        }
        let n = piece.len();
        let mut symbols: Vec<Symbol> = piece
            .iter()
            .enumerate()
            .map(|(i, &b)| Symbol {
                id: self.bytes[usize::from(b)],
                prev: if i == 0 { NONE } else { i - 1 },
                next: if i + 1 == n { NONE } else { i + 1 },
                alive: true,
            })
            .collect();
        let mut heap = BinaryHeap::new();
        for i in 0..n.saturating_sub(1) {
            if let Some((rank, merged)) = self.rank(symbols[i].id, symbols[i + 1].id) {
                heap.push(Reverse((rank, i, merged)));
            }
        }
        while let Some(Reverse((_, i, merged))) = heap.pop() {
            let next = symbols[i].next;
            if !symbols[i].alive || next == NONE {
                continue;
            }
            if self.rank(symbols[i].id, symbols[next].id).map(|(_, m)| m) != Some(merged) {
                continue;
            }
            symbols[i].id = merged;
            symbols[next].alive = false;
            let after = symbols[next].next;
            symbols[i].next = after;
            if after != NONE {
                symbols[after].prev = i;
                if let Some((rank, m)) = self.rank(merged, symbols[after].id) {
                    heap.push(Reverse((rank, i, m)));
                }
            }
            let before = symbols[i].prev;
            if before != NONE {
                if let Some((rank, m)) = self.rank(symbols[before].id, merged) {
                    heap.push(Reverse((rank, before, m)));
                }
            }
        }
        let mut i = 0;
        while i != NONE {
            out.push(symbols[i].id);
            i = symbols[i].next;
        }
    }
}
