//! What `kvroute serve` adds to a request: a fake engine that answers at once, called
//! directly, through kvroute serve, and (with `--sglang`) through SGLang's router
//! (`sglang-router` 0.3.2 from PyPI, `--policy cache_aware`), at 1 and 64 requests in flight,
//! streaming and not, in one run.
//!
//! ```text
//! cargo run --release -p kvroute-benches --bin serve-overhead
//! cargo run --release -p kvroute-benches --bin serve-overhead -- --text --sglang --seconds 5
//! cargo run --release -p kvroute-benches --bin serve-overhead -- --pin --text --sglang
//! cargo run --release -p kvroute-benches --bin serve-overhead -- --pin --text --sglang \
//!     --tokenizer llama3_1 --one-line --chat --no-stream
//! ```
//!
//! SGLang's router takes text prompts only, so `--sglang` needs `--text`: every path then
//! sends text (one of 16 documents of about 1,000 tokens in 17 lines, then a line of the
//! request's own), and kvroute serve tokenizes it with the model's tokenizer
//! (`scripts/fixtures.sh` fetches them; `--tokenizer` names the family, Qwen3's by default)
//! to route, the documents' chunks from its cache after their first requests; SGLang's router
//! matches characters and tokenizes nothing. `--one-line` puts each document on one line
//! (the same text, line breaks turned to spaces); `--chat` sends chats instead
//! (`/v1/chat/completions`: the document as the system message, the request's own line as
//! the user's), which serve renders with the model's template before tokenizing.
//! `--no-rests` turns off serve's tokenizing of a prompt's rest after routing
//! (`tokenize_rests`); `--no-stream` leaves out the streaming cells. `--serve-threads N` gives
//! serve's runtime N worker threads (1 pinned, 2 unpinned by default); `--current-thread` runs
//! serve on one thread with a single-threaded runtime instead (tokio's `current_thread`: one
//! shard of a gateway with a runtime per core). `serve µs/req` is the
//! CPU time of serve's threads (from /proc) per request over a kvroute cell's measured seconds:
//! when it holds as threads are added, requests/s scale with the cores given to serve.
//!
//! The fake engine (axum) answers `/v1/completions` with a fixed completion: one JSON body, or
//! four SSE chunks and `[DONE]`. Prompts are 1,024 token ids (no tokenizing), one of 16 shared
//! prefixes. A request's latency runs from sending it to having read its whole body. `added`
//! is a path's percentile less the direct path's; requests/s are completed requests over the
//! measured seconds. kvroute serve runs in this process on a runtime of its own; SGLang's
//! router is a process of its own, in a venv the benchmark makes (target/bench-venv). The
//! process allocates with mimalloc, as the `kvroute` program does.
//!
//! `--pin` gives the router a core of its own, as a frontend has in production: the load and
//! the fake engine run on CPU 0, kvroute serve's runtime (and SGLang's router, with
//! `taskset`) on CPU 1. Unpinned, all of them share the machine's cores, and the router's
//! figures include waiting for the load and the engine.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
use axum::body::Bytes;
use kvroute_benches::cpu::{stat_ticks, ticks_per_second};
use kvroute_benches::fake_engine::fake_engine;
use kvroute_serve::{BackendSpec, RunningServe, ServeOptions};
use serde_json::{json, Value};

struct Figures {
    p50_ms: f64,
    p99_ms: f64,
    rps: f64,
    /// CPU time of kvroute serve's threads per request over the measured seconds, in µs.
    serve_cpu_us: f64,
}

/// CPU time so far of this process's threads named `serve` (kvroute serve's runtime), in
/// clock ticks, from /proc (0 where there is none).
fn serve_cpu_ticks() -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("stat")).ok())
        .filter_map(|stat| {
            let (name, ticks) = stat_ticks(&stat)?;
            (name == "serve").then_some(ticks)
        })
        .sum()
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// `concurrency` loops sending requests to `url` for `seconds` (after a short warm-up).
/// `cell` names the run in text prompts' own lines, so that no cell sends a text an earlier
/// one sent (serve's chunk cache would otherwise have its lines tokenized already).
/// What the load sends.
#[derive(Clone, Copy)]
struct Shape {
    /// Text documents rather than token ids.
    text: bool,
    /// Each document on one line.
    one_line: bool,
    /// Chats rather than completions.
    chat: bool,
}

