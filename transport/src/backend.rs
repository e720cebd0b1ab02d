//! Which I/O engine drives the sockets: io_uring (tokio-uring) where the kernel lets us, else
//! tokio's epoll reactor.
//!
//! ```text
//!  BackendChoice::Auto ──probe──▶ io_uring usable? ──yes──▶ Backend::IoUring
//!                                                 └─no───▶ Backend::Epoll   (with the reason)
//!  BackendChoice::IoUring / ::Epoll ──▶ that backend (forcing io_uring where it is unusable is
//!                                        an error, never a silent fallback)
//! ```
//!
//! io_uring can be missing in four ways, and each is a fallback, not a panic: the platform is
//! not Linux (tokio-uring is then not even compiled in),
//! `/proc/sys/kernel/io_uring_disabled` is 2 (or 1 and we are not in the allowed group), the
//! kernel predates io_uring (`ENOSYS`), or a seccomp filter refuses `io_uring_setup` (`EPERM`,
//! `ENOSYS`; Docker's default profile does this). The probe reads the sysctl, then sets up a
//! small ring and drops it; its answer is kept for the life of the process.
//!
//! Both backends run the same code: one current-thread runtime per thread, tasks spawned with
//! `spawn_local`, so a connection never moves between threads. [`block_on`] builds that
//! runtime for either backend.
//!
//! An io_uring runtime submits its ring's work with one system call when it has nothing left
//! to run, so every read or write waits for the runtime to go idle first. With
//! [`UringSubmit::KernelPoll`] (set once per process, [`set_uring_submit`]) a kernel thread
//! polls the submission queues instead: one thread for every ring of the process (the rings
//! share it), asleep after `idle` without work. It answers sooner and takes a core while the
//! rings are busy. What each mode measured: `benches/RESULTS.md` (2026-11-23, kernel-polled
//! submission); why polling stays opt-in: `docs/experiments.md` §10.2.

use std::future::Future;
use std::io;
use std::sync::OnceLock;
use std::time::Duration;

/// The I/O engine in use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    /// tokio-uring: reads and writes are submitted to an io_uring ring.
    IoUring,
    /// tokio's reactor: readiness from epoll, then `read(2)` / `write(2)`.
    Epoll,
}

impl Backend {
    /// Its name in logs and on the command line (`io_uring`, `epoll`).
    pub fn name(self) -> &'static str {
        match self {
            Backend::IoUring => "io_uring",
            Backend::Epoll => "epoll",
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What the operator asked for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum BackendChoice {
    /// io_uring when usable, else epoll.
    #[default]
    Auto,
    /// io_uring or an error.
    IoUring,
    /// epoll, even where io_uring works.
    Epoll,
}

impl std::str::FromStr for BackendChoice {
    type Err = BackendError;

    /// `auto`, `io_uring` (or `uring`), `epoll`: the spelling of a command-line flag.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(BackendChoice::Auto),
            "io_uring" | "io-uring" | "uring" => Ok(BackendChoice::IoUring),
            "epoll" => Ok(BackendChoice::Epoll),
            _ => Err(BackendError::UnknownChoice {
                given: s.to_owned(),
            }),
        }
    }
}

/// How the submissions of an io_uring ring reach the kernel. One mode for the whole process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum UringSubmit {
    /// With a system call when the runtime has nothing left to run (tokio-uring's way): no
    /// CPU spent waiting, but each submission waits for the runtime to go idle.
    #[default]
    OnIdle,
    /// Through one kernel thread, shared by every ring of the process, that polls their
    /// submission queues and sleeps after `idle` without work (rounded to milliseconds, at
    /// least one). It takes a core while the rings are busy.
    KernelPoll {
        /// How long the poller runs without work before it sleeps.
        idle: Duration,
    },
}

impl UringSubmit {
    /// The poller's idle time in whole milliseconds, as the kernel takes it.
    fn idle_ms(idle: Duration) -> u32 {
        u32::try_from(idle.as_millis()).unwrap_or(u32::MAX).max(1)
    }
}

