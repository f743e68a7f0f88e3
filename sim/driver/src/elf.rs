//! CUDA ELF images ("cubins", as NVIDIA's `ptxas` and `nvcc -cubin` write them): read the kernel
//! names, their parameter sizes and the module variables; and write such an image, which is what
//! `cuLinkComplete` hands back.
//!
//! What is read, all from the ELF64 file format plus NVIDIA's public `cuobjdump`/`nvdisasm`
//! conventions:
//! - kernels: `STT_FUNC` symbols marked as entry points (`st_other` bit `0x10`, "STO_CUDA_ENTRY");
//! - a kernel's parameters: the `EIATTR_KPARAM_INFO` records (attribute `0x17`) of its
//!   `.nv.info.<kernel>` section, each giving a parameter's ordinal, offset and size;
//! - variables: `STT_OBJECT` symbols defined in `.nv.global*`, `.nv.constant<N>` (N ≥ 1) or
//!   `.nv.managed` sections;
//! - the architecture: `e_flags` (ELF ABI version 7: low byte; version 8: bits 8..24).

use crate::image::{ImageError, Kernel, ModuleInfo, Resources};

/// `e_machine` of CUDA images.
pub const EM_CUDA: u16 = 190;
const SHT_SYMTAB: u32 = 2;
const SHT_STRTAB: u32 = 3;
const SHT_PROGBITS: u32 = 1;
const SHT_NOBITS: u32 = 8;
/// `SHT_LOPROC`: NVIDIA's `.nv.info` sections.
const SHT_CUDA_INFO: u32 = 0x7000_0000;
const STT_OBJECT: u8 = 1;
const STT_FUNC: u8 = 2;
const STB_GLOBAL: u8 = 1;
const STO_CUDA_ENTRY: u8 = 0x10;
const EIFMT_SVAL: u8 = 0x04;
const EIATTR_KPARAM_INFO: u8 = 0x17;
const EIATTR_FRAME_SIZE: u8 = 0x11;
const EIATTR_CBANK_PARAM_SIZE: u8 = 0x19;
const EIFMT_HVAL: u8 = 0x03;

fn u16_at(b: &[u8], off: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(off..off + 2)?.try_into().ok()?))
}
fn u32_at(b: &[u8], off: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(off..off + 4)?.try_into().ok()?))
}
fn u64_at(b: &[u8], off: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(off..off + 8)?.try_into().ok()?))
}

/// Whether `b` starts like an ELF file.
pub fn is_elf(b: &[u8]) -> bool {
    b.starts_with(b"\x7fELF")
}

/// Bytes an ELF64 image spans, from its header alone (the first 64 bytes): the end of its
/// section header table or of its program header table, whichever is later.
pub fn image_len(header: &[u8]) -> Option<usize> {
    if !is_elf(header) || header.get(4) != Some(&2) {
        return None;
    }
    let sh_end =
        u64_at(header, 0x28)? + u64::from(u16_at(header, 0x3a)?) * u64::from(u16_at(header, 0x3c)?);
    let ph_end =
        u64_at(header, 0x20)? + u64::from(u16_at(header, 0x36)?) * u64::from(u16_at(header, 0x38)?);
    usize::try_from(sh_end.max(ph_end).max(64)).ok()
}

struct Section<'a> {
    name: &'a str,
    kind: u32,
    link: u32,
    data: &'a [u8],
    /// Size in memory (also for sections without file contents).
    size: usize,
}

fn c_string(b: &[u8], off: usize) -> Option<&str> {
    let s = b.get(off..)?;
    let end = s.iter().position(|&c| c == 0)?;
    std::str::from_utf8(&s[..end]).ok()
}

/// The SM architecture an image was built for (e.g. 90), from its header.
pub fn arch(b: &[u8]) -> Option<u32> {
    let flags = u32_at(b, 0x30)?;
    Some(match b.get(8)? {
        ..=7 => flags & 0xff,
        _ => (flags >> 8) & 0xffff,
    })
}

