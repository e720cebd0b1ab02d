//! The floor under a proxy's added latency on this machine: a TCP round trip on loopback
//! between two threads, on one CPU and across two, each pinned. A router between a client and
//! an engine on another CPU adds two such crossings to every request.
//!
//! ```text
//! cargo run --release -p kvroute-benches --bin loopback-rtt
//! ```
//!
//! 8-byte messages, `TCP_NODELAY`, 20,000 round trips after 1,000 unmeasured; p50 and p99.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

use anyhow::Result;
use kvroute_benches::affinity::pin_to;

/// p50 and p99 in µs of round trips from a thread on `client` to an echo thread on `server`.
fn round_trips(client: usize, server: usize) -> Result<(f64, f64)> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let echo = std::thread::spawn(move || -> Result<()> {
        pin_to(server)?;
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let mut buf = [0u8; 8];
        while s.read_exact(&mut buf).is_ok() {
            s.write_all(&buf)?;
        }
        Ok(())
    });
    pin_to(client)?;
    let mut c = TcpStream::connect(addr)?;
    c.set_nodelay(true)?;
    let mut buf = [0u8; 8];
    let mut us = Vec::with_capacity(20_000);
    for i in 0..21_000 {
        let t = Instant::now();
        c.write_all(&buf)?;
        c.read_exact(&mut buf)?;
        if i >= 1_000 {
            us.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    drop(c);
    let _ = echo.join();
    us.sort_by(f64::total_cmp);
    Ok((us[us.len() / 2], us[us.len() * 99 / 100]))
}

fn main() -> Result<()> {
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    println!("loopback-rtt: TCP round trips between two pinned threads, µs");
    let mut pairs = vec![(0, 0)];
    if cpus > 1 {
        pairs.extend([(1, 1), (0, 1), (1, 0)]);
    }
    for (client, server) in pairs {
        let (p50, p99) = round_trips(client, server)?;
        println!("  client on CPU {client}, echo on CPU {server}: p50 {p50:>6.1}, p99 {p99:>6.1}");
    }
    Ok(())
}
