//! The auth layer: `/health` and `/ready` only are open; routing takes the client key; the
//! fleet, bookings and metrics take the admin key.

use kvroute_serve::ServeOptions;
use reqwest::{Method, StatusCode};
use serde_json::json;

use super::gateway;

/// Every route the gateway serves, with a body where it needs one.
fn routes() -> Vec<(Method, &'static str, Option<serde_json::Value>)> {
    let prompt = json!({"prompt": [1, 2, 3], "max_tokens": 1});
    vec![
        (Method::GET, "/health", None),
        (Method::GET, "/ready", None),
        (Method::POST, "/v1/completions", Some(prompt.clone())),
        (
            Method::POST,
            "/v1/chat/completions",
            Some(json!({"messages": []})),
        ),
        (Method::GET, "/v1/models", None),
        (Method::POST, "/v1/route", Some(prompt.clone())),
        (Method::DELETE, "/v1/route/0", None),
        (Method::GET, "/v1/workers", None),
        (
            Method::POST,
            "/v1/workers",
            Some(json!({"id": 9, "url": "http://127.0.0.1:1", "kv_blocks": 8})),
        ),
        (Method::DELETE, "/v1/workers/9", None),
        (Method::GET, "/metrics", None),
    ]
}

fn is_admin(path: &str, method: &Method) -> bool {
    path.starts_with("/v1/workers")
        || path == "/metrics"
        || (path.starts_with("/v1/route/") && method == Method::DELETE)
}

async fn send(
    client: &reqwest::Client,
    url: &str,
    (method, path, body): &(Method, &str, Option<serde_json::Value>),
    key: Option<&str>,
) -> StatusCode {
    let mut request = client.request(method.clone(), format!("{url}{path}"));
    if let Some(body) = body {
        request = request.json(body);
    }
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    request.send().await.unwrap().status()
}

#[tokio::test]
async fn without_a_key_only_health_and_ready_answer_and_the_client_key_opens_no_admin_route() {
    let (serve, url) = gateway(ServeOptions {
        api_key: Some("client-key".into()),
        admin_key: Some("admin-key".into()),
        ..ServeOptions::default()
    })
    .await;
    let client = reqwest::Client::new();
    for route in routes() {
        let (method, path, _) = &route;
        let open = *path == "/health" || *path == "/ready";
        let none = send(&client, &url, &route, None).await;
        let wrong = send(&client, &url, &route, Some("client-ke")).await;
        let as_client = send(&client, &url, &route, Some("client-key")).await;
        let as_admin = send(&client, &url, &route, Some("admin-key")).await;
        if open {
            assert_ne!(none, StatusCode::UNAUTHORIZED, "{method} {path}");
            continue;
        }
        assert_eq!(
            none,
            StatusCode::UNAUTHORIZED,
            "{method} {path} without a key"
        );
        assert_eq!(
            wrong,
            StatusCode::UNAUTHORIZED,
            "{method} {path} with a wrong key"
        );
        assert!(
            !matches!(as_admin, StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN),
            "{method} {path} with the admin key: {as_admin}"
        );
        if is_admin(path, method) {
            assert_eq!(
                as_client,
                StatusCode::FORBIDDEN,
                "{method} {path} with the client key"
            );
        } else {
            assert_ne!(
                as_client,
                StatusCode::UNAUTHORIZED,
                "{method} {path} with the client key"
            );
            assert_ne!(
                as_client,
                StatusCode::FORBIDDEN,
                "{method} {path} with the client key"
            );
        }
    }
    // A booking through /v1/route is an admin's act; the question alone is a client's.
    let book = (
        Method::POST,
        "/v1/route",
        Some(json!({"prompt": [1, 2, 3], "book": true})),
    );
    assert_eq!(
        send(&client, &url, &book, Some("client-key")).await,
        StatusCode::FORBIDDEN
    );
    assert_ne!(
        send(&client, &url, &book, Some("admin-key")).await,
        StatusCode::FORBIDDEN
    );
    // Refusals are counted, under the route `auth`.
    let metrics = client
        .get(format!("{url}/metrics"))
        .bearer_auth("admin-key")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics
            .lines()
            .any(|l| l.contains("route=\"auth\"") && l.contains("client_error")),
        "{metrics}"
    );
    serve.stop();
}

#[tokio::test]
async fn with_only_a_client_key_the_admin_routes_are_closed_and_metrics_can_be_public() {
    let (serve, url) = gateway(ServeOptions {
        api_key: Some("client-key".into()),
        public_metrics: true,
        ..ServeOptions::default()
    })
    .await;
    let client = reqwest::Client::new();
    let workers = (Method::GET, "/v1/workers", None);
    assert_eq!(
        send(&client, &url, &workers, Some("client-key")).await,
        StatusCode::FORBIDDEN
    );
    assert_eq!(
        send(&client, &url, &workers, None).await,
        StatusCode::UNAUTHORIZED
    );
    let metrics = (Method::GET, "/metrics", None);
    assert_eq!(send(&client, &url, &metrics, None).await, StatusCode::OK);
    serve.stop();
}

#[tokio::test]
async fn one_key_for_both_roles_or_an_empty_key_is_refused_at_start() {
    for (api_key, admin_key) in [
        (Some("same"), Some("same")),
        (Some(""), None),
        (None, Some("")),
    ] {
        let started = kvroute_serve::RunningServe::start(ServeOptions {
            listen: "127.0.0.1:0".parse().unwrap(),
            api_key: api_key.map(Into::into),
            admin_key: admin_key.map(Into::into),
            ..ServeOptions::default()
        })
        .await;
        assert!(started.is_err(), "{api_key:?} {admin_key:?}");
    }
}
