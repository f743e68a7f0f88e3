//! Fat binary containers, as `nvcc` embeds them in programs and `fatbinary` writes them: one or
//! more entries, each a cubin for one SM architecture or PTX for a virtual one, optionally
//! LZ4-compressed. The driver picks the entry that runs on the device: a cubin of its exact
//! architecture, else the newest PTX it can JIT-compile.
//!
//! Layout (little-endian), as documented by NVIDIA's `cuobjdump` output and the interoperability
//! project ZLUDA (`dark_api/src/fatbin.rs`, whose field names this follows):
//! - container header, 16 bytes: magic `0xBA55ED50`, version `u16` (1), header size `u16`,
//!   size of the entries that follow `u64`; several containers may follow one another;
//! - entry header (its size in the header itself): kind `u16` at 0 (1 PTX, 2 ELF), header size
//!   `u32` at 4, payload size `u32` at 8, compressed size `u32` at 16, SM version `u32` at 28,
//!   flags `u64` at 40 (`0x2000`: LZ4-compressed, `0x8000`: Zstandard), uncompressed size `u64`
//!   at 56; the payload follows the entry header.
//! - the `__fatBinC_Wrapper_t` a program registers (`cuda_runtime`'s `__cudaRegisterFatBinary`):
//!   magic `0x466243B1`, version `u32`, then a pointer to the container.

use crate::image::{DEVICE_ARCH, ImageError};

pub const MAGIC: u32 = 0xBA55_ED50;
pub const WRAPPER_MAGIC: u32 = 0x4662_43B1;
const KIND_PTX: u16 = 1;
const KIND_ELF: u16 = 2;
const FLAG_LZ4: u64 = 0x2000;
const FLAG_ZSTD: u64 = 0x8000;

/// One entry of a container, decompressed.
#[derive(Debug, PartialEq, Eq)]
pub enum Entry {
    Ptx { arch: u32, text: Vec<u8> },
    Elf { arch: u32, image: Vec<u8> },
}

/// How an entry's payload is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Compression {
    None,
    Lz4,
    Zstd,
}

/// An entry as its header describes it, its payload still as stored: reading a container
/// decompresses nothing, so a library of hundreds of entries for other architectures costs
/// only the one the device runs.
#[derive(Debug, Clone, Copy)]
pub struct Stored<'a> {
    kind: u16,
    arch: u32,
    compression: Compression,
    /// The payload as stored (compressed or not).
    data: &'a [u8],
    /// Its size once expanded (compressed entries).
    uncompressed: usize,
}

impl Stored<'_> {
    /// The entry's content, decompressed.
    pub fn expand(&self) -> Result<Entry, ImageError> {
        let bad = |what: &str| ImageError::Malformed(format!("fatbin: {what}"));
        let content = match self.compression {
            Compression::None => self.data.to_vec(),
            Compression::Lz4 => {
                lz4_block(self.data, self.uncompressed).ok_or_else(|| bad("corrupt LZ4 entry"))?
            }
            Compression::Zstd => zstd_frame(self.data, self.uncompressed)
                .ok_or_else(|| bad("corrupt Zstandard entry"))?,
        };
        Ok(match self.kind {
            KIND_PTX => Entry::Ptx {
                arch: self.arch,
                text: content,
            },
            _ => Entry::Elf {
                arch: self.arch,
                image: content,
            },
        })
    }
}

fn u16_at(b: &[u8], off: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(off..off + 2)?.try_into().ok()?))
}
fn u32_at(b: &[u8], off: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(off..off + 4)?.try_into().ok()?))
}
fn u64_at(b: &[u8], off: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(off..off + 8)?.try_into().ok()?))
}

/// Bytes one container spans, from its 16-byte header.
pub fn container_len(header: &[u8]) -> Option<usize> {
    (u32_at(header, 0)? == MAGIC).then_some(())?;
    usize::try_from(u64::from(u16_at(header, 6)?) + u64_at(header, 8)?).ok()
}

/// The PTX and cubin entries of the containers in `b` (one or several back to back; trailing
/// padding ignored), read from their headers only.
pub fn entries(mut b: &[u8]) -> Result<Vec<Stored<'_>>, ImageError> {
    let bad = |what: &str| ImageError::Malformed(format!("fatbin: {what}"));
    let mut out = Vec::new();
    while b.len() >= 16 && u32_at(b, 0) == Some(MAGIC) {
        let len = container_len(b).ok_or_else(|| bad("header"))?;
        let header = u16_at(b, 6).unwrap_or(16) as usize;
        let mut files = b
            .get(header..len)
            .ok_or_else(|| bad("truncated container"))?;
        while files.len() >= 64 {
            let kind = u16_at(files, 0).unwrap_or(0);
            let hsize = u32_at(files, 4).unwrap_or(0) as usize;
            let payload = u32_at(files, 8).unwrap_or(0) as usize;
            let compressed = u32_at(files, 16).unwrap_or(0) as usize;
            let arch = u32_at(files, 28).unwrap_or(0);
            let flags = u64_at(files, 40).unwrap_or(0);
            let uncompressed = u64_at(files, 56).unwrap_or(0) as usize;
            if hsize < 64 {
                return Err(bad("entry header"));
            }
            let span = payload.max(compressed);
            let data = files
                .get(hsize..hsize + span)
                .ok_or_else(|| bad("truncated entry"))?;
            let (compression, data) = if flags & FLAG_LZ4 != 0 {
                (Compression::Lz4, &data[..compressed.min(data.len())])
            } else if flags & FLAG_ZSTD != 0 {
                (Compression::Zstd, &data[..compressed.min(data.len())])
            } else {
                (Compression::None, &data[..payload])
            };
            // Other kinds (e.g. LTO IR) are not for the driver.
            if kind == KIND_PTX || kind == KIND_ELF {
                out.push(Stored {
                    kind,
                    arch,
                    compression,
                    data,
                    uncompressed,
                });
            }
            files = &files[hsize + span..];
        }
        b = &b[len..];
    }
    if out.is_empty() {
        return Err(bad("no entries"));
    }
    Ok(out)
}

