//! The sharded prefix index: for a prompt's block hashes, which ranks hold how many leading
//! blocks, in which storage tier.
//!
//! ```text
//!   shard = f(first block hash)          one writer (PrefixIndex), readers anywhere (IndexReader)
//!   ┌ shard 0 ──────────────────────────────────────────────────────────────┐
//!   │ child table: (parent run, offset, next hash) -> run                    │
//!   │ runs (ArcSwap slots):  [h0 h1 h2 .. h63] holders: rank/tier -> bitmask │
//!   └────────────────────────────────────────────────────────────────────────┘
//!   per rank: engine block hash -> (shard, run, offset)    writer only: removals, parents
//! ```
//!
//! Chains live in runs of up to 64 blocks; a chain that diverges mid-run continues in a child
//! run linked from the divergence point, so a run is never split and a block never moves. A
//! match compares the query against each run's hashes in one loop and probes the child table
//! once per run. Every chain lives in the shard of its first block, so a match visits one shard.
//!
//! Engines name blocks by their own opaque hashes. Each rank keeps its own map from name to
//! position: the names of one rank's events are looked up in one small map that stays warm in
//! cache while that rank's events are applied, and two ranks never see each other's names.
//! Physical copies of one block in one (rank, tier) are counted, so the block leaves only with
//! its last copy.
//!
//! See `docs/ARCHITECTURE.md` for the measurements behind these choices.

mod depths;
mod mix;
mod names;
mod primitive;
mod read;
pub mod reference;
mod run;
mod shard;
mod slots;
mod table;
mod uses;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use arc_swap::ArcSwap;

pub use self::depths::{Depth, RankDepths};
use self::mix::{set_bytes, MixState};
use self::names::{HighHalves, NameMap};
use self::shard::{DroppedHold, Placed, Pos, ShardShared, ShardWriter};
use crate::event::{
    BlockHash, EventHeader, EventId, KvEvent, KvEventData, StorageTier, StoredBlock, WorkerId,
    WorkerRank,
};
use crate::hash::LocalHash;

/// Index configuration.
#[derive(Clone, Debug)]
pub struct IndexConfig {
    /// Number of shards; 0 means one per available core. At most [`MAX_SHARDS`].
    pub shards: usize,
    /// Upper bound of the index's own memory, in bytes; `None` means unbounded. Over it, the
    /// least recently used leaf blocks are evicted (used: stored into, or read by a match).
    pub memory_budget: Option<usize>,
    /// Register a rank on its first event. When false, ranks must be registered with
    /// [`PrefixIndex::register_rank`] and events of other ranks are rejected.
    pub auto_register: bool,
    /// Most ranks the index tracks at once.
    pub max_ranks: usize,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            shards: 0,
            memory_budget: None,
            auto_register: true,
            max_ranks: 1 << 16,
        }
    }
}

/// Options of one match.
#[derive(Clone, Copy, Debug, Default)]
pub struct MatchOptions {
    /// Stop walking once a single rank is left holding the whole prefix so far: its score is
    /// then a lower bound, and every other score is exact.
    pub early_exit: bool,
}

/// One rank's overlap with a query.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RankScore {
    pub rank: WorkerRank,
    /// Leading blocks of the query held, in any tier.
    pub blocks: u32,
    /// The same blocks split by the fastest tier each is held in.
    pub per_tier: [u32; StorageTier::COUNT],
}

/// Result of a match: one entry per rank holding at least the first block. Reuse one value
/// across calls to [`IndexReader::find_matches_into`] to match without allocating.
#[derive(Clone, Debug)]
pub struct OverlapScores {
    pub scores: Vec<RankScore>,
    /// The index's dense id of each score's rank, as the walk left them (`ids[i]` belongs to
    /// `scores[i]`): stable while the rank is registered, reused after it leaves.
    ids: Vec<u32>,
    /// Ranks still holding every block so far: (rank id, index in `scores`).
    active: Vec<(u32, u32)>,
    /// The same ranks as a mask of ids, kept instead of `active` after the first run when
    /// every id is below 64 (`by_mask`): a later run is then narrowed by its holders alone.
    active_mask: u64,
    by_mask: bool,
    /// Index in `scores` of each rank id of `active_mask`.
    key_of: [u32; 64],
    /// First runs of recent matches and how they scored, for the next matches that start in
    /// them (a few: most matches start in one of a few shared system prompts).
    firsts: Vec<FirstRun>,
    /// The entry of `firsts` replaced last.
    next_first: usize,
}

impl Default for OverlapScores {
    fn default() -> Self {
        OverlapScores {
            scores: Vec::new(),
            ids: Vec::new(),
            active: Vec::new(),
            active_mask: 0,
            by_mask: false,
            key_of: [0; 64],
            firsts: Vec::new(),
            next_first: 0,
        }
    }
}

/// First runs an [`OverlapScores`] keeps the scoring of.
const KEPT_FIRST_RUNS: usize = 4;

/// A walk's first run as it was scored: its slot, its holder words, the blocks matched in it
/// and the table of ranks read, and the scores, ids and active ranks that gave.
#[derive(Clone, Debug, Default)]
struct FirstRun {
    slot: u32,
    m: usize,
    ranks: Option<read::Ranks>,
    holders: Vec<u64>,
    scores: Vec<RankScore>,
    ids: Vec<u32>,
    active: Vec<(u32, u32)>,
    /// Whether every active id is below 64 (the later runs then narrow a mask of them).
    by_mask: bool,
}

impl OverlapScores {
    /// The score of one rank (0 blocks when absent).
    pub fn blocks(&self, rank: WorkerRank) -> u32 {
        self.scores
            .iter()
            .find(|s| s.rank == rank)
            .map_or(0, |s| s.blocks)
    }

