//! Framing shared by gpushare's socket protocols (hook ↔ scheduler, simulated driver ↔ device):
//! a little-endian `u32` length, then a `postcard` body. Decoders reject oversized or
//! undecodable frames with an error, never a panic. [`listen_at`] publishes the sockets these
//! protocols are served on; [`peer_credentials`] says who connected to one; [`heartbeat`] is
//! the page a daemon publishes its heartbeat in, passed to its clients over their sockets.

#[cfg(any(test, feature = "fuzz"))]
pub mod fuzz;
pub mod heartbeat;
mod listen;

pub use listen::{listen_at, peer_credentials};
use serde::{Deserialize, Serialize};
use std::io::{self, Read, Write};

/// Largest frame either side accepts; anything bigger is a corrupt or hostile stream.
pub const MAX_FRAME: usize = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    #[error("frame of {len} bytes exceeds the {max}-byte limit")]
    TooLarge { len: usize, max: usize },
    #[error("undecodable frame: {0}")]
    Decode(#[from] postcard::Error),
}

/// Serialise `msg` as one frame into `buf` (cleared first), ready for a single `write_all`.
pub fn encode<T: Serialize>(msg: &T, buf: &mut Vec<u8>) -> Result<(), WireError> {
    buf.clear();
    append(msg, buf)
}

/// Serialise `msg` as one frame after what `buf` already holds (frames queued behind others,
/// or the unsent rest of one); on an error `buf` is as it was.
pub fn append<T: Serialize>(msg: &T, buf: &mut Vec<u8>) -> Result<(), WireError> {
    let start = buf.len();
    buf.extend_from_slice(&[0; 4]);
    if let Err(e) = postcard::to_io(msg, &mut *buf) {
        buf.truncate(start);
        return Err(e.into());
    }
    let len = buf.len() - start - 4;
    if len > MAX_FRAME {
        buf.truncate(start);
        return Err(WireError::TooLarge {
            len,
            max: MAX_FRAME,
        });
    }
    buf[start..start + 4].copy_from_slice(&(len as u32).to_le_bytes());
    Ok(())
}

/// Write one frame.
pub fn send<T: Serialize>(w: &mut impl Write, msg: &T) -> Result<(), WireError> {
    let mut buf = Vec::new();
    encode(msg, &mut buf)?;
    w.write_all(&buf)?;
    Ok(())
}

/// Read one frame; `Ok(None)` on a clean end of stream between frames, an error on one that
/// ends inside a frame.
pub fn recv<T: for<'de> Deserialize<'de>>(
    r: &mut impl Read,
    buf: &mut Vec<u8>,
) -> Result<Option<T>, WireError> {
    let mut len = [0u8; 4];
    // A stream may end between frames, not inside a length prefix.
    let mut got = 0;
    while got < len.len() {
        match r.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(WireError::TooLarge {
            len,
            max: MAX_FRAME,
        });
    }
    buf.resize(len, 0);
    r.read_exact(buf)?;
    Ok(Some(postcard::from_bytes(buf)?))
}

/// Frames that arrive in pieces, for a non-blocking reader: [`push`](FrameBuf::push) the bytes
/// as they come, take whole frames with [`take`](FrameBuf::take). A length over `max` is an
/// error as soon as its 4 bytes are in, so a peer can never make the reader hold more than
/// `max + 4` bytes ([`room`](FrameBuf::room) says how many more it may take).
#[derive(Debug)]
pub struct FrameBuf {
    buf: Vec<u8>,
    max: usize,
}

impl FrameBuf {
    pub fn new(max: usize) -> FrameBuf {
        FrameBuf {
            buf: Vec::new(),
            max,
        }
    }

    /// Bytes the buffer may still take before a frame must be taken out.
    pub fn room(&self) -> usize {
        (self.max + 4).saturating_sub(self.buf.len())
    }