/// The entry the device runs: a cubin of its architecture, else the newest PTX not newer than
/// it. Only that entry is decompressed.
pub fn select(entries: &[Stored]) -> Result<Entry, ImageError> {
    let cubin = entries
        .iter()
        .find(|e| e.kind == KIND_ELF && e.arch == DEVICE_ARCH);
    let ptx = || {
        entries
            .iter()
            .filter(|e| e.kind == KIND_PTX && e.arch <= DEVICE_ARCH)
            .max_by_key(|e| e.arch)
    };
    cubin
        .or_else(ptx)
        .ok_or(ImageError::NoBinaryForGpu)?
        .expand()
}

/// Decompress one Zstandard frame of `expected` bytes.
fn zstd_frame(src: &[u8], expected: usize) -> Option<Vec<u8>> {
    use std::io::Read;
    let mut decoder = ruzstd::decoding::StreamingDecoder::new(src).ok()?;
    let mut out = Vec::with_capacity(expected);
    decoder.read_to_end(&mut out).ok()?;
    (expected == 0 || out.len() == expected).then_some(out)
}

/// Decompress one LZ4 block (the block format, without frame) of `expected` bytes.
pub fn lz4_block(src: &[u8], expected: usize) -> Option<Vec<u8>> {
    let mut out: Vec<u8> = Vec::with_capacity(expected);
    let mut i = 0;
    let length = |i: &mut usize, mut n: usize| -> Option<usize> {
        if n == 15 {
            loop {
                let b = *src.get(*i)?;
                *i += 1;
                n += b as usize;
                if b != 255 {
                    break;
                }
            }
        }
        Some(n)
    };
    while i < src.len() {
        let token = src[i];
        i += 1;
        let lits = length(&mut i, (token >> 4) as usize)?;
        out.extend_from_slice(src.get(i..i.checked_add(lits)?)?);
        i += lits;
        if i == src.len() {
            break; // the last sequence has literals only
        }
        let offset = u16_at(src, i)? as usize;
        i += 2;
        let len = length(&mut i, (token & 0xf) as usize)? + 4;
        if offset == 0 || offset > out.len() {
            return None;
        }
        let start = out.len() - offset;
        for k in 0..len {
            out.push(out[start + k]); // may overlap what it writes: byte by byte
        }
        if out.len() > expected.max(1) * 2 + 64 {
            return None;
        }
    }
    (expected == 0 || out.len() == expected).then_some(out)
}

