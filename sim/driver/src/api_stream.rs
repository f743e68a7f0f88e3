//! Streams: creation, ordering, synchronisation, host functions and stream capture.

use crate::api_graph::capture_node;
use crate::client::HostCall;
use crate::ffi::*;
use crate::state::{
    Capture, Graph, NodeKind, driver, exchange_capture_mode, thread_key, with_state,
};
use gpushare_sim_wire::Op;
use std::ffi::{c_int, c_uint, c_void};
use std::sync::atomic::{AtomicU64, Ordering};

fn create(ph: *mut Handle, flags: c_uint, priority: c_int) -> CuResult {
    if flags & !CU_STREAM_NON_BLOCKING != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    with_state(|d, st| {
        let ctx = st.current()?;
        // Priorities outside [greatest, least] = [-5, 0] are clamped, as documented.
        let s = st.create_stream(&d.client, ctx, flags, priority.clamp(-5, 0), false)?;
        put(ph, handle(s))
    })
}

entry!(
    fn cuStreamCreate(ph: *mut Handle, flags: c_uint) {
        create(ph, flags, 0)
    }
);

entry!(
    fn cuStreamCreateWithPriority(ph: *mut Handle, flags: c_uint, priority: c_int) {
        create(ph, flags, priority)
    }
);

fn destroy(h: Handle) -> CuResult {
    with_state(|d, st| {
        let s = id(h);
        match st.streams.get(&s) {
            Some(stream) if !stream.legacy && !st.per_thread.values().any(|&p| p == s) => {}
            _ => return Err(CUDA_ERROR_INVALID_HANDLE),
        }
        let ctx = st.streams.remove(&s).expect("checked above").ctx;
        if let Some(c) = st.contexts.get_mut(&ctx) {
            c.streams.retain(|&x| x != s);
        }
        d.client
            .send(&gpushare_sim_wire::Request::DestroyStream { stream: s })
    })
}

entry!(
    fn cuStreamDestroy(h: Handle) {
        destroy(h)
    }
);
entry!(
    fn cuStreamDestroy_v2(h: Handle) {
        destroy(h)
    }
);

entry_pt!(cuStreamSynchronize / cuStreamSynchronize_ptsz, |pt| fn(h: Handle) {
    let d = driver()?;
    let tail = {
        let mut st = d.lock();
        let s = st.resolve_stream(&d.client, h, pt)?;
        st.check_not_capturing(s)?;
        let seq = st.streams[&s].seq;
        if seq == 0 { vec![] } else { vec![(s, seq)] }
    };
    d.client.wait(tail)?;
    crate::api_memory::release_pools_at_sync()
});

entry_pt!(cuStreamQuery / cuStreamQuery_ptsz, |pt| fn(h: Handle) {
    let d = driver()?;
    let tail = {
        let mut st = d.lock();
        let s = st.resolve_stream(&d.client, h, pt)?;
        st.check_not_capturing(s)?;
        let seq = st.streams[&s].seq;
        if seq == 0 {
            return Ok(());
        }
        vec![(s, seq)]
    };
    match d.client.query(tail)?.first() {
        Some(Some(_)) => Ok(()),
        _ => Err(CUDA_ERROR_NOT_READY),
    }
});

entry_pt!(cuStreamWaitEvent / cuStreamWaitEvent_ptsz, |pt| fn(h: Handle, event: Handle, _flags: c_uint) {
    with_state(|d, st| {
        let s = st.resolve_stream(&d.client, h, pt)?;
        let ev = st.events.get(&id(event)).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if let Some(cap) = ev.captured.clone()
            && st.capture_active(cap.graph)
        {
            // A capture fork/join: the waiting stream follows the captured work.
            let stream = st.streams.get_mut(&s).expect("resolved stream exists");
            match stream.capture.as_mut() {
                Some(c) if c.graph == cap.graph => {
                    for n in cap.deps {
                        if !c.deps.contains(&n) {
                            c.deps.push(n);
                        }
                    }
                }
                Some(_) => return Err(CUDA_ERROR_STREAM_CAPTURE_ISOLATION),
                None => stream.capture = Some(cap),
            }
            return Ok(());
        }
        let wait = crate::api_event::wait_op(ev);
        if capture_node(st, s, NodeKind::EventWait { event: id(event) })? {
            return Ok(());
        }
        if let Some((op, deps)) = wait {
            st.submit(&d.client, s, op, &deps)?;
        }
        Ok(())
    })
});

entry_pt!(cuStreamGetPriority / cuStreamGetPriority_ptsz, |pt| fn(h: Handle, priority: *mut c_int) {
    with_state(|d, st| {
        let s = st.resolve_stream(&d.client, h, pt)?;
        put(priority, st.streams[&s].priority)
    })
});

