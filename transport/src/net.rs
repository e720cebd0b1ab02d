//! TCP sockets over either backend, behind one owned-buffer interface.
//!
//! io_uring's reads and writes take the buffer by value and hand it back with the result (the
//! kernel owns the memory while the operation is in flight); epoll's borrow it. The owned form
//! fits both, so [`Stream`] uses it: `read(buf) -> (result, buf)` appends to `buf`'s spare
//! capacity, `write_all(buf) -> (result, buf)` sends all of `buf`.
//!
//! Listeners are bound with `SO_REUSEPORT` so that every runtime thread can own a listener on
//! the same port and the kernel spreads connections among them.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
#[cfg(target_os = "linux")]
use std::rc::Rc;
use std::sync::mpsc as std_mpsc;

use bytes::BytesMut;
use socket2::{Domain, Protocol, Socket, Type};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;
#[cfg(target_os = "linux")]
use tokio_uring::buf::BoundedBuf;

use crate::backend::{Backend, BackendError};

/// Backlog of every listener.
const BACKLOG: i32 = 1024;

/// What happened to a server's connections, for its counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ConnEvent {
    Accepted,
    AcceptFailed,
    /// Connections still open when the shutdown grace ran out, and cut.
    CutAtShutdown(u64),
}

/// What one server thread needs besides its connection handler.
pub(crate) struct ServerThread {
    pub backend: Backend,
    pub listener: std::net::TcpListener,
    /// Told once the runtime and the listener are up, or why they are not.
    pub ready: std_mpsc::Sender<Result<(), BackendError>>,
    pub stop: watch::Receiver<bool>,
    pub grace: Duration,
    /// Names the server in logs.
    pub server: &'static str,
}

/// Runs one server thread to its end: builds the backend's runtime on this thread, turns the
/// listener into the backend's, reports readiness, then [`serve_until_stopped`].
pub(crate) fn run_server_thread<F, Fut>(
    thread: ServerThread,
    count: impl FnMut(ConnEvent),
    serve: F,
) where
    F: FnMut(Stream, SocketAddr) -> Fut,
    Fut: Future<Output = ()> + 'static,
{
    let ServerThread {
        backend,
        listener,
        ready,
        mut stop,
        grace,
        server,
    } = thread;
    let ready_on_error = ready.clone();
    let ran = crate::backend::block_on(backend, async move {
        let listener = match Listener::from_std(backend, listener) {
            Ok(l) => l,
            Err(source) => {
                let _ = ready.send(Err(BackendError::Runtime { backend, source }));
                return;
            }
        };
        // The receiver is gone only if `start` gave up on another thread.
        let _ = ready.send(Ok(()));
        serve_until_stopped(listener, &mut stop, grace, server, count, serve).await;
    });
    if let Err(e) = ran {
        let _ = ready_on_error.send(Err(e));
    }
}

/// Accepts connections and serves each on a task of its own on this thread until `stop`
/// changes; then stops accepting, drops `serve` (and whatever it holds for the connections),
/// waits up to `grace` for the open connections to end and cuts the rest. `server` names the
/// server in logs; `count` sees every accept, failed accept and cut.
pub(crate) async fn serve_until_stopped<F, Fut>(
    listener: Listener,
    stop: &mut watch::Receiver<bool>,
    grace: Duration,
    server: &'static str,
    mut count: impl FnMut(ConnEvent),
    mut serve: F,
) where
    F: FnMut(Stream, SocketAddr) -> Fut,
    Fut: Future<Output = ()> + 'static,
{
    let mut conns: Vec<tokio::task::JoinHandle<()>> = Vec::new();
    loop {
        tokio::select! {
            biased;
            _ = stop.changed() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    count(ConnEvent::Accepted);
                    conns.retain(|h| !h.is_finished());
                    conns.push(tokio::task::spawn_local(serve(stream, peer)));
                }
                Err(error) => {
                    count(ConnEvent::AcceptFailed);
                    tracing::warn!(server, %error, "accept failed");
                    // Out of descriptors, most likely: let connections end before retrying.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
        }
    }
    drop(listener);
    drop(serve);
    let deadline = tokio::time::Instant::now() + grace;
    let mut cut = 0;
    for mut conn in conns {
        if tokio::time::timeout_at(deadline, &mut conn).await.is_err() {
            conn.abort();
            cut += 1;
        }
    }
    if cut > 0 {
        tracing::warn!(
            server,
            connections = cut,
            ?grace,
            "shutdown cut open connections"
        );
        count(ConnEvent::CutAtShutdown(cut));
    }
}

/// Binds `count` listeners (at least one) to `addr` with `SO_REUSEPORT`. With port 0 the first
/// listener's port is used for the rest. Returns them non-blocking, ready for either backend.
pub(crate) fn bind_reuseport(
    addr: SocketAddr,
    count: usize,
) -> io::Result<Vec<std::net::TcpListener>> {
    let mut addr = addr;
    let mut out = Vec::with_capacity(count.max(1));
    for _ in 0..count.max(1) {
        let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
        socket.set_reuse_address(true)?;
        socket.set_reuse_port(true)?;
        socket.set_nonblocking(true)?;
        socket.bind(&addr.into())?;
        socket.listen(BACKLOG)?;
        let listener: std::net::TcpListener = socket.into();
        addr = listener.local_addr()?;
        out.push(listener);
    }
    Ok(out)
}

/// A listener of one runtime thread.
pub(crate) enum Listener {
    #[cfg(target_os = "linux")]
    Uring(tokio_uring::net::TcpListener),
    Epoll(tokio::net::TcpListener),
}

