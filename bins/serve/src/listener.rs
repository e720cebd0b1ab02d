//! The HTTP listener: hyper's HTTP/1 connections under the gateway's bounds, which
//! `axum::serve` does not set.
//!
//! * **A connection cap**: past `max_connections` open connections a new one is closed at
//!   once (counted), so slow or idle clients cannot take every socket and task.
//! * **A header timeout**, which is also the idle timeout: hyper arms it whenever a connection
//!   waits for a request's head, the first or the next on a kept-alive connection; a client
//!   that sends no full head in time is cut off.
//! * **A body timeout**, in the layer in front of every route ([`edge`]): the whole body must
//!   arrive within `body_timeout` (a client trickling bytes holds no handler).
//! * **Graceful shutdown**: on stop, no new connection is accepted; each open one finishes its
//!   request in flight and closes.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::Response;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{Notify, Semaphore};

use super::auth;
use super::proxy::error;
use super::AppState;

/// The listener's bounds.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Bounds {
    /// Most connections open at once.
    pub max_connections: usize,
    /// Longest wait for a request's head, on a new or a kept-alive connection.
    pub header_timeout: Duration,
}

/// Serves `app` on `listener` within `bounds` until `stop` is notified, then lets the open
/// connections finish their requests.
pub(crate) async fn serve(
    listener: TcpListener,
    app: axum::Router,
    bounds: Bounds,
    stop: Arc<Notify>,
    refused: prometheus::IntCounter,
) -> std::io::Result<()> {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(bounds.header_timeout)
        .keep_alive(true);
    let permits = Arc::new(Semaphore::new(bounds.max_connections));
    let graceful = GracefulShutdown::new();
    loop {
        let (tcp, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(x) => x,
                Err(e) => {
                    // Out of descriptors, or a connection reset before it was accepted: the
                    // listener goes on after a breath.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
            () = stop.notified() => break,
        };
        let Ok(permit) = Arc::clone(&permits).try_acquire_owned() else {
            refused.inc();
            drop(tcp);
            continue;
        };
        // Small writes (SSE chunks, a response's head) go out at once: with Nagle's algorithm
        // a chunk waits for the peer's delayed ACK, some 40 ms.
        let _ = tcp.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let connection = graceful.watch(http.serve_connection(TokioIo::new(tcp), service));
        tokio::spawn(async move {
            // A connection's own end (closed, timed out, reset) is no error of the server's.
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "connection ended");
            }
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// The one layer in front of every route: the key checked first ([`auth::admit`]; what it
/// granted goes into the request's extensions), then the whole body read within the
/// configured time and size, before any handler sees it: 408 when it is too slow, 413 when it
/// is too large (both counted, in OpenAI's shape). One layer, over one `Arc` of the state:
/// each layer costs every request a boxed future and a clone of its state.
pub(crate) async fn edge(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    let granted = match auth::admit(&state, &request) {
        Ok(granted) => granted,
        Err(status) => return auth::refuse(&state, status),
    };
    let (mut parts, body) = request.into_parts();
    parts.extensions.insert(granted);
    let limit = state.options.max_body;
    let read = axum::body::to_bytes(body, limit);
    let bytes = match tokio::time::timeout(state.options.body_timeout, read).await {
        Ok(Ok(bytes)) => bytes,
        Ok(Err(_)) => {
            return error(
                &state,
                "body",
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the request body is larger than {limit} bytes, or was cut off"),
            )
        }
        Err(_) => {
            return error(
                &state,
                "body",
                StatusCode::REQUEST_TIMEOUT,
                "the request body did not arrive in time",
            )
        }
    };
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}
