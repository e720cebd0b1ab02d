//! What the tests that drive an engine's own KV-event publisher (SGLang's, vLLM's: Python
//! processes, see `scripts/*_publisher.py`) share: the process, its blocks, and serve's view of
//! them.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::{free_port, Process};

/// The fixtures' Python and the module path holding `engine`'s publisher `module` (relative
/// to `target/fixtures/<engine>`), when `scripts/fixtures.sh` has run.
pub fn fixtures(engine: &str, module: &str) -> Option<(PathBuf, PathBuf)> {
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/fixtures");
    let python = fixtures.join("venv/bin/python");
    let path = fixtures.join(engine);
    (python.exists() && path.join(module).exists()).then_some((python, path))
}

/// `kvroute serve` following one worker of `dp_size` ranks publishing on `events`/`replay`
/// (port + r for rank r), answering on the URL returned. The worker's HTTP is never called:
/// the tests ask `/v1/route`.
pub async fn serve(events: &str, replay: &str, dp_size: u32) -> (Process, String) {
    serve_sized(events, replay, dp_size, 4096).await
}

/// [`serve`], the worker declared with `kv_blocks` blocks per rank.
pub async fn serve_sized(
    events: &str,
    replay: &str,
    dp_size: u32,
    kv_blocks: u64,
) -> (Process, String) {
    let http = free_port();
    let process = Process(
        Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(["serve", "--listen", &format!("127.0.0.1:{http}")])
            .arg("--worker")
            .arg(format!(
                "url=http://127.0.0.1:1,events={events},replay={replay},kv_blocks={kv_blocks},dp_size={dp_size}"
            ))
            .env("KVROUTE_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let url = format!("http://127.0.0.1:{http}");
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while client.get(format!("{url}/health")).send().await.is_err() {
        assert!(Instant::now() < deadline, "serve never answered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (process, url)
}

pub struct Publisher {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Publisher {
    /// `scripts/<script>` run by `python` with `args` and `path` as its module path, once it
    /// says it is bound.
    pub fn start(python: &PathBuf, path: &PathBuf, script: &str, args: &[String]) -> Publisher {
        let scripts = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts");
        let mut child = Command::new(python)
            .arg(scripts.join(script))
            .args(args)
            .env("PYTHONPATH", path)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut publisher = Publisher {
            stdin: child.stdin.take().unwrap(),
            stdout: BufReader::new(child.stdout.take().unwrap()),
            child,
        };
        let mut line = String::new();
        publisher.stdout.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "ok", "the publisher said {line:?}");
        publisher
    }

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

/// Serve's event counts of worker 0's rank `rank`.
pub async fn events(client: &reqwest::Client, url: &str, rank: usize) -> Value {
    let w: Value = client
        .get(format!("{url}/v1/workers"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    w["workers"][0]["ranks"][rank]["events"].clone()
}
