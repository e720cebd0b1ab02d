//! kvroute's own request wire in front of the same engine: the transport's
//! [`WorkerServer`](kvroute_transport::worker::WorkerServer) takes routers' rkyv `Dispatch`
//! frames (io_uring or epoll), and each request runs through the driver as an HTTP one does.
//! A Cancel, or the router's connection ending, drops the request's future, which aborts it
//! in the engine; heartbeats carry the engine's occupancy.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use kvroute_transport::wire::{Dispatch, FinishReason, Hello, RankLoad, Role};
use kvroute_transport::worker::{
    Engine as WireEngine, ResponseSink, WorkerServer, WorkerServerConfig, WorkerServerError,
};
use kvroute_transport::PROTOCOL_VERSION;
use tokio::sync::{mpsc, oneshot};

use super::driver::{Command, Driver, PromptKv};
use kvroute_sim::{EngineConfig, Finish};

/// Starts the wire's server on `addr` (its own runtime threads), answering routers' Hello as
/// worker `worker_id` with one rank of the engine's size.
pub(crate) fn start(
    addr: SocketAddr,
    worker_id: u64,
    engine: &EngineConfig,
    driver: Driver,
) -> Result<WorkerServer, WorkerServerError> {
    let hello = Hello {
        protocol_version: PROTOCOL_VERSION,
        worker_id,
        dp_start: 0,
        dp_size: 1,
        kv_blocks: u64::from(engine.kv_blocks),
        block_size: engine.block_size,
        role: Role::Aggregated,
        max_batched_tokens: u64::from(engine.max_num_batched_tokens),
        labels: Vec::new(),
    };
    WorkerServer::start(
        WorkerServerConfig {
            threads: 1,
            ..WorkerServerConfig::new(addr)
        },
        hello,
        Arc::new(WireServed { driver }),
    )
}

/// The driver behind the wire.
pub(crate) struct WireServed {
    pub(crate) driver: Driver,
}

/// Aborts the request in the engine when its future is dropped before it ends.
struct AbortOnDrop {
    driver: Driver,
    id: Option<kvroute_sim::RequestId>,
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(id) = self.id {
            self.driver.send(Command::Abort(id));
        }
    }
}

impl WireEngine for WireServed {
    fn serve(&self, request: Dispatch, sink: ResponseSink) -> impl Future<Output = ()> + 'static {
        let driver = self.driver.clone();
        async move {
            let (outputs_tx, mut outputs) = mpsc::unbounded_channel();
            let (reply, admitted) = oneshot::channel();
            let admit = Command::Admit {
                prompt: request.tokens,
                cache_salt: None,
                max_output_tokens: request.sampling.max_tokens,
                kv: PromptKv::Computed,
                sink: outputs_tx,
                reply,
            };
            if !driver.send(admit) {
                let _ = sink.fail("the engine has stopped").await;
                return;
            }
            let id = match admitted.await {
                Ok(Ok(id)) => id,
                Ok(Err(e)) => {
                    let _ = sink.fail(e.to_string()).await;
                    return;
                }
                _ => {
                    let _ = sink.fail("the engine has stopped").await;
                    return;
                }
            };
            let mut guard = AbortOnDrop {
                driver,
                id: Some(id),
            };
            let mut sink = sink;
            while let Some(output) = outputs.recv().await {
                match output.finish {
                    None => {
                        if !output.tokens.is_empty() && sink.send(output.tokens).await.is_err() {
                            return;
                        }
                    }
                    Some(finish) => {
                        // The engine has let the request go: nothing to abort.
                        guard.id = None;
                        let _ = match finish {
                            Finish::Length => {
                                sink.finish(output.tokens, FinishReason::Length).await
                            }
                            Finish::Aborted => sink.fail("the engine aborted the request").await,
                        };
                        return;
                    }
                }
            }
            let _ = sink.fail("the engine has stopped").await;
        }
    }

    fn load(&self) -> Vec<RankLoad> {
        let o = self.driver.occupancy();
        vec![RankLoad {
            dp_rank: 0,
            active_blocks: u64::from(o.blocks_in_use),
            total_blocks: u64::from(o.blocks_total),
            running: o.running,
            waiting: o.waiting,
        }]
    }
}