    /// The index's dense rank ids of the scores the match produced, in the same order: a
    /// cheap key for a caller's own per-rank tables (check the rank too: an id is reused once
    /// its rank leaves the index).
    pub fn rank_ids(&self) -> &[u32] {
        &self.ids
    }

    /// The best score.
    pub fn max_blocks(&self) -> u32 {
        self.scores.iter().map(|s| s.blocks).max().unwrap_or(0)
    }
}

/// Why an event or call was rejected. Every rejection is also counted in [`ErrorCounts`].
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum IndexError {
    #[error("stored event of {rank} continues parent block {parent:?}, which the rank does not hold; the rank needs resynchronisation")]
    UnknownParent { rank: WorkerRank, parent: BlockHash },
    #[error("removed event of {rank} names {count} block(s) the rank does not hold in that tier (first: {first:?}); the others were removed")]
    UnknownBlocks {
        rank: WorkerRank,
        count: usize,
        first: BlockHash,
    },
    #[error("stored event of {rank} names block {block:?} as its own parent or twice in a row")]
    InvalidChain { rank: WorkerRank, block: BlockHash },
    #[error("event of unregistered rank {rank}")]
    UnknownRank { rank: WorkerRank },
    #[error("unknown worker {worker:?}")]
    UnknownWorker { worker: WorkerId },
    #[error("rank {rank} cannot be registered: the index already tracks {limit} ranks")]
    TooManyRanks { rank: WorkerRank, limit: usize },
    #[error("stored event of {rank} does not fit: its shard is out of run slots; the rank needs resynchronisation")]
    Full { rank: WorkerRank },
}

/// Rejections, per kind. `unknown_blocks` counts blocks, the others count events or calls.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ErrorCounts {
    pub unknown_parent: u64,
    pub unknown_blocks: u64,
    pub invalid_chain: u64,
    pub unknown_rank: u64,
    pub unknown_worker: u64,
    pub too_many_ranks: u64,
    pub full: u64,
}

/// Event-id bookkeeping, summed over ranks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EventCounts {
    /// Events applied (rejected ones included).
    pub events: u64,
    /// Times an event id jumped ahead of the next expected one.
    pub gaps: u64,
    /// Event ids skipped over by those jumps.
    pub missing: u64,
    /// Events whose id was not above the last one seen (duplicates and late arrivals).
    pub reordered: u64,
}

/// Where a rank's event stream stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankStatus {
    pub rank: WorkerRank,
    /// The highest event id applied.
    pub last_event: Option<EventId>,
    /// The stream no longer fits the index (a gap, an unknown parent): the rank's blocks should
    /// be re-read from the worker.
    pub needs_resync: bool,
    /// Gaps seen on this rank.
    pub gaps: u64,
}

/// Counters and sizes.
#[derive(Clone, Debug, Default)]
pub struct IndexStats {
    pub shards: usize,
    pub ranks: usize,
    pub runs: usize,
    /// Blocks in the structure (distinct positions).
    pub blocks: usize,
    /// (rank, block, tier) holds.
    pub stored_pairs: u64,
    /// Extra physical copies beyond the first of a (rank, block, tier).
    pub duplicate_copies: u64,
    /// Bytes the index accounts for itself.
    pub memory_bytes: usize,
    pub memory_budget: Option<usize>,
    /// Blocks evicted to stay within the budget, and the holds they took along.
    pub evicted_blocks: u64,
    pub evicted_pairs: u64,
    pub errors: ErrorCounts,
    pub events: EventCounts,
    pub ranks_needing_resync: usize,
    /// Engine block names the ranks' maps resolve.
    pub names: usize,
}

#[derive(Debug)]
struct RankState {
    rank: WorkerRank,
    /// Ids freed before this rank was given its id ([`RankKey::epoch`]).
    epoch: u32,
    /// The rank's block names -> packed position.
    names: NameMap,
    /// Positions of blocks the rank stored again under another name while it held them: when
    /// its hold of one ends, every name it has for the block goes, not only the one the event
    /// named (engines name a block one way; this is for those that do not).
    aliased: HashSet<u32, MixState>,
    /// Tiers the rank has stored blocks in (bit = tier).
    tiers: u8,
    last_event: Option<u64>,
    needs_resync: bool,
    gaps: u64,
}

struct Shared {
    shards: Vec<Arc<ShardShared>>,
    /// Rank id -> rank, for turning holders into scores.
    ranks: ArcSwap<Vec<Option<WorkerRank>>>,
    /// Rank ids freed so far (saturating), raised after the table without them is published.
    frees: primitive::AtomicU32,
}

/// A registered rank's id, with the number of ids the index had freed when it gave the id out:
/// the key a caller that keeps rank ids reads a [`RankDepths`] by. Two keys of one id differ
/// in `epoch`, as the id was freed in between.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RankKey {
    pub id: u32,
    pub epoch: u32,
}

/// Something KV events are applied to: the index itself, or a router's writer that applies
/// them to its index and notes each one ([`crate::router::EventWriter`]). An ingest path
/// that decodes events from the wire writes through this, whichever it feeds.
pub trait ApplyEvents {
    /// [`PrefixIndex::apply_stored`].
    fn apply_stored(
        &mut self,
        header: EventHeader,
        parent: Option<BlockHash>,
        blocks: &[StoredBlock],
    ) -> Result<(), IndexError>;
    /// [`PrefixIndex::apply_removed`].
    fn apply_removed(
        &mut self,
        header: EventHeader,
        blocks: &[BlockHash],
    ) -> Result<(), IndexError>;
    /// [`PrefixIndex::apply_cleared`].
    fn apply_cleared(&mut self, header: EventHeader) -> Result<(), IndexError>;