impl std::fmt::Display for UringSubmit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UringSubmit::OnIdle => f.write_str("submit on idle"),
            UringSubmit::KernelPoll { idle } => {
                write!(f, "kernel-polled, idle after {} ms", Self::idle_ms(*idle))
            }
        }
    }
}

static SUBMIT: OnceLock<UringSubmit> = OnceLock::new();

/// Sets how every io_uring ring of this process submits. It can be set once, before the first
/// io_uring runtime (which fixes the default otherwise); a later call changes nothing and
/// returns the mode in force.
pub fn set_uring_submit(mode: UringSubmit) -> Result<(), UringSubmit> {
    match SUBMIT.set(mode) {
        Ok(()) => Ok(()),
        Err(_) if uring_submit() == mode => Ok(()),
        Err(_) => Err(uring_submit()),
    }
}

/// How this process's io_uring rings submit (the default until [`set_uring_submit`]).
pub fn uring_submit() -> UringSubmit {
    *SUBMIT.get_or_init(UringSubmit::default)
}

/// Why io_uring cannot be used here.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum UringUnavailable {
    /// Not a Linux build.
    #[error("io_uring exists only on Linux")]
    NotLinux,
    /// The kernel's `io_uring_disabled` sysctl turns it off.
    #[error("/proc/sys/kernel/io_uring_disabled is {value}")]
    DisabledBySysctl {
        /// The sysctl's value.
        value: u8,
    },
    /// Setting up a probe ring failed (an old kernel, or a seccomp filter).
    #[error("io_uring_setup failed ({kind:?}, errno {errno:?}): old kernel or seccomp")]
    SetupFailed {
        /// The error's kind.
        kind: io::ErrorKind,
        /// The OS error number, if any.
        errno: Option<i32>,
    },
}

/// Backend selection and runtime errors.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// A backend name that is not `auto`, `io_uring` or `epoll`.
    #[error("unknown backend {given:?} (expected auto, io_uring or epoll)")]
    UnknownChoice {
        /// The name given.
        given: String,
    },
    /// io_uring was asked for explicitly and cannot be used.
    #[error("io_uring was forced but is unavailable: {reason}")]
    UringForced {
        /// Why not.
        reason: UringUnavailable,
    },
    /// The runtime could not be built.
    #[error("could not build the {backend} runtime: {source}")]
    Runtime {
        /// The backend it was for.
        backend: Backend,
        /// The builder's error.
        #[source]
        source: io::Error,
    },
}

/// The backend a choice resolved to, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resolved {
    /// The backend to use.
    pub backend: Backend,
    /// Set when `Auto` fell back to epoll.
    pub fallback: Option<UringUnavailable>,
}

impl BackendChoice {
    /// The backend to use. Probes io_uring (once per process) unless epoll is forced; logs
    /// nothing (the server logs its one line, [`Resolved::log`]).
    pub fn resolve(self) -> Result<Resolved, BackendError> {
        match self {
            BackendChoice::Epoll => Ok(Resolved {
                backend: Backend::Epoll,
                fallback: None,
            }),
            BackendChoice::IoUring => match uring_support() {
                Ok(()) => Ok(Resolved {
                    backend: Backend::IoUring,
                    fallback: None,
                }),
                Err(reason) => Err(BackendError::UringForced { reason }),
            },
            BackendChoice::Auto => Ok(match uring_support() {
                Ok(()) => Resolved {
                    backend: Backend::IoUring,
                    fallback: None,
                },
                Err(reason) => Resolved {
                    backend: Backend::Epoll,
                    fallback: Some(reason),
                },
            }),
        }
    }
}

impl Resolved {
    /// The one line that says which backend runs, and, after a fallback, why.
    pub fn log(&self, what: &'static str, choice: BackendChoice) {
        match &self.fallback {
            None => tracing::info!(what, backend = %self.backend, ?choice, "transport backend"),
            Some(reason) => tracing::warn!(
                what,
                backend = %self.backend,
                ?choice,
                %reason,
                "transport backend: io_uring unavailable, falling back to epoll"
            ),
        }
    }
}

/// Whether io_uring is usable in this process (probed once, then remembered).
pub fn uring_support() -> Result<(), UringUnavailable> {
    static PROBE: OnceLock<Result<(), UringUnavailable>> = OnceLock::new();
    PROBE.get_or_init(probe_uring).clone()
}

