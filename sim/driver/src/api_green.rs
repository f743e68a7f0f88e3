//! Green contexts (CUDA 12.4+), as cuda.h documents them: a device's SMs as a resource
//! (`cuDeviceGetDevResource`), split into groups (`cuDevSmResourceSplitByCount`), made into a
//! descriptor (`cuDevResourceGenerateDesc`) and provisioned as a green context
//! (`cuGreenCtxCreate`), which retains the device's primary context and is a context of its
//! own that `cuCtxFromGreenCtx` hands out to the context APIs. PyTorch's driver table looks
//! these entry points up; a lookup that fails leaves the CUDA runtime with an error to report.
//!
//! The simulated device models no SMs: a green context's kernels take the time they take in any
//! context and, as any two contexts do, a green context and another context take turns on the
//! GPU instead of running side by side on disjoint SMs.

use crate::api_context::{primary_context, primary_release};
use crate::ffi::*;
use crate::state::{Green, driver, with_state};
use std::ffi::{c_int, c_uint, c_void};

/// `CUdevResource` (cuda.h, `RESOURCE_ABI_VERSION` 1): the type, 92 bytes the driver keeps for
/// itself (here: a mark, the device and the split the resource came from), then the union whose
/// SM member is the SM count, padded to 48 bytes.
#[repr(C)]
#[derive(Clone, Copy)]
struct DevResource {
    kind: CUdevResourceType,
    mark: u32,
    device: u32,
    /// The split that produced the resource (0: a whole device's or context's SMs).
    split: u32,
    _internal: [u8; 80],
    sm_count: u32,
    _oversize: [u8; 44],
}
const _: () = assert!(std::mem::size_of::<DevResource>() == 144);

/// Marks a resource this driver filled in.
const MARK: u32 = u32::from_le_bytes(*b"GSsm");
/// SMs of the simulated device (an H100 SXM5's 132, as `MULTIPROCESSOR_COUNT` says).
const DEVICE_SMS: u32 = 132;
/// Partition granularity on compute capability 9.0, as cuda.h gives it: "the minimum count is 8
/// SMs and must be a multiple of 8". With `CU_DEV_SM_RESOURCE_SPLIT_IGNORE_SM_COSCHEDULING`
/// ("lower the minimum SM count and alignment, and treat each SM independent of its hierarchy")
/// the simulator takes the finest granularity cuda.h lists for any architecture with SM pairs,
/// 2 SMs.
const SM_GRANULE: u32 = 8;
const SM_GRANULE_UNCOSCHEDULED: u32 = 2;

fn sm_resource(device: u32, sms: u32, split: u32) -> DevResource {
    DevResource {
        kind: CU_DEV_RESOURCE_TYPE_SM,
        mark: MARK,
        device,
        split,
        _internal: [0; 80],
        sm_count: sms,
        _oversize: [0; 44],
    }
}