async fn load(
    url: &str,
    concurrency: usize,
    stream: bool,
    seconds: f64,
    shape: Shape,
    cell: usize,
) -> Result<Figures> {
    let text = shape.text;
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .tcp_nodelay(true)
        .build()?;
    // Token ids: one of 16 prompts. Text: one of 16 documents of about 1,000 tokens in 17
    // lines, then a line of the request's own, so no two texts are alike.
    let prompts: Arc<Vec<Value>> = Arc::new(
        (0..16u32)
            .map(|p| {
                if text {
                    let doc = format!(
                        "Document {p}.\n{}",
                        format!("{}\n", "The router reads the prompt. ".repeat(10)).repeat(17)
                    );
                    json!(if shape.one_line {
                        doc.replace('\n', " ")
                    } else {
                        doc
                    })
                } else {
                    json!((p * 100_000..p * 100_000 + 1_024).collect::<Vec<u32>>())
                }
            })
            .collect(),
    );
    // Token-id bodies are made once; a text body gets its own last line per request.
    let fixed: Arc<Vec<Bytes>> = Arc::new(
        prompts
            .iter()
            .map(|p| {
                Bytes::from(
                    json!({"model": "fake", "prompt": p, "max_tokens": 4, "stream": stream})
                        .to_string(),
                )
            })
            .collect(),
    );
    let body_of = move |prompts: &[Value], fixed: &[Bytes], phase: &str, i: usize| -> Bytes {
        match prompts[i % prompts.len()].as_str() {
            Some(doc) if shape.chat => Bytes::from(
                json!({"model": "fake", "max_tokens": 4, "stream": stream, "messages": [
                    {"role": "system", "content": doc},
                    {"role": "user", "content": format!("Request {cell}{phase}.{i}: what does the router read first?")}]})
                .to_string(),
            ),
            Some(doc) => Bytes::from(
                json!({"model": "fake", "max_tokens": 4, "stream": stream,
                    "prompt": format!("{doc}Request {cell}{phase}.{i}: what does the router read first?")})
                .to_string(),
            ),
            None => fixed[i % fixed.len()].clone(),
        }
    };
    let run = |duration: Duration, phase: &'static str| {
        let client = client.clone();
        let prompts = Arc::clone(&prompts);
        let fixed = Arc::clone(&fixed);
        let url = url.to_owned();
        async move {
            let tasks: Vec<_> = (0..concurrency)
                .map(|c| {
                    let client = client.clone();
                    let prompts = Arc::clone(&prompts);
                    let fixed = Arc::clone(&fixed);
                    let url = url.clone();
                    tokio::spawn(async move {
                        let mut latencies = Vec::new();
                        let end = Instant::now() + duration;
                        let mut i = c;
                        while Instant::now() < end {
                            let body = body_of(&prompts, &fixed, phase, i);
                            i += concurrency;
                            let t = Instant::now();
                            let r = client
                                .post(&url)
                                .header("content-type", "application/json")
                                .body(body)
                                .send()
                                .await?;
                            if !r.status().is_success() {
                                bail!("status {}", r.status());
                            }
                            r.bytes().await?;
                            latencies.push(t.elapsed().as_secs_f64() * 1e3);
                        }
                        Ok::<_, anyhow::Error>(latencies)
                    })
                })
                .collect();
            let mut all = Vec::new();
            for t in tasks {
                all.extend(t.await??);
            }
            Ok::<_, anyhow::Error>(all)
        }
    };
    run(Duration::from_millis(300), "w").await?;
    let started = Instant::now();
    let ticks = serve_cpu_ticks();
    let mut latencies = run(Duration::from_secs_f64(seconds), "m").await?;
    let serve_s = (serve_cpu_ticks() - ticks) as f64 / ticks_per_second();
    let elapsed = started.elapsed().as_secs_f64();
    latencies.sort_by(f64::total_cmp);
    Ok(Figures {
        p50_ms: percentile(&latencies, 0.5),
        p99_ms: percentile(&latencies, 0.99),
        rps: latencies.len() as f64 / elapsed,
        serve_cpu_us: serve_s * 1e6 / latencies.len().max(1) as f64,
    })
}

/// Keeps the calling thread on `cpu`, or says why not.
fn pin_to(cpu: usize) {
    if let Err(e) = kvroute_benches::affinity::pin_to(cpu) {
        eprintln!("serve-overhead: could not pin a thread to CPU {cpu}: {e}");
    }
}