    /// Applies one event, whichever kind.
    fn apply_event(&mut self, event: &KvEvent) -> Result<(), IndexError> {
        match &event.data {
            KvEventData::Stored { parent, blocks } => {
                self.apply_stored(event.header, *parent, blocks)
            }
            KvEventData::Removed { blocks } => self.apply_removed(event.header, blocks),
            KvEventData::Cleared => self.apply_cleared(event.header),
        }
    }
}

impl ApplyEvents for PrefixIndex {
    fn apply_stored(
        &mut self,
        header: EventHeader,
        parent: Option<BlockHash>,
        blocks: &[StoredBlock],
    ) -> Result<(), IndexError> {
        PrefixIndex::apply_stored(self, header, parent, blocks)
    }
    fn apply_removed(
        &mut self,
        header: EventHeader,
        blocks: &[BlockHash],
    ) -> Result<(), IndexError> {
        PrefixIndex::apply_removed(self, header, blocks)
    }
    fn apply_cleared(&mut self, header: EventHeader) -> Result<(), IndexError> {
        PrefixIndex::apply_cleared(self, header)
    }
}

/// A cheap, cloneable, thread-safe handle that matches queries lock-free.
#[derive(Clone)]
pub struct IndexReader {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for IndexReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IndexReader")
            .field("shards", &self.shared.shards.len())
            .finish()
    }
}

#[inline]
fn shard_of(h: LocalHash, n: usize) -> usize {
    let x = h.0.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
    ((x * n as u64) >> 32) as usize
}

impl IndexReader {
    /// Scores every rank against `query`, allocating the result.
    pub fn find_matches(&self, query: &[LocalHash], opts: MatchOptions) -> OverlapScores {
        let mut out = OverlapScores::default();
        self.find_matches_into(query, opts, &mut out);
        out
    }

    /// Scores every rank against `query` into `out` (cleared first). Lock-free; allocates
    /// nothing once `out` has grown to the number of ranks that match.
    pub fn find_matches_into(
        &self,
        query: &[LocalHash],
        opts: MatchOptions,
        out: &mut OverlapScores,
    ) {
        out.scores.clear();
        out.ids.clear();
        out.active.clear();
        let Some(first) = query.first() else {
            return;
        };
        let shards = &self.shared.shards;
        let shard = &shards[shard_of(*first, shards.len())];
        let ranks = self.shared.ranks.load();
        read::walk(shard, &ranks, query, opts.early_exit, out);
    }

    /// [`IndexReader::find_matches_into`] by rank id: the same overlaps, left in a table keyed
    /// by the index's dense rank ids, for a caller that visits its own ranks by id
    /// ([`PrefixIndex::rank_key`]). Lock-free; allocates nothing once `out` has grown to the
    /// number of ranks.
    pub fn find_depths_into(&self, query: &[LocalHash], opts: MatchOptions, out: &mut RankDepths) {
        // The count first: the table loaded after it has freed at least that many ids.
        let epoch = self.shared.frees.load(primitive::Ordering::Acquire);
        let ranks = self.shared.ranks.load();
        out.begin(ranks.len(), epoch);
        let Some(first) = query.first() else {
            return;
        };
        let shards = &self.shared.shards;
        let shard = &shards[shard_of(*first, shards.len())];
        read::walk(shard, &ranks, query, opts.early_exit, out);
        out.end(&ranks);
    }

    /// [`IndexReader::find_depths_into`] for rank id `id` alone: the walk follows that rank
    /// only, and `out` holds nothing for any other (its deepest is that rank, or none). For a
    /// caller that has already chosen its rank (a pinned request) and wants its overlap.
    /// `opts.early_exit` is ignored: with one rank followed, it would end every walk after
    /// its first run.
    pub fn find_depth_of_into(
        &self,
        query: &[LocalHash],
        _opts: MatchOptions,
        id: u32,
        out: &mut RankDepths,
    ) {
        let epoch = self.shared.frees.load(primitive::Ordering::Acquire);
        let ranks = self.shared.ranks.load();
        out.begin(ranks.len(), epoch);
        out.only = Some(id);
        let Some(first) = query.first() else {
            return;
        };
        let shards = &self.shared.shards;
        let shard = &shards[shard_of(*first, shards.len())];
        read::walk(shard, &ranks, query, false, out);
        out.end(&ranks);
    }

    /// The rank that rank id `id` names now (`None`: a free id).
    pub fn rank_of(&self, id: u32) -> Option<WorkerRank> {
        self.shared.ranks.load().get(id as usize).copied().flatten()
    }
}

/// The prefix index, as its single writer sees it. Reads go through [`PrefixIndex::reader`]
/// handles, from any thread, while this value applies events.
pub struct PrefixIndex {
    config: IndexConfig,
    reader: IndexReader,
    shards: Vec<ShardWriter>,
    ranks: Vec<Option<RankState>>,
    rank_ids: HashMap<WorkerRank, u32, MixState>,
    free_rank_ids: Vec<u32>,
    /// (rank, tier, position) -> copies beyond the first.
    copies: HashMap<(u32, u8, u32), u32, MixState>,
    tick: u64,
    stored_pairs: u64,
    duplicate_copies: u64,
    evicted_blocks: u64,
    evicted_pairs: u64,
    errors: ErrorCounts,
    events: EventCounts,
    dropped: Vec<DroppedHold>,
    /// Scratch: where a Stored event's blocks landed.
    placed: Vec<Placed>,
}

impl std::fmt::Debug for PrefixIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixIndex")
            .field("config", &self.config)
            .field("stats", &self.stats())
            .finish()
    }
}

