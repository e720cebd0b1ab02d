//! One worker registry for every replica of a fleet, in NATS JetStream's key-value store: the
//! bucket `kvroute-<fleet>-workers`, one key per worker (`w<id>`) holding its spec as JSON.
//!
//! ```text
//!  POST /v1/workers on any replica ──local add──▶ put w<id> ──watch──▶ every replica adds it
//!  DELETE /v1/workers/{id} ──delete w<id> ──watch──▶ every replica drains it and removes it
//!  start: each configured worker ──▶ created in the bucket unless it is there, or was removed
//! ```
//!
//! The engines stay the source of truth for caches; the bucket holds only who the workers are.
//! A replica whose registry is not reachable (NATS down, or a server without JetStream) keeps
//! its workers and changes them through its own API alone, and says so (`"shared": false` in
//! the answer, a log line); it follows the bucket once it can. What its API changed before the
//! bucket was first reached is written then (`"pending": true` in the answer): workers added
//! are created unless the bucket holds their ids, workers removed are deleted unless the
//! bucket holds another spec under their ids. Workers' `api_key`s are in the
//! bucket: NATS access to it must be guarded as the configuration file is.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_nats::jetstream::kv::{Entry, Operation, Store};
use futures_util::StreamExt;
use kvroute_core::{WorkerId, WorkerRank};
use tokio::task::JoinHandle;

use super::backends::BackendSpec;
use super::AppState;

/// The store, once reached, and the client it is reached by.
#[derive(Debug, Default)]
pub(crate) struct SharedRegistry {
    store: OnceLock<Store>,
    client: OnceLock<async_nats::Client>,
    /// The latest change the watch has seen per worker id: its revision, and whether it
    /// removed the worker. A change applied in a task of its own (a worker drained before it
    /// rejoins) checks it is still the latest before it acts.
    latest: std::sync::Mutex<std::collections::HashMap<u64, (u64, bool)>>,
    /// Workers removed through this replica's API before the bucket was first reached, to
    /// delete from it then; `store` is set under this lock, so none is missed.
    removed_early: std::sync::Mutex<Vec<BackendSpec>>,
    /// The drains and joins the bucket's changes started: aborted with the registry's watch
    /// when the server stops.
    tasks: std::sync::Mutex<tokio::task::JoinSet<()>>,
}

/// What became of a worker change, for the fleet's other replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shared {
    /// The registry has it: every replica follows.
    Yes,
    /// Not acknowledged (NATS down), or the bucket not reached yet: written when it is,
    /// while this replica runs (never, from a server without JetStream: the log says so).
    Pending,
    /// No registry (serve runs without NATS): this replica's own.
    No,
}

impl Shared {
    /// The answer's `"shared"` and `"pending"`.
    pub(crate) fn json(self) -> (bool, bool) {
        (self == Shared::Yes, self == Shared::Pending)
    }
}

impl SharedRegistry {
    /// Runs `task` (a drain, a join) until it ends or the registry stops.
    fn spawn(&self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        let mut tasks = self.tasks.lock().unwrap_or_else(|p| p.into_inner());
        while tasks.try_join_next().is_some() {}
        tasks.spawn(task);
    }

    /// Stops every drain and join the registry started (the server is stopping).
    pub(crate) fn abort_tasks(&self) {
        self.tasks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .abort_all();
    }

    /// The bucket, when it has been reached; before, `early` changes the removals kept for
    /// then, under the lock the bucket is set under (so none is missed).
    fn reached_or(&self, early: impl FnOnce(&mut Vec<BackendSpec>)) -> Option<Store> {
        let mut removed = self.removed_early.lock().unwrap_or_else(|p| p.into_inner());
        let store = self.store().cloned();
        if store.is_none() {
            early(&mut removed);
        }
        store
    }

    fn note(&self, id: u64, revision: u64, removed: bool) {
        if let Ok(mut latest) = self.latest.lock() {
            latest.insert(id, (revision, removed));
        }
    }

    /// The latest change seen for worker `id`.
    fn latest(&self, id: u64) -> Option<(u64, bool)> {
        self.latest.lock().ok()?.get(&id).copied()
    }

