//! CPU time from /proc, for the gateway benchmarks that report what a process or thread used.
#![allow(unsafe_code)]

/// A task's name and its CPU time (user and system) in clock ticks, from the text of a
/// `/proc/…/stat` file; `None` when it is not one.
pub fn stat_ticks(stat: &str) -> Option<(&str, u64)> {
    let (head, rest) = stat.rsplit_once(')')?;
    let name = head.split_once('(')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime: fields 14 and 15 of stat, 12 and 13 after the name.
    let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some((name, ticks))
}

/// The CPU time so far of the process or thread whose stat file is `path`, in clock ticks
/// (0 when it cannot be read).
pub fn ticks_of(path: &str) -> u64 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| stat_ticks(&s).map(|(_, t)| t))
        .unwrap_or(0)
}

/// Clock ticks per second.
pub fn ticks_per_second() -> f64 {
    // SAFETY: sysconf reads a configuration value; no memory is passed.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if ticks > 0 {
        ticks as f64
    } else {
        100.0
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_stat_line_gives_its_name_and_user_plus_system_ticks() {
        // A name with a space and a parenthesis, as a thread may have.
        let stat = "42 (serve (1)) S 1 42 42 0 -1 4194560 100 0 0 0 7 5 0 0 20 0 2 0";
        assert_eq!(super::stat_ticks(stat), Some(("serve (1)", 12)));
        assert_eq!(super::stat_ticks("garbage"), None);
        assert!(super::ticks_per_second() > 0.0);
    }
}
