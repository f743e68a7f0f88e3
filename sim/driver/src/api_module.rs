//! Modules from PTX text, their functions and globals, function attributes and occupancy.

use crate::ffi::*;
use crate::ptx::{self, PtxError};
use crate::state::{Alloc, AllocKind, Function, Module, State, with_state};
use gpushare_sim_wire::Request;
use std::collections::HashMap;
use std::ffi::{CString, c_char, c_int, c_uint, c_void};

/// Load PTX text into a new module of the current context.
fn load(out: *mut Handle, text: &[u8]) -> CuResult {
    let text = std::str::from_utf8(text).map_err(|_| CUDA_ERROR_INVALID_IMAGE)?;
    let parsed = ptx::parse(text).map_err(|e| match e {
        PtxError::NotPtx => CUDA_ERROR_INVALID_IMAGE,
        PtxError::Malformed(_) => CUDA_ERROR_INVALID_PTX,
    })?;
    with_state(|d, st| {
        let device = st.current_device()?;
        let module = st.new_id();
        let mut functions = HashMap::new();
        for k in parsed.kernels {
            let f = st.new_id();
            d.client.send(&Request::RegisterFunction {
                function: f,
                name: k.name.clone(),
            })?;
            functions.insert(k.name.clone(), f);
            let name = CString::new(k.name).map_err(|_| CUDA_ERROR_INVALID_PTX)?;
            st.functions.insert(
                f,
                Function {
                    name,
                    params: k.params,
                    ptx_version: parsed.version,
                    module,
                },
            );
        }
        let mut globals = HashMap::new();
        for (name, size) in parsed.globals {
            let addr = map_global(size)?;
            st.allocs.insert(
                addr,
                Alloc {
                    size,
                    mapped: size,
                    device,
                    charged: 0,
                    kind: AllocKind::Global,
                },
            );
            globals.insert(name, (addr, size));
        }
        st.modules.insert(module, Module { functions, globals });
        put(out, handle(module))
    })
}

/// Zeroed backing for a module variable.
fn map_global(size: usize) -> CuResult<u64> {
    let v = vec![0u8; size.max(1)].into_boxed_slice();
    Ok(Box::leak(v).as_mut_ptr() as u64)
}

/// The bytes of a NUL-terminated image (PTX is text; binary images are rejected by the parser).
fn image_bytes<'a>(image: *const c_void) -> CuResult<&'a [u8]> {
    Ok(c_str(image as *const c_char)?.to_bytes())
}

entry!(
    fn cuModuleLoadData(out: *mut Handle, image: *const c_void) {
        load(out, image_bytes(image)?)
    }
);

entry!(
    fn cuModuleLoadDataEx(
        out: *mut Handle,
        image: *const c_void,
        _n: c_uint,
        _options: *mut c_int,
        _values: *mut *mut c_void,
    ) {
        load(out, image_bytes(image)?)
    }
);

entry!(
    fn cuModuleLoadFatBinary(out: *mut Handle, image: *const c_void) {
        load(out, image_bytes(image)?)
    }
);

entry!(
    fn cuModuleLoad(out: *mut Handle, path: *const c_char) {
        let path = c_str(path)?
            .to_str()
            .map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        let bytes = std::fs::read(path).map_err(|_| CUDA_ERROR_FILE_NOT_FOUND)?;
        load(out, &bytes)
    }
);

fn unload(st: &mut State, module: u64) -> CuResult {
    let m = st
        .modules
        .remove(&module)
        .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    for f in m.functions.values() {
        st.functions.remove(f);
    }
    for (addr, size) in m.globals.values() {
        st.allocs.remove(addr);
        // SAFETY: leaked by `map_global` with exactly this size; no handle to it remains.
        drop(unsafe {
            Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                *addr as *mut u8,
                (*size).max(1),
            ))
        });
    }
    Ok(())
}

entry!(
    fn cuModuleUnload(h: Handle) {
        with_state(|_, st| unload(st, id(h)))
    }
);

entry!(
    fn cuModuleGetFunction(out: *mut Handle, h: Handle, name: *const c_char) {
        let name = c_str(name)?.to_str().map_err(|_| CUDA_ERROR_NOT_FOUND)?;
        with_state(|_, st| {
            let m = st.modules.get(&id(h)).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
            put(
                out,
                handle(*m.functions.get(name).ok_or(CUDA_ERROR_NOT_FOUND)?),
            )
        })
    }
);