/// The sections of an ELF64 little-endian file, any machine.
fn sections(b: &[u8]) -> Result<Vec<Section<'_>>, ImageError> {
    let bad = |what: &str| ImageError::Malformed(format!("cubin: {what}"));
    if !is_elf(b) || b.get(4) != Some(&2) || b.get(5) != Some(&1) {
        return Err(bad("not a little-endian ELF64 file"));
    }
    let shoff = u64_at(b, 0x28).ok_or_else(|| bad("header"))? as usize;
    let shentsize = u16_at(b, 0x3a).ok_or_else(|| bad("header"))? as usize;
    let shnum = u16_at(b, 0x3c).ok_or_else(|| bad("header"))? as usize;
    let shstrndx = u16_at(b, 0x3e).ok_or_else(|| bad("header"))? as usize;
    if shentsize < 64 {
        return Err(bad("section header size"));
    }
    let raw: Vec<(u32, u32, u32, &[u8], usize)> = (0..shnum)
        .map(|i| {
            let h = shoff + i * shentsize;
            let kind = u32_at(b, h + 4)?;
            let off = u64_at(b, h + 0x18)? as usize;
            let size = u64_at(b, h + 0x20)? as usize;
            let data = if kind == SHT_NOBITS {
                &[][..]
            } else {
                b.get(off..off.checked_add(size)?)?
            };
            Some((u32_at(b, h)?, kind, u32_at(b, h + 0x28)?, data, size))
        })
        .collect::<Option<_>>()
        .ok_or_else(|| bad("section headers out of range"))?;
    let names = raw
        .get(shstrndx)
        .ok_or_else(|| bad("no section name table"))?
        .3;
    Ok(raw
        .iter()
        .map(|&(name, kind, link, data, size)| Section {
            name: c_string(names, name as usize).unwrap_or(""),
            kind,
            link,
            data,
            size,
        })
        .collect())
}

/// The device code a host object file (`nvcc -c`) carries: its `.nv_fatbin` section.
pub fn host_fatbin(b: &[u8]) -> Option<&[u8]> {
    sections(b)
        .ok()?
        .into_iter()
        .find(|s| s.name == ".nv_fatbin")
        .map(|s| s.data)
}

/// Read a CUDA ELF image.
pub fn parse(b: &[u8]) -> Result<ModuleInfo, ImageError> {
    let bad = |what: &str| ImageError::Malformed(format!("cubin: {what}"));
    if !is_elf(b) || b.get(4) != Some(&2) || b.get(5) != Some(&1) {
        return Err(bad("not a little-endian ELF64 file"));
    }
    if u16_at(b, 0x12) != Some(EM_CUDA) {
        return Err(ImageError::NotCuda);
    }
    let sections = sections(b)?;
    let symtab = sections
        .iter()
        .find(|s| s.kind == SHT_SYMTAB)
        .ok_or_else(|| bad("no symbol table"))?;
    let strtab = sections
        .get(symtab.link as usize)
        .ok_or_else(|| bad("symbol table without strings"))?
        .data;
    let mut kernels = Vec::new();
    let mut globals = Vec::new();
    let frames = frame_sizes(&sections)?;
    let constant = sections
        .iter()
        .filter(|s| s.name.starts_with(".nv.constant") && !s.name.starts_with(".nv.constant0"))
        .map(|s| s.size)
        .sum();
    for (index, sym) in symtab.data.chunks_exact(24).enumerate() {
        let info = sym[4];
        let other = sym[5];
        let shndx = u16_at(sym, 6).unwrap_or(0) as usize;
        let size = u64_at(sym, 16).unwrap_or(0) as usize;
        if shndx == 0 || shndx >= 0xff00 {
            continue;
        }
        let name = c_string(strtab, u32_at(sym, 0).unwrap_or(0) as usize)
            .ok_or_else(|| bad("symbol name"))?;
        let section = sections.get(shndx).map_or("", |s| s.name);
        match info & 0xf {
            STT_FUNC if other & STO_CUDA_ENTRY != 0 => {
                let section = |prefix: &str| {
                    let want = format!("{prefix}.{name}");
                    sections.iter().find(move |s| s.name == want)
                };
                let params =
                    section(".nv.info").map_or(Ok(Vec::new()), |s| kernel_params(s.data))?;
                kernels.push(Kernel {
                    name: name.to_string(),
                    params,
                    resources: Resources {
                        shared: section(".nv.shared").map_or(0, |s| s.size),
                        constant,
                        local: frames.get(&(index as u32)).copied().unwrap_or(0),
                    },
                });
            }
            STT_OBJECT
                if section.starts_with(".nv.global")
                    || section.starts_with(".nv.managed")
                    || (section.starts_with(".nv.constant")
                        && !section.starts_with(".nv.constant0")) =>
            {
                globals.push((name.to_string(), size));
            }
            _ => {}
        }
    }
    Ok(ModuleInfo {
        version: arch(b).map_or(0, |a| a as i32),
        arch: arch(b),
        kernels,
        globals,
    })
}