#[cfg(not(target_os = "linux"))]
fn probe_uring() -> Result<(), UringUnavailable> {
    Err(UringUnavailable::NotLinux)
}

/// The error of an io_uring operation asked for where there is no io_uring.
#[cfg(not(target_os = "linux"))]
pub(crate) fn not_linux() -> io::Error {
    io::Error::new(io::ErrorKind::Unsupported, UringUnavailable::NotLinux)
}

#[cfg(target_os = "linux")]
fn probe_uring() -> Result<(), UringUnavailable> {
    // 0: allowed; 1: only for io_uring_group members (the setup below tells); 2: refused.
    if let Ok(text) = std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled") {
        if let Ok(value) = text.trim().parse::<u8>() {
            if value >= 2 {
                return Err(UringUnavailable::DisabledBySysctl { value });
            }
        }
    }
    match tokio_uring::uring_builder().build(4) {
        Ok(ring) => {
            drop(ring);
            Ok(())
        }
        Err(e) => Err(UringUnavailable::SetupFailed {
            kind: e.kind(),
            errno: e.raw_os_error(),
        }),
    }
}

/// A tokio-uring runtime whose ring submits as [`uring_submit`] says.
#[cfg(target_os = "linux")]
fn uring_runtime() -> io::Result<tokio_uring::Runtime> {
    let mut builder = tokio_uring::builder();
    if let UringSubmit::KernelPoll { idle } = uring_submit() {
        let idle = UringSubmit::idle_ms(idle);
        let mut ring = tokio_uring::uring_builder();
        ring.setup_sqpoll(idle)
            .setup_attach_wq(kernel_poller(idle)?);
        builder.uring_builder(&ring);
    }
    tokio_uring::Runtime::new(&builder)
}

/// The descriptor of the ring whose kernel thread polls every ring of the process: a small
/// ring of its own, set up with the first runtime and kept for the life of the process, so
/// that runtimes come and go without taking the poller with them.
#[cfg(target_os = "linux")]
fn kernel_poller(idle_ms: u32) -> io::Result<std::os::fd::RawFd> {
    use std::os::fd::AsRawFd;
    type Ring = Box<dyn AsRawFd + Send + Sync>;
    static POLLER: OnceLock<Result<Ring, (io::ErrorKind, Option<i32>)>> = OnceLock::new();
    let ring = POLLER.get_or_init(|| {
        let mut ring = tokio_uring::uring_builder();
        ring.setup_sqpoll(idle_ms);
        match ring.build(4) {
            Ok(ring) => {
                tracing::info!(idle_ms, "io_uring: one kernel thread polls every ring");
                Ok(Box::new(ring) as Ring)
            }
            Err(e) => {
                tracing::warn!(error = %e, "io_uring: the kernel-polled ring could not be set up");
                Err((e.kind(), e.raw_os_error()))
            }
        }
    });
    match ring {
        Ok(ring) => Ok(ring.as_raw_fd()),
        Err((_, Some(errno))) => Err(io::Error::from_raw_os_error(*errno)),
        Err((kind, None)) => Err(io::Error::from(*kind)),
    }
}

/// Runs `future` to completion on a new current-thread runtime of `backend`, inside a
/// `LocalSet` (so `tokio::task::spawn_local` works on both).
pub fn block_on<F: Future>(backend: Backend, future: F) -> Result<F::Output, BackendError> {
    match backend {
        #[cfg(not(target_os = "linux"))]
        Backend::IoUring => Err(BackendError::Runtime {
            backend,
            source: not_linux(),
        }),
        #[cfg(target_os = "linux")]
        Backend::IoUring => {
            let rt = uring_runtime().map_err(|source| BackendError::Runtime { backend, source })?;
            Ok(rt.block_on(future))
        }
        Backend::Epoll => {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|source| BackendError::Runtime { backend, source })?;
            let local = tokio::task::LocalSet::new();
            Ok(local.block_on(&rt, future))
        }
    }
}

#[cfg(test)]
mod tests;