/// A resource the caller passes in: an SM resource this driver made.
fn read_resource(p: *const c_void) -> CuResult<DevResource> {
    let r = get(p.cast::<DevResource>())?;
    if r.kind != CU_DEV_RESOURCE_TYPE_SM {
        return Err(CUDA_ERROR_INVALID_RESOURCE_TYPE);
    }
    if r.mark != MARK {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(r)
}

fn put_resource(out: *mut c_void, kind: CUdevResourceType, r: DevResource) -> CuResult {
    if kind != CU_DEV_RESOURCE_TYPE_SM {
        return Err(CUDA_ERROR_INVALID_RESOURCE_TYPE);
    }
    put(out.cast::<DevResource>(), r)
}

fn green(st: &crate::state::State, h: Handle) -> CuResult<&Green> {
    st.greens.get(&id(h)).ok_or(CUDA_ERROR_INVALID_CONTEXT)
}

entry!(
    fn cuDeviceGetDevResource(device: CUdevice, resource: *mut c_void, kind: CUdevResourceType) {
        let dev = driver()?.check_device(device)?;
        put_resource(resource, kind, sm_resource(dev, DEVICE_SMS, 0))
    }
);

entry!(
    fn cuCtxGetDevResource(ctx: Handle, resource: *mut c_void, kind: CUdevResourceType) {
        let r = with_state(|_, st| {
            let c = st
                .contexts
                .get(&id(ctx))
                .ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
            let sms = (st.greens.values())
                .find(|g| g.ctx == id(ctx))
                .map_or(DEVICE_SMS, |g| g.sms);
            Ok(sm_resource(c.device, sms, 0))
        })?;
        put_resource(resource, kind, r)
    }
);

entry!(
    fn cuGreenCtxGetDevResource(h: Handle, resource: *mut c_void, kind: CUdevResourceType) {
        let r = with_state(|_, st| {
            let g = green(st, h)?;
            Ok(sm_resource(g.device, g.sms, 0))
        })?;
        put_resource(resource, kind, r)
    }
);

/// Groups of `min_count` SMs (rounded up to the granularity) that `input` holds.
fn split_size(input: &DevResource, flags: c_uint, min_count: c_uint) -> CuResult<u32> {
    let known = CU_DEV_SM_RESOURCE_SPLIT_IGNORE_SM_COSCHEDULING
        | CU_DEV_SM_RESOURCE_SPLIT_MAX_POTENTIAL_CLUSTER_SIZE;
    // "minCount must be between 0 and the SM count specified in input".
    if flags & !known != 0 || min_count > input.sm_count {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // "The output results cannot be split again without first creating a descriptor and a
    // green context with that descriptor."
    if input.split != 0 {
        return Err(CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION);
    }
    let granule = if flags & CU_DEV_SM_RESOURCE_SPLIT_IGNORE_SM_COSCHEDULING != 0 {
        SM_GRANULE_UNCOSCHEDULED
    } else {
        SM_GRANULE
    };
    Ok(min_count.max(1).div_ceil(granule) * granule)
}

entry!(
    fn cuDevSmResourceSplitByCount(
        result: *mut c_void,
        groups: *mut c_uint,
        input: *const c_void,
        remaining: *mut c_void,
        flags: c_uint,
        min_count: c_uint,
    ) {
        let d = driver()?;
        let input = read_resource(input)?;
        let asked = get(groups)?;
        let size = split_size(&input, flags, min_count)?;
        let possible = input.sm_count / size;
        // "If result is NULL, the API simulates a split and provides the amount of groups that
        // would be created in nbGroups."
        if result.is_null() {
            return put(groups, possible);
        }
        let n = asked.min(possible);
        let split = d.lock().new_id() as u32;
        let out = result.cast::<DevResource>();
        for i in 0..n as usize {
            // SAFETY: the caller passed `result` with room for `*nbGroups` resources.
            put(
                unsafe { out.add(i) },
                sm_resource(input.device, size, split),
            )?;
        }
        if !remaining.is_null() {
            let rest = input.sm_count - n * size;
            put(
                remaining.cast::<DevResource>(),
                sm_resource(input.device, rest, split),
            )?;
        }
        put(groups, n)
    }
);

entry!(
    fn cuDevResourceGenerateDesc(
        desc: *mut CUdevResourceDesc,
        resources: *mut c_void,
        count: c_uint,
    ) {
        if count == 0 || desc.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let all = slice(resources.cast::<DevResource>().cast_const(), count as usize)?;
        let first = read_resource((&all[0] as *const DevResource).cast())?;
        let mut sms = 0;
        for r in all {
            let r = read_resource((r as *const DevResource).cast())?;
            // "the device they came from must be the same"; SM resources "must be outputs
            // (whether result or remaining) from the same split API instance".
            if r.device != first.device || (count > 1 && (r.split == 0 || r.split != first.split)) {
                return Err(CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION);
            }
            sms += r.sm_count;
        }
        with_state(|_, st| {
            let h = st.new_id();
            st.resource_descs.insert(h, (first.device, sms));
            put(desc, handle(h))
        })
    }
);

entry!(
    fn cuGreenCtxCreate(
        out: *mut CUgreenCtx,
        desc: CUdevResourceDesc,
        dev: CUdevice,
        flags: c_uint,
    ) {
        let d = driver()?;
        let device = d.check_device(dev)?;
        // "CU_GREEN_CTX_DEFAULT_STREAM is required."
        if flags != CU_GREEN_CTX_DEFAULT_STREAM || out.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (desc_device, sms) = *d
            .lock()
            .resource_descs
            .get(&id(desc))
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if desc_device != device {
            return Err(CUDA_ERROR_INVALID_DEVICE);
        }
        // "This API will retain the primary context on device dev, which is released when the
        // green context is destroyed." It does not make the green context current.
        primary_context(dev, true)?;
        let created = (|| {
            let mut st = d.lock();
            let ctx = st.create_context(&d.client, device, 0)?;
            let h = st.new_id();
            st.greens.insert(h, Green { ctx, device, sms });
            Ok(h)
        })();
        match created {
            Ok(h) => put(out, handle(h)),
            Err(e) => {
                primary_release(dev)?;
                Err(e)
            }
        }
    }
);

entry!(
    fn cuGreenCtxDestroy(h: Handle) {
        let d = driver()?;
        let (ctx, device) = {
            let st = d.lock();
            let g = green(&st, h)?;
            (g.ctx, g.device)
        };
        // As cuCtxDestroy, once the context's work is done.
        let tail = d.lock().ctx_tail(ctx);
        d.client.wait(tail)?;
        let callbacks = {
            let mut st = d.lock();
            st.greens.remove(&id(h));
            st.destroy_context(&d.client, ctx)?
        };
        crate::state::run_storage_callbacks(callbacks);
        primary_release(device as CUdevice)
    }
);

entry!(
    fn cuCtxFromGreenCtx(out: *mut Handle, h: Handle) {
        if out.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let ctx = with_state(|_, st| Ok(green(st, h)?.ctx))?;
        put(out, handle(ctx))
    }
);

entry!(
    fn cuGreenCtxStreamCreate(out: *mut Handle, h: Handle, flags: c_uint, priority: c_int) {
        // "CU_STREAM_NON_BLOCKING must be specified."
        if flags != CU_STREAM_NON_BLOCKING {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        with_state(|d, st| {
            let ctx = green(st, h)?.ctx;
            // Priorities outside [greatest, least] = [-5, 0] are clamped, as for any stream.
            let s = st.create_stream(&d.client, ctx, flags, priority.clamp(-5, 0), false)?;
            put(out, handle(s))
        })
    }
);

/// The green context whose context `ctx` is, if any.
pub fn green_of(st: &crate::state::State, ctx: u64) -> Option<u64> {
    st.greens
        .iter()
        .find(|(_, g)| g.ctx == ctx)
        .map(|(&h, _)| h)
}

entry!(
    fn cuStreamGetGreenCtx(stream: Handle, out: *mut Handle) {
        with_state(|d, st| {
            // Special handles mean the calling thread's current context.
            let s = st.resolve_stream(&d.client, stream, false)?;
            let ctx = st.streams[&s].ctx;
            put(out, handle(green_of(st, ctx).unwrap_or(0)))
        })
    }
);

entry!(
    fn cuGreenCtxRecordEvent(h: Handle, event: Handle) {
        with_state(|d, st| {
            let g = green(st, h)?;
            let (ctx, device) = (g.ctx, g.device);
            // "hEvent and hCtx must be from the same primary context."
            let ev = st.events.get(&id(event)).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
            if st.contexts.get(&ev.ctx).map(|c| c.device) != Some(device) {
                return Err(CUDA_ERROR_INVALID_HANDLE);
            }
            // Not while a stream of the green context captures (that capture is invalidated).
            st.check_ctx_not_capturing(ctx)?;
            // "Captures in hEvent all the activities of the green context": every stream's.
            let tail = st.ctx_tail(ctx);
            let legacy = st.contexts[&ctx].legacy;
            crate::api_event::record_on(d, st, id(event), legacy, &tail)
        })
    }
);

entry!(
    fn cuGreenCtxWaitEvent(h: Handle, event: Handle) {
        with_state(|_, st| {
            let ctx = green(st, h)?.ctx;
            let ev = st.events.get(&id(event)).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
            let (record, captured) = (ev.record, ev.captured.as_ref().map(|c| c.graph));
            // Not with an event of a capture under way, nor while the green context captures.
            if let Some(graph) = captured.filter(|&g| st.capture_active(g)) {
                st.invalidate_capture(graph);
                return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
            }
            st.check_ctx_not_capturing(ctx)?;
            // "All future work submitted to green context hCtx" waits for the event's work.
            if let Some((stream, seq)) = record {
                let waits = &mut st.contexts.get_mut(&ctx).expect("a green context's").waits;
                match waits.iter_mut().find(|w| w.0 == stream) {
                    Some(w) => w.1 = w.1.max(seq),
                    None => waits.push((stream, seq)),
                }
            }
            Ok(())
        })
    }
);
