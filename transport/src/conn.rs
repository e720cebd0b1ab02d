//! What both ends of a dispatch connection share: a frame reader over the read half, a
//! coalescing frame writer over the write half, and the reconnect backoff.
//!
//! ```text
//!  ReadHalf ──read (one large buffer)──▶ FrameDecoder ──every whole frame in it──▶ caller
//!  caller ──encode, encode, ...──▶ one BytesMut ──flush: one write──▶ WriteHalf
//! ```
//!
//! A reader decodes every frame a read brought before it reads again, and a writer encodes
//! whatever is queued before it writes, so a burst of small frames costs one system call (or
//! one io_uring submission) each way instead of one per frame.

use std::io;
use std::time::Duration;

use bytes::BytesMut;
use kvroute_core::Rng;

use crate::frame::{self, DecodeStats, EncodeError, Frame, FrameDecoder, FrameError};
use crate::net::{ReadHalf, WriteHalf};
use crate::wire::{Message, MessageRef};

/// Why a frame reader stopped.
#[derive(Debug)]
pub(crate) enum ReadEnd {
    /// The peer closed its side between frames.
    Closed,
    /// A bad frame (or the stream ended inside one).
    Frame(FrameError),
    /// The read failed.
    Io(io::Error),
}

/// Cuts frames out of one connection's byte stream.
pub(crate) struct FrameReader {
    half: ReadHalf,
    buf: BytesMut,
    decoder: FrameDecoder,
    read_chunk: usize,
    eof: bool,
}

impl FrameReader {
    pub(crate) fn new(half: ReadHalf, max_payload: u32, read_chunk: usize) -> FrameReader {
        let read_chunk = read_chunk.max(4096);
        FrameReader {
            half,
            buf: BytesMut::with_capacity(read_chunk),
            decoder: FrameDecoder::new(max_payload),
            read_chunk,
            eof: false,
        }
    }

    /// The next whole frame, reading only when the buffer holds none.
    pub(crate) async fn next_frame(&mut self) -> Result<Frame, ReadEnd> {
        loop {
            let next = if self.eof {
                self.decoder.decode_eof(&mut self.buf)
            } else {
                self.decoder.decode(&mut self.buf)
            };
            match next {
                Ok(Some(frame)) => return Ok(frame),
                Ok(None) if self.eof => return Err(ReadEnd::Closed),
                Ok(None) => {}
                Err(e) => return Err(ReadEnd::Frame(e)),
            }
            if self.buf.capacity() - self.buf.len() < self.read_chunk / 2 {
                self.buf.reserve(self.read_chunk);
            }
            let (res, buf) = self.half.read(std::mem::take(&mut self.buf)).await;
            self.buf = buf;
            match res {
                Ok(0) => self.eof = true,
                Ok(_) => {}
                Err(e) => return Err(ReadEnd::Io(e)),
            }
        }
    }

    /// Validates a frame this reader returned.
    pub(crate) fn validate<'f>(&mut self, frame: &'f Frame) -> Result<MessageRef<'f>, FrameError> {
        self.decoder.validate(frame)
    }

    pub(crate) fn stats(&self) -> &DecodeStats {
        self.decoder.stats()
    }
}

/// Why [`FrameWriter::flush_while_alive`] gave up.
#[derive(Debug)]
pub(crate) enum FlushError {
    Io(io::Error),
    PeerSilent { silent: Duration },
}

/// Encodes frames into one buffer and writes them together.
pub(crate) struct FrameWriter {
    half: WriteHalf,
    out: BytesMut,
}

impl FrameWriter {
    pub(crate) fn new(half: WriteHalf) -> FrameWriter {
        FrameWriter {
            half,
            out: BytesMut::with_capacity(64 << 10),
        }
    }

    /// Appends `msg` to what the next [`flush`](Self::flush) writes.
    pub(crate) fn push(&mut self, msg: &Message) -> Result<(), EncodeError> {
        frame::encode(msg, &mut self.out).map(|_| ())
    }

    /// Writes everything pushed so far in one `write_all`.
    pub(crate) async fn flush(&mut self) -> io::Result<()> {
        if self.out.is_empty() {
            return Ok(());
        }
        let (res, mut out) = self.half.write_all(std::mem::take(&mut self.out)).await;
        out.clear();
        self.out = out;
        res
    }

    /// Flushes for as long as the peer shows life: every `limit`, `silent_for` says how long
    /// the peer has been silent, and past `limit` the flush is given up (the connection must
    /// then be closed: part of the buffer may have been written). A peer that reads slowly
    /// but still talks is waited for; that is backpressure, not failure.
    pub(crate) async fn flush_while_alive(
        &mut self,
        limit: Duration,
        silent_for: impl Fn() -> Duration,
    ) -> Result<(), FlushError> {
        let flush = self.flush();
        tokio::pin!(flush);
        loop {
            tokio::select! {
                done = &mut flush => return done.map_err(FlushError::Io),
                _ = tokio::time::sleep(limit) => {
                    let silent = silent_for();
                    if silent > limit {
                        return Err(FlushError::PeerSilent { silent });
                    }
                }
            }
        }
    }

    /// Flushes, then shuts down the write side.
    pub(crate) async fn close(mut self) -> io::Result<()> {
        self.flush().await?;
        self.half.shutdown_write().await
    }
}

/// Reconnect delays: exponential from `initial` to `max`, each drawn uniformly from the upper
/// half of its step ("equal jitter"), so that clients cut off together do not return together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    /// The first delay's step.
    pub initial: Duration,
    /// The largest step.
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            initial: Duration::from_millis(50),
            max: Duration::from_secs(5),
        }
    }
}

/// The state of one client's backoff.
#[derive(Debug)]
pub(crate) struct BackoffState {
    config: Backoff,
    step: Duration,
    rng: Rng,
}

impl BackoffState {
    pub(crate) fn new(config: Backoff, seed: u64) -> BackoffState {
        BackoffState {
            config,
            step: config.initial,
            rng: Rng::new(seed),
        }
    }

    /// After a connection that worked: start again from `initial`.
    pub(crate) fn reset(&mut self) {
        self.step = self.config.initial;
    }

    /// The next delay: between half the current step and the step, then the step doubles.
    pub(crate) fn next_delay(&mut self) -> Duration {
        let step = self.step.min(self.config.max);
        let half = step / 2;
        let span = u64::try_from((step - half).as_nanos()).unwrap_or(u64::MAX);
        let jitter = Duration::from_nanos(self.rng.below(span.saturating_add(1)));
        self.step = step.saturating_mul(2).min(self.config.max);
        half + jitter
    }
}

#[cfg(test)]
mod tests;