/// How many names ahead a Removed event's loop prefetches (into the first-level cache: each
/// lookup reads its entry, then the high half it names, at once).
const PREFETCH_AHEAD: usize = 16;

/// How many names ahead a Stored event's loop prefetches (into the second-level cache, which
/// can wait on more lines at once: an insert writes its entry and reads nothing from it).
const INSERT_AHEAD: usize = 32;

/// Most shards an index has: a position packs its shard into 4 bits.
pub const MAX_SHARDS: usize = 16;

/// Most blocks [`PrefixIndex::reserve_blocks`] makes room for in one rank's name map (about
/// 370 MB of map): a capacity past it, from a worker's report, is taken as this.
pub const MAX_RESERVED_BLOCKS: u64 = 1 << 24;

/// Bytes a reserved name takes in its map (64-byte groups of seven at
/// [`names::RESERVED_LOAD_PCT`]), rounded up.
const RESERVED_NAME_BYTES: u64 =
    (names::GROUP_BYTES * 100).div_ceil(names::GROUP * names::RESERVED_LOAD_PCT) as u64;

/// A block's position in 32 bits: shard (4 bits), run slot (22 bits), offset (6 bits). Names
/// map to it, so its size is most of a name's cost.
#[inline]
fn pack(shard: usize, pos: Pos) -> u32 {
    ((shard as u32) << 28) | (pos.slot << 6) | pos.off as u32
}

#[inline]
fn unpack(loc: u32) -> (usize, Pos) {
    (
        (loc >> 28) as usize,
        Pos {
            slot: (loc >> 6) & (shard::MAX_SLOTS - 1),
            off: (loc & 63) as u8,
        },
    )
}

impl HighHalves for Vec<ShardWriter> {
    #[inline]
    fn high(&self, loc: u32) -> u32 {
        let (shard, pos) = unpack(loc);
        self[shard].high(pos)
    }
}

/// One stretch of a Stored event's blocks, placed in one run.
#[derive(Clone, Copy)]
struct Stretch<'a> {
    blocks: &'a [StoredBlock],
    /// Index in `blocks` of the stretch's first block.
    at: usize,
    placed: &'a Placed,
    /// The packed position of the run's offset 0.
    base: u32,
    /// Whether the map takes every name of the event without a rebuild.
    room: bool,
}

/// Names the blocks of `stretch` in a rank's map, prefetching names ahead. With `ALIASES`,
/// a block the rank held before the event (`before`, bit = offset) that gets a name new to
/// the map has another name already: its position goes into `aliased`.
#[inline(always)]
fn insert_names<const ALIASES: bool>(
    names: &mut NameMap,
    aliased: &mut HashSet<u32, MixState>,
    stretch: Stretch<'_>,
    before: u64,
    highs: &impl HighHalves,
) {
    let Stretch {
        blocks,
        at,
        placed: st,
        base,
        room,
    } = stretch;
    for (k, b) in blocks[at..at + st.n as usize].iter().enumerate() {
        if let Some(ahead) = blocks.get(at + k + INSERT_AHEAD) {
            names.prefetch(ahead.block_hash.0, true);
        }
        let off = st.first as u32 + k as u32;
        let kept = st.side >> off & 1 == 0;
        let was = names.insert_compared(b.block_hash.0, base | off, kept, room, highs);
        if ALIASES && before >> off & 1 != 0 && was.is_none() {
            aliased.insert(base | off);
        }
    }
}

/// What a Removed event did, block by block.
#[derive(Default)]
struct Removal {
    removed: u64,
    unknown: usize,
    /// Index in the event of the first block that was not held.
    first_unknown: u32,
    /// Shards changed (bit = shard % 64).
    touched: u64,
}

impl Removal {
    fn unknown(&mut self, i: usize) {
        if self.unknown == 0 || (i as u32) < self.first_unknown {
            self.first_unknown = i as u32;
        }
        self.unknown += 1;
    }
}

/// One run's hold by the (rank, tier) a Removed event clears, while the event's blocks in it
/// are gathered.
struct RunHold {
    shard: usize,
    slot: u32,
    /// The run's packed position without an offset: `pack(shard, slot, 0) >> 6`.
    run: u32,
    /// Blocks (rank, tier) holds in the run.
    held: u64,
    /// Blocks the rank holds in the run in another tier.
    elsewhere: u64,
    /// Blocks of the event gathered so far.
    bits: u64,
}

impl RunHold {
    const NONE: RunHold = RunHold {
        shard: usize::MAX,
        slot: u32::MAX,
        run: u32::MAX,
        held: 0,
        elsewhere: 0,
        bits: 0,
    };

    #[inline]
    fn read(shards: &[ShardWriter], shard: usize, slot: u32, (rank, tier): (u32, u8)) -> Self {
        let (held, elsewhere) = shards
            .get(shard)
            .map_or((0, 0), |s| s.rank_masks(slot, rank, tier));
        RunHold {
            shard,
            slot,
            run: pack(shard, Pos { slot, off: 0 }) >> 6,
            held,
            elsewhere,
            bits: 0,
        }
    }

    /// Clears the gathered blocks with one holder update.
    #[inline]
    fn clear(&self, shards: &mut [ShardWriter], (rank, tier): (u32, u8), tally: &mut Removal) {
        if self.bits == 0 {
            return;
        }
        let (cleared, _) = shards[self.shard].unhold(self.slot, rank, tier, self.bits);
        debug_assert_eq!(cleared, self.bits);
        tally.touched |= 1 << (self.shard % 64);
    }
}