entry!(
    fn cuModuleGetGlobal_v2(
        dptr: *mut CUdeviceptr,
        bytes: *mut usize,
        h: Handle,
        name: *const c_char,
    ) {
        let name = c_str(name)?.to_str().map_err(|_| CUDA_ERROR_NOT_FOUND)?;
        with_state(|_, st| {
            let m = st.modules.get(&id(h)).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
            let &(addr, size) = m.globals.get(name).ok_or(CUDA_ERROR_NOT_FOUND)?;
            if !dptr.is_null() {
                put(dptr, addr)?;
            }
            if !bytes.is_null() {
                put(bytes, size)?;
            }
            Ok(())
        })
    }
);

entry!(
    fn cuModuleGetFunctionCount(count: *mut c_uint, h: Handle) {
        with_state(|_, st| {
            let m = st.modules.get(&id(h)).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
            put(count, m.functions.len() as c_uint)
        })
    }
);

fn with_function<T>(f: Handle, body: impl FnOnce(&Function) -> CuResult<T>) -> CuResult<T> {
    with_state(|_, st| body(st.functions.get(&id(f)).ok_or(CUDA_ERROR_INVALID_HANDLE)?))
}

entry!(
    fn cuFuncGetAttribute(value: *mut c_int, attrib: c_int, f: Handle) {
        let v = with_function(f, |func| {
            Ok(match attrib {
                0 => 1024,                         // MAX_THREADS_PER_BLOCK
                1..=3 => 0,                        // SHARED / CONST / LOCAL sizes
                4 => 32,                           // NUM_REGS
                5 | 6 => func.ptx_version.max(90), // PTX_VERSION, BINARY_VERSION
                7 => 0,                            // CACHE_MODE_CA
                8 => 49152,                        // MAX_DYNAMIC_SHARED_SIZE_BYTES
                9 => -1,                           // PREFERRED_SHARED_MEMORY_CARVEOUT
                10 => 0,                           // CLUSTER_SIZE_MUST_BE_SET
                11..=13 => 0,                      // REQUIRED_CLUSTER_WIDTH/HEIGHT/DEPTH
                14 => 0,                           // NON_PORTABLE_CLUSTER_SIZE_ALLOWED
                15 => 0,                           // CLUSTER_SCHEDULING_POLICY_PREFERENCE
                _ => return Err(CUDA_ERROR_INVALID_VALUE),
            })
        })?;
        put(value, v)
    }
);

entry!(
    fn cuFuncSetAttribute(f: Handle, attrib: c_int, _value: c_int) {
        with_function(f, |_| {
            if (0..=15).contains(&attrib) {
                Ok(())
            } else {
                Err(CUDA_ERROR_INVALID_VALUE)
            }
        })
    }
);

entry!(
    fn cuFuncSetCacheConfig(f: Handle, _config: c_int) {
        with_function(f, |_| Ok(()))
    }
);

entry!(
    fn cuFuncSetSharedMemConfig(f: Handle, _config: c_int) {
        with_function(f, |_| Ok(()))
    }
);

entry!(
    fn cuFuncGetName(name: *mut *const c_char, f: Handle) {
        // The string lives as long as the module, as the driver documents.
        let p = with_function(f, |func| Ok(func.name.as_ptr()))?;
        put(name, p)
    }
);

entry!(
    fn cuFuncGetModule(module: *mut Handle, f: Handle) {
        let m = with_function(f, |func| Ok(func.module))?;
        put(module, handle(m))
    }
);

entry!(
    fn cuOccupancyMaxActiveBlocksPerMultiprocessor(
        n: *mut c_int,
        f: Handle,
        block: c_int,
        _smem: usize,
    ) {
        with_function(f, |_| Ok(()))?;
        if block <= 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        put(n, (2048 / block).min(32))
    }
);

entry!(
    fn cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(
        n: *mut c_int,
        f: Handle,
        block: c_int,
        _smem: usize,
        _flags: c_uint,
    ) {
        with_function(f, |_| Ok(()))?;
        if block <= 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        put(n, (2048 / block).min(32))
    }
);

entry!(
    fn cuOccupancyMaxPotentialBlockSize(
        min_grid: *mut c_int,
        block: *mut c_int,
        f: Handle,
        _smem_fn: *const c_void,
        _smem: usize,
        limit: c_int,
    ) {
        with_function(f, |_| Ok(()))?;
        let b = if limit > 0 { limit.min(1024) } else { 1024 };
        put(min_grid, 132 * (2048 / b).min(32))?;
        put(block, b)
    }
);
