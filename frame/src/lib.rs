//! Framing shared by gpushare's socket protocols (hook ↔ scheduler, simulated driver ↔ device):
//! a little-endian `u32` length, then a `postcard` body. Decoders reject oversized or
//! undecodable frames with an error, never a panic. [`listen_at`] publishes the sockets these
//! protocols are served on.

#[cfg(any(test, feature = "fuzz"))]
pub mod fuzz;
mod listen;

pub use listen::listen_at;
use serde::{Deserialize, Serialize};
use std::io::{self, Read, Write};

/// Largest frame either side accepts; anything bigger is a corrupt or hostile stream.
pub const MAX_FRAME: usize = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    #[error("frame of {0} bytes exceeds the {MAX_FRAME}-byte limit")]
    TooLarge(usize),
    #[error("undecodable frame: {0}")]
    Decode(#[from] postcard::Error),
}

/// Serialise `msg` as one frame into `buf` (cleared first), ready for a single `write_all`.
pub fn encode<T: Serialize>(msg: &T, buf: &mut Vec<u8>) -> Result<(), WireError> {
    buf.clear();
    buf.extend_from_slice(&[0; 4]);
    let body = postcard::to_extend(msg, std::mem::take(buf))?;
    *buf = body;
    let len = buf.len() - 4;
    if len > MAX_FRAME {
        return Err(WireError::TooLarge(len));
    }
    buf[..4].copy_from_slice(&(len as u32).to_le_bytes());
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
        return Err(WireError::TooLarge(len));
    }
    buf.resize(len, 0);
    r.read_exact(buf)?;
    Ok(Some(postcard::from_bytes(buf)?))
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

    #[test]
    fn oversized_frame_is_rejected() {
        let mut wire = ((MAX_FRAME + 1) as u32).to_le_bytes().to_vec();
        wire.extend_from_slice(&[0; 16]);
        let err = recv::<u32>(&mut &wire[..], &mut Vec::new()).unwrap_err();
        assert!(matches!(err, WireError::TooLarge(_)));
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
    fn hostile_streams_are_rejected_without_panicking() {
        let samples = [(0, vec![]), (u64::MAX, vec!["two".into(), String::new()])];
        fuzz::frames::<(u64, Vec<String>)>(1, &samples, 100_000, |_| {}).assert_exercised(100_000);
    }
}