    /// The bucket, when it has been reached.
    pub(crate) fn store(&self) -> Option<&Store> {
        self.store.get()
    }

    /// `"shared"` while the bucket is reached and NATS connected, `"unreachable"` otherwise.
    pub(crate) fn state(&self) -> &'static str {
        let connected = self
            .client
            .get()
            .is_some_and(|c| c.connection_state() == async_nats::connection::State::Connected);
        if self.store().is_some() && connected {
            "shared"
        } else {
            "unreachable"
        }
    }
}

/// Why a worker cannot be added to the fleet's registry.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Conflict {
    /// The registry holds another worker under the id.
    #[error(
        "worker {0} is in the fleet's registry with another spec: remove it first (DELETE \
         /v1/workers/{0})"
    )]
    Taken(u64),
}

/// Before a worker joins through this replica's API: refused when the registry holds another
/// spec under its id (it would replace that worker on every replica).
pub(crate) async fn check_add(store: &Store, spec: &BackendSpec) -> Result<(), Conflict> {
    match store.entry(key(spec.id)).await {
        Ok(Some(e)) if e.operation == Operation::Put => {
            match serde_json::from_slice::<BackendSpec>(&e.value) {
                Ok(held) if held == *spec => Ok(()),
                _ => Err(Conflict::Taken(spec.id)),
            }
        }
        // Not there, removed, or not readable now (the create below then decides).
        _ => Ok(()),
    }
}

/// Shares a worker that joined through this replica's API: written to the bucket now, or,
/// before the bucket was first reached, created when it is (a removal of the same id made
/// before then is forgotten).
pub(crate) async fn share_join(
    registry: &SharedRegistry,
    spec: &BackendSpec,
) -> Result<Shared, Conflict> {
    // The worker is among this replica's by now: created with the others once the bucket is
    // reached.
    let reached = registry.reached_or(|early| early.retain(|removed| removed.id != spec.id));
    match reached {
        Some(store) => share_add(&store, spec).await,
        None => Ok(Shared::Pending),
    }
}

/// Writes a worker that joined through this replica's API to the registry: created, so that
/// a spec written meanwhile by another replica is not replaced.
async fn share_add(store: &Store, spec: &BackendSpec) -> Result<Shared, Conflict> {
    let value = serde_json::to_vec(spec).unwrap_or_default();
    match store.create(key(spec.id), value.into()).await {
        Ok(_) => Ok(Shared::Yes),
        Err(e) if e.kind() == async_nats::jetstream::kv::CreateErrorKind::AlreadyExists => {
            // The same spec already there is shared; another is a conflict.
            match check_add(store, spec).await {
                Ok(()) => Ok(Shared::Yes),
                Err(c) => Err(c),
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, worker = spec.id, "worker registry: not acknowledged");
            Ok(Shared::Pending)
        }
    }
}

/// Removes a worker from the registry (its removal through this replica's API); before the
/// bucket was first reached, kept to remove once it is.
pub(crate) async fn share_removal(registry: &SharedRegistry, spec: &BackendSpec) -> Shared {
    let Some(store) = registry.reached_or(|early| early.push(spec.clone())) else {
        return Shared::Pending;
    };
    let id = spec.id;
    match store.delete(key(id)).await {
        Ok(()) => Shared::Yes,
        Err(e) => {
            tracing::warn!(error = %e, worker = id, "worker registry: removal not acknowledged");
            Shared::Pending
        }
    }
}

/// The bucket of fleet `fleet`.
pub(crate) fn bucket(fleet: &str) -> String {
    format!("kvroute-{fleet}-workers")
}

/// Worker `id`'s key.
pub(crate) fn key(id: u64) -> String {
    format!("w{id}")
}

fn id_of(key: &str) -> Option<u64> {
    key.strip_prefix('w')?.parse().ok()
}

