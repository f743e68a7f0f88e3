//! Context-independent loading (CUDA 12): libraries (`CUlibrary`) and their kernels
//! (`CUkernel`). A library's image becomes one module, shared by every context; a `CUkernel` is
//! the id of that module's function, so it is accepted wherever a `CUfunction` is (launches,
//! graph nodes, attributes), as the driver documents, and `cuKernelGetFunction` returns it.
//!
//! Libraries load lazily by default, as the driver documents for `cuLibraryLoadData` ("If the
//! environment variables are set to LAZY, library is not immediately loaded onto all existent
//! contexts and will only be loaded when a function is needed for that context, such as a kernel
//! launch"; lazy loading is the default on Linux since CUDA 12.2, `CUDA_MODULE_LOADING=EAGER`
//! turns it off). So a library whose image holds nothing the device runs (a fat binary of
//! cubins for newer GPUs only, as cuBLAS ships many) loads, and what needs its code (its
//! kernels, its module) answers `CUDA_ERROR_NO_BINARY_FOR_GPU`; loaded eagerly, the load fails.

use crate::api_module::{
    create_module, function_attribute, param_info, read_image_file, set_function_attribute, unload,
    with_function,
};
use crate::ffi::*;
use crate::image::{self, ModuleInfo};
use crate::state::{State, driver, with_state};
use std::ffi::{c_char, c_int, c_uint, c_void};

/// Make a library of an image's description; an image with nothing for the device makes a
/// library whose code is never loadable, if loading is lazy.
fn create_library(out: *mut Handle, info: CuResult<ModuleInfo>) -> CuResult {
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let info = match info {
        Err(CUDA_ERROR_NO_BINARY_FOR_GPU) if lazy_loading() => Err(CUDA_ERROR_NO_BINARY_FOR_GPU),
        Err(e) => return Err(e),
        Ok(info) => Ok(info),
    };
    let lib = driver()?.lock().new_id();
    let module = match info {
        Ok(info) => Ok(create_module(info, Some(lib))?),
        Err(e) => Err(e),
    };
    with_state(|_, st| {
        st.libraries.insert(lib, module);
        Ok(())
    })?;
    put(out, handle(lib))
}

/// Whether modules load lazily: `CUDA_MODULE_LOADING` is `LAZY` or unset (the default since
/// CUDA 12.2), not `EAGER`.
pub fn lazy_loading() -> bool {
    static LAZY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *LAZY.get_or_init(|| {
        std::env::var("CUDA_MODULE_LOADING").map_or(true, |v| !v.eq_ignore_ascii_case("EAGER"))
    })
}

entry!(
    fn cuLibraryLoadData(
        out: *mut Handle,
        code: *const c_void,
        _jit_options: *mut CUjit_option,
        _jit_values: *mut *mut c_void,
        _n_jit: c_uint,
        _lib_options: *mut CUlibraryOption,
        _lib_values: *mut *mut c_void,
        _n_lib: c_uint,
    ) {
        driver()?;
        create_library(out, image::load_at(code))
    }
);

entry!(
    fn cuLibraryLoadFromFile(
        out: *mut Handle,
        path: *const c_char,
        _jit_options: *mut CUjit_option,
        _jit_values: *mut *mut c_void,
        _n_jit: c_uint,
        _lib_options: *mut CUlibraryOption,
        _lib_values: *mut *mut c_void,
        _n_lib: c_uint,
    ) {
        driver()?;
        create_library(out, read_image_file(path))
    }
);

/// The module of a library (its loading error if nothing in it runs on the device).
fn library_module(st: &State, lib: Handle) -> CuResult<u64> {
    st.libraries
        .get(&id(lib))
        .copied()
        .ok_or(CUDA_ERROR_INVALID_HANDLE)?
}

entry!(
    fn cuLibraryUnload(lib: Handle) {
        with_state(|_, st| {
            let module = st
                .libraries
                .remove(&id(lib))
                .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
            module.map_or(Ok(()), |m| unload(st, m))
        })
    }
);

entry!(
    fn cuLibraryGetModule(out: *mut Handle, lib: Handle) {
        let m = with_state(|_, st| library_module(st, lib))?;
        put(out, handle(m))
    }
);

entry!(
    fn cuLibraryGetKernel(out: *mut Handle, lib: Handle, name: *const c_char) {
        let name = c_str(name)?.to_str().map_err(|_| CUDA_ERROR_NOT_FOUND)?;
        let k = with_state(|_, st| {
            let m = library_module(st, lib)?;
            st.modules[&m].function(name).ok_or(CUDA_ERROR_NOT_FOUND)
        })?;
        put(out, handle(k))
    }
);

