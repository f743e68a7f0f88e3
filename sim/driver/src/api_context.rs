//! Contexts: primary (retained per device, shared by the process) and created ones, and each
//! thread's current-context stack.

use crate::ffi::*;
use crate::state::{self, Primary, current_ctx, driver, with_state};
use std::ffi::{c_int, c_uint, c_void};

fn create(pctx: *mut Handle, flags: c_uint, dev: CUdevice) -> CuResult {
    let d = driver()?;
    let device = d.check_device(dev)?;
    let ctx = d.lock().create_context(&d.client, device, flags)?;
    state::push_current(ctx);
    put(pctx, handle(ctx))
}

entry!(
    fn cuCtxCreate_v2(pctx: *mut Handle, flags: c_uint, dev: CUdevice) {
        create(pctx, flags, dev)
    }
);

entry!(
    fn cuCtxCreate_v3(
        pctx: *mut Handle,
        _params: *mut c_void,
        _num_params: c_int,
        flags: c_uint,
        dev: CUdevice,
    ) {
        create(pctx, flags, dev)
    }
);

entry!(
    fn cuCtxCreate_v4(pctx: *mut Handle, _params: *mut c_void, flags: c_uint, dev: CUdevice) {
        create(pctx, flags, dev)
    }
);

entry!(
    fn cuCtxDestroy_v2(ctx: Handle) {
        let d = driver()?;
        let tail = d.lock().ctx_tail(id(ctx));
        // Destroying a context waits for its work, as the real driver does.
        d.client.wait(tail)?;
        let callbacks = {
            let mut st = d.lock();
            if st.primary.iter().any(|p| p.ctx == Some(id(ctx))) {
                return Err(CUDA_ERROR_INVALID_CONTEXT);
            }
            st.destroy_context(&d.client, id(ctx))?
        };
        state::run_storage_callbacks(callbacks);
        Ok(())
    }
);

entry!(
    fn cuCtxGetCurrent(pctx: *mut Handle) {
        driver()?;
        put(pctx, handle(current_ctx().unwrap_or(0)))
    }
);

