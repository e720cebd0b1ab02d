//! One shard of the index: the runs whose chains start with a block that hashes to this shard,
//! the child table that links them, and the single writer's bookkeeping.
//!
//! The writer changes runs inside a transaction per event: the first change to a run copies it
//! into a working buffer, and `commit` publishes every changed run once, then the new links,
//! then removes dead links and frees dead slots. Readers therefore never find a link to a run
//! that is not yet published, and a run is copied once per event however many of its blocks
//! the event touches.
//!
//! `commit.rs` publishes a transaction; `evict.rs` keeps the runs' use order and evicts
//! under a memory budget; `tests.rs` holds the unit tests.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;

use super::mix::{self, set_bytes, MixState};
use super::run::{find_group, holders_of, run_bytes, Run, RunBuf, RUN_CAP};
use super::slots::{Slots, NO_NEXT};
use super::table::{ChildKey, ChildTable, ChildTableWriter, ROOT};
use super::uses::UseMarks;
use crate::event::StoredBlock;

mod commit;
mod evict;

/// Commits between hand-overs of retired runs to the epoch collector.
const FLUSH_EVERY: u32 = 8;

/// Working copies kept for reuse, at most.
const SPARE_BUFS: usize = 16;

/// What readers share.
pub(crate) struct ShardShared {
    pub slots: Slots,
    pub children: ChildTable,
    /// Under a memory budget only: when a match last read each run.
    pub used: Option<UseMarks>,
}

/// A position: a block of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Pos {
    pub slot: u32,
    pub off: u8,
}

/// A stretch of a stored chain placed in one run: offsets `first..first + n` of run `slot`,
/// and the bits of those the holder already held.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Placed {
    pub slot: u32,
    pub first: u8,
    pub n: u8,
    pub held: u64,
    /// The bits of those whose names differ in their high half from the name the block is
    /// kept under (another rank stored it first, under another name).
    pub side: u64,
}

const CLEAN: u32 = u32::MAX;

/// Slots per segment of high halves (16 KiB).
const HIGH_SLOTS: usize = 64;

/// The high halves of [`HIGH_SLOTS`] slots' blocks.
type HighSegment = [u32; HIGH_SLOTS * RUN_CAP];

/// Run slots a shard can have: positions pack the slot into 22 bits.
pub(crate) const MAX_SLOTS: u32 = 1 << 22;

/// Writer-only facts about a live run: 24 bytes, so that the ones an event touches share few
/// cache lines. What only a memory budget needs lives beside them (`ShardWriter::ehs`,
/// `ShardWriter::touches`).
#[derive(Debug)]
struct SlotMeta {
    /// Offsets that have children (bit = offset); the children beyond the first at an offset
    /// are counted in `ShardWriter::more_children`.
    child_mask: u64,
    /// Index of the run's working copy in the transaction, or `CLEAN`.
    dirty: u32,
    live: bool,
    /// Queued in `prune_pending`.
    prune_queued: bool,
    /// Some rank named a block of this run other than it was first stored under.
    renamed: bool,
    /// The parent run's slot, or `ROOT`.
    parent: u32,
    /// Words of the run's published array, length word included (saturated; 0 for none).
    words: u16,
}

impl Default for SlotMeta {
    fn default() -> Self {
        SlotMeta {
            child_mask: 0,
            dirty: CLEAN,
            live: false,
            prune_queued: false,
            renamed: false,
            parent: ROOT,
            words: 0,
        }
    }
}

impl SlotMeta {
    #[inline]
    fn has_children(&self, off: u8) -> bool {
        self.child_mask & (1u64 << off) != 0
    }
}

/// One (rank, tier) hold dropped by eviction.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DroppedHold {
    pub shard: usize,
    pub pos: Pos,
    pub rank: u32,
    pub tier: u8,
    /// The name the block was first stored under.
    pub eh: u64,
    /// Whether some rank named a block of its run otherwise.
    pub renamed: bool,
}

