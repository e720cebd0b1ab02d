//! The listener's bounds against slow and idle clients: a head or a body that does not come in
//! time, an idle kept-alive connection, and more connections than the cap.

use std::time::Duration;

use kvroute_serve::ServeOptions;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::gateway;

fn bounded() -> ServeOptions {
    ServeOptions {
        header_timeout: Duration::from_millis(300),
        body_timeout: Duration::from_millis(300),
        max_connections: 8,
        ..ServeOptions::default()
    }
}

/// What the server sends until it closes the connection, and how long that took; panics if it
/// is still open after `within`.
async fn until_closed(tcp: &mut TcpStream, within: Duration) -> (String, Duration) {
    let start = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout_at(start + within, tcp.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Err(_) => panic!(
                "still open after {within:?}: {}",
                String::from_utf8_lossy(&got)
            ),
        }
    }
    (String::from_utf8_lossy(&got).into_owned(), start.elapsed())
}

#[tokio::test]
async fn a_client_that_never_finishes_its_head_is_cut_off() {
    let (serve, url) = gateway(bounded()).await;
    let mut tcp = TcpStream::connect(serve.listen).await.unwrap();
    tcp.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let (_, took) = until_closed(&mut tcp, Duration::from_secs(5)).await;
    assert!(took >= Duration::from_millis(250), "{took:?}");
    // The server still answers others.
    let ok = reqwest::get(format!("{url}/health")).await.unwrap();
    assert!(ok.status().is_success());
    serve.stop();
}

#[tokio::test]
async fn an_idle_kept_alive_connection_is_closed() {
    let (serve, _) = gateway(bounded()).await;
    let mut tcp = TcpStream::connect(serve.listen).await.unwrap();
    tcp.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let (answer, _) = until_closed(&mut tcp, Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    serve.stop();
}

#[tokio::test]
async fn a_body_that_trickles_gets_a_408() {
    let (serve, _) = gateway(bounded()).await;
    let mut tcp = TcpStream::connect(serve.listen).await.unwrap();
    tcp.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
          Content-Length: 100\r\n\r\n{\"prompt\":",
    )
    .await
    .unwrap();
    let (answer, _) = until_closed(&mut tcp, Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("did not arrive in time"), "{answer}");
    serve.stop();
}

#[tokio::test]
async fn past_the_connection_cap_new_connections_are_closed_at_once_and_counted() {
    let (serve, url) = gateway(ServeOptions {
        header_timeout: Duration::from_secs(30),
        max_connections: 4,
        public_metrics: true,
        ..ServeOptions::default()
    })
    .await;
    let mut held = Vec::new();
    for _ in 0..4 {
        let mut tcp = TcpStream::connect(serve.listen).await.unwrap();
        tcp.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 512];
        let n = tcp.read(&mut buf).await.unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
        held.push(tcp);
    }
    let mut fifth = TcpStream::connect(serve.listen).await.unwrap();
    let _ = fifth
        .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await;
    let (answer, took) = until_closed(&mut fifth, Duration::from_secs(5)).await;
    assert!(answer.is_empty(), "{answer}");
    assert!(took < Duration::from_secs(2), "{took:?}");
    // One held connection closes: room for a new one.
    drop(held.pop());
    tokio::time::sleep(Duration::from_millis(100)).await;
    let metrics = reqwest::get(format!("{url}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("kvroute_connections_refused_total 1"),
        "{metrics}"
    );
    serve.stop();
}