entry_pt!(cuStreamGetFlags / cuStreamGetFlags_ptsz, |pt| fn(h: Handle, flags: *mut c_uint) {
    with_state(|d, st| {
        let s = st.resolve_stream(&d.client, h, pt)?;
        put(flags, st.streams[&s].flags)
    })
});

entry_pt!(cuStreamGetCtx / cuStreamGetCtx_ptsz, |pt| fn(h: Handle, ctx: *mut Handle) {
    with_state(|d, st| {
        let s = st.resolve_stream(&d.client, h, pt)?;
        put(ctx, handle(st.streams[&s].ctx))
    })
});

entry_pt!(cuStreamGetCtx_v2 / cuStreamGetCtx_v2_ptsz, |pt| fn(h: Handle, ctx: *mut Handle, green: *mut Handle) {
    with_state(|d, st| {
        let s = st.resolve_stream(&d.client, h, pt)?;
        let c = st.streams[&s].ctx;
        // A green context's stream: "the green context in pGreenCtx and the primary context of
        // the associated device in pCtx"; a regular context's: it, and NULL.
        let (regular, g) = match crate::api_green::green_of(st, c) {
            Some(g) => {
                let device = st.contexts[&c].device as usize;
                (st.primary[device].ctx.unwrap_or(0), g)
            }
            None => (c, 0),
        };
        put(ctx, handle(regular))?;
        if !green.is_null() {
            put(green, handle(g))?;
        }
        Ok(())
    })
});

entry_pt!(cuStreamGetDevice / cuStreamGetDevice_ptsz, |pt| fn(h: Handle, dev: *mut CUdevice) {
    with_state(|d, st| {
        let s = st.resolve_stream(&d.client, h, pt)?;
        put(dev, st.contexts[&st.streams[&s].ctx].device as CUdevice)
    })
});

entry_pt!(cuStreamGetId / cuStreamGetId_ptsz, |pt| fn(h: Handle, out: *mut u64) {
    with_state(|d, st| {
        let s = st.resolve_stream(&d.client, h, pt)?;
        put(out, s)
    })
});

/// Queue a host call on a stream (or into the graph it is capturing).
fn host_call(
    h: Handle,
    pt: bool,
    func: Option<HostFn>,
    call: impl FnOnce(u64) -> HostCall,
) -> CuResult {
    let f = func.ok_or(CUDA_ERROR_INVALID_VALUE)?;
    with_state(|d, st| {
        let s = st.resolve_stream(&d.client, h, pt)?;
        let call = call(s);
        if let HostCall::Func(_, data) = call
            && capture_node(st, s, NodeKind::Host { func: f, data })?
        {
            return Ok(());
        }
        // Registered before the submit, so it is there when the device asks for it.
        let key = (s, st.streams[&s].seq + 1);
        let calls = &d.client.host_calls;
        calls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, call);
        if let Err(e) = st.submit(&d.client, s, Op::HostFunc, &[]) {
            calls.lock().unwrap_or_else(|e| e.into_inner()).remove(&key);
            return Err(e);
        }
        Ok(())
    })
}

entry_pt!(cuLaunchHostFunc / cuLaunchHostFunc_ptsz, |pt| fn(h: Handle, func: CUhostFn, data: *mut c_void) {
    host_call(h, pt, func, |_| HostCall::Func(func.expect("checked"), data as usize))
});

entry_pt!(cuStreamAddCallback / cuStreamAddCallback_ptsz, |pt| fn(
    h: Handle,
    cb: CUstreamCallback,
    data: *mut c_void,
    flags: c_uint,
) {
    if flags != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let cb = cb.ok_or(CUDA_ERROR_INVALID_VALUE)?;
    // The callback receives the stream handle the application passed.
    host_call(h, pt, Some(noop_host_fn), |_| HostCall::Callback(cb, h as usize, data as usize))
});

/// Stand-in function pointer for callbacks, which carry their own signature in [`HostCall`].
unsafe extern "C" fn noop_host_fn(_: *mut c_void) {}

static CAPTURE_IDS: AtomicU64 = AtomicU64::new(1);