pub(crate) struct ShardWriter {
    index: usize,
    pub shared: Arc<ShardShared>,
    table: ChildTableWriter,
    metas: Vec<SlotMeta>,
    free: Vec<u32>,
    /// Bytes of published runs.
    run_bytes: usize,
    /// Blocks in the structure (live runs' lengths).
    positions: usize,
    live_runs: usize,
    lru: Option<BinaryHeap<Reverse<(u64, u32)>>>,
    /// Per slot, under a memory budget only: the engine hash each block was first stored under
    /// (eviction uses it to forget the evicted block's names).
    ehs: Vec<Vec<u64>>,
    /// Per slot, under a memory budget only: the last event that stored into the run.
    touches: Vec<u64>,
    /// Heap bytes of `ehs`'s vectors.
    ehs_heap: usize,
    /// Per position, in segments of [`HIGH_SLOTS`] slots: the high half of the name the block
    /// was stored under while no rank held it, which every rank's name map checks its entries
    /// against ([`super::names::HighHalves`]). Segments, so that growing never copies them.
    highs: Vec<Box<HighSegment>>,
    /// (slot, offset) -> children beyond the first at that offset.
    more_children: HashMap<(u32, u8), u32, MixState>,
    // Transaction state.
    dirty: Vec<(u32, RunBuf)>,
    /// Working copies of earlier transactions, for the next ones: a run copied for an event
    /// reuses their vectors instead of allocating.
    spare: Vec<RunBuf>,
    /// Heap bytes of `spare`.
    spare_bytes: usize,
    /// Commits since the retired runs were last handed to the collector.
    unflushed: u32,
    new_links: Vec<(ChildKey, u32)>,
    /// Slots published by the commit under way.
    fresh: Vec<u32>,
    dead_links: Vec<ChildKey>,
    dead_slots: Vec<u32>,
    /// Runs that lost holds in this transaction.
    prune_pending: Vec<u32>,
}

impl ShardWriter {
    pub(crate) fn new(index: usize, track_lru: bool) -> Self {
        let shared = Arc::new(ShardShared {
            slots: Slots::new(),
            children: ChildTable::new(),
            used: track_lru.then(UseMarks::new),
        });
        ShardWriter {
            index,
            table: ChildTableWriter::new(&shared.children),
            shared,
            metas: Vec::new(),
            free: Vec::new(),
            run_bytes: 0,
            positions: 0,
            live_runs: 0,
            lru: track_lru.then(BinaryHeap::new),
            ehs: Vec::new(),
            touches: Vec::new(),
            ehs_heap: 0,
            highs: Vec::new(),
            more_children: HashMap::default(),
            dirty: Vec::new(),
            spare: Vec::new(),
            spare_bytes: 0,
            unflushed: 0,
            new_links: Vec::new(),
            fresh: Vec::new(),
            dead_links: Vec::new(),
            dead_slots: Vec::new(),
            prune_pending: Vec::new(),
        }
    }

    pub(crate) fn positions(&self) -> usize {
        self.positions
    }

    pub(crate) fn runs(&self) -> usize {
        self.live_runs
    }

    /// Heap bytes of everything this shard owns.
    pub(crate) fn bytes(&self) -> usize {
        let metas = self.metas.capacity() * std::mem::size_of::<SlotMeta>()
            + self.ehs.capacity() * std::mem::size_of::<Vec<u64>>()
            + self.touches.capacity() * std::mem::size_of::<u64>()
            + self.ehs_heap
            + self.highs.capacity() * std::mem::size_of::<Box<HighSegment>>()
            + self.highs.len() * std::mem::size_of::<HighSegment>()
            + set_bytes::<((u32, u8), u32)>(self.more_children.capacity());
        let lru = self.lru.as_ref().map_or(0, |h| {
            h.capacity() * std::mem::size_of::<Reverse<(u64, u32)>>()
        });
        let used = self.shared.used.as_ref().map_or(0, UseMarks::bytes);
        self.run_bytes
            + self.shared.slots.bytes()
            + used
            + self.table.bytes()
            + metas
            + lru
            + self.free.capacity() * 4
            + self.new_links.capacity() * std::mem::size_of::<(ChildKey, u32)>()
            + (self.dead_links.capacity() * std::mem::size_of::<ChildKey>())
            + self.dead_slots.capacity() * 4
            + self.spare_bytes
            + self.spare.capacity() * std::mem::size_of::<RunBuf>()
    }