    /// Append bytes read from the stream (at most [`room`](FrameBuf::room)).
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next whole frame, decoded; `Ok(None)` until one is complete.
    pub fn take<T: for<'de> Deserialize<'de>>(&mut self) -> Result<Option<T>, WireError> {
        let Some(head) = self.buf.first_chunk::<4>() else {
            return Ok(None);
        };
        let len = u32::from_le_bytes(*head) as usize;
        if len > self.max {
            return Err(WireError::TooLarge { len, max: self.max });
        }
        if self.buf.len() < 4 + len {
            return Ok(None);
        }
        let msg = postcard::from_bytes(&self.buf[4..4 + len]);
        self.buf.drain(..4 + len);
        if self.buf.is_empty() {
            // An idle connection keeps no buffer.
            self.buf = Vec::new();
        }
        Ok(Some(msg?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_clean_end() {
        let mut wire = Vec::new();
        send(&mut wire, &(1u32, "two".to_string())).unwrap();
        let mut r = &wire[..];
        let mut buf = Vec::new();
        assert_eq!(
            recv::<(u32, String)>(&mut r, &mut buf).unwrap(),
            Some((1, "two".into()))
        );
        assert_eq!(recv::<(u32, String)>(&mut r, &mut buf).unwrap(), None);
    }

    /// Frames appended behind one another (and behind the unsent rest of one) all come out,
    /// in order; `encode` starts afresh.
    #[test]
    fn appended_frames_queue_behind_what_the_buffer_holds() {
        let mut queued = Vec::new();
        encode(&1u32, &mut queued).unwrap();
        let unsent = queued.split_off(2);
        let mut wire = queued;
        let mut backlog = unsent;
        append(&"two".to_string(), &mut backlog).unwrap();
        append(&3u64, &mut backlog).unwrap();
        wire.extend_from_slice(&backlog);
        let mut r = &wire[..];
        let mut buf = Vec::new();
        assert_eq!(recv::<u32>(&mut r, &mut buf).unwrap(), Some(1));
        assert_eq!(
            recv::<String>(&mut r, &mut buf).unwrap(),
            Some("two".into())
        );
        assert_eq!(recv::<u64>(&mut r, &mut buf).unwrap(), Some(3));
        assert_eq!(recv::<u64>(&mut r, &mut buf).unwrap(), None);
        encode(&4u32, &mut backlog).unwrap();
        assert_eq!(recv::<u32>(&mut &backlog[..], &mut buf).unwrap(), Some(4));
    }

    #[test]
    fn oversized_frame_is_rejected() {
        let mut wire = ((MAX_FRAME + 1) as u32).to_le_bytes().to_vec();
        wire.extend_from_slice(&[0; 16]);
        let err = recv::<u32>(&mut &wire[..], &mut Vec::new()).unwrap_err();
        assert!(matches!(err, WireError::TooLarge { .. }));
    }

    #[test]
    fn frames_in_pieces_come_out_whole() {
        let mut wire = Vec::new();
        for i in 0..3u32 {
            send(&mut wire, &(i, "x".repeat(i as usize))).unwrap();
        }
        let mut fb = FrameBuf::new(64);
        let mut got = Vec::new();
        for b in &wire {
            assert!(fb.room() > 0);
            fb.push(std::slice::from_ref(b));
            while let Some(m) = fb.take::<(u32, String)>().unwrap() {
                got.push(m.0);
            }
        }
        assert_eq!(got, [0, 1, 2]);
        assert_eq!(fb.room(), 68);
    }

    #[test]
    fn a_long_frame_is_refused_by_its_length() {
        let mut fb = FrameBuf::new(64);
        fb.push(&65u32.to_le_bytes());
        assert!(matches!(
            fb.take::<u32>(),
            Err(WireError::TooLarge { len: 65, max: 64 })
        ));
    }

    #[test]
    fn a_stream_cut_inside_a_frame_is_an_error() {
        let mut wire = Vec::new();
        send(&mut wire, &7u32).unwrap();
        for cut in 1..wire.len() {
            assert!(
                recv::<u32>(&mut &wire[..cut], &mut Vec::new()).is_err(),
                "{cut}"
            );
        }
    }

    #[test]
    fn hostile_streams_in_pieces_are_rejected_without_panicking() {
        let samples: Vec<Vec<u8>> = [(0u64, vec![]), (u64::MAX, vec!["two".to_string()])]
            .iter()
            .map(|m| {
                let mut b = Vec::new();
                send(&mut b, m).unwrap();
                b
            })
            .collect();
        fuzz::run(2, &samples, 100_000, |bytes| {
            let mut fb = FrameBuf::new(32);
            let mut decoded = false;
            for chunk in bytes.chunks(7) {
                fb.push(&chunk[..chunk.len().min(fb.room())]);
                loop {
                    match fb.take::<(u64, Vec<String>)>() {
                        Ok(Some(_)) => decoded = true,
                        Ok(None) => break,
                        Err(_) => return decoded,
                    }
                }
            }
            decoded
        })
        .assert_exercised(100_000);
    }

    #[test]
    fn hostile_streams_are_rejected_without_panicking() {
        let samples = [(0, vec![]), (u64::MAX, vec!["two".into(), String::new()])];
        fuzz::frames::<(u64, Vec<String>)>(1, &samples, 100_000, |_| {}).assert_exercised(100_000);
    }
}