impl PrefixIndex {
    pub fn new(config: IndexConfig) -> Self {
        let n = match config.shards {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        }
        .min(MAX_SHARDS);
        let track_lru = config.memory_budget.is_some();
        let shards: Vec<ShardWriter> = (0..n).map(|i| ShardWriter::new(i, track_lru)).collect();
        let shared = Arc::new(Shared {
            shards: shards.iter().map(|s| Arc::clone(&s.shared)).collect(),
            ranks: ArcSwap::from_pointee(Vec::new()),
            frees: primitive::AtomicU32::new(0),
        });
        PrefixIndex {
            config,
            reader: IndexReader { shared },
            shards,
            ranks: Vec::new(),
            rank_ids: HashMap::default(),
            free_rank_ids: Vec::new(),
            copies: HashMap::default(),
            tick: 0,
            stored_pairs: 0,
            duplicate_copies: 0,
            evicted_blocks: 0,
            evicted_pairs: 0,
            errors: ErrorCounts::default(),
            events: EventCounts::default(),
            dropped: Vec::new(),
            placed: Vec::new(),
        }
    }

    /// A reading handle; clone it into every thread that routes.
    pub fn reader(&self) -> IndexReader {
        self.reader.clone()
    }

    /// See [`IndexReader::find_matches`].
    pub fn find_matches(&self, query: &[LocalHash], opts: MatchOptions) -> OverlapScores {
        self.reader.find_matches(query, opts)
    }

    /// See [`IndexReader::find_matches_into`].
    pub fn find_matches_into(
        &self,
        query: &[LocalHash],
        opts: MatchOptions,
        out: &mut OverlapScores,
    ) {
        self.reader.find_matches_into(query, opts, out);
    }

    // ---- ranks ----

    /// Registers a rank (a no-op when it is known).
    pub fn register_rank(&mut self, rank: WorkerRank) -> Result<(), IndexError> {
        self.rank_id_or_register(rank)?;
        self.enforce_budget();
        Ok(())
    }

    /// Registers a rank (if it is new) and makes room in its name map for `blocks` blocks: the
    /// KV capacity its worker reports (every tier it publishes events for), so that the map is
    /// not rebuilt again and again while the rank fills (each rebuild moves every name, a
    /// stall of the writer that grows with the rank), and is not shrunk below it when blocks
    /// leave. A rank holding more grows its map as usual. The room counts in
    /// [`PrefixIndex::memory_bytes`] from now on; it is capped at [`MAX_RESERVED_BLOCKS`] and,
    /// under a memory budget, so that all ranks' reserved room together stays within a
    /// quarter of the budget. A later call with fewer blocks lowers the floor without
    /// shrinking the map at once.
    pub fn reserve_blocks(&mut self, rank: WorkerRank, blocks: u64) -> Result<(), IndexError> {
        let id = self.rank_id_or_register(rank)?;
        let mut cap = MAX_RESERVED_BLOCKS;
        if let Some(budget) = self.config.memory_budget {
            let others: usize = (self.ranks.iter().enumerate())
                .filter(|&(i, _)| i != id as usize)
                .filter_map(|(_, r)| r.as_ref())
                .map(|r| r.names.reserved_bytes())
                .sum();
            let room = (budget / 4).saturating_sub(others) as u64;
            cap = cap.min(room / RESERVED_NAME_BYTES);
        }
        if let Some(Some(state)) = self.ranks.get_mut(id as usize) {
            state.names.reserve(blocks.min(cap) as usize, &self.shards);
        }
        self.enforce_budget();
        Ok(())
    }

    /// The key of a registered rank (see [`RankDepths`]): its id is stable until the rank is
    /// removed, then free for the next rank to register.
    pub fn rank_key(&self, rank: WorkerRank) -> Option<RankKey> {
        let id = *self.rank_ids.get(&rank)?;
        let epoch = self.ranks[id as usize].as_ref()?.epoch;
        Some(RankKey { id, epoch })
    }

    fn rank_id_or_register(&mut self, rank: WorkerRank) -> Result<u32, IndexError> {
        if let Some(&id) = self.rank_ids.get(&rank) {
            return Ok(id);
        }
        if self.rank_ids.len() >= self.config.max_ranks {
            self.errors.too_many_ranks += 1;
            return Err(IndexError::TooManyRanks {
                rank,
                limit: self.config.max_ranks,
            });
        }
        let id = self.free_rank_ids.pop().unwrap_or(self.ranks.len() as u32);
        if id as usize == self.ranks.len() {
            self.ranks.push(None);
        }
        self.ranks[id as usize] = Some(RankState {
            rank,
            epoch: self.reader.shared.frees.load(primitive::Ordering::Relaxed),
            names: NameMap::default(),
            aliased: HashSet::default(),
            tiers: 0,
            last_event: None,
            needs_resync: false,
            gaps: 0,
        });
        self.rank_ids.insert(rank, id);
        self.publish_ranks();
        Ok(id)
    }

    fn publish_ranks(&self) {
        let list = self
            .ranks
            .iter()
            .map(|r| r.as_ref().map(|s| s.rank))
            .collect();
        self.reader.shared.ranks.store(Arc::new(list));
    }

    /// The rank id for an event, registering the rank when allowed; counts the event id.
    fn event_rank(&mut self, header: EventHeader) -> Result<u32, IndexError> {
        self.events.events += 1;
        let id = match self.rank_ids.get(&header.source) {
            Some(&id) => id,
            None if self.config.auto_register => self.rank_id_or_register(header.source)?,
            None => {
                self.errors.unknown_rank += 1;
                return Err(IndexError::UnknownRank {
                    rank: header.source,
                });
            }
        };
        if let Some(Some(state)) = self.ranks.get_mut(id as usize) {
            let id_now = header.event_id.0;
            match state.last_event {
                None => state.last_event = Some(id_now),
                Some(last) if id_now == last.wrapping_add(1) => state.last_event = Some(id_now),
                Some(last) if id_now > last => {
                    self.events.gaps += 1;
                    self.events.missing = self.events.missing.saturating_add(id_now - last - 1);
                    state.gaps += 1;
                    state.needs_resync = true;
                    state.last_event = Some(id_now);
                }
                Some(_) => self.events.reordered += 1,
            }
        }
        Ok(id)
    }

