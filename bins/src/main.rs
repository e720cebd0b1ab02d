//! `kvroute`: the router's programs. The router service, the simulated GPU worker and the trace
//! replayer are built on the core and the transport; until they land this prints what exists.

// A program: it prints to its terminal.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use mimalloc::MiMalloc;

#[global_allocator]
static GLOBAL: MiMalloc = MiMalloc;

const USAGE: &str = "\
kvroute — KV-cache-aware request router

USAGE: kvroute <COMMAND>

The programs (serve, worker simulator, replay, demo) are not built yet.
The index benchmark runs with:
    cargo run --release -p kvroute-benches --bin peer-index
";

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        None | Some("-h" | "--help" | "help") => {
            print!("{USAGE}");
            Ok(())
        }
        Some("--version" | "-V") => {
            println!("kvroute {}", env!("CARGO_PKG_VERSION"));
            Ok(())
        }
        Some(other) => anyhow::bail!("unknown command {other:?}\n\n{USAGE}"),
    }
}
