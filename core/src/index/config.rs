//! How an index is set up ([`IndexConfig`]), how one match runs ([`MatchOptions`]), and the
//! limits a configuration or a worker's report is held to.

/// Index configuration.
#[derive(Clone, Debug)]
pub struct IndexConfig {
    /// Number of shards; 0 means one per available core. At most 16.
    pub shards: usize,
    /// Upper bound of the index's own memory, in bytes; `None` means unbounded. Over it, the
    /// least recently used leaf blocks are evicted (used: stored into, or read by a match).
    pub memory_budget: Option<usize>,
    /// Register a rank on its first event. When false, ranks must be registered with
    /// [`PrefixIndex::register_rank`] and events of other ranks are rejected.
    ///
    /// [`PrefixIndex::register_rank`]: super::PrefixIndex::register_rank
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

/// Most shards an index has: a position packs its shard into 4 bits.
pub(crate) const MAX_SHARDS: usize = 16;

/// Most blocks [`PrefixIndex::reserve_blocks`] makes room for in one rank's name map (about
/// 370 MB of map): a capacity past it, from a worker's report, is taken as this.
///
/// [`PrefixIndex::reserve_blocks`]: super::PrefixIndex::reserve_blocks
pub(crate) const MAX_RESERVED_BLOCKS: u64 = 1 << 24;