    fn flag_resync(&mut self, rank: u32) {
        if let Some(Some(state)) = self.ranks.get_mut(rank as usize) {
            state.needs_resync = true;
        }
    }

    /// Status of every tracked rank.
    pub fn rank_status(&self) -> Vec<RankStatus> {
        self.ranks
            .iter()
            .flatten()
            .map(|s| RankStatus {
                rank: s.rank,
                last_event: s.last_event.map(EventId),
                needs_resync: s.needs_resync,
                gaps: s.gaps,
            })
            .collect()
    }

    /// Ranks whose event stream no longer fits the index.
    pub fn ranks_needing_resync(&self) -> Vec<WorkerRank> {
        self.ranks
            .iter()
            .flatten()
            .filter(|s| s.needs_resync)
            .map(|s| s.rank)
            .collect()
    }

    /// Clears a rank's resynchronisation flag (after its blocks were re-read).
    pub fn mark_resynced(&mut self, rank: WorkerRank) {
        if let Some(&id) = self.rank_ids.get(&rank) {
            if let Some(Some(state)) = self.ranks.get_mut(id as usize) {
                state.needs_resync = false;
            }
        }
    }

    // ---- events ----

    /// Applies one event.
    pub fn apply(&mut self, event: &KvEvent) -> Result<(), IndexError> {
        ApplyEvents::apply_event(self, event)
    }

    fn lookup(&self, rank: u32, eh: u64) -> Option<u32> {
        self.ranks
            .get(rank as usize)?
            .as_ref()?
            .names
            .get(eh, &self.shards)
    }

    fn holds(&self, loc: u32, rank: u32, tier: Option<u8>) -> bool {
        let (shard, pos) = unpack(loc);
        self.shards
            .get(shard)
            .is_some_and(|s| s.holds(pos, rank, tier))
    }

    /// Applies a Stored event given by parts (the form a received frame is read in).
    pub fn apply_stored(
        &mut self,
        header: EventHeader,
        parent: Option<BlockHash>,
        blocks: &[StoredBlock],
    ) -> Result<(), IndexError> {
        let rank = self.event_rank(header)?;
        let Some(first) = blocks.first() else {
            self.enforce_budget();
            return Ok(());
        };
        // The event's blocks come from memory nobody touched lately: fetch their lines
        // at once, before the checks below read them one by one (four blocks to a line).
        for b in blocks.iter().step_by(4) {
            mix::prefetch_read(b);
        }
        // The parent is looked up first, so that its misses (its name, then its run) overlap
        // with the fetches of the event's lines; what it found is acted on after the checks.
        // The hold is checked, not assumed from the name: a rank that named one block twice
        // keeps the other name when one is removed.
        let found = match parent {
            None => Ok((shard_of(first.local_hash, self.shards.len()), None)),
            Some(p) => match self.lookup(rank, p.0) {
                Some(loc) if self.holds(loc, rank, None) => {
                    let (s, pos) = unpack(loc);
                    Ok((s, Some(pos)))
                }
                _ => Err(p),
            },
        };
        // The first block that names itself as the chain's parent, or repeats its predecessor.
        let invalid = blocks.iter().enumerate().find(|(i, b)| {
            Some(b.block_hash) == parent || (*i > 0 && blocks[i - 1].block_hash == b.block_hash)
        });
        if let Some((_, bad)) = invalid {
            self.errors.invalid_chain += 1;
            return Err(IndexError::InvalidChain {
                rank: header.source,
                block: bad.block_hash,
            });
        }
        let (shard, start) = match found {
            Ok(at) => at,
            Err(p) => {
                self.errors.unknown_parent += 1;
                self.flag_resync(rank);
                return Err(IndexError::UnknownParent {
                    rank: header.source,
                    parent: p,
                });
            }
        };
        // A store creates at most one run per block: refuse it whole if that could not fit.
        if !self.shards[shard].has_room_for(blocks.len()) {
            self.errors.full += 1;
            self.flag_resync(rank);
            return Err(IndexError::Full {
                rank: header.source,
            });
        }
        self.tick += 1;
        if self.config.memory_budget.is_some() {
            self.publish_clock();
        }
        let tier = header.tier as u8;
        let mut placed = std::mem::take(&mut self.placed);
        placed.clear();
        self.shards[shard].store(start, blocks, (rank, tier), self.tick, &mut placed);
        let Some(Some(state)) = self.ranks.get_mut(rank as usize) else {
            unreachable!("event_rank returned a live rank id");
        };
        // Whether the rank may hold a block in another tier: only then are its stretches'
        // holds there read, to tell a block stored again under another name.
        let other_tiers = state.tiers & !(1 << tier) != 0;
        state.tiers |= 1 << tier;
        let names = &mut state.names;
        for b in blocks.iter().take(INSERT_AHEAD) {
            names.prefetch(b.block_hash.0, true);
        }
        // Each stretch's blocks are consecutive offsets of one run and of the event.
        let mut at = 0;
        // Whether the map takes all of the event's names without a rebuild: then each insert
        // skips the check.
        let room = names.has_room_for(blocks.len());
        for st in &placed {
            let base = pack(
                shard,
                Pos {
                    slot: st.slot,
                    off: 0,
                },
            );
            let n = st.n as usize;
            // Blocks of the stretch the rank held before this event, in any tier.
            let mut before = st.held;
            if other_tiers {
                before |= self.shards[shard].rank_masks(st.slot, rank, tier).1;
            }
            let stretch = Stretch {
                blocks,
                at,
                placed: st,
                base,
                room,
            };
            // Blocks new to the rank (the common case) need no check for a second name.
            if before == 0 {
                insert_names::<false>(names, &mut state.aliased, stretch, 0, &self.shards);
            } else {
                insert_names::<true>(names, &mut state.aliased, stretch, before, &self.shards);
            }
            at += n;
            self.stored_pairs += (n - st.held.count_ones() as usize) as u64;
            let mut held = st.held;
            while held != 0 {
                let loc = base | held.trailing_zeros();
                *self.copies.entry((rank, tier, loc)).or_insert(0) += 1;
                self.duplicate_copies += 1;
                held &= held - 1;
            }
        }
        self.placed = placed;
        self.shards[shard].commit();
        self.enforce_budget();
        Ok(())
    }