/// Reaches the bucket (retrying while it cannot), registers the configured workers, then
/// applies every change to the fleet's workers.
pub(crate) fn start(
    state: AppState,
    client: async_nats::Client,
    fleet: &str,
    shared: Arc<SharedRegistry>,
) -> JoinHandle<()> {
    let name = bucket(fleet);
    let _ = shared.client.set(client.clone());
    tokio::spawn(async move {
        let js = async_nats::jetstream::new(client);
        let mut warned = false;
        let store = loop {
            let found = match js.get_key_value(name.as_str()).await {
                Ok(s) => Ok(s),
                Err(_) => create_bucket(&js, &name).await,
            };
            match found {
                Ok(s) => break s,
                Err(e) => {
                    if !warned {
                        tracing::warn!(
                            bucket = %name,
                            error = %e,
                            "worker registry unreachable (NATS down, or no JetStream): workers \
                             change through this replica's own API alone until it is"
                        );
                        warned = true;
                    }
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            }
        };
        let removed_early = {
            let mut early = shared
                .removed_early
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let _ = shared.store.set(store.clone());
            std::mem::take(&mut *early)
        };
        tracing::info!(bucket = %name, "worker registry shared");
        let mut removed_early = removed_early;
        while !removed_early.is_empty() {
            removed_early = remove_early(&store, removed_early).await;
            if !removed_early.is_empty() {
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
        register_configured(&state, &shared, &store).await;
        loop {
            match store.watch_with_history(">").await {
                Ok(mut watch) => {
                    while let Some(entry) = watch.next().await {
                        match entry {
                            Ok(entry) => apply(&state, &shared, entry),
                            Err(e) => {
                                tracing::warn!(error = %e, "worker registry: watch failed");
                                break;
                            }
                        }
                    }
                }
                Err(e) => tracing::warn!(error = %e, "worker registry: cannot watch"),
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    })
}

/// Creates the bucket: the stream JetStream's key-value layout defines (`KV_<bucket>` on
/// `$KV.<bucket>.>`, the latest value per key, deletes as markers), made directly rather than
/// through the client's `create_key_value`, which first reads account fields that servers
/// before 2.10 do not send (Debian 12 ships 2.9).
async fn create_bucket(
    js: &async_nats::jetstream::Context,
    name: &str,
) -> Result<Store, async_nats::Error> {
    js.get_or_create_stream(async_nats::jetstream::stream::Config {
        name: format!("KV_{name}"),
        subjects: vec![format!("$KV.{name}.>")],
        max_messages_per_subject: 1,
        discard: async_nats::jetstream::stream::DiscardPolicy::New,
        allow_rollup: true,
        deny_delete: true,
        allow_direct: true,
        ..Default::default()
    })
    .await?;
    Ok(js.get_key_value(name).await?)
}

/// The workers removed through this replica's API before the bucket was reached leave it
/// too, unless it holds another spec under their ids (a worker added since, elsewhere).
/// Returns those it could not read or write, to try again.
async fn remove_early(store: &Store, removed: Vec<BackendSpec>) -> Vec<BackendSpec> {
    let mut again = Vec::new();
    for spec in removed {
        let id = spec.id;
        let ours = match store.entry(key(id)).await {
            Ok(None) => true,
            Ok(Some(e)) if e.operation == Operation::Put => {
                serde_json::from_slice::<BackendSpec>(&e.value).is_ok_and(|held| held == spec)
            }
            // Removed already.
            Ok(Some(_)) => false,
            Err(e) => {
                tracing::warn!(worker = id, error = %e, "worker registry: cannot read");
                again.push(spec);
                continue;
            }
        };
        if !ours {
            continue;
        }
        match store.delete(key(id)).await {
            Ok(()) => tracing::info!(
                worker = id,
                "worker removed here while the registry was unreachable: removed from the fleet's"
            ),
            Err(e) => {
                tracing::warn!(worker = id, error = %e, "worker registry: removal not written");
                again.push(spec);
            }
        }
    }
    again
}

/// Each of this replica's workers is created in the bucket unless it is there; one the bucket
/// says was removed leaves this replica too.
async fn register_configured(state: &AppState, shared: &SharedRegistry, store: &Store) {
    for b in state.backends.all() {
        let id = b.spec.id;
        match store.entry(key(id)).await {
            Ok(Some(e)) if e.operation != Operation::Put => {
                tracing::info!(
                    worker = id,
                    "worker removed from the fleet's registry: leaving"
                );
                spawn_removal(state, shared, id);
            }
            Ok(Some(_)) => {}
            Ok(None) => {
                let spec = serde_json::to_vec(&b.spec).unwrap_or_default();
                if let Err(e) = store.create(key(id), spec.into()).await {
                    tracing::debug!(worker = id, error = %e, "worker registry: not created");
                }
            }
            Err(e) => tracing::warn!(worker = id, error = %e, "worker registry: cannot read"),
        }
    }
}

/// Applies one change of the bucket to this replica's workers, in the watch's order: each is
/// noted as the worker's latest before anything is done, and a join that waits (a changed
/// worker drained first, or the join itself) is dropped, or undone, when a later change of
/// the same worker was seen meanwhile.
fn apply(state: &AppState, shared: &Arc<SharedRegistry>, entry: Entry) {
    let Some(id) = id_of(&entry.key) else {
        return;
    };
    let revision = entry.revision;
    match entry.operation {
        Operation::Put => {
            shared.note(id, revision, false);
            let spec: BackendSpec = match serde_json::from_slice(&entry.value) {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(worker = id, error = %e, "worker registry: not a worker spec");
                    return;
                }
            };
            if spec.id != id {
                tracing::warn!(key = %entry.key, id = spec.id, "worker registry: key and id differ");
                return;
            }
            let (state, held) = (state.clone(), Arc::clone(shared));
            let latest = move |id| held.latest(id);
            let still_latest = {
                let latest = latest.clone();
                move || latest(id) == Some((revision, false))
            };
            shared.spawn(async move {
                if let Some(b) = state.backends.get(id) {
                    if b.spec == spec {
                        return;
                    }
                    tracing::warn!(
                        worker = id,
                        "worker's spec differs in the fleet's registry: drained, then rejoining \
                         as the registry has it"
                    );
                    let _ = drain_and_remove(&state, &b).await;
                }
                if !still_latest() {
                    return;
                }
                match state
                    .backends
                    .add(&state.router, &state.client, spec, &state.options.limits())
                    .await
                {
                    Ok(b) => match latest(id) {
                        // Removed while it joined: the removal stands (its own task found
                        // nothing to remove yet). A later spec's task replaces it itself.
                        Some((_, true)) => {
                            let _ = drain_and_remove(&state, &b).await;
                        }
                        _ => tracing::info!(worker = id, "worker joined from the fleet's registry"),
                    },
                    Err(e) => tracing::warn!(
                        worker = id,
                        error = %e,
                        "worker from the fleet's registry refused"
                    ),
                }
            });
        }
        Operation::Delete | Operation::Purge => {
            shared.note(id, revision, true);
            spawn_removal(state, shared, id);
        }
    }
}

/// Drains worker `id` and removes it, unless it is gone or being drained already.
fn spawn_removal(state: &AppState, shared: &SharedRegistry, id: u64) {
    if state.draining().contains(&WorkerId(id)) {
        return;
    }
    let Some(backend) = state.backends.get(id) else {
        return;
    };
    let state = state.clone();
    shared.spawn(async move {
        match drain_and_remove(&state, &backend).await {
            Ok(blocks) => tracing::info!(
                worker = id,
                blocks,
                "worker left, removed from the fleet's registry"
            ),
            Err(e) => tracing::debug!(worker = id, error = %e, "worker registry: removal"),
        }
    });
}

/// No new request goes to `backend`; once its requests here have ended (or the drain timeout
/// passed) it leaves, and its blocks leave the index. Returns the blocks removed.
pub(crate) async fn drain_and_remove(
    state: &AppState,
    backend: &super::backends::Backend,
) -> Result<usize, super::backends::BackendError> {
    let id = backend.spec.id;
    state.set_draining(WorkerId(id), true);
    let deadline = tokio::time::Instant::now() + state.options.drain_timeout;
    loop {
        let active: u64 = (0..backend.spec.dp_size)
            .filter_map(|r| state.router.load(WorkerRank::new(id, r)))
            .map(|l| l.requests)
            .sum();
        if active == 0 || tokio::time::Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let result = state.backends.remove(&state.router, id);
    state.set_draining(WorkerId(id), false);
    result
}
