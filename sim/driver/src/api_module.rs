//! Modules from any image (PTX, cubin, fat binary), their functions and globals, function
//! attributes and occupancy.

use crate::ffi::*;
use crate::image::{self, ModuleInfo};
use crate::occupancy;
use crate::state::{Alloc, AllocKind, Function, Module, State, with_state};
use gpushare_sim_wire::Request;
use std::collections::HashMap;
use std::ffi::{CString, c_char, c_int, c_uint, c_void};

/// Create a module from an image's description: its kernels announced to the device, its
/// variables backed by zeroed memory. A library's module (`library` set) needs no current
/// context; its variables then live on device 0.
pub fn create_module(info: ModuleInfo, library: Option<u64>) -> CuResult<u64> {
    with_state(|d, st| {
        let device = match library {
            Some(_) => st.current_device().unwrap_or(0),
            None => st.current_device()?,
        };
        let module = st.new_id();
        let mut functions = Vec::new();
        for k in info.kernels {
            let f = st.new_id();
            d.client.send(&Request::RegisterFunction {
                function: f,
                name: k.name.clone(),
            })?;
            let name = CString::new(k.name.clone()).map_err(|_| CUDA_ERROR_INVALID_IMAGE)?;
            functions.push((k.name, f));
            st.functions.insert(
                f,
                Function {
                    name,
                    params: k.params,
                    resources: k.resources,
                    ptx_version: info.version,
                    module,
                    attrs: Vec::new(),
                },
            );
        }
        let mut globals = HashMap::new();
        for (name, size) in info.globals {
            let addr = map_global(size)?;
            st.allocs.insert(
                addr,
                Alloc {
                    size,
                    mapped: size,
                    device,
                    charged: 0,
                    kind: AllocKind::Global,
                    arena: false,
                },
            );
            globals.insert(name, (addr, size));
        }
        st.modules.insert(
            module,
            Module {
                functions,
                globals,
                library,
            },
        );
        Ok(module)
    })
}

/// Load the image at `image` into a new module of the current context.
fn load(out: *mut Handle, image: *const c_void) -> CuResult {
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let info = image::load_at(image)?;
    put(out, handle(create_module(info, None)?))
}

/// Zeroed backing for a module variable.
fn map_global(size: usize) -> CuResult<u64> {
    let v = vec![0u8; size.max(1)].into_boxed_slice();
    Ok(Box::leak(v).as_mut_ptr() as u64)
}

entry!(
    fn cuModuleLoadData(out: *mut Handle, image: *const c_void) {
        load(out, image)
    }
);

entry!(
    fn cuModuleLoadDataEx(
        out: *mut Handle,
        image: *const c_void,
        _n: c_uint,
        _options: *mut CUjit_option,
        _values: *mut *mut c_void,
    ) {
        load(out, image)
    }
);

entry!(
    fn cuModuleLoadFatBinary(out: *mut Handle, image: *const c_void) {
        load(out, image)
    }
);

/// Read an image file (PTX, cubin or fat binary).
pub fn read_image_file(path: *const c_char) -> CuResult<ModuleInfo> {
    let path = c_str(path)?
        .to_str()
        .map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    let bytes = std::fs::read(path).map_err(|_| CUDA_ERROR_FILE_NOT_FOUND)?;
    image::parse(&bytes).map_err(|e| e.code())
}

entry!(
    fn cuModuleLoad(out: *mut Handle, path: *const c_char) {
        let info = read_image_file(path)?;
        put(out, handle(create_module(info, None)?))
    }
);