    /// Applies a Removed event given by parts. Blocks the rank does not hold are skipped,
    /// counted and reported; the others are removed.
    pub fn apply_removed(
        &mut self,
        header: EventHeader,
        blocks: &[BlockHash],
    ) -> Result<(), IndexError> {
        let rank = self.event_rank(header)?;
        let tier = header.tier as u8;
        let Some(Some(state)) = self.ranks.get_mut(rank as usize) else {
            return Ok(());
        };
        let names = &mut state.names;
        let aliased = &mut state.aliased;
        // Blocks whose hold ended that the rank also named otherwise.
        let mut unnamed = Vec::new();
        let shards = &mut self.shards;
        let mut tally = Removal::default();
        // The blocks of one run are cleared together, with one holder update. The run's masks
        // are read when the walk reaches it, so that each block is judged (held, held in
        // another tier too) and its name forgotten at once.
        let mut run = RunHold::NONE;
        // The first names at once, into the second level: a burst the first level has too
        // few miss buffers for; the later ones one at a time, into the first.
        for b in blocks.iter().take(PREFETCH_AHEAD) {
            names.prefetch(b.0, true);
        }
        for (i, b) in blocks.iter().enumerate() {
            if let Some(ahead) = blocks.get(i + PREFETCH_AHEAD) {
                names.prefetch(ahead.0, false);
            }
            let Some((entry, loc)) = names.find(b.0, &*shards) else {
                tally.unknown(i);
                continue;
            };
            // Extra copies exist only while the block is held in that tier.
            let extra = match self.copies.is_empty() {
                true => None,
                false => self.copies.get_mut(&(rank, tier, loc)),
            };
            if let Some(c) = extra {
                *c -= 1;
                if *c == 0 {
                    self.copies.remove(&(rank, tier, loc));
                }
                self.duplicate_copies -= 1;
                continue;
            }
            // The run's shard and slot are the position's bits above its offset.
            if loc >> 6 != run.run {
                run.clear(shards, (rank, tier), &mut tally);
                let (shard, pos) = unpack(loc);
                run = RunHold::read(shards, shard, pos.slot, (rank, tier));
                // The high halves the next names of this run are checked against (an event
                // goes down a run's offsets), and where the event likely goes on once it is
                // done with the run.
                shards[shard].prefetch_highs_below(pos);
                shards[shard].prefetch_parent(pos.slot);
            }
            let bit = 1u64 << (loc & 63);
            // Not held in this tier, or already cleared by another name for the same block.
            if (run.held & !run.bits) & bit == 0 {
                tally.unknown(i);
                continue;
            }
            run.bits |= bit;
            tally.removed += 1;
            if run.elsewhere & bit == 0 {
                names.vacate(entry, b.0);
                if !aliased.is_empty() && aliased.remove(&loc) {
                    unnamed.push(loc);
                }
            }
        }
        run.clear(shards, (rank, tier), &mut tally);
        if !unnamed.is_empty() {
            // One pass over the map for all of them.
            unnamed.sort_unstable();
            names.retain(|_, l| unnamed.binary_search(&l).is_err(), &*shards);
        }
        names.settle(&*shards);
        self.stored_pairs -= tally.removed;
        self.commit_touched(tally.touched);
        self.enforce_budget();
        if tally.unknown > 0 {
            self.errors.unknown_blocks += tally.unknown as u64;
            return Err(IndexError::UnknownBlocks {
                rank: header.source,
                count: tally.unknown,
                first: blocks[tally.first_unknown as usize],
            });
        }
        Ok(())
    }

    /// Applies a Cleared event: the rank holds nothing any more, in any tier. Its stream fits
    /// the index again.
    pub fn apply_cleared(&mut self, header: EventHeader) -> Result<(), IndexError> {
        let rank = self.event_rank(header)?;
        self.clear_rank(rank);
        self.enforce_budget();
        if let Some(Some(state)) = self.ranks.get_mut(rank as usize) {
            state.needs_resync = false;
        }
        Ok(())
    }

    fn clear_rank(&mut self, rank: u32) {
        let mut dropped = std::mem::take(&mut self.dropped);
        dropped.clear();
        for s in &mut self.shards {
            s.clear_rank(rank, &mut dropped);
        }
        self.stored_pairs -= dropped.len() as u64;
        let mut copies_gone = 0u64;
        self.copies.retain(|&(r, _, _), n| {
            if r == rank {
                copies_gone += *n as u64;
            }
            r != rank
        });
        self.duplicate_copies -= copies_gone;
        if let Some(Some(state)) = self.ranks.get_mut(rank as usize) {
            state.names.clear();
            state.aliased.clear();
        }
        self.dropped = dropped;
        self.commit_touched(u64::MAX);
    }

