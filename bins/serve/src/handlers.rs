//! The OpenAI routes' handlers: a request is read for its routing fields (`proxy`), then served
//! whole (`proxy::dispatch`) or, in a fleet with prefill and decode workers, in the two halves
//! of disaggregated serving (`disagg`).

use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;

use crate::proxy::{dispatch, read_completion_async, read_prompt_async, Api, Asked, Leg, Routed};
use crate::AppState;

/// `POST /v1/completions`.
pub(crate) async fn completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    const ROUTE: &str = "completions";
    let started = Instant::now();
    let routed = match read_completion_async(&state, &body).await {
        Ok(routed) => routed,
        Err(refusal) => return refusal.respond(&state, ROUTE),
    };
    let read_in = started.elapsed();
    forward(
        &state,
        ROUTE,
        Api::Completions,
        &headers,
        body,
        &routed,
        read_in,
    )
    .await
}

/// `POST /v1/chat/completions`.
pub(crate) async fn chat_completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    const ROUTE: &str = "chat_completions";
    let started = Instant::now();
    let routed = match read_prompt_async(&state, &body, true).await {
        Ok((_, routed)) => routed,
        Err(refusal) => return refusal.respond(&state, ROUTE),
    };
    let read_in = started.elapsed();
    forward(&state, ROUTE, Api::Chat, &headers, body, &routed, read_in).await
}

/// Routes the client's request: whole, or in a fleet with prefill and decode workers, in the
/// two halves of disaggregated serving.
async fn forward(
    state: &AppState,
    route: &'static str,
    api: Api,
    headers: &HeaderMap,
    body: Bytes,
    routed: &Routed,
    read_in: std::time::Duration,
) -> Response {
    let asked = Asked {
        route,
        api,
        routed,
        read_in,
    };
    if state.backends.any_split() {
        return crate::disagg::forward(state, asked, headers, body).await;
    }
    dispatch(state, asked, Leg::whole(body)).await
}
