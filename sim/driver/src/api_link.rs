//! The JIT linker: `cuLinkCreate`, add PTX, cubins, fat binaries, host objects carrying device
//! code, or archives of them; `cuLinkComplete` hands back one cubin holding every kernel and
//! variable of the inputs, which `cuModuleLoadData` (or `cuLibraryLoadData`) then loads.

use crate::elf;
use crate::ffi::*;
use crate::image::{self, DEVICE_ARCH, ImageError, ModuleInfo};
use crate::state::{driver, with_state};
use std::ffi::{c_char, c_uint, c_void};

/// What a link has collected, and its output once complete (valid until `cuLinkDestroy`).
#[derive(Default)]
pub struct LinkState {
    info: ModuleInfo,
    inputs: usize,
    output: Option<Vec<u8>>,
}

/// The device code of input `b` of type `kind`.
fn read_input(kind: CUjitInputType, b: &[u8]) -> Result<ModuleInfo, ImageError> {
    match kind {
        CU_JIT_INPUT_CUBIN | CU_JIT_INPUT_PTX | CU_JIT_INPUT_FATBINARY => image::parse(b),
        CU_JIT_INPUT_OBJECT => image::parse(elf::host_fatbin(b).ok_or(ImageError::NotCuda)?),
        CU_JIT_INPUT_LIBRARY => {
            let mut info = ModuleInfo::default();
            for member in archive_members(b).ok_or(ImageError::NotCuda)? {
                // Members without device code are host objects the device linker skips.
                if let Some(fat) = elf::host_fatbin(member) {
                    info.merge(image::parse(fat)?);
                }
            }
            Ok(info)
        }
        _ => Err(ImageError::Unsupported(
            "this input type (NVVM IR needs libNVVM)",
        )),
    }
}

/// The members of a Unix `ar` archive (the format of `.a` libraries such as libcudadevrt.a).
fn archive_members(b: &[u8]) -> Option<Vec<&[u8]>> {
    let mut rest = b.strip_prefix(b"!<arch>\n")?;
    let mut out = Vec::new();
    while rest.len() >= 60 {
        let header = &rest[..60];
        let name = std::str::from_utf8(&header[..16]).ok()?.trim_end();
        let size: usize = std::str::from_utf8(&header[48..58])
            .ok()?
            .trim()
            .parse()
            .ok()?;
        let data = rest.get(60..60 + size)?;
        if name != "/" && name != "//" && !name.starts_with("/SYM64/") {
            out.push(data);
        }
        rest = rest.get(60 + size + size % 2..).unwrap_or(&[]);
    }
    Some(out)
}

fn add(state: Handle, kind: CUjitInputType, bytes: &[u8]) -> CuResult {
    let info = read_input(kind, bytes).map_err(|e| e.code())?;
    with_state(|_, st| {
        let link = st
            .links
            .get_mut(&id(state))
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        // Two definitions of one kernel or variable do not link.
        let defined = |name: &str| {
            link.info.kernels.iter().any(|k| k.name == name)
                || link.info.globals.iter().any(|g| g.0 == name)
        };
        if info.kernels.iter().any(|k| defined(&k.name))
            || info.globals.iter().any(|g| defined(&g.0))
        {
            return Err(CUDA_ERROR_INVALID_IMAGE);
        }
        link.info.merge(info);
        link.inputs += 1;
        Ok(())
    })
}

fn create(out: *mut Handle) -> CuResult {
    with_state(|_, st| {
        st.current()?;
        let h = st.new_id();
        st.links.insert(h, LinkState::default());
        put(out, handle(h))
    })
}

fn add_data(state: Handle, kind: CUjitInputType, data: *mut c_void, size: usize) -> CuResult {
    driver()?;
    // PTX may be passed with its size but no terminating NUL; the size is what counts.
    add(state, kind, slice(data as *const u8, size)?)
}

fn add_file(state: Handle, kind: CUjitInputType, path: *const c_char) -> CuResult {
    driver()?;
    let path = c_str(path)?
        .to_str()
        .map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    let bytes = std::fs::read(path).map_err(|_| CUDA_ERROR_FILE_NOT_FOUND)?;
    add(state, kind, &bytes)
}