/// `EIATTR_FRAME_SIZE` records of the module-wide `.nv.info`: function symbol → stack frame
/// (local memory per thread).
fn frame_sizes(sections: &[Section]) -> Result<std::collections::HashMap<u32, usize>, ImageError> {
    let mut out = std::collections::HashMap::new();
    for info in sections.iter().filter(|s| s.name == ".nv.info") {
        for (attr, payload) in records(info.data)? {
            if attr == EIATTR_FRAME_SIZE && payload.len() >= 8 {
                let sym = u32_at(payload, 0).unwrap_or(0);
                out.insert(sym, u32_at(payload, 4).unwrap_or(0) as usize);
            }
        }
    }
    Ok(out)
}

/// The `(attribute, payload)` of each value-carrying (`EIFMT_SVAL`) record of an `.nv.info`
/// section.
fn records(info: &[u8]) -> Result<Vec<(u8, &[u8])>, ImageError> {
    let mut out = Vec::new();
    let mut off = 0;
    while off + 4 <= info.len() {
        let (format, attr) = (info[off], info[off + 1]);
        if format != EIFMT_SVAL {
            off += 4;
            continue;
        }
        let len = u16_at(info, off + 2).unwrap_or(0) as usize;
        let payload = info
            .get(off + 4..off + 4 + len)
            .ok_or_else(|| ImageError::Malformed("cubin: truncated .nv.info record".into()))?;
        out.push((attr, payload));
        off += 4 + len;
    }
    Ok(out)
}

/// Parameter sizes, in order, from a kernel's `.nv.info.<kernel>` attribute records.
fn kernel_params(info: &[u8]) -> Result<Vec<usize>, ImageError> {
    let mut params: Vec<(u16, usize)> = records(info)?
        .into_iter()
        .filter(|&(attr, payload)| attr == EIATTR_KPARAM_INFO && payload.len() >= 12)
        .map(|(_, payload)| {
            let ordinal = u16_at(payload, 4).unwrap_or(0);
            let size = (u32_at(payload, 8).unwrap_or(0) >> 18) & 0x3fff;
            (ordinal, size as usize)
        })
        .collect();
    params.sort_unstable();
    Ok(params.into_iter().map(|(_, s)| s).collect())
}