/// Forget a module, its functions and its variables' memory.
pub fn unload(st: &mut State, module: u64) -> CuResult {
    let m = st
        .modules
        .remove(&module)
        .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    for (_, f) in &m.functions {
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
            put(out, handle(m.function(name).ok_or(CUDA_ERROR_NOT_FOUND)?))
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

pub fn with_function<T>(f: Handle, body: impl FnOnce(&Function) -> CuResult<T>) -> CuResult<T> {
    with_state(|_, st| body(st.functions.get(&id(f)).ok_or(CUDA_ERROR_INVALID_HANDLE)?))
}

/// `CUfunction_attribute` values a kernel reports: an H100's limits, or what was set.
pub fn function_attribute(func: &Function, attrib: CUfunction_attribute) -> CuResult<c_int> {
    if let Some(&(_, v)) = func.attrs.iter().find(|(a, _)| *a == attrib) {
        return Ok(v);
    }
    Ok(match attrib {
        CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK => 1024,
        CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES => func.resources.shared as c_int, // static
        CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES => func.resources.constant as c_int,
        CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES => func.resources.local as c_int,
        CU_FUNC_ATTRIBUTE_NUM_REGS => 32,
        CU_FUNC_ATTRIBUTE_PTX_VERSION | CU_FUNC_ATTRIBUTE_BINARY_VERSION => {
            func.ptx_version.max(90)
        }
        CU_FUNC_ATTRIBUTE_CACHE_MODE_CA => 0,
        CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES => 49152,
        CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT => -1,
        CU_FUNC_ATTRIBUTE_CLUSTER_SIZE_MUST_BE_SET => 0,
        CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH..=CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH => 0,
        CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED => 0,
        CU_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE => 0,
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    })
}

/// Set a settable `CUfunction_attribute` (the documented ones: dynamic shared memory size,
/// carveout, cluster shape and policy), checking the value against the H100's limits.
pub fn set_function_attribute(
    func: &mut Function,
    attrib: CUfunction_attribute,
    value: c_int,
) -> CuResult {
    let ok = match attrib {
        // The opt-in maximum.
        CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES => (0..=232_448).contains(&value),
        CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT => (-1..=100).contains(&value),
        CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH..=CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH => {
            (0..=16).contains(&value)
        }
        CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
        | CU_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE => value >= 0,
        _ => false,
    };
    if !ok {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    func.attrs.retain(|(a, _)| *a != attrib);
    func.attrs.push((attrib, value));
    Ok(())
}

entry!(
    fn cuFuncGetAttribute(value: *mut c_int, attrib: CUfunction_attribute, f: Handle) {
        let v = with_function(f, |func| function_attribute(func, attrib))?;
        put(value, v)
    }
);

entry!(
    fn cuFuncSetAttribute(f: Handle, attrib: CUfunction_attribute, value: c_int) {
        with_state(|_, st| {
            let func = st
                .functions
                .get_mut(&id(f))
                .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
            set_function_attribute(func, attrib, value)
        })
    }
);

/// Offset and size of a kernel's parameter `index`, through out-pointers that may be null.
pub fn param_info(f: Handle, index: usize, offset: *mut usize, size: *mut usize) -> CuResult {
    let (o, s) = with_function(f, |func| {
        func.param_info(index).ok_or(CUDA_ERROR_INVALID_VALUE)
    })?;
    if !offset.is_null() {
        put(offset, o)?;
    }
    if !size.is_null() {
        put(size, s)?;
    }
    Ok(())
}

entry!(
    fn cuFuncGetParamInfo(f: Handle, index: usize, offset: *mut usize, size: *mut usize) {
        param_info(f, index, offset, size)
    }
);

entry!(
    fn cuFuncIsLoaded(state: *mut CUfunctionLoadingState, f: Handle) {
        with_function(f, |_| Ok(()))?;
        put(state, CU_FUNCTION_LOADING_STATE_LOADED) // images load eagerly here
    }
);

entry!(
    fn cuFuncLoad(f: Handle) {
        with_function(f, |_| Ok(()))
    }
);

entry!(
    fn cuModuleEnumerateFunctions(out: *mut Handle, n: c_uint, h: Handle) {
        with_state(|_, st| {
            let m = st.modules.get(&id(h)).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
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

entry!(
    fn cuFuncSetCacheConfig(f: Handle, _config: CUfunc_cache) {
        with_function(f, |_| Ok(()))
    }
);

entry!(
    fn cuFuncSetSharedMemConfig(f: Handle, _config: CUsharedconfig) {
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
    fn cuModuleGetLoadingMode(mode: *mut CUmoduleLoadingMode) {
        put(
            mode,
            if crate::api_library::lazy_loading() {
                CU_MODULE_LAZY_LOADING
            } else {
                CU_MODULE_EAGER_LOADING
            },
        )
    }
);

/// What bounds a kernel's occupancy, from its attributes.
fn kernel_limits(func: &Function) -> CuResult<occupancy::KernelLimits> {
    let attr = |a| function_attribute(func, a).map(|v| v.max(0) as u32);
    Ok(occupancy::KernelLimits {
        registers_per_thread: attr(CU_FUNC_ATTRIBUTE_NUM_REGS)?,
        static_shared: attr(CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)?,
        max_dynamic_shared: attr(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)?,
        max_threads_per_block: attr(CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?,
    })
}

/// Blocks of `block` threads of `f` that fit on one SM.
fn blocks_per_sm(f: Handle, block: c_int, dynamic: usize) -> CuResult<c_int> {
    let k = with_function(f, kernel_limits)?;
    if block <= 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let dynamic = u32::try_from(dynamic).unwrap_or(u32::MAX);
    Ok(occupancy::blocks_per_sm(&k, block as u32, dynamic) as c_int)
}

entry!(
    fn cuOccupancyMaxActiveBlocksPerMultiprocessor(
        n: *mut c_int,
        f: Handle,
        block: c_int,
        smem: usize,
    ) {
        put(n, blocks_per_sm(f, block, smem)?)
    }
);

entry!(
    fn cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(
        n: *mut c_int,
        f: Handle,
        block: c_int,
        smem: usize,
        _flags: c_uint,
    ) {
        put(n, blocks_per_sm(f, block, smem)?)
    }
);

/// The block size (a multiple of the warp, at most `limit`) with the most resident threads per
/// SM, and the grid that fills the GPU with it: `cuOccupancyMaxPotentialBlockSize`'s answer.
fn potential_block_size(
    min_grid: *mut c_int,
    block: *mut c_int,
    f: Handle,
    smem_of: CUoccupancyB2DSize,
    smem: usize,
    limit: c_int,
) -> CuResult {
    let k = with_function(f, kernel_limits)?;
    let most = if limit > 0 {
        (limit as u32).min(k.max_threads_per_block)
    } else {
        k.max_threads_per_block
    };
    let mut best = (0u32, 0u32); // (threads per SM, block)
    for b in (32..=most).step_by(32) {
        let dynamic = match smem_of {
            // SAFETY: the caller's callback, documented to map a block size to its dynamic
            // shared memory.
            Some(cb) => unsafe { cb(b as c_int) },
            None => smem,
        };
        let blocks = occupancy::blocks_per_sm(&k, b, u32::try_from(dynamic).unwrap_or(u32::MAX));
        if blocks * b >= best.0 {
            best = (blocks * b, b);
        }
    }
    let (threads, b) = best;
    put(min_grid, (132 * threads / b.max(1)) as c_int)?;
    put(block, b as c_int)
}

entry!(
    fn cuOccupancyMaxPotentialBlockSize(
        min_grid: *mut c_int,
        block: *mut c_int,
        f: Handle,
        smem_of: CUoccupancyB2DSize,
        smem: usize,
        limit: c_int,
    ) {
        potential_block_size(min_grid, block, f, smem_of, smem, limit)
    }
);

entry!(
    fn cuOccupancyMaxPotentialBlockSizeWithFlags(
        min_grid: *mut c_int,
        block: *mut c_int,
        f: Handle,
        smem_of: CUoccupancyB2DSize,
        smem: usize,
        limit: c_int,
        _flags: c_uint,
    ) {
        potential_block_size(min_grid, block, f, smem_of, smem, limit)
    }
);

entry!(
    fn cuOccupancyAvailableDynamicSMemPerBlock(
        size: *mut usize,
        f: Handle,
        blocks: c_int,
        block: c_int,
    ) {
        let k = with_function(f, kernel_limits)?;
        if blocks <= 0 || block <= 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        put(
            size,
            occupancy::available_dynamic_shared(&k, blocks as u32, block as u32) as usize,
        )
    }
);

/// The cluster shape of a launch: its `CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION`, else the
/// kernel's required cluster size; with the largest cluster size the kernel allows.
fn cluster_of(f: Handle, config: *const CUlaunchConfig) -> CuResult<(u32, u32, u32, u32)> {
    let c = get(config)?;
    let attrs = slice(c.attrs as *const LaunchAttribute, c.numAttrs as usize)?;
    let given = attrs
        .iter()
        .find(|a| a.id == CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)
        .map(|a| a.value[0] * a.value[1] * a.value[2]);
    with_function(f, |func| {
        let attr = |a| function_attribute(func, a).map(|v| v.max(0) as u32);
        let required = attr(CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH)?
            * attr(CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT)?.max(1)
            * attr(CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH)?.max(1);
        let size = match (given, required) {
            (Some(g), r) if r == 0 || g == r => g,
            (None, r) if r > 0 => r,
            // "Without required sizes, the cluster size must be specified in config".
            _ => return Err(CUDA_ERROR_INVALID_CLUSTER_SIZE),
        };
        let most = if attr(CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED)? != 0 {
            occupancy::NON_PORTABLE_CLUSTER
        } else {
            occupancy::PORTABLE_CLUSTER
        };
        let block = c.blockDimX * c.blockDimY * c.blockDimZ;
        Ok((size, most, block, c.sharedMemBytes))
    })
}

entry!(
    fn cuOccupancyMaxActiveClusters(n: *mut c_int, f: Handle, config: *const CUlaunchConfig) {
        let (size, most, block, dynamic) = cluster_of(f, config)?;
        if size == 0 || size > most {
            return Err(CUDA_ERROR_INVALID_CLUSTER_SIZE);
        }
        let k = with_function(f, kernel_limits)?;
        put(
            n,
            occupancy::max_active_clusters(&k, block, dynamic, size) as c_int,
        )
    }
);

entry!(
    fn cuOccupancyMaxPotentialClusterSize(
        size: *mut c_int,
        f: Handle,
        config: *const CUlaunchConfig,
    ) {
        let c = get(config)?;
        let most = with_function(f, |func| {
            let np = function_attribute(func, CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED)?;
            let k = kernel_limits(func)?;
            let block = c.blockDimX * c.blockDimY * c.blockDimZ;
            if occupancy::blocks_per_sm(&k, block, c.sharedMemBytes) == 0 {
                return Ok(0);
            }
            Ok(if np != 0 {
                occupancy::NON_PORTABLE_CLUSTER
            } else {
                occupancy::PORTABLE_CLUSTER
            })
        })?;
        put(size, most as c_int)
    }
);