    /// Removes every rank of a worker and all they hold.
    pub fn remove_worker(&mut self, worker: WorkerId) -> Result<(), IndexError> {
        let ranks: Vec<(WorkerRank, u32)> = self
            .rank_ids
            .iter()
            .filter(|(r, _)| r.worker == worker)
            .map(|(r, id)| (*r, *id))
            .collect();
        if ranks.is_empty() {
            self.errors.unknown_worker += 1;
            return Err(IndexError::UnknownWorker { worker });
        }
        let freed = ranks.len() as u32;
        for (rank, id) in ranks {
            self.clear_rank(id);
            self.rank_ids.remove(&rank);
            self.ranks[id as usize] = None;
            self.free_rank_ids.push(id);
        }
        self.publish_ranks();
        let frees = &self.reader.shared.frees;
        let n = frees.load(primitive::Ordering::Relaxed);
        frees.store(n.saturating_add(freed), primitive::Ordering::Release);
        Ok(())
    }

    /// Commits the shards in `mask` (bit = shard % 64).
    fn commit_touched(&mut self, mask: u64) {
        for (i, s) in self.shards.iter_mut().enumerate() {
            if mask & (1 << (i % 64)) != 0 {
                s.commit();
            }
        }
    }

    // ---- memory ----

    /// Bytes the index accounts for itself: runs, tables, maps and bookkeeping, by capacity.
    pub fn memory_bytes(&self) -> usize {
        let shards: usize = self.shards.iter().map(|s| s.bytes()).sum();
        let names: usize = self
            .ranks
            .iter()
            .flatten()
            .map(|r| r.names.bytes() + set_bytes::<u32>(r.aliased.capacity()))
            .sum();
        shards
            + names
            + set_bytes::<((u32, u8, u32), u32)>(self.copies.capacity())
            + set_bytes::<(WorkerRank, u32)>(self.rank_ids.capacity())
            + self.ranks.capacity() * std::mem::size_of::<Option<RankState>>()
            + self.ranks.len() * std::mem::size_of::<Option<WorkerRank>>()
            + std::mem::size_of::<Self>()
    }

    /// Publishes the clock of Stored events to every shard, for walks to mark the runs they
    /// match with (under a budget only). Out of line: the event loop's code stays as it is
    /// without a budget.
    #[inline(never)]
    fn publish_clock(&self) {
        for s in &self.shards {
            s.set_clock(self.tick);
        }
    }

    fn enforce_budget(&mut self) {
        let Some(budget) = self.config.memory_budget else {
            return;
        };
        let mut nothing_left = false;
        while !nothing_left && self.memory_bytes() > budget {
            let mut dropped = std::mem::take(&mut self.dropped);
            dropped.clear();
            let mut evicted = 0u64;
            let mut touched = 0u64;
            'batch: for _ in 0..32 {
                let mut any = false;
                for (i, s) in self.shards.iter_mut().enumerate() {
                    if s.evict_one(&mut dropped) {
                        evicted += 1;
                        any = true;
                        touched |= 1 << (i % 64);
                    }
                }
                if !any {
                    nothing_left = true;
                    break 'batch;
                }
            }
            self.evicted_blocks += evicted;
            self.evicted_pairs += dropped.len() as u64;
            for d in &dropped {
                let loc = pack(d.shard, d.pos);
                if let Some(n) = self.copies.remove(&(d.rank, d.tier, loc)) {
                    self.duplicate_copies -= n as u64;
                }
            }
            self.stored_pairs -= dropped.len() as u64;
            // Forget the names of the holds dropped, unless the rank still holds the block in
            // another tier. A rank that named the block other than it was first stored under
            // is searched for it.
            for d in &dropped {
                let loc = pack(d.shard, d.pos);
                if self.shards[d.shard].holds(d.pos, d.rank, None) {
                    continue;
                }
                let Some(Some(state)) = self.ranks.get_mut(d.rank as usize) else {
                    continue;
                };
                let names = &mut state.names;
                if state.aliased.remove(&loc) {
                    names.retain(|_, l| l != loc, &self.shards);
                } else if names.get(d.eh, &self.shards) == Some(loc) {
                    names.remove(d.eh, &self.shards);
                } else if d.renamed {
                    names.retain(|_, l| l != loc, &self.shards);
                }
            }
            self.dropped = dropped;
            self.commit_touched(touched);
        }
        if nothing_left && self.memory_bytes() > budget {
            // Nothing left to evict: the budget comes before the room reserved for names.
            for state in self.ranks.iter_mut().flatten() {
                state.names.release(&self.shards);
            }
        }
    }

    // ---- statistics ----

    /// Checks the shards' links (child table, array addresses, hints) against their runs;
    /// for tests and fuzzing. A description of the first inconsistency, if any.
    #[doc(hidden)]
    pub fn check_links(&self) -> Result<(), String> {
        self.shards.iter().try_for_each(|s| s.check_links())
    }

    pub fn stats(&self) -> IndexStats {
        IndexStats {
            shards: self.shards.len(),
            ranks: self.rank_ids.len(),
            runs: self.shards.iter().map(|s| s.runs()).sum(),
            blocks: self.shards.iter().map(|s| s.positions()).sum(),
            stored_pairs: self.stored_pairs,
            duplicate_copies: self.duplicate_copies,
            memory_bytes: self.memory_bytes(),
            memory_budget: self.config.memory_budget,
            evicted_blocks: self.evicted_blocks,
            evicted_pairs: self.evicted_pairs,
            errors: self.errors,
            events: self.events,
            ranks_needing_resync: self
                .ranks
                .iter()
                .flatten()
                .filter(|s| s.needs_resync)
                .count(),
            names: self.ranks.iter().flatten().map(|r| r.names.len()).sum(),
        }
    }
}

#[cfg(test)]
mod tests;
