//! The one fuzz loop of gpushare's decoder tests (feature `fuzz`, for dev-dependencies): a
//! seeded, fast generator of hostile inputs, random bytes and structure-aware mutations of
//! valid samples (bit flips, truncations, splices, corrupted length prefixes and varints), fed
//! to a decoder. Stable Rust and a fixed seed, so CI runs the same million inputs every time
//! and a failure names the input that caused it.

use rand_xoshiro::SplitMix64;
use rand_xoshiro::rand_core::{Rng as _, SeedableRng};
use serde::{Serialize, de::DeserializeOwned};
use std::fmt::Debug;

/// What a fuzz run did: every input was either accepted or rejected (a panic fails the test).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Outcome {
    pub inputs: usize,
    pub accepted: usize,
    pub rejected: usize,
}

impl Outcome {
    /// Panics unless all `n` inputs ran and both outcomes occurred: a generator that only ever
    /// produces garbage (or only valid input) tests half a decoder.
    pub fn assert_exercised(&self, n: usize) {
        assert_eq!(self.inputs, n, "{self:?}");
        assert_eq!(self.accepted + self.rejected, n, "{self:?}");
        assert!(self.accepted > 0 && self.rejected > 0, "{self:?}");
    }
}

/// The fuzzer's choices, from SplitMix64: tiny, fast, good enough to pick mutations, and a fixed
/// algorithm (the same inputs for a seed on every platform and release).
struct Rng(SplitMix64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(SplitMix64::seed_from_u64(seed))
    }

    fn next(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in `0..n` (`n > 0`).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// Mostly printable ASCII (text decoders), sometimes any byte or a varint edge.
    fn byte(&mut self) -> u8 {
        match self.below(4) {
            0 | 1 => b' ' + self.below(95) as u8,
            2 => self.next() as u8,
            _ => [0, 0x7f, 0x80, 0xff][self.below(4)],
        }
    }
}

/// Length prefixes worth trying: empty, the limit and just past it, the largest.
const LENGTHS: [u32; 5] = [
    0,
    1,
    crate::MAX_FRAME as u32,
    crate::MAX_FRAME as u32 + 1,
    u32::MAX,
];

/// Up to four mutations of `buf`; `samples` supply splices.
fn mutate(rng: &mut Rng, buf: &mut Vec<u8>, samples: &[Vec<u8>]) {
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(buf.len() + 1);
        match rng.below(9) {
            0 if at < buf.len() => buf[at] ^= 1 << rng.below(8),
            1 if at < buf.len() => buf[at] = rng.byte(),
            2 => buf.truncate(at),
            3 => {
                let n = 1 + rng.below(8);
                let bytes: Vec<u8> = (0..n).map(|_| rng.byte()).collect();
                buf.splice(at..at, bytes);
            }
            4 => {
                let end = (at + 1 + rng.below(8)).min(buf.len());
                buf.drain(at..end);
            }
            // A length prefix (or any u32) at `at`: an edge, or the true length ± 1.
            5 => {
                let len = buf.len().saturating_sub(at + 4) as u32;
                let v = match rng.below(3) {
                    0 => LENGTHS[rng.below(LENGTHS.len())],
                    1 => len.wrapping_add(1),
                    _ => len.wrapping_sub(1),
                };
                let end = (at + 4).min(buf.len());
                buf.splice(at..end, v.to_le_bytes());
            }
            // A varint that never ends, or ends past 64 bits.
            6 => {
                let n = 1 + rng.below(12);
                buf.splice(at..at, std::iter::repeat_n(0xff, n));
            }
            7 => {
                let other = &samples[rng.below(samples.len())];
                let from = rng.below(other.len() + 1);
                let to = from + rng.below(other.len() - from + 1);
                buf.splice(at..at, other[from..to].iter().copied());
            }
            _ => {
                let end = (at + 1 + rng.below(16)).min(buf.len());
                let dup = buf[at..end].to_vec();
                buf.splice(at..at, dup);
            }
        }
    }
}