entry!(
    fn cuCtxSetCurrent(ctx: Handle) {
        let d = driver()?;
        if ctx.is_null() {
            state::set_current(None);
            return Ok(());
        }
        if !d.lock().contexts.contains_key(&id(ctx)) {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        state::set_current(Some(id(ctx)));
        Ok(())
    }
);

fn push(ctx: Handle) -> CuResult {
    let d = driver()?;
    if !d.lock().contexts.contains_key(&id(ctx)) {
        return Err(CUDA_ERROR_INVALID_CONTEXT);
    }
    state::push_current(id(ctx));
    Ok(())
}

fn pop(pctx: *mut Handle) -> CuResult {
    driver()?;
    let ctx = state::pop_current().ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
    if !pctx.is_null() {
        put(pctx, handle(ctx))?;
    }
    Ok(())
}

entry!(
    fn cuCtxPushCurrent_v2(ctx: Handle) {
        push(ctx)
    }
);

entry!(
    fn cuCtxPopCurrent_v2(pctx: *mut Handle) {
        pop(pctx)
    }
);

// The legacy names of the push and pop, which programs still look up with dlsym.
entry!(
    fn cuCtxPushCurrent(ctx: Handle) {
        push(ctx)
    }
);
entry!(
    fn cuCtxPopCurrent(pctx: *mut Handle) {
        pop(pctx)
    }
);

/// Peer access from the current context to `peer`'s memory: the current context and the
/// peer, checked as `cuCtxEnablePeerAccess` and `cuCtxDisablePeerAccess` document ("no current
/// context, peerContext is not a valid context, or ... the current context is peerContext":
/// `CUDA_ERROR_INVALID_CONTEXT`).
fn peer_pair(st: &crate::state::State, peer: Handle) -> CuResult<(u64, u64)> {
    let ctx = st.current()?;
    let peer = id(peer);
    if peer == ctx || !st.contexts.contains_key(&peer) {
        return Err(CUDA_ERROR_INVALID_CONTEXT);
    }
    Ok((ctx, peer))
}

entry!(
    fn cuCtxEnablePeerAccess(peer: Handle, flags: c_uint) {
        with_state(|_, st| {
            let (ctx, peer) = peer_pair(st, peer)?;
            if flags != 0 {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            // Only across devices cuDeviceCanAccessPeer links.
            if st.contexts[&ctx].device == st.contexts[&peer].device {
                return Err(CUDA_ERROR_PEER_ACCESS_UNSUPPORTED);
            }
            let peers = &mut st.contexts.get_mut(&ctx).expect("current").peers;
            if peers.contains(&peer) {
                return Err(CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED);
            }
            peers.push(peer);
            Ok(())
        })
    }
);

entry!(
    fn cuCtxDisablePeerAccess(peer: Handle) {
        with_state(|_, st| {
            let (ctx, peer) = peer_pair(st, peer)?;
            let peers = &mut st.contexts.get_mut(&ctx).expect("current").peers;
            if !peers.contains(&peer) {
                return Err(CUDA_ERROR_PEER_ACCESS_NOT_ENABLED);
            }
            peers.retain(|&p| p != peer);
            Ok(())
        })
    }
);

entry!(
    fn cuCtxGetDevice(dev: *mut CUdevice) {
        with_state(|_, st| put(dev, st.current_device()? as CUdevice))
    }
);

entry!(
    fn cuCtxGetFlags(flags: *mut c_uint) {
        with_state(|_, st| {
            let ctx = st.current()?;
            put(flags, st.contexts[&ctx].flags)
        })
    }
);

entry!(
    fn cuCtxSetFlags(flags: c_uint) {
        with_state(|_, st| {
            let ctx = st.current()?;
            st.contexts
                .get_mut(&ctx)
                .expect("current context exists")
                .flags = flags;
            Ok(())
        })
    }
);

entry!(
    fn cuCtxGetApiVersion(ctx: Handle, version: *mut c_uint) {
        with_state(|_, st| {
            let c = if ctx.is_null() {
                st.current()?
            } else {
                id(ctx)
            };
            if !st.contexts.contains_key(&c) {
                return Err(CUDA_ERROR_INVALID_CONTEXT);
            }
            put(version, 12090)
        })
    }
);

entry!(
    fn cuCtxGetId(ctx: Handle, out: *mut u64) {
        with_state(|_, st| {
            let c = if ctx.is_null() {
                st.current()?
            } else {
                id(ctx)
            };
            if !st.contexts.contains_key(&c) {
                return Err(CUDA_ERROR_INVALID_CONTEXT);
            }
            put(out, c)
        })
    }
);

entry!(
    fn cuCtxSynchronize() {
        let d = driver()?;
        let tail = {
            let mut st = d.lock();
            let ctx = st.current()?;
            st.check_ctx_not_capturing(ctx)?;
            st.ctx_tail(ctx)
        };
        d.client.wait(tail)?;
        crate::api_memory::release_pools_at_sync()
    }
);

entry!(
    fn cuCtxGetStreamPriorityRange(least: *mut c_int, greatest: *mut c_int) {
        driver()?;
        if !least.is_null() {
            put(least, 0)?;
        }
        if !greatest.is_null() {
            put(greatest, -5)?;
        }
        Ok(())
    }
);

/// A context's limit, as set or else its default (an H100's; a context is never a CIG context).
/// Every limit CUDA 12.9 defines answers: libraries query them all, including those added late
/// (`CU_LIMIT_CIG_ENABLED`), and read the value.
fn limit_value(set: &[(CUlimit, usize)], limit: CUlimit) -> CuResult<usize> {
    if let Some(&(_, v)) = set.iter().find(|(l, _)| *l == limit) {
        return Ok(v);
    }
    Ok(match limit {
        CU_LIMIT_STACK_SIZE => 1024,
        CU_LIMIT_PRINTF_FIFO_SIZE => 1 << 20,
        CU_LIMIT_MALLOC_HEAP_SIZE => 8 << 20,
        CU_LIMIT_DEV_RUNTIME_SYNC_DEPTH => 2,
        CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT => 2048,
        CU_LIMIT_MAX_L2_FETCH_GRANULARITY => 32,
        CU_LIMIT_PERSISTING_L2_CACHE_SIZE => 0,
        // The shared memory kernels may use: the whole opt-in maximum outside CIG.
        CU_LIMIT_SHMEM_SIZE => crate::occupancy::SHARED_PER_BLOCK_OPTIN as usize,
        CU_LIMIT_CIG_ENABLED => 0,
        CU_LIMIT_CIG_SHMEM_FALLBACK_ENABLED => 1,
        _ => return Err(CUDA_ERROR_UNSUPPORTED_LIMIT),
    })
}

entry!(
    fn cuCtxGetLimit(value: *mut usize, limit: CUlimit) {
        let v = with_state(|_, st| {
            let ctx = st.current()?;
            limit_value(&st.contexts[&ctx].limits, limit)
        })?;
        put(value, v)
    }
);

// "The driver is free to modify the requested value to meet h/w requirements": the L2 fetch
// granularity is at most 128 bytes. The CIG limits `SHMEM_SIZE` and `CIG_ENABLED` "can only be
// queried, cannot be set".
entry!(
    fn cuCtxSetLimit(limit: CUlimit, value: usize) {
        with_state(|_, st| {
            let ctx = st.current()?;
            let value = match limit {
                CU_LIMIT_SHMEM_SIZE | CU_LIMIT_CIG_ENABLED => {
                    return Err(CUDA_ERROR_UNSUPPORTED_LIMIT);
                }
                CU_LIMIT_MAX_L2_FETCH_GRANULARITY => value.min(128),
                _ => value,
            };
            let limits = &mut st.contexts.get_mut(&ctx).expect("current").limits;
            limit_value(limits, limit)?;
            limits.retain(|(l, _)| *l != limit);
            limits.push((limit, value));
            Ok(())
        })
    }
);

entry!(
    fn cuCtxGetCacheConfig(config: *mut CUfunc_cache) {
        with_state(|_, st| st.current().map(|_| ()))?;
        put(config, CU_FUNC_CACHE_PREFER_NONE)
    }
);

entry!(
    fn cuCtxSetCacheConfig(_config: CUfunc_cache) {
        with_state(|_, st| st.current().map(|_| ()))
    }
);

/// The primary context of `dev`, created if it does not exist yet; `retain` counts a reference.
pub fn primary_context(dev: CUdevice, retain: bool) -> CuResult<u64> {
    let d = driver()?;
    let device = d.check_device(dev)? as usize;
    let mut st = d.lock();
    let p = st.primary[device];
    let ctx = match (p.ctx, p.handle) {
        (Some(c), _) => c,
        (None, Some(h)) => st.create_context_as(&d.client, h, device as u32, p.flags)?,
        (None, None) => st.create_context(&d.client, device as u32, p.flags)?,
    };
    st.primary[device] = Primary {
        ctx: Some(ctx),
        handle: Some(ctx),
        refs: p.refs + u32::from(retain),
        flags: p.flags,
    };
    Ok(ctx)
}

entry!(
    fn cuDevicePrimaryCtxRetain(pctx: *mut Handle, dev: CUdevice) {
        if pctx.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        put(pctx, handle(primary_context(dev, true)?))
    }
);

pub fn primary_release(dev: CUdevice) -> CuResult {
    let d = driver()?;
    let device = d.check_device(dev)? as usize;
    let p = d.lock().primary[device];
    if p.refs == 0 {
        return Err(CUDA_ERROR_INVALID_CONTEXT);
    }
    if p.refs == 1 {
        return primary_destroy(dev, true);
    }
    d.lock().primary[device].refs -= 1;
    Ok(())
}

/// Destroy the primary context's state (after its work drains): its allocations, streams,
/// events and modules are gone. Resetting does not release it (the driver documents): a
/// module that retained it goes on with a fresh context under the same handle. Released by
/// the last module (`release`), it is inactive until retained again, under the same handle.
fn primary_reset(dev: CUdevice) -> CuResult {
    primary_destroy(dev, false)
}

fn primary_destroy(dev: CUdevice, release: bool) -> CuResult {
    let d = driver()?;
    let device = d.check_device(dev)? as usize;
    let Some(ctx) = d.lock().primary[device].ctx else {
        return Ok(());
    };
    let tail = d.lock().ctx_tail(ctx);
    d.client.wait(tail)?;
    let callbacks = {
        let mut st = d.lock();
        let p = st.primary[device];
        let refs = if release { 0 } else { p.refs };
        st.primary[device] = Primary {
            ctx: None,
            refs,
            ..p
        };
        let callbacks = st.destroy_context(&d.client, ctx)?;
        if refs > 0 {
            st.create_context_as(&d.client, ctx, device as u32, p.flags)?;
            st.primary[device].ctx = Some(ctx);
        }
        callbacks
    };
    state::run_storage_callbacks(callbacks);
    Ok(())
}

entry!(
    fn cuDevicePrimaryCtxRelease(dev: CUdevice) {
        primary_release(dev)
    }
);
entry!(
    fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) {
        primary_release(dev)
    }
);
entry!(
    fn cuDevicePrimaryCtxReset(dev: CUdevice) {
        primary_reset(dev)
    }
);
entry!(
    fn cuDevicePrimaryCtxReset_v2(dev: CUdevice) {
        primary_reset(dev)
    }
);

entry!(
    fn cuDevicePrimaryCtxGetState(dev: CUdevice, flags: *mut c_uint, active: *mut c_int) {
        let d = driver()?;
        let p = d.lock().primary[d.check_device(dev)? as usize];
        put(flags, p.flags)?;
        put(active, p.ctx.is_some() as c_int)
    }
);

fn primary_set_flags(dev: CUdevice, flags: c_uint) -> CuResult {
    let d = driver()?;
    let device = d.check_device(dev)? as usize;
    d.lock().primary[device].flags = flags;
    Ok(())
}

entry!(
    fn cuDevicePrimaryCtxSetFlags(dev: CUdevice, flags: c_uint) {
        primary_set_flags(dev, flags)
    }
);
entry!(
    fn cuDevicePrimaryCtxSetFlags_v2(dev: CUdevice, flags: c_uint) {
        primary_set_flags(dev, flags)
    }
);

// The profiler control API: no profiler attaches to the simulated device, so starting and
// stopping collection only checks for a context, as the driver does.
entry!(
    fn cuProfilerStart() {
        with_state(|_, st| st.current().map(|_| ()))
    }
);
entry!(
    fn cuProfilerStop() {
        with_state(|_, st| st.current().map(|_| ()))
    }
);