/// Write a CUDA ELF image for an SM `arch` with these kernels and variables, in the layout
/// [`parse`] (and NVIDIA's tools) read: what a link of several images produces.
pub fn write(arch: u32, kernels: &[Kernel], globals: &[(String, usize)]) -> Vec<u8> {
    struct Out {
        name: u32,
        kind: u32,
        flags: u64,
        link: u32,
        info: u32,
        align: u64,
        size: u64,
        data: Vec<u8>,
    }
    let mut shstr = vec![0u8];
    let add_name = |t: &mut Vec<u8>, s: &str| {
        let off = t.len() as u32;
        t.extend_from_slice(s.as_bytes());
        t.push(0);
        off
    };
    let mut strtab = vec![0u8];
    let mut sections: Vec<Out> = Vec::new();
    let plain = |name, kind, data: Vec<u8>| Out {
        name,
        kind,
        flags: 0,
        link: 0,
        info: 0,
        align: 1,
        size: data.len() as u64,
        data,
    };
    sections.push(plain(0, 0, Vec::new()));
    let n = add_name(&mut shstr, ".shstrtab");
    sections.push(plain(n, SHT_STRTAB, Vec::new()));
    let n = add_name(&mut shstr, ".strtab");
    sections.push(plain(n, SHT_STRTAB, Vec::new()));
    let n = add_name(&mut shstr, ".symtab");
    sections.push(Out {
        link: 2,
        align: 8,
        ..plain(n, SHT_SYMTAB, Vec::new())
    });
    let mut symbols: Vec<[u8; 24]> = vec![[0; 24]];
    let symbol = |strtab: &mut Vec<u8>,
                  name: &str,
                  info: u8,
                  other: u8,
                  shndx: u16,
                  value: u64,
                  size: u64| {
        let mut s = [0u8; 24];
        s[0..4].copy_from_slice(&add_name(strtab, name).to_le_bytes());
        s[4] = info;
        s[5] = other;
        s[6..8].copy_from_slice(&shndx.to_le_bytes());
        s[8..16].copy_from_slice(&value.to_le_bytes());
        s[16..24].copy_from_slice(&size.to_le_bytes());
        s
    };
    for k in kernels {
        let text = sections.len() as u16 + 1;
        let mut info = Vec::new();
        let mut offset = 0u16;
        for (ordinal, &size) in k.params.iter().enumerate() {
            info.extend_from_slice(&[EIFMT_SVAL, EIATTR_KPARAM_INFO, 12, 0]);
            info.extend_from_slice(&0u32.to_le_bytes());
            info.extend_from_slice(&(ordinal as u16).to_le_bytes());
            info.extend_from_slice(&offset.to_le_bytes());
            info.extend_from_slice(&(0x1f000 | ((size as u32 & 0x3fff) << 18)).to_le_bytes());
            offset = offset.saturating_add(size as u16);
        }
        info.extend_from_slice(&[EIFMT_HVAL, EIATTR_CBANK_PARAM_SIZE]);
        info.extend_from_slice(&offset.to_le_bytes());
        let n = add_name(&mut shstr, &format!(".nv.info.{}", k.name));
        sections.push(Out {
            link: 3,
            info: u32::from(text),
            align: 4,
            ..plain(n, SHT_CUDA_INFO, info)
        });
        let n = add_name(&mut shstr, &format!(".text.{}", k.name));
        sections.push(Out {
            flags: 0x6, // SHF_ALLOC | SHF_EXECINSTR
            link: 3,
            align: 128,
            ..plain(n, SHT_PROGBITS, vec![0; 16])
        });
        symbols.push(symbol(
            &mut strtab,
            &k.name,
            (STB_GLOBAL << 4) | STT_FUNC,
            STO_CUDA_ENTRY,
            text,
            0,
            16,
        ));
    }
    // Static shared memory: a `.nv.shared.<kernel>` section of that size; stack frames:
    // `EIATTR_FRAME_SIZE` records in the module's `.nv.info`; user constants: `.nv.constant3`.
    let mut frames = Vec::new();
    for (i, k) in kernels.iter().enumerate() {
        let r = k.resources;
        if r.shared > 0 {
            let n = add_name(&mut shstr, &format!(".nv.shared.{}", k.name));
            sections.push(Out {
                flags: 0x3,
                align: 16,
                size: r.shared as u64,
                ..plain(n, SHT_NOBITS, Vec::new())
            });
        }
        frames.extend_from_slice(&[EIFMT_SVAL, EIATTR_FRAME_SIZE, 8, 0]);
        frames.extend_from_slice(&(i as u32 + 1).to_le_bytes()); // kernel i is symbol i + 1
        frames.extend_from_slice(&(r.local as u32).to_le_bytes());
    }
    let n = add_name(&mut shstr, ".nv.info");
    sections.push(Out {
        link: 3,
        align: 4,
        ..plain(n, SHT_CUDA_INFO, frames)
    });
    let constant = kernels
        .iter()
        .map(|k| k.resources.constant)
        .max()
        .unwrap_or(0);
    if constant > 0 {
        let n = add_name(&mut shstr, ".nv.constant3");
        sections.push(Out {
            flags: 0x2,
            align: 8,
            size: constant as u64,
            ..plain(n, SHT_NOBITS, Vec::new())
        });
    }
    if !globals.is_empty() {
        let index = sections.len() as u16;
        let mut offset = 0u64;
        for (name, size) in globals {
            symbols.push(symbol(
                &mut strtab,
                name,
                (STB_GLOBAL << 4) | STT_OBJECT,
                0,
                index,
                offset,
                *size as u64,
            ));
            offset += (*size as u64).div_ceil(8) * 8;
        }
        let n = add_name(&mut shstr, ".nv.global");
        sections.push(Out {
            flags: 0x3, // SHF_WRITE | SHF_ALLOC
            align: 8,
            size: offset,
            ..plain(n, SHT_NOBITS, Vec::new())
        });
    }
    sections[1].data = shstr;
    sections[2].data = strtab;
    sections[3].data = symbols.concat();
    sections[3].info = 1; // first non-local symbol
    let mut out = vec![0u8; 64];
    let mut offsets = Vec::new();
    for s in &mut sections {
        if s.kind != SHT_NOBITS {
            s.size = s.data.len() as u64;
        }
        while !out.len().is_multiple_of(8) {
            out.push(0);
        }
        offsets.push(out.len() as u64);
        out.extend_from_slice(&s.data);
    }
    while !out.len().is_multiple_of(8) {
        out.push(0);
    }
    let shoff = out.len() as u64;
    for (s, off) in sections.iter().zip(&offsets) {
        let mut h = [0u8; 64];
        h[0..4].copy_from_slice(&s.name.to_le_bytes());
        h[4..8].copy_from_slice(&s.kind.to_le_bytes());
        h[8..16].copy_from_slice(&s.flags.to_le_bytes());
        h[0x18..0x20].copy_from_slice(&off.to_le_bytes());
        h[0x20..0x28].copy_from_slice(&s.size.to_le_bytes());
        h[0x28..0x2c].copy_from_slice(&s.link.to_le_bytes());
        h[0x2c..0x30].copy_from_slice(&s.info.to_le_bytes());
        h[0x30..0x38].copy_from_slice(&s.align.to_le_bytes());
        if s.kind == SHT_SYMTAB {
            h[0x38..0x40].copy_from_slice(&24u64.to_le_bytes());
        }
        out.extend_from_slice(&h);
    }
    let h = &mut out[..64];
    h[0..4].copy_from_slice(b"\x7fELF");
    h[4] = 2; // ELFCLASS64
    h[5] = 1; // little-endian
    h[6] = 1; // EV_CURRENT
    h[7] = 0x33; // OS/ABI of CUDA images
    h[8] = 7; // ABI version
    h[0x10..0x12].copy_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    h[0x12..0x14].copy_from_slice(&EM_CUDA.to_le_bytes());
    h[0x14..0x18].copy_from_slice(&1u32.to_le_bytes());
    h[0x28..0x30].copy_from_slice(&shoff.to_le_bytes());
    h[0x30..0x34].copy_from_slice(&(arch | (arch << 16) | 0x500).to_le_bytes());
    h[0x34..0x36].copy_from_slice(&64u16.to_le_bytes());
    h[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
    h[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
    h[0x3c..0x3e].copy_from_slice(&(sections.len() as u16).to_le_bytes());
    h[0x3e..0x40].copy_from_slice(&1u16.to_le_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernel(name: &str, params: &[usize]) -> Kernel {
        Kernel {
            name: name.into(),
            params: params.to_vec(),
            ..Kernel::default()
        }
    }

    #[test]
    fn a_written_image_reads_back() {
        let mut kernels = [
            kernel("gpushare_spin", &[8]),
            kernel("touch", &[8, 4]),
            kernel("none", &[]),
        ];
        kernels[1].resources = Resources {
            shared: 400,
            constant: 80,
            local: 4000,
        };
        kernels[0].resources.constant = 80;
        kernels[2].resources.constant = 80;
        let globals = [("counter".to_string(), 4), ("table".to_string(), 64)];
        let img = write(90, &kernels, &globals);
        assert_eq!(image_len(&img[..64]), Some(img.len()));
        let m = parse(&img).unwrap();
        assert_eq!(m.kernels, kernels);
        assert_eq!(m.globals, globals);
        assert_eq!(m.arch, Some(90));
    }

    #[test]
    fn what_is_not_a_cuda_image_is_refused() {
        let mut img = write(90, &[kernel("k", &[])], &[]);
        assert!(matches!(parse(&img[..40]), Err(ImageError::Malformed(_))));
        img[0x12] = 62; // x86-64
        assert!(matches!(parse(&img), Err(ImageError::NotCuda)));
    }

    #[test]
    fn architecture_from_both_header_versions() {
        let mut h = [0u8; 64];
        h[8] = 7;
        h[0x30..0x34].copy_from_slice(&0x5a055au32.to_le_bytes());
        assert_eq!(arch(&h), Some(90));
        h[8] = 8;
        h[0x30..0x34].copy_from_slice(&0x600_6402u32.to_le_bytes());
        assert_eq!(arch(&h), Some(100));
    }
}