impl Listener {
    /// Takes over `listener`; call on the runtime thread that will accept.
    pub(crate) fn from_std(backend: Backend, listener: std::net::TcpListener) -> io::Result<Self> {
        Ok(match backend {
            #[cfg(target_os = "linux")]
            Backend::IoUring => Listener::Uring(tokio_uring::net::TcpListener::from_std(listener)),
            #[cfg(not(target_os = "linux"))]
            Backend::IoUring => return Err(crate::backend::not_linux()),
            Backend::Epoll => Listener::Epoll(tokio::net::TcpListener::from_std(listener)?),
        })
    }

    pub(crate) async fn accept(&self) -> io::Result<(Stream, SocketAddr)> {
        match self {
            #[cfg(target_os = "linux")]
            Listener::Uring(l) => {
                let (s, peer) = l.accept().await?;
                Ok((Stream::Uring(s), peer))
            }
            Listener::Epoll(l) => {
                let (s, peer) = l.accept().await?;
                Ok((Stream::Epoll(s), peer))
            }
        }
    }
}

/// A connected TCP stream on either backend.
pub(crate) enum Stream {
    #[cfg(target_os = "linux")]
    Uring(tokio_uring::net::TcpStream),
    Epoll(tokio::net::TcpStream),
}

impl Stream {
    /// Connects to `addr`; call inside a runtime of `backend` ([`crate::backend::block_on`]).
    pub(crate) async fn connect(backend: Backend, addr: SocketAddr) -> io::Result<Self> {
        let stream = match backend {
            #[cfg(target_os = "linux")]
            Backend::IoUring => Stream::Uring(tokio_uring::net::TcpStream::connect(addr).await?),
            #[cfg(not(target_os = "linux"))]
            Backend::IoUring => return Err(crate::backend::not_linux()),
            Backend::Epoll => Stream::Epoll(tokio::net::TcpStream::connect(addr).await?),
        };
        stream.set_nodelay()?;
        Ok(stream)
    }

    pub(crate) fn set_nodelay(&self) -> io::Result<()> {
        match self {
            #[cfg(target_os = "linux")]
            Stream::Uring(s) => s.set_nodelay(true),
            Stream::Epoll(s) => s.set_nodelay(true),
        }
    }

    /// Reads once into the spare capacity of `buf` (which should have some), appending.
    /// `Ok(0)`: the peer closed its side.
    pub(crate) async fn read(&mut self, mut buf: BytesMut) -> (io::Result<usize>, BytesMut) {
        match self {
            #[cfg(target_os = "linux")]
            Stream::Uring(s) => {
                let (len, cap) = (buf.len(), buf.capacity());
                // A slice of the spare capacity: the kernel writes after the bytes kept.
                let (res, slice) = s.read(buf.slice(len..cap)).await;
                (res, slice.into_inner())
            }
            Stream::Epoll(s) => {
                let res = s.read_buf(&mut buf).await;
                (res, buf)
            }
        }
    }

    /// Splits the stream so that one task reads while another writes. Both halves stay on
    /// this thread (io_uring's stream is shared through an `Rc`; its operations take `&self`).
    pub(crate) fn into_split(self) -> (ReadHalf, WriteHalf) {
        match self {
            #[cfg(target_os = "linux")]
            Stream::Uring(s) => {
                let s = Rc::new(s);
                (ReadHalf::Uring(Rc::clone(&s)), WriteHalf::Uring(s))
            }
            Stream::Epoll(s) => {
                let (r, w) = s.into_split();
                (ReadHalf::Epoll(r), WriteHalf::Epoll(w))
            }
        }
    }
}

/// The reading half of a split [`Stream`].
pub(crate) enum ReadHalf {
    #[cfg(target_os = "linux")]
    Uring(Rc<tokio_uring::net::TcpStream>),
    Epoll(tokio::net::tcp::OwnedReadHalf),
}

impl ReadHalf {
    /// As [`Stream::read`].
    pub(crate) async fn read(&mut self, mut buf: BytesMut) -> (io::Result<usize>, BytesMut) {
        match self {
            #[cfg(target_os = "linux")]
            ReadHalf::Uring(s) => {
                let (len, cap) = (buf.len(), buf.capacity());
                let (res, slice) = s.read(buf.slice(len..cap)).await;
                (res, slice.into_inner())
            }
            ReadHalf::Epoll(s) => {
                let res = s.read_buf(&mut buf).await;
                (res, buf)
            }
        }
    }
}

/// The writing half of a split [`Stream`]. Dropping both halves closes the socket.
pub(crate) enum WriteHalf {
    #[cfg(target_os = "linux")]
    Uring(Rc<tokio_uring::net::TcpStream>),
    Epoll(tokio::net::tcp::OwnedWriteHalf),
}

impl WriteHalf {
    /// As [`Stream::write_all`].
    pub(crate) async fn write_all(&mut self, buf: BytesMut) -> (io::Result<()>, BytesMut) {
        match self {
            #[cfg(target_os = "linux")]
            WriteHalf::Uring(s) => s.write_all(buf).await,
            WriteHalf::Epoll(s) => {
                let res = s.write_all(&buf).await;
                (res, buf)
            }
        }
    }

    /// Shuts down the write side (the peer reads end of stream).
    pub(crate) async fn shutdown_write(&mut self) -> io::Result<()> {
        match self {
            #[cfg(target_os = "linux")]
            WriteHalf::Uring(s) => s.shutdown(std::net::Shutdown::Write),
            WriteHalf::Epoll(s) => s.shutdown().await,
        }
    }
}
