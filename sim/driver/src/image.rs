//! Module images, whatever their kind: PTX text, a CUDA ELF image (cubin), a fat binary
//! container, or the wrapper a program registers its fat binary with. `cuModuleLoadData`,
//! `cuLibraryLoadData` and `cuLinkAddData` take any of them by pointer, without a length: the
//! kind comes from the first bytes, the length from the kind's own header.

use crate::ffi::*;
use crate::{elf, fatbin, ptx};

/// SM architecture of the simulated GPU (an H100: compute capability 9.0).
pub const DEVICE_ARCH: u32 = 90;

#[derive(Debug, PartialEq, Eq, Clone, Default)]
pub struct Kernel {
    pub name: String,
    /// Size in bytes of each parameter, in order.
    pub params: Vec<usize>,
    pub resources: Resources,
}

/// Memory a kernel declares statically, as the compiler reports it (`cuFuncGetAttribute`'s
/// shared, constant and local sizes).
#[derive(Debug, PartialEq, Eq, Clone, Copy, Default)]
pub struct Resources {
    /// Static shared memory per block.
    pub shared: usize,
    /// User constant memory (`__constant__`) of its module.
    pub constant: usize,
    /// Local memory (its stack frame) per thread.
    pub local: usize,
}

/// What the driver needs from an image.
#[derive(Debug, PartialEq, Eq, Default)]
pub struct ModuleInfo {
    /// PTX ISA version (`.version 8.4` → 84) or the cubin's SM architecture.
    pub version: i32,
    /// SM architecture of a cubin; `None` for PTX.
    pub arch: Option<u32>,
    pub kernels: Vec<Kernel>,
    /// Module-scope variables: name and size.
    pub globals: Vec<(String, usize)>,
}