/// How a test entry is stored: as is, or compressed (the compressed bytes and the size they
/// expand to).
#[cfg(test)]
#[derive(Clone, Copy)]
pub enum Packed<'a> {
    Plain,
    Lz4(&'a [u8], usize),
    Zstd(&'a [u8], usize),
}

/// One entry for [`build`]: kind, SM architecture, payload (ignored when compressed), storage.
#[cfg(test)]
pub type TestEntry<'a> = (u16, u32, &'a [u8], Packed<'a>);

/// Build a container from entries (for tests, and to describe the layout by example).
#[cfg(test)]
pub fn build(entries: &[TestEntry]) -> Vec<u8> {
    let mut files = Vec::new();
    for &(kind, arch, payload, packed) in entries {
        let mut h = [0u8; 64];
        h[0..2].copy_from_slice(&kind.to_le_bytes());
        h[2..4].copy_from_slice(&0x101u16.to_le_bytes());
        h[4..8].copy_from_slice(&64u32.to_le_bytes());
        h[28..32].copy_from_slice(&arch.to_le_bytes());
        let body = match packed {
            Packed::Lz4(compressed, size) | Packed::Zstd(compressed, size) => {
                let flag = match packed {
                    Packed::Lz4(..) => FLAG_LZ4,
                    _ => FLAG_ZSTD,
                };
                h[8..12].copy_from_slice(&(compressed.len() as u32).to_le_bytes());
                h[16..20].copy_from_slice(&(compressed.len() as u32).to_le_bytes());
                h[40..48].copy_from_slice(&(flag | 0x11).to_le_bytes());
                h[56..64].copy_from_slice(&(size as u64).to_le_bytes());
                compressed
            }
            Packed::Plain => {
                h[8..12].copy_from_slice(&(payload.len() as u32).to_le_bytes());
                h[40..48].copy_from_slice(&0x11u64.to_le_bytes());
                payload
            }
        };
        files.extend_from_slice(&h);
        files.extend_from_slice(body);
    }
    let mut out = Vec::new();
    out.extend_from_slice(&MAGIC.to_le_bytes());
    out.extend_from_slice(&1u16.to_le_bytes());
    out.extend_from_slice(&16u16.to_le_bytes());
    out.extend_from_slice(&(files.len() as u64).to_le_bytes());
    out.extend_from_slice(&files);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pick(img: &[u8]) -> Result<Entry, ImageError> {
        select(&entries(img)?)
    }

    #[test]
    fn lz4_literals_matches_and_overlapping_copies() {
        // "abc" then a 9-byte match at offset 3 (overlapping), then literals "xyz".
        let src = [0x35, b'a', b'b', b'c', 3, 0, 0x30, b'x', b'y', b'z'];
        assert_eq!(lz4_block(&src, 15).unwrap(), b"abcabcabcabcxyz");
        // A literal run of 20 (15 + extension byte 5).
        let mut long = vec![0xf0, 5];
        long.extend(std::iter::repeat_n(b'q', 20));
        assert_eq!(lz4_block(&long, 20).unwrap(), vec![b'q'; 20]);
        assert!(
            lz4_block(&[0x10, b'a', 9, 0], 5).is_none(),
            "offset before the start"
        );
        assert!(
            lz4_block(&src, 14).is_none(),
            "size disagrees with the header"
        );
    }

    #[test]
    fn picks_the_device_cubin_else_the_newest_usable_ptx() {
        let plain = Packed::Plain;
        let img = build(&[
            (KIND_ELF, 80, b"sm80", plain),
            (KIND_PTX, 80, b"ptx80", plain),
            (KIND_ELF, 90, b"sm90", plain),
        ]);
        assert_eq!(entries(&img).unwrap().len(), 3);
        assert_eq!(
            pick(&img).unwrap(),
            Entry::Elf {
                arch: 90,
                image: b"sm90".to_vec()
            }
        );
        let img = build(&[
            (KIND_PTX, 70, b"ptx70", plain),
            (KIND_ELF, 80, b"sm80", plain),
            (KIND_PTX, 86, b"ptx86", plain),
            (KIND_PTX, 100, b"ptx100", plain),
        ]);
        assert_eq!(
            pick(&img).unwrap(),
            Entry::Ptx {
                arch: 86,
                text: b"ptx86".to_vec()
            }
        );
        let img = build(&[(KIND_ELF, 100, b"sm100", plain)]);
        assert_eq!(pick(&img), Err(ImageError::NoBinaryForGpu));
    }

    #[test]
    fn compressed_entries_are_expanded() {
        let src = [0x35, b'a', b'b', b'c', 3, 0, 0x30, b'x', b'y', b'z'];
        let img = build(&[(KIND_PTX, 90, b"", Packed::Lz4(&src, 15))]);
        assert_eq!(container_len(&img), Some(img.len()));
        assert_eq!(
            pick(&img).unwrap(),
            Entry::Ptx {
                arch: 90,
                text: b"abcabcabcabcxyz".to_vec()
            }
        );
        let mut broken = img.clone();
        broken.truncate(img.len() - 3);
        assert!(entries(&broken).is_err());

        let cubin = b"a cubin for sm_90, a cubin for sm_90, a cubin for sm_90".repeat(20);
        let packed = ruzstd::encoding::compress_to_vec(
            &cubin[..],
            ruzstd::encoding::CompressionLevel::Fastest,
        );
        let img = build(&[(KIND_ELF, 90, b"", Packed::Zstd(&packed, cubin.len()))]);
        assert_eq!(
            pick(&img).unwrap(),
            Entry::Elf {
                arch: 90,
                image: cubin.clone()
            }
        );
        let img = build(&[(KIND_ELF, 90, b"", Packed::Zstd(&packed[..10], cubin.len()))]);
        assert!(matches!(pick(&img), Err(ImageError::Malformed(_))));
    }

    /// As the CUDA 12.8+ libraries ship them: entries for newer architectures compressed with
    /// Zstandard, the device's own with LZ4. Only the chosen entry is expanded, so entries the
    /// device does not run load even when this reader could not expand them.
    #[test]
    fn only_the_chosen_entry_is_decompressed() {
        let src = [0x35, b'a', b'b', b'c', 3, 0, 0x30, b'x', b'y', b'z'];
        let garbage = [0xde, 0xad, 0xbe, 0xef];
        let img = build(&[
            (KIND_ELF, 100, b"", Packed::Zstd(&garbage, 4096)),
            (KIND_ELF, 90, b"", Packed::Lz4(&src, 15)),
            (KIND_ELF, 120, b"", Packed::Zstd(&garbage, 4096)),
        ]);
        assert_eq!(
            pick(&img).unwrap(),
            Entry::Elf {
                arch: 90,
                image: b"abcabcabcabcxyz".to_vec()
            }
        );
    }
}