// The `_v2` entry points (ABI 6050) and the original ones (5050) take the same arguments.
entry!(
    fn cuLinkCreate(
        _n: c_uint,
        _options: *mut CUjit_option,
        _values: *mut *mut c_void,
        out: *mut Handle,
    ) {
        create(out)
    }
);
entry!(
    fn cuLinkCreate_v2(
        _n: c_uint,
        _options: *mut CUjit_option,
        _values: *mut *mut c_void,
        out: *mut Handle,
    ) {
        create(out)
    }
);
entry!(
    fn cuLinkAddData(
        state: Handle,
        kind: CUjitInputType,
        data: *mut c_void,
        size: usize,
        _name: *const c_char,
        _n: c_uint,
        _options: *mut CUjit_option,
        _values: *mut *mut c_void,
    ) {
        add_data(state, kind, data, size)
    }
);
entry!(
    fn cuLinkAddData_v2(
        state: Handle,
        kind: CUjitInputType,
        data: *mut c_void,
        size: usize,
        _name: *const c_char,
        _n: c_uint,
        _options: *mut CUjit_option,
        _values: *mut *mut c_void,
    ) {
        add_data(state, kind, data, size)
    }
);
entry!(
    fn cuLinkAddFile(
        state: Handle,
        kind: CUjitInputType,
        path: *const c_char,
        _n: c_uint,
        _options: *mut CUjit_option,
        _values: *mut *mut c_void,
    ) {
        add_file(state, kind, path)
    }
);
entry!(
    fn cuLinkAddFile_v2(
        state: Handle,
        kind: CUjitInputType,
        path: *const c_char,
        _n: c_uint,
        _options: *mut CUjit_option,
        _values: *mut *mut c_void,
    ) {
        add_file(state, kind, path)
    }
);

entry!(
    fn cuLinkComplete(state: Handle, cubin: *mut *mut c_void, size: *mut usize) {
        with_state(|_, st| {
            let link = st
                .links
                .get_mut(&id(state))
                .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
            if link.inputs == 0 {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            let out = link.output.insert(elf::write(
                DEVICE_ARCH,
                &link.info.kernels,
                &link.info.globals,
            ));
            put(size, out.len())?;
            put(cubin, out.as_mut_ptr().cast())
        })
    }
);

entry!(
    fn cuLinkDestroy(state: Handle) {
        with_state(|_, st| {
            st.links
                .remove(&id(state))
                .map(|_| ())
                .ok_or(CUDA_ERROR_INVALID_HANDLE)
        })
    }
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::image::Kernel;

    #[test]
    fn archives_list_their_members() {
        let mut a = b"!<arch>\n".to_vec();
        for (name, data) in [
            ("/", &b"symbols"[..]),
            ("one.o/", b"abc"),
            ("two.o/", b"defg"),
        ] {
            a.extend_from_slice(
                format!(
                    "{name:<16}{:<12}{:<6}{:<6}{:<8}{:<10}`\n",
                    0,
                    0,
                    0,
                    644,
                    data.len()
                )
                .as_bytes(),
            );
            a.extend_from_slice(data);
            if data.len() % 2 == 1 {
                a.push(b'\n');
            }
        }
        assert_eq!(archive_members(&a).unwrap(), vec![&b"abc"[..], b"defg"]);
        assert!(archive_members(b"not an archive").is_none());
    }

    #[test]
    fn inputs_of_each_type_are_read() {
        let k = Kernel {
            name: "k".into(),
            params: vec![8],
            ..Kernel::default()
        };
        let cubin = elf::write(90, std::slice::from_ref(&k), &[]);
        assert_eq!(
            read_input(CU_JIT_INPUT_CUBIN, &cubin).unwrap().kernels,
            vec![k.clone()]
        );
        let ptx = b".version 8.0\n.target sm_90\n.entry p(.param .u32 x) { ret; }";
        assert_eq!(
            read_input(CU_JIT_INPUT_PTX, ptx).unwrap().kernels[0].params,
            vec![4]
        );
        assert!(matches!(
            read_input(CU_JIT_INPUT_NVVM, ptx),
            Err(ImageError::Unsupported(_))
        ));
        assert_eq!(
            read_input(CU_JIT_INPUT_OBJECT, &cubin),
            Err(ImageError::NotCuda)
        );
    }
}