entry!(
    fn cuLibraryGetKernelCount(count: *mut c_uint, lib: Handle) {
        let n = with_state(|_, st| Ok(st.modules[&library_module(st, lib)?].functions.len()))?;
        put(count, n as c_uint)
    }
);

entry!(
    fn cuLibraryEnumerateKernels(out: *mut Handle, n: c_uint, lib: Handle) {
        with_state(|_, st| {
            let m = &st.modules[&library_module(st, lib)?];
            if m.functions.len() > n as usize {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            for (i, (_, f)) in m.functions.iter().enumerate() {
                put(out.wrapping_add(i), handle(*f))?;
            }
            Ok(())
        })
    }
);

/// A library variable's address and size.
fn library_global(
    dptr: *mut CUdeviceptr,
    bytes: *mut usize,
    lib: Handle,
    name: *const c_char,
) -> CuResult {
    let name = c_str(name)?.to_str().map_err(|_| CUDA_ERROR_NOT_FOUND)?;
    let (addr, size) = with_state(|_, st| {
        let m = library_module(st, lib)?;
        st.modules[&m]
            .globals
            .get(name)
            .copied()
            .ok_or(CUDA_ERROR_NOT_FOUND)
    })?;
    if !dptr.is_null() {
        put(dptr, addr)?;
    }
    if !bytes.is_null() {
        put(bytes, size)?;
    }
    Ok(())
}

entry!(
    fn cuLibraryGetGlobal(
        dptr: *mut CUdeviceptr,
        bytes: *mut usize,
        lib: Handle,
        name: *const c_char,
    ) {
        library_global(dptr, bytes, lib, name)
    }
);

entry!(
    fn cuLibraryGetManaged(
        dptr: *mut CUdeviceptr,
        bytes: *mut usize,
        lib: Handle,
        name: *const c_char,
    ) {
        library_global(dptr, bytes, lib, name)
    }
);

entry!(
    fn cuLibraryGetUnifiedFunction(_fptr: *mut *mut c_void, lib: Handle, name: *const c_char) {
        c_str(name)?;
        with_state(|_, st| library_module(st, lib).map(|_| ()))?;
        // Unified functions are host-callable device functions; simulated images have none.
        Err(CUDA_ERROR_NOT_FOUND)
    }
);

/// Check that `k` is a kernel (of a library or a module) and return it as a function handle.
fn kernel(k: Handle) -> CuResult<Handle> {
    with_function(k, |_| Ok(k))
}

entry!(
    fn cuKernelGetFunction(out: *mut Handle, k: Handle) {
        driver()?.lock().current()?;
        put(out, kernel(k)?)
    }
);

entry!(
    fn cuKernelGetLibrary(out: *mut Handle, k: Handle) {
        let lib = with_state(|_, st| {
            let f = st.functions.get(&id(k)).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
            st.modules
                .get(&f.module)
                .and_then(|m| m.library)
                .ok_or(CUDA_ERROR_INVALID_HANDLE)
        })?;
        put(out, handle(lib))
    }
);

entry!(
    fn cuKernelGetAttribute(
        value: *mut c_int,
        attrib: CUfunction_attribute,
        k: Handle,
        dev: CUdevice,
    ) {
        driver()?.check_device(dev)?;
        let v = with_function(k, |func| function_attribute(func, attrib))?;
        put(value, v)
    }
);

entry!(
    fn cuKernelSetAttribute(attrib: CUfunction_attribute, value: c_int, k: Handle, dev: CUdevice) {
        driver()?.check_device(dev)?;
        with_state(|_, st| {
            let func = st
                .functions
                .get_mut(&id(k))
                .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
            set_function_attribute(func, attrib, value)
        })
    }
);

entry!(
    fn cuKernelSetCacheConfig(k: Handle, _config: CUfunc_cache, dev: CUdevice) {
        driver()?.check_device(dev)?;
        kernel(k).map(|_| ())
    }
);

entry!(
    fn cuKernelGetName(name: *mut *const c_char, k: Handle) {
        let p = with_function(k, |func| Ok(func.name.as_ptr()))?;
        put(name, p)
    }
);

entry!(
    fn cuKernelGetParamInfo(k: Handle, index: usize, offset: *mut usize, size: *mut usize) {
        param_info(k, index, offset, size)
    }
);
