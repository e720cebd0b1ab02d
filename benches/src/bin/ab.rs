//! Two builds of the `replay` example timed in turn, for comparing builds on a noisy machine.
//!
//! ```text
//! git worktree add ../base <revision>
//! (cd ../base && cargo build --release -p kvroute-benches --example replay)
//! cargo build --release -p kvroute-benches --example replay
//! cargo run --release -p kvroute-benches --bin ab -- \
//!     --base ../base/target/release/examples/replay \
//!     --new target/release/examples/replay --pairs 10 -- --split
//! ```
//!
//! Each pair runs both binaries once, one after the other, with the order swapped from one
//! pair to the next, so that a drift of the machine hits both alike. Every argument after `--`
//! goes to both (`--trace FILE`, `--replays N`, `--split`, `--unsized`). A run's figure is the
//! median of its replays after the first (the first pays for faults and cold caches), and each
//! pair gives the ratio new / base of its two runs; the summary is the median of those ratios
//! and their range, for the wall time, match p99 and, with `--split`, the time in Stored
//! events, Removed events and queries. Ratios taken within a pair are what this machine allows
//! comparing: the same run can take twice as long from one minute to the next.
//!
//! Two builds compared in separate processes differ in nothing but their code. Two copies of
//! the index linked into one binary do not: their code lands at other addresses, and a copy
//! compared with itself that way ran at 0.89 to 1.01 of the other's time.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};
use kvroute_benches::median;

/// The figures one replay line gives.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Replay {
    wall_ms: f64,
    p99_ns: f64,
    stored_ms: Option<f64>,
    removed_ms: Option<f64>,
    queries_ms: Option<f64>,
}

/// How to read one figure from a replay.
type Read = fn(&Replay) -> Option<f64>;

/// The figures compared, by name, and how to read each from a replay.
const FIGURES: [(&str, Read); 5] = [
    ("wall", |r| Some(r.wall_ms)),
    ("match p99", |r| Some(r.p99_ns)),
    ("stored", |r| r.stored_ms),
    ("removed", |r| r.removed_ms),
    ("queries", |r| r.queries_ms),
];

/// The replay lines of the `replay` example's output, such as
/// `replay  2:    26.81 ms  p50   440 ns  p99    992 ns  stored 14.69 ms  removed 6.08 ms  queries 4.83 ms`.
fn parse(output: &str) -> Result<Vec<Replay>> {
    let mut replays = Vec::new();
    for line in output.lines().filter(|l| l.starts_with("replay ")) {
        let words: Vec<&str> = line.split_whitespace().collect();
        let after = |key: &str| -> Result<Option<f64>> {
            match words.iter().position(|w| *w == key) {
                Some(i) => {
                    let word = words.get(i + 1).context("a key without a value")?;
                    Ok(Some(word.parse().with_context(|| format!("{key} {word}"))?))
                }
                None => Ok(None),
            }
        };
        let wall = words
            .iter()
            .position(|w| w.ends_with(':'))
            .and_then(|i| words.get(i + 1))
            .with_context(|| format!("no wall time in {line:?}"))?;
        replays.push(Replay {
            wall_ms: wall.parse().with_context(|| format!("wall time {wall}"))?,
            p99_ns: after("p99")?.with_context(|| format!("no p99 in {line:?}"))?,
            stored_ms: after("stored")?,
            removed_ms: after("removed")?,
            queries_ms: after("queries")?,
        });
    }
    if replays.is_empty() {
        bail!("no replay lines in the output");
    }
    Ok(replays)
}

/// One run's figure: the median over its replays after the first (all of them if only one).
fn figure(replays: &[Replay], read: Read) -> Option<f64> {
    let rest = if replays.len() > 1 {
        &replays[1..]
    } else {
        replays
    };
    median(rest.iter().map(read).collect::<Option<Vec<f64>>>()?)
}

fn run(binary: &PathBuf, args: &[String]) -> Result<Vec<Replay>> {
    let out = Command::new(binary)
        .args(args)
        .output()
        .with_context(|| format!("running {binary:?}"))?;
    if !out.status.success() {
        bail!(
            "{binary:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    parse(&String::from_utf8_lossy(&out.stdout)).with_context(|| format!("{binary:?}'s output"))
}

fn main() -> Result<()> {
    let mut base = None;
    let mut new = None;
    let mut pairs = 8usize;
    let mut passed = Vec::new();
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--base" => base = Some(PathBuf::from(it.next().context("--base needs a binary")?)),
            "--new" => new = Some(PathBuf::from(it.next().context("--new needs a binary")?)),
            "--pairs" => {
                pairs = it
                    .next()
                    .context("--pairs needs a number")?
                    .parse()
                    .context("--pairs")?
            }
            "--" => passed.extend(it.by_ref()),
            "--help" | "-h" => {
                println!("usage: ab --base BINARY --new BINARY [--pairs N] [-- REPLAY ARGS]");
                return Ok(());
            }
            other => bail!("unknown argument {other:?} (see --help)"),
        }
    }
    let (Some(base), Some(new)) = (base, new) else {
        bail!("--base and --new are both needed (see --help)");
    };
    if pairs == 0 {
        bail!("--pairs must be positive");
    }
    let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); FIGURES.len()];
    for pair in 0..pairs {
        let (first, second) = if pair % 2 == 0 {
            (&base, &new)
        } else {
            (&new, &base)
        };
        let a = run(first, &passed)?;
        let b = run(second, &passed)?;
        let (base_run, new_run) = if pair % 2 == 0 { (a, b) } else { (b, a) };
        let mut line = format!("pair {:>2}:", pair + 1);
        for (k, (name, read)) in FIGURES.iter().enumerate() {
            if let (Some(x), Some(y)) = (figure(&base_run, *read), figure(&new_run, *read)) {
                let ratio = y / x;
                ratios[k].push(ratio);
                line += &format!("  {name} {x:.2} -> {y:.2} ({ratio:.3})");
            }
        }
        println!("{line}");
    }
    println!("new / base, median of {pairs} pairs (range):");
    for ((name, _), values) in FIGURES.iter().zip(ratios) {
        let (lo, hi) = values
            .iter()
            .fold((f64::MAX, f64::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
        if let Some(m) = median(values) {
            println!("  {name:<10} {m:.3}  ({lo:.3}-{hi:.3})");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replay_lines_give_their_figures() {
        let out = "34600 ops, 5598477 block ops; kvroute, 2 replays\n\
            replay  1:   107.10 ms  p50   500 ns  p99   2153 ns  stored 53.01 ms  removed 45.13 ms  queries 7.26 ms\n\
            replay  2:   101.00 ms  p50   451 ns  p99   1933 ns\n\
            median 101.00 ms, fastest 101.00 ms, 55.4 M block ops/s at the median\n";
        let replays = parse(out).unwrap();
        assert_eq!(replays.len(), 2);
        assert_eq!(
            replays[0],
            Replay {
                wall_ms: 107.10,
                p99_ns: 2153.0,
                stored_ms: Some(53.01),
                removed_ms: Some(45.13),
                queries_ms: Some(7.26),
            }
        );
        assert_eq!((replays[1].wall_ms, replays[1].stored_ms), (101.0, None));
        // The first replay is left out of a run's figure when there are others.
        assert_eq!(figure(&replays, |r| Some(r.wall_ms)), Some(101.0));
        assert_eq!(figure(&replays, |r| r.stored_ms), None);
        assert!(parse("no replays here").is_err());
        assert!(parse("replay  1:   x ms  p99 3 ns").is_err());
    }
}
