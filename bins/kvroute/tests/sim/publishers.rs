//! What the tests that drive an engine's own KV-event publisher (SGLang's, vLLM's: Python
//! processes, see `scripts/*_publisher.py`) share: the process, its blocks, and serve's view of
//! them.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

pub struct Publisher {
    pub child: Child,
    pub stdin: ChildStdin,
    pub stdout: BufReader<ChildStdout>,
}

impl Publisher {
    pub fn send(&mut self, command: Value) {
        writeln!(self.stdin, "{command}").unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "ok", "the publisher answered {line:?}");
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Blocks of 16 tokens `first..`, SGLang-style signed hashes (negative ones included).
pub fn blocks(first: u32, n: u32) -> (Vec<i64>, Vec<u32>) {
    let hashes = (0..n)
        .map(|b| -((first as i64) * 1_000 + b as i64) - 1)
        .collect();
    let tokens = (first * 16..(first + n) * 16).collect();
    (hashes, tokens)
}

pub async fn predicted(client: &reqwest::Client, url: &str, tokens: &[u32]) -> u64 {
    let mut prompt = tokens.to_vec();
    prompt.extend([7, 7, 7]);
    let v: Value = client
        .post(format!("{url}/v1/route"))
        .json(&json!({"prompt": prompt}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v["predicted_cached_tokens"].as_u64().unwrap()
}

pub async fn wait_predicted(client: &reqwest::Client, url: &str, tokens: &[u32], want: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let got = predicted(client, url, tokens).await;
        if got == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "predicted {got} cached tokens, want {want}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub async fn events(client: &reqwest::Client, url: &str) -> Value {
    let w: Value = client
        .get(format!("{url}/v1/workers"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    w["workers"][0]["ranks"][0]["events"].clone()
}