/// SGLang's router in a venv of its own, in front of `engine`.
fn sglang_router(engine: SocketAddr, port: u16, cpu: Option<usize>) -> Result<Child> {
    let venv = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench-venv");
    let python = venv.join("bin/python");
    if !python.exists() {
        let ok = Command::new("python3")
            .args(["-m", "venv"])
            .arg(&venv)
            .status()?
            .success();
        let pip = venv.join("bin/pip");
        if !ok
            || !Command::new(&pip)
                .args([
                    "install",
                    "--quiet",
                    "--disable-pip-version-check",
                    "sglang-router==0.3.2",
                ])
                .status()?
                .success()
        {
            bail!("could not install sglang-router 0.3.2");
        }
    }
    let mut command = match cpu {
        Some(cpu) => {
            let mut c = Command::new("taskset");
            c.arg("-c").arg(cpu.to_string()).arg(python);
            c
        }
        None => Command::new(python),
    };
    command
        .args([
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
        ])
        .arg(port.to_string())
        .arg("--worker-urls")
        .arg(format!("http://{engine}"))
        .args([
            "--policy",
            "cache_aware",
            "--log-level",
            "warn",
            "--prometheus-port",
        ])
        .arg(
            std::net::TcpListener::bind("127.0.0.1:0")?
                .local_addr()?
                .port()
                .to_string(),
        )
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting sglang_router")
}