fn begin_capture(h: Handle, pt: bool, mode: CUstreamCaptureMode) -> CuResult {
    if !(CU_STREAM_CAPTURE_MODE_GLOBAL..=CU_STREAM_CAPTURE_MODE_RELAXED).contains(&mode) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    with_state(|d, st| {
        let s = st.resolve_stream(&d.client, h, pt)?;
        if st.streams[&s].legacy {
            return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        if st.streams[&s].capture.is_some() {
            return Err(CUDA_ERROR_ILLEGAL_STATE);
        }
        let graph = st.new_id();
        st.graphs.insert(graph, Graph::default());
        let cap = Capture {
            graph,
            id: CAPTURE_IDS.fetch_add(1, Ordering::Relaxed),
            deps: Vec::new(),
            invalidated: false,
            mode,
            thread: thread_key(),
        };
        st.streams.get_mut(&s).expect("resolved").capture = Some(cap);
        Ok(())
    })
}

// The original entry point (ABI 10000) captures in global mode.
entry_pt!(cuStreamBeginCapture / cuStreamBeginCapture_ptsz, |pt| fn(h: Handle) {
    begin_capture(h, pt, CU_STREAM_CAPTURE_MODE_GLOBAL)
});
entry_pt!(cuStreamBeginCapture_v2 / cuStreamBeginCapture_v2_ptsz, |pt| fn(h: Handle, mode: CUstreamCaptureMode) {
    begin_capture(h, pt, mode)
});

entry_pt!(cuStreamEndCapture / cuStreamEndCapture_ptsz, |pt| fn(h: Handle, graph: *mut Handle) {
    with_state(|d, st| {
        let s = st.resolve_stream(&d.client, h, pt)?;
        let cap = st.streams.get_mut(&s).expect("resolved").capture.take();
        let cap = cap.ok_or(CUDA_ERROR_ILLEGAL_STATE)?;
        for other in st.streams.values_mut() {
            if other.capture.as_ref().is_some_and(|c| c.graph == cap.graph) {
                other.capture = None;
            }
        }
        if cap.invalidated {
            st.graphs.remove(&cap.graph);
            put(graph, std::ptr::null_mut())?;
            return Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
        }
        put(graph, handle(cap.graph))
    })
});

/// The `CUstreamCaptureStatus` of a stream, and its capture's id and graph.
fn capture_status(h: Handle, pt: bool) -> CuResult<(CUstreamCaptureStatus, u64, u64)> {
    with_state(|d, st| {
        let s = st.resolve_stream(&d.client, h, pt)?;
        Ok(match &st.streams[&s].capture {
            None => (CU_STREAM_CAPTURE_STATUS_NONE, 0, 0),
            Some(c) if c.invalidated => (CU_STREAM_CAPTURE_STATUS_INVALIDATED, c.id, c.graph),
            Some(c) => (CU_STREAM_CAPTURE_STATUS_ACTIVE, c.id, c.graph),
        })
    })
}

entry_pt!(cuStreamIsCapturing / cuStreamIsCapturing_ptsz, |pt| fn(h: Handle, status: *mut CUstreamCaptureStatus) {
    put(status, capture_status(h, pt)?.0)
});

entry_pt!(cuStreamGetCaptureInfo_v2 / cuStreamGetCaptureInfo_v2_ptsz, |pt| fn(
    h: Handle,
    status: *mut CUstreamCaptureStatus,
    cap_id: *mut u64,
    graph: *mut Handle,
    deps: *mut *const Handle,
    num_deps: *mut usize,
) {
    capture_info(h, pt, status, cap_id, graph, deps, num_deps)
});

/// `cuStreamGetCaptureInfo`'s out-parameters (all but the status may be null).
fn capture_info(
    h: Handle,
    pt: bool,
    status: *mut CUstreamCaptureStatus,
    cap_id: *mut u64,
    graph: *mut Handle,
    deps: *mut *const Handle,
    num_deps: *mut usize,
) -> CuResult {
    let (s, i, g) = capture_status(h, pt)?;
    put(status, s)?;
    for (ptr, v) in [(cap_id, i)] {
        if !ptr.is_null() {
            put(ptr, v)?;
        }
    }
    if !graph.is_null() {
        put(graph, handle(g))?;
    }
    if !deps.is_null() {
        put(deps, std::ptr::null())?;
    }
    if !num_deps.is_null() {
        put(num_deps, 0)?;
    }
    Ok(())
}

entry_pt!(cuStreamGetCaptureInfo_v3 / cuStreamGetCaptureInfo_v3_ptsz, |pt| fn(
    h: Handle,
    status: *mut CUstreamCaptureStatus,
    cap_id: *mut u64,
    graph: *mut Handle,
    deps: *mut *const Handle,
    edges: *mut *const c_void,
    num_deps: *mut usize,
) {
    capture_info(h, pt, status, cap_id, graph, deps, num_deps)?;
    // Edges carry no data here (all default edges): a null array, as documented.
    if !edges.is_null() {
        put(edges, std::ptr::null())?;
    }
    Ok(())
});

entry!(
    fn cuThreadExchangeStreamCaptureMode(mode: *mut CUstreamCaptureMode) {
        driver()?;
        let new = get(mode)?;
        if !(CU_STREAM_CAPTURE_MODE_GLOBAL..=CU_STREAM_CAPTURE_MODE_RELAXED).contains(&new) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        put(mode, exchange_capture_mode(new))
    }
);
