//! The gateway's edges, through its public API on loopback: a `RunningServe` in this process,
//! probed by a real HTTP client as a hostile client would (`auth.rs`: every route without a
//! key and with the wrong one; `workers.rs`: adds that must change nothing when refused;
//! `bookings.rs`: bookings that expire).

// A test: it may unwrap, panic and print (the library code may not).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout,
    clippy::print_stderr
)]

mod auth;
mod bookings;
mod config;
mod disagg;
mod listener;
mod prompts;
mod upstream;
mod workers;

use kvroute_serve::{RunningServe, ServeOptions};

/// A gateway on a free loopback port, with no engine.
pub async fn gateway(options: ServeOptions) -> (RunningServe, String) {
    let serve = RunningServe::start(ServeOptions {
        listen: "127.0.0.1:0".parse().unwrap(),
        ..options
    })
    .await
    .unwrap();
    let url = format!("http://{}", serve.listen);
    (serve, url)
}

/// `GET url` as JSON (no key).
pub async fn get_json(client: &reqwest::Client, url: &str) -> serde_json::Value {
    client.get(url).send().await.unwrap().json().await.unwrap()
}

/// `GET url` as text (no key).
pub async fn get_text(client: &reqwest::Client, url: &str) -> String {
    client.get(url).send().await.unwrap().text().await.unwrap()
}

/// `POST url` with a JSON body (no key): the status and the JSON answer (null if none).
pub async fn post_json(
    client: &reqwest::Client,
    url: &str,
    body: &serde_json::Value,
) -> (reqwest::StatusCode, serde_json::Value) {
    let r = client.post(url).json(body).send().await.unwrap();
    let status = r.status();
    (status, r.json().await.unwrap_or(serde_json::Value::Null))
}