impl ModuleInfo {
    /// Add another image's kernels and variables (a link, or a fat binary with several parts).
    pub fn merge(&mut self, other: ModuleInfo) {
        self.version = self.version.max(other.version);
        self.arch = self.arch.or(other.arch);
        for k in other.kernels {
            if !self.kernels.iter().any(|x| x.name == k.name) {
                self.kernels.push(k);
            }
        }
        for g in other.globals {
            if !self.globals.iter().any(|x| x.0 == g.0) {
                self.globals.push(g);
            }
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
pub enum ImageError {
    /// Neither PTX, nor a CUDA ELF image, nor a fat binary.
    NotCuda,
    /// Of a known kind but unreadable.
    Malformed(String),
    /// Valid, but nothing in it runs on the device's architecture.
    NoBinaryForGpu,
    /// A valid feature the simulated driver does not read.
    Unsupported(&'static str),
}

impl ImageError {
    pub fn code(&self) -> CUresult {
        match self {
            ImageError::NotCuda | ImageError::Unsupported(_) => CUDA_ERROR_INVALID_IMAGE,
            ImageError::Malformed(m) if m.starts_with("ptx") => CUDA_ERROR_INVALID_PTX,
            ImageError::Malformed(_) => CUDA_ERROR_INVALID_IMAGE,
            ImageError::NoBinaryForGpu => CUDA_ERROR_NO_BINARY_FOR_GPU,
        }
    }
}

/// Read any image held in memory.
pub fn parse(b: &[u8]) -> Result<ModuleInfo, ImageError> {
    if elf::is_elf(b) {
        let info = elf::parse(b)?;
        return match info.arch {
            Some(a) if a != DEVICE_ARCH => Err(ImageError::NoBinaryForGpu),
            _ => Ok(info),
        };
    }
    match b
        .get(..4)
        .map(|m| u32::from_le_bytes(m.try_into().expect("4 bytes")))
    {
        Some(fatbin::MAGIC) => match fatbin::select(&fatbin::entries(b)?)? {
            fatbin::Entry::Elf { image, .. } => elf::parse(&image),
            fatbin::Entry::Ptx { text, .. } => parse_ptx(&text),
        },
        _ => parse_ptx(b),
    }
}

fn parse_ptx(b: &[u8]) -> Result<ModuleInfo, ImageError> {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    let text = std::str::from_utf8(&b[..end]).map_err(|_| ImageError::NotCuda)?;
    let m = ptx::parse(text).map_err(|e| match e {
        ptx::PtxError::NotPtx => ImageError::NotCuda,
        ptx::PtxError::Malformed(m) => ImageError::Malformed(format!("ptx: {m}")),
    })?;
    Ok(ModuleInfo {
        version: m.version,
        arch: None,
        kernels: m.kernels,
        globals: m.globals,
    })
}

/// Borrow `len` bytes at `p`.
///
/// # Safety
/// `p..p+len` must be readable for the caller's lifetime `'a`.
unsafe fn bytes<'a>(p: *const u8, len: usize) -> &'a [u8] {
    // SAFETY: per this function's contract.
    unsafe { std::slice::from_raw_parts(p, len) }
}

/// The images an application passed by pointer, each as a byte slice of its real length. A
/// registered fat binary wrapper (version 2) may carry several prelinked containers.
pub fn images_at<'a>(p: *const std::ffi::c_void) -> CuResult<Vec<&'a [u8]>> {
    if p.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let p = p.cast::<u8>();
    // Peek at up to 4 bytes, stopping at a NUL so a short string is never overrun.
    let mut magic = [0u8; 4];
    for (i, m) in magic.iter_mut().enumerate() {
        // SAFETY: the bytes before it were non-NUL, so the image (a string at least) goes on.
        *m = unsafe { *p.add(i) };
        if *m == 0 {
            break;
        }
    }
    let word = u32::from_le_bytes(magic);
    if elf::is_elf(&magic) {
        // SAFETY: an ELF image starts with its 64-byte header.
        let len = elf::image_len(unsafe { bytes(p, 64) }).ok_or(CUDA_ERROR_INVALID_IMAGE)?;
        // SAFETY: the header says the image spans `len` bytes.
        return Ok(vec![unsafe { bytes(p, len) }]);
    }
    if word == fatbin::MAGIC {
        // SAFETY: a container starts with its 16-byte header, which gives its length.
        let len = fatbin::container_len(unsafe { bytes(p, 16) }).ok_or(CUDA_ERROR_INVALID_IMAGE)?;
        // SAFETY: as the header says.
        return Ok(vec![unsafe { bytes(p, len) }]);
    }
    if word == fatbin::WRAPPER_MAGIC {
        // `__fatBinC_Wrapper_t`: magic, version, container pointer, then (version 2) a
        // NULL-terminated array of prelinked containers.
        // SAFETY: the wrapper is two u32 and two pointers.
        let (version, data, extra) = unsafe {
            (
                (p.add(4) as *const u32).read_unaligned(),
                (p.add(8) as *const *const std::ffi::c_void).read_unaligned(),
                (p.add(16) as *const *const *const std::ffi::c_void).read_unaligned(),
            )
        };
        let mut out = images_at(data)?;
        if version == 2 && !extra.is_null() {
            for i in 0.. {
                // SAFETY: a NULL-terminated array of container pointers.
                let c = unsafe { extra.add(i).read_unaligned() };
                if c.is_null() {
                    break;
                }
                out.extend(images_at(c)?);
            }
        }
        return Ok(out);
    }
    // PTX text: NUL-terminated.
    Ok(vec![c_str(p.cast())?.to_bytes()])
}

/// Read every image at `p` into one module description.
pub fn load_at(p: *const std::ffi::c_void) -> CuResult<ModuleInfo> {
    let mut info = ModuleInfo::default();
    for img in images_at(p)? {
        info.merge(parse(img).map_err(|e| e.code())?);
    }
    Ok(info)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PTX: &str = ".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry k(.param .u64 a) { ret; }\n";

    #[test]
    fn every_kind_is_recognised_from_its_pointer() {
        let ptx = format!("{PTX}\0");
        let from_ptx = load_at(ptx.as_ptr().cast()).unwrap();
        assert_eq!(from_ptx.kernels[0].params, vec![8]);
        let cubin = elf::write(90, &from_ptx.kernels, &[]);
        assert_eq!(
            load_at(cubin.as_ptr().cast()).unwrap().kernels,
            from_ptx.kernels
        );
        let fat = fatbin::build(&[
            (1, 90, PTX.as_bytes(), fatbin::Packed::Plain),
            (2, 80, b"old", fatbin::Packed::Plain),
        ]);
        assert_eq!(
            load_at(fat.as_ptr().cast()).unwrap().kernels,
            from_ptx.kernels
        );
        #[repr(C)]
        struct Wrapper(u32, u32, *const u8, *const u8);
        let w = Wrapper(fatbin::WRAPPER_MAGIC, 1, fat.as_ptr(), std::ptr::null());
        let via_wrapper = load_at(&w as *const Wrapper as *const _).unwrap();
        assert_eq!(via_wrapper.kernels, from_ptx.kernels);
    }

    #[test]
    fn a_cubin_for_another_architecture_does_not_load() {
        let cubin = elf::write(80, &[], &[]);
        assert_eq!(parse(&cubin), Err(ImageError::NoBinaryForGpu));
        assert_eq!(parse(b"garbage"), Err(ImageError::NotCuda));
        assert_eq!(load_at(c"x".as_ptr().cast()), Err(CUDA_ERROR_INVALID_IMAGE));
    }
}