/// Feed `n` inputs to `decode` (true: accepted): each a valid sample, a mutation of one, or
/// random bytes (one in eight). `seed` fixes the sequence.
pub fn run(
    seed: u64,
    samples: &[Vec<u8>],
    n: usize,
    mut decode: impl FnMut(&[u8]) -> bool,
) -> Outcome {
    assert!(!samples.is_empty(), "fuzzing needs valid samples to mutate");
    let mut rng = Rng::new(seed);
    let mut buf = Vec::new();
    let mut out = Outcome::default();
    for _ in 0..n {
        buf.clear();
        match rng.below(16) {
            0 => {}
            1 | 2 => buf.extend((0..rng.below(64)).map(|_| rng.next() as u8)),
            _ => {
                buf.extend_from_slice(&samples[rng.below(samples.len())]);
                mutate(&mut rng, &mut buf, samples);
            }
        }
        out.inputs += 1;
        if decode(&buf) {
            out.accepted += 1;
        } else {
            out.rejected += 1;
        }
    }
    out
}

/// Fuzz the frame decoder of message type `T` with `n` byte streams made from `samples`.
///
/// First every sample must decode to itself, alone and all in one stream. Then each hostile
/// stream is read to its end or first error; every message decoded from it goes to `sink` (a
/// daemon's receive path) and must survive its own round trip. A stream is accepted if its
/// first frame decodes.
pub fn frames<T>(seed: u64, samples: &[T], n: usize, mut sink: impl FnMut(T)) -> Outcome
where
    T: Serialize + DeserializeOwned + PartialEq + Debug,
{
    let valid: Vec<Vec<u8>> = samples.iter().map(encoded).collect();
    let stream = valid.concat();
    let (mut r, mut buf) = (&stream[..], Vec::new());
    for m in samples {
        assert_eq!(
            crate::recv::<T>(&mut r, &mut buf).unwrap().as_ref(),
            Some(m)
        );
    }
    assert!(crate::recv::<T>(&mut r, &mut buf).unwrap().is_none());
    let mut buf = Vec::new();
    run(seed, &valid, n, |mut r| {
        let mut first = true;
        loop {
            match crate::recv::<T>(&mut r, &mut buf) {
                Ok(Some(m)) => {
                    let bytes = encoded(&m);
                    let again = crate::recv::<T>(&mut &bytes[..], &mut Vec::new());
                    assert_eq!(encoded(&again.unwrap().unwrap()), bytes, "{m:?}");
                    sink(m);
                }
                Ok(None) | Err(_) => return !first,
            }
            first = false;
        }
    })
}

/// Fuzz a text decoder (config, annotation, units, JSON) with `n` strings made from `samples`;
/// `parse` says whether it accepted, after checking what it accepted.
pub fn texts(
    seed: u64,
    samples: &[&str],
    n: usize,
    mut parse: impl FnMut(&str) -> bool,
) -> Outcome {
    let samples: Vec<Vec<u8>> = samples.iter().map(|s| s.as_bytes().to_vec()).collect();
    run(seed, &samples, n, |b| parse(&String::from_utf8_lossy(b)))
}

fn encoded<T: Serialize>(m: &T) -> Vec<u8> {
    let mut buf = Vec::new();
    crate::encode(m, &mut buf).expect("samples encode");
    buf
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_inputs() {
        let samples = [b"sample".to_vec()];
        let trace = |seed| {
            let mut seen = Vec::new();
            run(seed, &samples, 64, |b| {
                seen.push(b.to_vec());
                true
            });
            seen
        };
        assert_eq!(trace(1), trace(1));
        assert_ne!(trace(1), trace(2));
    }

    /// The generator is SplitMix64 seeded with the seed itself: a seed names the same inputs
    /// whatever the version of the crate that provides it.
    #[test]
    fn the_generator_is_splitmix64() {
        let mut rng = Rng::new(1);
        let first: Vec<u64> = (0..3).map(|_| rng.next()).collect();
        assert_eq!(
            first,
            [
                10_451_216_379_200_822_465,
                13_757_245_211_066_428_519,
                17_911_839_290_282_890_590
            ]
        );
    }
}