async fn wait_healthy(url: &str) -> Result<()> {
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if let Ok(r) = client.get(url).send().await {
            if r.status().is_success() {
                return Ok(());
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("{url} never answered")
}

fn main() -> Result<()> {
    let mut seconds = 3.0;
    let mut sglang = false;
    let mut text = false;
    let mut pin = false;
    let mut one_line = false;
    let mut chat = false;
    let mut rests = true;
    let mut streams = vec![false, true];
    let mut family = "qwen3".to_owned();
    let mut serve_threads = None;
    let mut current = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--seconds" => seconds = args.next().unwrap_or_default().parse()?,
            "--sglang" => sglang = true,
            "--text" => text = true,
            "--pin" => pin = true,
            "--one-line" => one_line = true,
            "--chat" => chat = true,
            "--no-rests" => rests = false,
            "--no-stream" => streams = vec![false],
            "--tokenizer" => family = args.next().unwrap_or_default(),
            "--current-thread" => current = true,
            "--serve-threads" => serve_threads = Some(args.next().unwrap_or_default().parse()?),
            other => bail!(
                "unknown argument {other}; --seconds S, --sglang, --text, --pin, --one-line, \
                 --chat, --no-rests, --no-stream, --tokenizer FAMILY, --serve-threads N, \
                 --current-thread"
            ),
        }
    }
    if (one_line || chat) && !text {
        bail!("--one-line and --chat shape text prompts: add --text");
    }
    let shape = Shape {
        text,
        one_line,
        chat,
    };
    if pin && std::thread::available_parallelism().map_or(0, |n| n.get()) < 2 {
        bail!("--pin needs two CPUs");
    }
    // The load and the fake engine on one runtime, kvroute serve on its own.
    // Named threads, so that a profile tells serve's time from the load's and the engine's.
    // With --pin, the runtimes' threads (workers and blocking) each on their CPU.
    // Pinned, each runtime has one worker thread: two on one CPU would take turns by the
    // scheduler's time slices, milliseconds apart.
    let load_rt = tokio::runtime::Builder::new_multi_thread()
        .thread_name("load-engine")
        .worker_threads(if pin { 1 } else { 2 })
        .on_thread_start(move || {
            if pin {
                pin_to(0)
            }
        })
        .enable_all()
        .build()?;
    let engine = load_rt.block_on(fake_engine())?;
    let options = ServeOptions {
        listen: "127.0.0.1:0".parse()?,
        workers: vec![BackendSpec {
            id: 0,
            url: format!("http://{engine}"),
            kv_events: None,
            kv_replay: None,
            topic: String::new(),
            dp_size: 1,
            kv_blocks: 1 << 20,
            block_size: 16,
            api_key: None,
            labels: Default::default(),
            role: Default::default(),
            bootstrap_port: None,
        }],
        tokenizer: text.then(|| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../target/fixtures")
                .join(&family)
        }),
        tokenize_rests: rests,
        ..ServeOptions::default()
    };
    let (listen_tx, listen_rx) = std::sync::mpsc::channel::<Result<SocketAddr, String>>();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let mut serve_keep = None;
    let mut shard = None;
    if current {
        if serve_threads.is_some() {
            bail!("--current-thread runs serve on one thread: leave out --serve-threads");
        }
        // One thread runs serve's runtime and all of its tasks: one shard of a gateway with
        // a runtime per core. Its blocking threads inherit its CPU.
        shard = Some(
            std::thread::Builder::new()
                .name("serve".into())
                .spawn(move || {
                    if pin {
                        pin_to(1)
                    }
                    let runtime = match tokio::runtime::Builder::new_current_thread()
                        .thread_name("serve")
                        .enable_all()
                        .build()
                    {
                        Ok(runtime) => runtime,
                        Err(e) => {
                            let _ = listen_tx.send(Err(e.to_string()));
                            return;
                        }
                    };
                    runtime.block_on(async move {
                        match RunningServe::start(options).await {
                            Ok(serve) => {
                                let _ = listen_tx.send(Ok(serve.listen));
                                let _ = stop_rx.await;
                                serve.stop();
                            }
                            Err(e) => {
                                let _ = listen_tx.send(Err(e.to_string()));
                            }
                        }
                    });
                })?,
        );
    } else {
        let serve_rt = tokio::runtime::Builder::new_multi_thread()
            .thread_name("serve")
            .worker_threads(serve_threads.unwrap_or(if pin { 1 } else { 2 }))
            .on_thread_start(move || {
                if pin {
                    pin_to(1)
                }
            })
            .enable_all()
            .build()?;
        let serve = serve_rt.block_on(RunningServe::start(options))?;
        listen_tx.send(Ok(serve.listen))?;
        serve_keep = Some((serve_rt, serve));
    }
    let serve_listen = listen_rx
        .recv()
        .context("kvroute serve's thread ended")?
        .map_err(|e| anyhow::anyhow!("kvroute serve did not start: {e}"))?;
    let route = if chat {
        "/v1/chat/completions"
    } else {
        "/v1/completions"
    };
    let mut paths = vec![
        ("direct", format!("http://{engine}{route}")),
        ("kvroute", format!("http://{}{route}", serve_listen)),
    ];
    let mut router_process = None;
    if sglang && !text {
        bail!("SGLang's router takes text prompts only: add --text");
    }
    if sglang {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        router_process = Some(sglang_router(engine, port, pin.then_some(1))?);
        load_rt.block_on(wait_healthy(&format!("http://127.0.0.1:{port}/health")))?;
        paths.push(("sglang-router", format!("http://127.0.0.1:{port}{route}")));
    }
    println!(
        "serve-overhead: {seconds} s per cell, {} prompts, a fake engine that answers at once{}",
        if text {
            format!(
                "text ({}{}, about 1,000 tokens; kvroute tokenizes them with {family}'s \
                 tokenizer{})",
                if chat { "chats" } else { "completions" },
                if one_line { ", one line" } else { ", 18 lines" },
                if rests { "" } else { ", no rests" }
            )
        } else {
            "1,024-token-id".to_owned()
        },
        if pin {
            "; load and engine on CPU 0, the router on CPU 1"
        } else {
            ""
        }
    );
    println!(
        "{:<14} {:>3} {:>6} {:>9} {:>9} {:>10} {:>10} {:>9} {:>12}",
        "path",
        "in",
        "stream",
        "p50 ms",
        "p99 ms",
        "added p50",
        "added p99",
        "req/s",
        "serve µs/req"
    );
    let mut cell = 0;
    for concurrency in [1usize, 64] {
        for &stream in &streams {
            let mut direct: Option<Figures> = None;
            for (name, url) in &paths {
                cell += 1;
                let f = load_rt.block_on(load(url, concurrency, stream, seconds, shape, cell))?;
                let (a50, a99) = match &direct {
                    Some(d) => (f.p50_ms - d.p50_ms, f.p99_ms - d.p99_ms),
                    None => (0.0, 0.0),
                };
                let cpu = if *name == "kvroute" {
                    format!("{:.1}", f.serve_cpu_us)
                } else {
                    String::new()
                };
                println!(
                    "{name:<14} {concurrency:>3} {:>6} {:>9.3} {:>9.3} {:>10.3} {:>10.3} {:>9.0} {cpu:>12}",
                    if stream { "yes" } else { "no" },
                    f.p50_ms,
                    f.p99_ms,
                    a50,
                    a99,
                    f.rps
                );
                if direct.is_none() {
                    direct = Some(f);
                }
            }
        }
    }
    if let Some(mut p) = router_process {
        let _ = p.kill();
        let _ = p.wait();
    }
    if let Some((_runtime, serve)) = serve_keep {
        serve.stop();
    }
    let _ = stop_tx.send(());
    if let Some(shard) = shard {
        let _ = shard.join();
    }
    Ok(())
}
