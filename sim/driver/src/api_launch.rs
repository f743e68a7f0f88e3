//! Kernel launches, every path the driver offers: plain, extended, cooperative and
//! multi-device cooperative, each also with per-thread default stream semantics.

use crate::api_graph::capture_node;
use crate::ffi::*;
use crate::state::{KernelLaunch, NodeKind, State, with_state};
use gpushare_sim_wire::Op;
use std::ffi::{c_uint, c_void};

/// Reject launch shapes a real H100 rejects.
pub fn check_dims(grid: [u32; 3], block: [u32; 3]) -> CuResult {
    let threads = block.iter().map(|&b| b as u64).product::<u64>();
    let grid_ok = grid[0] >= 1
        && grid[1] >= 1
        && grid[1] <= 65535
        && grid[2] >= 1
        && grid[2] <= 65535
        && grid[0] <= i32::MAX as u32;
    let block_ok = block[0] >= 1
        && block[0] <= 1024
        && block[1] >= 1
        && block[1] <= 1024
        && block[2] >= 1
        && block[2] <= 64;
    if !grid_ok || !block_ok || threads > 1024 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(())
}

/// Read the launch's first argument when it is 8 bytes wide: the duration of `gpushare_spin*`
/// kernels, the flag address of `gpushare_wait_flag*` / `gpushare_set_flag*` ones. Arguments
/// come either from `kernelParams` or from an `extra` parameter buffer.
pub fn kernel_arg0(
    st: &State,
    function: u64,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CuResult<Option<u64>> {
    let f = st
        .functions
        .get(&function)
        .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    if f.params.first() != Some(&8) {
        if !f.params.is_empty() && params.is_null() && extra.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        return Ok(None);
    }
    if !params.is_null() {
        let p0 = get(params as *const *const u64)?;
        return get(p0).map(Some);
    }
    let (buf, size) = extra_buffer(extra)?;
    if size < 8 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    get(buf as *const u64).map(Some)
}

/// A copy of a launch's arguments, one block per parameter, from `kernelParams` or from an
/// `extra` parameter buffer (laid out as `cuFuncGetParamInfo` reports).
pub fn copy_args(
    st: &State,
    function: u64,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CuResult<Vec<Box<[u8]>>> {
    let f = st
        .functions
        .get(&function)
        .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    if f.params.is_empty() {
        return Ok(Vec::new());
    }
    if !params.is_null() {
        let ptrs = slice(params as *const *const u8, f.params.len())?;
        return ptrs
            .iter()
            .zip(&f.params)
            .map(|(&p, &size)| Ok(slice(p, size)?.into()))
            .collect();
    }
    let (buf, size) = extra_buffer(extra)?;
    (0..f.params.len())
        .map(|i| {
            let (off, len) = f.param_info(i).expect("parameter in range");
            if off + len > size {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            Ok(slice(buf.wrapping_add(off), len)?.into())
        })
        .collect()
}

/// The parameter buffer of an `extra` list of (key, value) pointers ending with
/// `CU_LAUNCH_PARAM_END`, and its size.
fn extra_buffer(extra: *mut *mut c_void) -> CuResult<(*const u8, usize)> {
    if extra.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let (mut buf, mut size) = (std::ptr::null::<u8>(), 0usize);
    let mut i = 0;
    loop {
        let key = get(extra.wrapping_add(i) as *const *mut c_void)?;
        if key == CU_LAUNCH_PARAM_END {
            break;
        }
        let value = get(extra.wrapping_add(i + 1) as *const *const c_void)?;
        if key == CU_LAUNCH_PARAM_BUFFER_POINTER {
            buf = value.cast();
        } else if key == CU_LAUNCH_PARAM_BUFFER_SIZE {
            size = get(value as *const usize)?;
        } else {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        i += 2;
    }
    if buf.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok((buf, size))
}

/// Queue one kernel on a stream (or into the graph the stream is capturing).
#[allow(clippy::too_many_arguments)] // the launch as the driver API takes it
pub fn launch(
    stream: Handle,
    per_thread: bool,
    function: Handle,
    grid: [u32; 3],
    block: [u32; 3],
    shared: u32,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CuResult {
    check_dims(grid, block)?;
    with_state(|d, st| {
        let s = st.resolve_stream(&d.client, stream, per_thread)?;
        let function = id(function);
        let arg0 = kernel_arg0(st, function, params, extra)?;
        if st.streams.get(&s).is_some_and(|x| x.capture.is_some()) {
            let args = copy_args(st, function, params, extra)?;
            let launch = Box::new(KernelLaunch::new(grid, block, shared, args));
            let node = NodeKind::Kernel {
                function,
                arg0,
                launch,
            };
            if capture_node(st, s, node)? {
                return Ok(());
            }
        }
        st.submit(&d.client, s, Op::Kernel { function, arg0 }, &[])
            .map(|_| ())
    })
}

entry_pt!(cuLaunchKernel / cuLaunchKernel_ptsz, |pt| fn(
    f: Handle,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    stream: Handle,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) {
    launch(stream, pt, f, [gx, gy, gz], [bx, by, bz], shared, params, extra)
});

entry_pt!(cuLaunchKernelEx / cuLaunchKernelEx_ptsz, |pt| fn(
    config: *const CUlaunchConfig,
    f: Handle,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) {
    let c = get(config)?;
    let (grid, block) = ([c.gridDimX, c.gridDimY, c.gridDimZ], [c.blockDimX, c.blockDimY, c.blockDimZ]);
    launch(c.hStream, pt, f, grid, block, c.sharedMemBytes, params, extra)
});

entry_pt!(cuLaunchCooperativeKernel / cuLaunchCooperativeKernel_ptsz, |pt| fn(
    f: Handle,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    stream: Handle,
    params: *mut *mut c_void,
) {
    launch(stream, pt, f, [gx, gy, gz], [bx, by, bz], shared, params, std::ptr::null_mut())
});

entry!(
    fn cuLaunchCooperativeKernelMultiDevice(
        list: *mut CUDA_LAUNCH_PARAMS,
        n: c_uint,
        _flags: c_uint,
    ) {
        let launches = slice(list as *const CUDA_LAUNCH_PARAMS, n as usize)?;
        if launches.is_empty() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        for l in launches {
            launch(
                l.hStream,
                false,
                l.function,
                [l.gridDimX, l.gridDimY, l.gridDimZ],
                [l.blockDimX, l.blockDimY, l.blockDimZ],
                l.sharedMemBytes,
                l.kernelParams,
                std::ptr::null_mut(),
            )?;
        }
        Ok(())
    }
);
