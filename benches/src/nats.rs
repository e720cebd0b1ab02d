//! A real `nats-server` (the system's package; `scripts/fixtures.sh` installs it) on a
//! loopback port, for the replica benchmarks.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// `nats-server` on 127.0.0.1:`port`, with JetStream storing in a directory of its own (the
/// worker registry needs it); killed, and its store removed, when dropped.
#[derive(Debug)]
pub struct NatsServer {
    child: Child,
    store: PathBuf,
    /// `nats://127.0.0.1:port`.
    pub url: String,
}

impl NatsServer {
    /// Starts it on a free port and waits until it listens.
    pub fn start() -> Result<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let store =
            std::env::temp_dir().join(format!("kvroute-bench-nats-{}-{port}", std::process::id()));
        let child = Command::new(kvroute_serve::nats_server_program())
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
            .arg(&store)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("nats-server (run scripts/fixtures.sh, or install Debian's nats-server)")?;
        let server = Self {
            child,
            store,
            url: format!("nats://127.0.0.1:{port}"),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if Instant::now() > deadline {
                bail!("nats-server never listened on {port}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(server)
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.store);
    }
}
