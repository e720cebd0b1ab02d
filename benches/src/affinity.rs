//! Pinning a thread to a CPU, for the benchmarks that give the router a core of its own.
#![allow(unsafe_code)]

/// Keeps the calling thread on `cpu`; the OS error when it cannot.
pub fn pin_to(cpu: usize) -> std::io::Result<()> {
    if cpu >= 1024 {
        return Err(std::io::Error::other("no such CPU"));
    }
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET writes inside it (cpu < 1024,
    // checked above), and sched_setaffinity reads it for the calling thread (pid 0).
    let failed = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0
    };
    if failed {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}