    /// Changes the first-stored names of a slot (kept under a budget), keeping the byte count.
    fn ehs_mut<R>(&mut self, slot: u32, f: impl FnOnce(&mut Vec<u64>) -> R) -> R {
        let ehs = &mut self.ehs[slot as usize];
        let before = ehs.capacity();
        let r = f(ehs);
        self.ehs_heap = self.ehs_heap + ehs.capacity() * 8 - before * 8;
        r
    }

    /// Makes room for the high halves of slots up to the last one allocated.
    #[allow(
        clippy::expect_used,
        reason = "a vector of a segment's length converts to a segment"
    )]
    fn grow_highs(&mut self) {
        if self.highs.len() * HIGH_SLOTS < self.metas.len() {
            let segment: Box<HighSegment> = vec![0; HIGH_SLOTS * RUN_CAP]
                .into_boxed_slice()
                .try_into()
                .expect("a segment's length");
            self.highs.push(segment);
        }
    }

    #[inline]
    fn highs_of_mut(&mut self, slot: u32) -> &mut [u32] {
        let (seg, at) = (slot as usize / HIGH_SLOTS, slot as usize % HIGH_SLOTS);
        &mut self.highs[seg][at * RUN_CAP..(at + 1) * RUN_CAP]
    }

    /// The high half kept for the block at `pos`.
    #[inline]
    pub(crate) fn high(&self, pos: Pos) -> u32 {
        let slot = pos.slot as usize;
        // In bounds by construction: the offset is below 64 = RUN_CAP.
        self.highs[slot / HIGH_SLOTS][slot % HIGH_SLOTS * RUN_CAP + (pos.off as usize & 63)]
    }

    /// Keeps the high halves of the names of a stretch stored at offsets `first..` of `slot`
    /// as `blocks` (`created`: blocks new to the run). Returns the stretch's blocks whose
    /// names go to the side map: the blocks some rank holds under a name with another high
    /// half. A block no rank holds takes the new name's half (no name refers to it).
    fn keep_highs(
        &mut self,
        slot: u32,
        first: usize,
        blocks: &[StoredBlock],
        created: bool,
    ) -> u64 {
        let half = |b: &StoredBlock| (b.block_hash.0 >> 32) as u32;
        let highs = &mut self.highs_of_mut(slot)[first..first + blocks.len()];
        if created {
            for (h, b) in highs.iter_mut().zip(blocks) {
                *h = half(b);
            }
            return 0;
        }
        let mut differs = 0u64;
        for (k, (h, b)) in highs.iter().zip(blocks).enumerate() {
            differs |= ((*h != half(b)) as u64) << k;
        }
        let differs = differs << first;
        if differs == 0 {
            return 0;
        }
        // Rare: another name for blocks already in the run.
        let held = self.run_mut(slot).held_mask();
        let highs = &mut self.highs_of_mut(slot)[first..first + blocks.len()];
        for (k, (h, b)) in highs.iter_mut().zip(blocks).enumerate() {
            if (differs & !held) >> (first + k) & 1 != 0 {
                *h = half(b);
            }
        }
        differs & held
    }

    /// Counts a child of `slot` at offset `off`.
    fn add_child(&mut self, slot: u32, off: u8) {
        let meta = &mut self.metas[slot as usize];
        if meta.has_children(off) {
            *self.more_children.entry((slot, off)).or_insert(0) += 1;
        } else {
            meta.child_mask |= 1u64 << off;
        }
    }

    /// Forgets a child of `slot` at offset `off`.
    fn remove_child(&mut self, slot: u32, off: u8) {
        match self.more_children.get_mut(&(slot, off)) {
            Some(n) if *n > 1 => *n -= 1,
            Some(_) => {
                self.more_children.remove(&(slot, off));
            }
            None => self.metas[slot as usize].child_mask &= !(1u64 << off),
        }
    }

    // ---- reading the writer's current view (working copies first) ----

    fn with_run<R>(&self, slot: u32, f: impl FnOnce(u32, u8, &[u64]) -> R) -> Option<R> {
        let meta = self.metas.get(slot as usize)?;
        if meta.dirty != CLEAN {
            let b = &self.dirty[meta.dirty as usize].1;
            return Some(f(b.parent, b.parent_off, &b.hashes));
        }
        let run = self.published(slot)?;
        Some(f(run.parent, run.parent_off, run.hashes))
    }

    /// The run readers see in `slot`.
    #[allow(unsafe_code)]
    fn published(&self, slot: u32) -> Option<Run<'_>> {
        // SAFETY: this is the shard's single writer, and only `commit`, which takes `&mut self`
        // (so no run returned here is alive), publishes into the slots or clears them.
        let words = unsafe { self.shared.slots.current(slot) }?;
        Run::parse(words)
    }

    /// Checks what walks rely on beyond the runs themselves: every live run is its link's
    /// child in the table, every table entry names its slot's current array, and every run
    /// with a child has a hint. A description of the first thing wrong, if any.
    pub(crate) fn check_links(&self) -> Result<(), String> {
        let slots = &self.shared.slots;
        for (key, slot, address) in self.table.entries() {
            if address != slots.address(slot) {
                return Err(format!("entry {key:?} names slot {slot} but not its array"));
            }
            if key.parent != ROOT && slots.hints(key.parent).0 == NO_NEXT {
                return Err(format!("slot {} has child {slot} but no hint", key.parent));
            }
        }
        for (slot, meta) in self.metas.iter().enumerate() {
            let slot = slot as u32;
            let Some(run) = self.published(slot).filter(|_| meta.live) else {
                continue;
            };
            let key = ChildKey {
                parent: run.parent,
                off: run.parent_off,
                hash: run.hashes.first().copied().unwrap_or_default(),
            };
            if self.table.get(key) != Some(slot) {
                return Err(format!(
                    "run in slot {slot} is not its link {key:?}'s child"
                ));
            }
            if meta.parent != run.parent {
                return Err(format!("slot {slot}'s facts name another parent"));
            }
            // The size a removal fetches the run by (see `prefetch_parent`).
            let words = run_bytes(run.words()) / std::mem::size_of::<u64>();
            if usize::from(meta.words) != words.min(usize::from(u16::MAX)) {
                return Err(format!("slot {slot}'s facts give its array another size"));
            }
            // The word two runs ahead names the array of the slot the second hint names: none
            // without one, and the current one when that slot's run is this run's grandchild.
            let ahead = slots.ahead(slot);
            match slots.hints(slot).1 {
                NO_NEXT if ahead != 0 => {
                    return Err(format!("slot {slot} has no second hint but an array ahead"));
                }
                NO_NEXT => {}
                n2 => {
                    let grandchild = self.metas.get(n2 as usize).is_some_and(|m| {
                        m.live && m.parent != ROOT && self.metas[m.parent as usize].parent == slot
                    });
                    if grandchild && ahead != slots.address(n2) {
                        return Err(format!(
                            "slot {slot}'s array ahead is not its grandchild {n2}'s"
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    fn run_mut(&mut self, slot: u32) -> &mut RunBuf {
        let mut dirty = self.metas[slot as usize].dirty;
        if dirty == CLEAN {
            let mut buf = self.spare.pop().unwrap_or_default();
            self.spare_bytes -= buf.heap_bytes();
            match self.published(slot) {
                Some(run) => buf.copy_run(run),
                None => buf.reset(ROOT),
            }
            dirty = self.dirty.len() as u32;
            self.metas[slot as usize].dirty = dirty;
            self.dirty.push((slot, buf));
        }
        &mut self.dirty[dirty as usize].1
    }

    fn link(&self, key: ChildKey) -> Option<u32> {
        self.new_links
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, s)| *s)
            .or_else(|| self.table.get(key))
    }

    /// Whether `rank` has any holder entry in the run, in the writer's current view.
    fn run_has_rank(&self, slot: u32, rank: u32) -> bool {
        let meta = &self.metas[slot as usize];
        if meta.dirty != CLEAN {
            return self.dirty[meta.dirty as usize].1.has_rank(rank);
        }
        self.published(slot)
            .is_some_and(|r| holders_of(r.holders).any(|h| h.rank == rank))
    }

    /// Lines of a parent's array [`ShardWriter::prefetch_parent`] fetches at most: the header,
    /// 64 hashes and 30 holders.
    const PARENT_LINES: usize = 16;

    /// Hints the CPU to fetch what a removal reads and copies when it reaches the parent of
    /// run `slot`: the parent's high halves and its published array, whole (up to
    /// [`ShardWriter::PARENT_LINES`]). Engines evict a
    /// chain from its tail, so a Removed event that leaves a run mostly goes on in its parent
    /// (7 in 10 of the trace's moves from one run to another within an event): fetched when
    /// the event reaches the run, the parent's lines arrive while the run's blocks are
    /// cleared, instead of the event waiting there on three dependent misses (a high half,
    /// then the slot's array, then the holders past the hashes). Its up to 20 lines go to
    /// the second-level cache, where they take none of the few first-level miss buffers the
    /// removal's name lookups wait in.
    #[inline]
    pub(crate) fn prefetch_parent(&self, slot: u32) {
        let Some(parent) = self.metas.get(slot as usize).map(|m| m.parent) else {
            return;
        };
        let Some(meta) = self.metas.get(parent as usize).filter(|m| m.live) else {
            return; // the root, or a run freed in this transaction
        };
        if let Some(first) = self.highs_ptr(parent) {
            for line in 0..RUN_CAP / 16 {
                mix::prefetch_addr_l2(first.wrapping_add(16 * line));
            }
        }
        // A run changed in this transaction is read from its working copy instead. A run
        // held by a great many ranks is fetched in part.
        if meta.dirty == CLEAN {
            let address = self.shared.slots.address(parent) as usize;
            let bytes =
                (meta.words as usize * std::mem::size_of::<u64>()).min(Self::PARENT_LINES * 64);
            if address != 0 && bytes != 0 {
                let mut at = address & !63;
                while at < address + bytes {
                    mix::prefetch_addr_l2(at as *const u8);
                    at += 64;
                }
            }
        }
    }

    /// Hints the CPU to fetch the high halves kept for the blocks of `pos`'s run below
    /// `pos`: a Removed event that reaches a run at `pos` mostly goes on down its offsets
    /// (engines evict a chain from its tail), checking each name against the high half kept
    /// for it.
    #[inline]
    pub(crate) fn prefetch_highs_below(&self, pos: Pos) {
        if let Some(first) = self.highs_ptr(pos.slot) {
            // Sixteen high halves to a line; the line of `pos` itself is being read.
            for line in 0..(pos.off as usize & 63) / 16 {
                mix::prefetch_addr(first.wrapping_add(16 * line));
            }
        }
    }

    /// Where the high halves of slot `slot`'s blocks start, for fetching them.
    #[inline]
    fn highs_ptr(&self, slot: u32) -> Option<*const u32> {
        let p = slot as usize;
        let seg = self.highs.get(p / HIGH_SLOTS)?;
        Some(seg[p % HIGH_SLOTS * RUN_CAP..].as_ptr())
    }

    /// (rank, tier)'s mask of run `slot` and the union of the rank's masks in its other tiers,
    /// in the writer's current view (nothing for a run that is not live).
    pub(crate) fn rank_masks(&self, slot: u32, rank: u32, tier: u8) -> (u64, u64) {
        let Some(meta) = self.metas.get(slot as usize).filter(|m| m.live) else {
            return (0, 0);
        };
        let split = |(held, elsewhere): (u64, u64), h: super::run::Holder| match h.tier == tier {
            true => (held | h.mask, elsewhere),
            false => (held, elsewhere | h.mask),
        };
        if meta.dirty != CLEAN {
            let holders = &self.dirty[meta.dirty as usize].1.holders;
            let from = holders.partition_point(|h| h.rank < rank);
            return holders[from..]
                .iter()
                .take_while(|h| h.rank == rank)
                .copied()
                .fold((0, 0), split);
        }
        let Some(run) = self.published(slot) else {
            return (0, 0);
        };
        match find_group(run.holders, rank) {
            Some((start, end, _)) => {
                holders_of(&run.holders[2 * start..2 * end]).fold((0, 0), split)
            }
            None => (0, 0),
        }
    }

    /// Whether (rank, tier) holds `pos` in the writer's current view (any tier when `None`).
    pub(crate) fn holds(&self, pos: Pos, rank: u32, tier: Option<u8>) -> bool {
        let bit = 1u64 << pos.off;
        let test = |h: &super::run::Holder| {
            h.rank == rank && tier.is_none_or(|t| t == h.tier) && h.mask & bit != 0
        };
        let Some(meta) = self.metas.get(pos.slot as usize).filter(|m| m.live) else {
            return false;
        };
        if meta.dirty != CLEAN {
            return self.dirty[meta.dirty as usize].1.holders.iter().any(test);
        }
        self.published(pos.slot)
            .is_some_and(|r| holders_of(r.holders).any(|h| test(&h)))
    }

    // ---- building chains ----

    /// Whether `runs` more runs can be allocated.
    pub(crate) fn has_room_for(&self, runs: usize) -> bool {
        self.free.len() + (MAX_SLOTS as usize - self.metas.len()) >= runs
    }

    fn alloc_slot(&mut self) -> u32 {
        let slot = self.free.pop().unwrap_or_else(|| {
            let s = self.metas.len() as u32;
            self.metas.push(SlotMeta::default());
            self.grow_highs();
            if self.lru.is_some() {
                self.ehs.push(Vec::new());
                self.touches.push(0);
            }
            s
        });
        self.shared.slots.reserve(slot);
        if let Some(used) = &self.shared.used {
            used.reset(slot);
        }
        let meta = &mut self.metas[slot as usize];
        meta.live = true;
        meta.renamed = false;
        meta.child_mask = 0;
        if self.lru.is_some() {
            self.ehs_mut(slot, |e| e.clear());
        }
        self.live_runs += 1;
        slot
    }

    /// Stores a chain for (rank, tier) after `start` (the root when `None`). Each block is found
    /// where the chain already has it, or created: appended to a run that ends there and has
    /// room, else in a new child run. Pushes each stretch of the chain that went into one run,
    /// and the blocks of it (rank, tier) already held, to `placed`.
    ///
    /// The work is per stretch of a run, not per block: the hashes a run already has are
    /// compared in one loop, new ones are appended in one copy, and the hold of each stretch is
    /// one mask update.
    pub(crate) fn store(
        &mut self,
        start: Option<Pos>,
        blocks: &[StoredBlock],
        holder: (u32, u8),
        tick: u64,
        placed: &mut Vec<Placed>,
    ) {
        let (rank, tier) = holder;
        let mut cur = start;
        let mut i = 0;
        while i < blocks.len() {
            let rest = &blocks[i..];
            let (slot, first, n, created) = self.stretch(cur, rest);
            let bits = if n == RUN_CAP {
                !0
            } else {
                ((1u64 << n) - 1) << first
            };
            // Before the hold: what other ranks held decides whose names the blocks keep.
            let side = self.keep_highs(slot, first, &rest[..n], created);
            let held = self.run_mut(slot).hold(rank, tier, bits);
            self.touch(slot, tick);
            if self.lru.is_some() {
                let names = rest[..n].iter().map(|b| b.block_hash.0);
                if created {
                    self.ehs_mut(slot, |e| e.extend(names));
                } else {
                    let known = self.ehs[slot as usize]
                        .get(first..first + n)
                        .unwrap_or_default();
                    if !names.eq(known.iter().copied()) {
                        self.metas[slot as usize].renamed = true;
                    }
                }
            }
            placed.push(Placed {
                slot,
                first: first as u8,
                n: n as u8,
                held,
                side,
            });
            cur = Some(Pos {
                slot,
                off: (first + n - 1) as u8,
            });
            i += n;
        }
    }

    /// The next stretch of `blocks` (not empty) after `cur`: `(slot, first offset, blocks,
    /// created)`. It continues `cur`'s run where the run already has the blocks, else follows
    /// the child link of the first block, else appends to `cur`'s run when it ends there and has
    /// room, else starts a new child run.
    fn stretch(&mut self, cur: Option<Pos>, blocks: &[StoredBlock]) -> (u32, usize, usize, bool) {
        // How many of `bs` continue `hashes` from offset `from`.
        let same = |hashes: &[u64], from: usize, bs: &[StoredBlock]| {
            hashes
                .get(from..)
                .unwrap_or_default()
                .iter()
                .zip(bs)
                .take_while(|(h, b)| **h == b.local_hash.0)
                .count()
        };
        let key = match cur {
            None => ChildKey {
                parent: ROOT,
                off: 0,
                hash: blocks[0].local_hash.0,
            },
            Some(p) => {
                let next = p.off as usize + 1;
                let m = self
                    .with_run(p.slot, |_, _, h| same(h, next, blocks))
                    .unwrap_or(0);
                if m > 0 {
                    return (p.slot, next, m, false);
                }
                ChildKey {
                    parent: p.slot,
                    off: p.off,
                    hash: blocks[0].local_hash.0,
                }
            }
        };
        // Only look for a child where the run has one (the root always may).
        let may_branch =
            key.parent == ROOT || self.metas[key.parent as usize].has_children(key.off);
        if may_branch {
            if let Some(child) = self.link(key) {
                // The link names the child's first block; compare the rest.
                let m = 1 + self
                    .with_run(child, |_, _, h| same(h, 1, &blocks[1..]))
                    .unwrap_or(0);
                return (child, 0, m, false);
            }
        }
        if let Some(p) = cur {
            let len = self.with_run(p.slot, |_, _, h| h.len()).unwrap_or(0);
            if p.off as usize + 1 == len && len < RUN_CAP {
                let n = (RUN_CAP - len).min(blocks.len());
                self.positions += n;
                let hashes = &mut self.run_mut(p.slot).hashes;
                hashes.extend(blocks[..n].iter().map(|b| b.local_hash.0));
                return (p.slot, len, n, true);
            }
            self.add_child(p.slot, p.off);
        }
        let n = RUN_CAP.min(blocks.len());
        self.positions += n;
        let slot = self.alloc_slot();
        self.metas[slot as usize].parent = key.parent;
        let buf = self.run_mut(slot);
        buf.parent = key.parent;
        buf.parent_off = key.off;
        buf.hashes
            .extend(blocks[..n].iter().map(|b| b.local_hash.0));
        self.new_links.push((key, slot));
        (slot, 0, n, true)
    }

    /// Clears (rank, tier)'s hold of the blocks `bits` of run `slot`. Returns `(cleared,
    /// elsewhere)`: the blocks it held, and those of them the rank still holds in another tier.
    /// A run these bits leave without holders or children is freed as it is
    /// ([`ShardWriter::unhold_last`]); otherwise emptied blocks are pruned at commit.
    pub(crate) fn unhold(&mut self, slot: u32, rank: u32, tier: u8, bits: u64) -> (u64, u64) {
        let Some(meta) = self.metas.get(slot as usize).filter(|m| m.live) else {
            return (0, 0);
        };
        if meta.dirty == CLEAN && meta.child_mask == 0 {
            if let Some(freed) = self.unhold_last(slot, rank, tier, bits) {
                return freed;
            }
        }
        let (cleared, elsewhere) = self.run_mut(slot).unhold(rank, tier, bits);
        let meta = &mut self.metas[slot as usize];
        if cleared != 0 && !meta.prune_queued {
            meta.prune_queued = true;
            self.prune_pending.push(slot);
        }
        (cleared, elsewhere)
    }

    /// [`ShardWriter::unhold`] of a published run without children whose only holder is
    /// (rank, tier) and which these bits empty: the run is freed as it is, without a working
    /// copy. `None` for any other run.
    fn unhold_last(&mut self, slot: u32, rank: u32, tier: u8, bits: u64) -> Option<(u64, u64)> {
        let run = self.published(slot)?;
        // One holder: one pair of words.
        if run.holders.len() != 2 {
            return None;
        }
        let holder = holders_of(run.holders).next()?;
        if (holder.rank, holder.tier) != (rank, tier) || holder.mask & !bits != 0 {
            return None;
        }
        let (len, first, parent, parent_off) = (
            run.hashes.len(),
            run.hashes.first().copied(),
            run.parent,
            run.parent_off,
        );
        self.positions -= len;
        if self.lru.is_some() {
            self.ehs_mut(slot, |e| e.clear());
        }
        if let Some(parent) = self.free_run(slot, first, parent, parent_off) {
            // The parent may end in blocks nobody holds now: pruned at commit.
            let meta = &mut self.metas[parent as usize];
            if !meta.prune_queued {
                meta.prune_queued = true;
                self.prune_pending.push(parent);
            }
        }
        Some((holder.mask, 0))
    }

    /// Drops every hold of `rank` (all tiers) in this shard. Returns the holds dropped.
    ///
    /// Scans every run: clears and departures are rare, and a per-rank list of runs would cost
    /// memory and work on every store and removal.
    pub(crate) fn clear_rank(&mut self, rank: u32, dropped: &mut Vec<DroppedHold>) {
        let shard = self.index;
        for slot in 0..self.metas.len() as u32 {
            if !self.metas[slot as usize].live || !self.run_has_rank(slot, rank) {
                continue;
            }
            let buf = self.run_mut(slot);
            buf.holders.retain(|h| {
                if h.rank != rank {
                    return true;
                }
                let mut m = h.mask;
                while m != 0 {
                    let off = m.trailing_zeros() as u8;
                    dropped.push(DroppedHold {
                        shard,
                        pos: Pos { slot, off },
                        rank,
                        tier: h.tier,
                        eh: 0,
                        renamed: false,
                    });
                    m &= m - 1;
                }
                false
            });
            self.prune(slot);
        }
    }

    /// Removes trailing blocks of `slot` that nobody holds and nothing branches from, and frees
    /// the run when it empties, walking up to the parent.
    fn prune(&mut self, mut slot: u32) {
        loop {
            // Judged on the writer's view as it is: a run that keeps its blocks (the parent
            // of a freed child, mostly) is not copied.
            let Some((len, held, first, parent, parent_off)) = self.prune_view(slot) else {
                return;
            };
            let meta = &self.metas[slot as usize];
            let mut keep = len;
            while keep > 0
                && held & (1u64 << (keep - 1)) == 0
                && !meta.has_children((keep - 1) as u8)
            {
                keep -= 1;
            }
            if keep == len {
                return;
            }
            self.positions -= len - keep;
            if self.lru.is_some() {
                self.ehs_mut(slot, |e| e.truncate(keep));
            }
            if keep > 0 {
                self.run_mut(slot).hashes.truncate(keep);
                return;
            }
            match self.free_run(slot, first, parent, parent_off) {
                Some(p) => slot = p,
                None => return,
            }
        }
    }

    /// What pruning a run needs of the writer's current view: its length, the union of its
    /// holders' masks, its first hash and its parent.
    fn prune_view(&self, slot: u32) -> Option<(usize, u64, Option<u64>, u32, u8)> {
        let meta = self.metas.get(slot as usize)?;
        if meta.dirty != CLEAN {
            let b = &self.dirty[meta.dirty as usize].1;
            return Some((
                b.hashes.len(),
                b.held_mask(),
                b.hashes.first().copied(),
                b.parent,
                b.parent_off,
            ));
        }
        let run = self.published(slot)?;
        let held = holders_of(run.holders).fold(0, |m, h| m | h.mask);
        Some((
            run.hashes.len(),
            held,
            run.hashes.first().copied(),
            run.parent,
            run.parent_off,
        ))
    }

    /// Unlinks an emptied run and frees its slot at commit (readers see it until then).
    /// Returns its parent, whose last block may have just become a leaf, unless it hangs from
    /// the root.
    fn free_run(
        &mut self,
        slot: u32,
        first: Option<u64>,
        parent: u32,
        parent_off: u8,
    ) -> Option<u32> {
        if let Some(first) = first {
            self.dead_links.push(ChildKey {
                parent,
                off: parent_off,
                hash: first,
            });
        }
        self.metas[slot as usize].live = false;
        self.dead_slots.push(slot);
        self.live_runs -= 1;
        if parent == ROOT {
            return None;
        }
        self.remove_child(parent, parent_off);
        if let Some(lru) = &mut self.lru {
            lru.push(Reverse((self.touches[parent as usize], parent)));
        }
        Some(parent)
    }
}

#[cfg(test)]
mod tests;
