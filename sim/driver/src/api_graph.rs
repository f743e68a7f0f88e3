//! CUDA graphs: built by stream capture or node by node, instantiated into a fixed node list,
//! and launched as ordinary stream work (nodes in dependency order on the launch stream).

use crate::api_launch::{check_dims, copy_args, kernel_arg0};
use crate::api_memory::{copy_checked, memset_checked};
use crate::client::HostCall;
use crate::ffi::*;
use crate::state::{
    Exec, Graph, KernelLaunch, NodeKind, State, UserObject, run_user_object_destructors, with_state,
};
use gpushare_sim_wire::Op;
use std::ffi::{c_char, c_uint, c_void};

/// If `stream` is capturing, append `kind` after the capture's frontier and report `true`.
pub fn capture_node(st: &mut State, stream: u64, kind: NodeKind) -> CuResult<bool> {
    let Some(cap) = st.streams.get(&stream).and_then(|s| s.capture.clone()) else {
        return Ok(false);
    };
    if cap.invalidated {
        return Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    }
    let g = st
        .graphs
        .get_mut(&cap.graph)
        .ok_or(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)?;
    g.nodes.push(kind);
    let idx = g.nodes.len() - 1;
    let c = st.streams.get_mut(&stream).and_then(|s| s.capture.as_mut());
    c.expect("capturing stream").deps = vec![idx];
    Ok(true)
}

entry!(
    fn cuGraphCreate(ph: *mut Handle, flags: c_uint) {
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        with_state(|_, st| {
            let g = st.new_id();
            st.graphs.insert(g, Graph::default());
            put(ph, handle(g))
        })
    }
);

entry!(
    fn cuGraphDestroy(h: Handle) {
        let due = with_state(|_, st| {
            let g = st.graphs.remove(&id(h)).ok_or(CUDA_ERROR_INVALID_VALUE)?;
            st.graph_nodes.retain(|_, (g, _)| *g != id(h));
            Ok(release_refs(st, &g.user_refs))
        })?;
        run_user_object_destructors(due);
        Ok(())
    }
);

/// Add a node to a graph after the given dependency nodes; returns the new node's handle.
fn add_node(
    st: &mut State,
    graph: Handle,
    deps: *const Handle,
    n: usize,
    kind: NodeKind,
) -> CuResult<Handle> {
    for h in slice(deps, n)? {
        if !matches!(st.graph_nodes.get(&id(*h)), Some(&(g, _)) if g == id(graph)) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
    }
    let g = st
        .graphs
        .get_mut(&id(graph))
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    g.nodes.push(kind);
    let idx = g.nodes.len() - 1;
    let node = st.new_id();
    st.graph_nodes.insert(node, (id(graph), idx));
    Ok(handle(node))
}

/// A kernel node of `p`. Arguments are copied when the node is created, as the driver
/// documents.
fn kernel_node(st: &State, p: &CUDA_KERNEL_NODE_PARAMS_v1) -> CuResult<NodeKind> {
    let grid = [p.gridDimX, p.gridDimY, p.gridDimZ];
    let block = [p.blockDimX, p.blockDimY, p.blockDimZ];
    check_dims(grid, block)?;
    let function = id(p.func);
    let arg0 = kernel_arg0(st, function, p.kernelParams, p.extra)?;
    let args = copy_args(st, function, p.kernelParams, p.extra)?;
    Ok(NodeKind::Kernel {
        function,
        arg0,
        launch: Box::new(KernelLaunch::new(grid, block, p.sharedMemBytes, args)),
    })
}

fn add_kernel_node(
    out: *mut Handle,
    graph: Handle,
    deps: *const Handle,
    n: usize,
    p: *const CUDA_KERNEL_NODE_PARAMS_v1,
) -> CuResult {
    let p = get(p)?;
    with_state(|_, st| {
        let node = add_node(st, graph, deps, n, kernel_node(st, &p)?)?;
        put(out, node)
    })
}

entry!(
    fn cuGraphAddKernelNode(
        out: *mut Handle,
        graph: Handle,
        deps: *const Handle,
        n: usize,
        p: *const CUDA_KERNEL_NODE_PARAMS_v1,
    ) {
        add_kernel_node(out, graph, deps, n, p)
    }
);
entry!(
    fn cuGraphAddKernelNode_v2(
        out: *mut Handle,
        graph: Handle,
        deps: *const Handle,
        n: usize,
        p: *const CUDA_KERNEL_NODE_PARAMS,
    ) {
        // v1 is a prefix of v2 (the same members at the same offsets).
        add_kernel_node(out, graph, deps, n, p.cast())
    }
);

entry!(
    fn cuGraphAddEmptyNode(out: *mut Handle, graph: Handle, deps: *const Handle, n: usize) {
        with_state(|_, st| put(out, add_node(st, graph, deps, n, NodeKind::Empty)?))
    }
);

entry!(
    fn cuGraphAddMemsetNode(
        out: *mut Handle,
        graph: Handle,
        deps: *const Handle,
        n: usize,
        p: *const CUDA_MEMSET_NODE_PARAMS,
        _ctx: Handle,
    ) {
        let p = get(p)?;
        if ![1, 2, 4].contains(&p.elementSize) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let kind = NodeKind::Memset {
            dst: p.dst,
            value: p.value,
            element_size: p.elementSize,
            width: p.width,
            height: p.height.max(1),
            pitch: p.pitch,
        };
        with_state(|_, st| put(out, add_node(st, graph, deps, n, kind)?))
    }
);

entry!(
    fn cuGraphAddHostNode(
        out: *mut Handle,
        graph: Handle,
        deps: *const Handle,
        n: usize,
        p: *const CUDA_HOST_NODE_PARAMS,
    ) {
        let p = get(p)?;
        let func = p.fn_.ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let kind = NodeKind::Host {
            func,
            data: p.userData as usize,
        };
        with_state(|_, st| put(out, add_node(st, graph, deps, n, kind)?))
    }
);

entry!(
    fn cuGraphGetNodes(graph: Handle, nodes: *mut Handle, count: *mut usize) {
        with_state(|_, st| {
            let g = st.graphs.get(&id(graph)).ok_or(CUDA_ERROR_INVALID_VALUE)?;
            let total = g.nodes.len();
            if nodes.is_null() {
                return put(count, total);
            }
            let want = get(count)?.min(total);
            for idx in 0..want {
                let existing = st
                    .graph_nodes
                    .iter()
                    .find(|(_, v)| **v == (id(graph), idx))
                    .map(|(k, _)| *k);
                let node = match existing {
                    Some(n) => n,
                    None => {
                        let n = st.new_id();
                        st.graph_nodes.insert(n, (id(graph), idx));
                        n
                    }
                };
                put(nodes.wrapping_add(idx), handle(node))?;
            }
            put(count, want)
        })
    }
);

fn instantiate_flags(out: *mut Handle, graph: Handle, flags: u64) -> CuResult {
    with_state(|_, st| {
        let g = st.graphs.get(&id(graph)).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let exec = Exec {
            nodes: g.nodes.clone(),
            flags,
            user_refs: g.user_refs.clone(),
        };
        // The executable graph holds its own references to the graph's user objects.
        for &(obj, n) in &exec.user_refs {
            if let Some(o) = st.user_objects.get_mut(&obj) {
                o.refs += n;
            }
        }
        let e = st.new_id();
        st.execs.insert(e, exec);
        put(out, handle(e))
    })
}

fn instantiate(out: *mut Handle, graph: Handle) -> CuResult {
    instantiate_flags(out, graph, 0)
}

/// Drop the user-object references `refs` held, running destructors that come due.
fn release_refs(st: &mut State, refs: &[(u64, u32)]) -> Vec<(HostFn, usize)> {
    refs.iter()
        .filter_map(|&(obj, n)| st.release_user_object(obj, n).ok().flatten())
        .collect()
}

entry!(
    fn cuGraphInstantiateWithFlags(out: *mut Handle, graph: Handle, flags: u64) {
        instantiate_flags(out, graph, flags)
    }
);

entry!(
    fn cuGraphExecGetFlags(exec: Handle, flags: *mut u64) {
        let f = with_state(|_, st| {
            st.execs
                .get(&id(exec))
                .map(|e| e.flags)
                .ok_or(CUDA_ERROR_INVALID_VALUE)
        })?;
        put(flags, f)
    }
);

entry!(
    fn cuUserObjectCreate(
        out: *mut Handle,
        ptr: *mut c_void,
        destroy: Option<HostFn>,
        initial_refs: c_uint,
        flags: c_uint,
    ) {
        // CU_USER_OBJECT_NO_DESTRUCTOR_SYNC = 1 is the only flag and is required.
        let destroy = destroy.ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if initial_refs == 0 || flags != 1 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        with_state(|_, st| {
            let h = st.new_id();
            st.user_objects.insert(
                h,
                UserObject {
                    refs: initial_refs,
                    ptr: ptr as usize,
                    destroy,
                },
            );
            put(out, handle(h))
        })
    }
);

entry!(
    fn cuUserObjectRetain(obj: Handle, count: c_uint) {
        with_state(|_, st| {
            let o = st
                .user_objects
                .get_mut(&id(obj))
                .ok_or(CUDA_ERROR_INVALID_VALUE)?;
            if count == 0 {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            o.refs += count;
            Ok(())
        })
    }
);

entry!(
    fn cuUserObjectRelease(obj: Handle, count: c_uint) {
        let due = with_state(|_, st| st.release_user_object(id(obj), count))?;
        run_user_object_destructors(due.into_iter().collect());
        Ok(())
    }
);

entry!(
    fn cuGraphRetainUserObject(graph: Handle, obj: Handle, count: c_uint, flags: c_uint) {
        // CU_GRAPH_USER_OBJECT_MOVE = 1: the caller's references move to the graph.
        if count == 0 || flags & !1 != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        with_state(|_, st| {
            let o = st
                .user_objects
                .get_mut(&id(obj))
                .ok_or(CUDA_ERROR_INVALID_VALUE)?;
            if flags & 1 == 0 {
                o.refs += count;
            }
            let g = st
                .graphs
                .get_mut(&id(graph))
                .ok_or(CUDA_ERROR_INVALID_VALUE)?;
            match g.user_refs.iter_mut().find(|(h, _)| *h == id(obj)) {
                Some((_, n)) => *n += count,
                None => g.user_refs.push((id(obj), count)),
            }
            Ok(())
        })
    }
);

entry!(
    fn cuGraphReleaseUserObject(graph: Handle, obj: Handle, count: c_uint) {
        let due = with_state(|_, st| {
            let g = st
                .graphs
                .get_mut(&id(graph))
                .ok_or(CUDA_ERROR_INVALID_VALUE)?;
            let held = g.user_refs.iter_mut().find(|(h, _)| *h == id(obj));
            match held {
                Some((_, n)) if *n >= count && count > 0 => *n -= count,
                _ => return Err(CUDA_ERROR_INVALID_VALUE),
            }
            g.user_refs.retain(|(_, n)| *n > 0);
            st.release_user_object(id(obj), count)
        })?;
        run_user_object_destructors(due.into_iter().collect());
        Ok(())
    }
);

/// `cuGraphInstantiate` with an error-node and a log out-parameter (ABI versions 10000, 11000).
fn instantiate_with_log(out: *mut Handle, graph: Handle, err_node: *mut Handle) -> CuResult {
    if !err_node.is_null() {
        put(err_node, std::ptr::null_mut())?;
    }
    instantiate(out, graph)
}

entry!(
    fn cuGraphInstantiate(
        out: *mut Handle,
        graph: Handle,
        err_node: *mut Handle,
        _log: *mut c_char,
        _log_size: usize,
    ) {
        instantiate_with_log(out, graph, err_node)
    }
);

entry!(
    fn cuGraphInstantiate_v2(
        out: *mut Handle,
        graph: Handle,
        err_node: *mut Handle,
        _log: *mut c_char,
        _log_size: usize,
    ) {
        instantiate_with_log(out, graph, err_node)
    }
);

entry_pt!(cuGraphInstantiateWithParams / cuGraphInstantiateWithParams_ptsz, |_pt| fn(
    out: *mut Handle,
    graph: Handle,
    params: *mut CUDA_GRAPH_INSTANTIATE_PARAMS,
) {
    let r = instantiate(out, graph);
    if !params.is_null() {
        // SAFETY: non-null pointer to the caller's params struct; we write its result field.
        unsafe {
            (*params).result_out = if r.is_ok() {
                CUDA_GRAPH_INSTANTIATE_SUCCESS
            } else {
                CUDA_GRAPH_INSTANTIATE_ERROR
            }
        };
    }
    r
});

entry!(
    fn cuGraphExecDestroy(h: Handle) {
        let due = with_state(|_, st| {
            let e = st.execs.remove(&id(h)).ok_or(CUDA_ERROR_INVALID_VALUE)?;
            Ok(release_refs(st, &e.user_refs))
        })?;
        run_user_object_destructors(due);
        Ok(())
    }
);

entry_pt!(cuGraphUpload / cuGraphUpload_ptsz, |pt| fn(exec: Handle, stream: Handle) {
    with_state(|d, st| {
        st.resolve_stream(&d.client, stream, pt)?;
        st.execs.contains_key(&id(exec)).then_some(()).ok_or(CUDA_ERROR_INVALID_VALUE)
    })
});

entry_pt!(cuGraphLaunch / cuGraphLaunch_ptsz, |pt| fn(exec: Handle, stream: Handle) {
    with_state(|d, st| {
        let s = st.resolve_stream(&d.client, stream, pt)?;
        let nodes = st.execs.get(&id(exec)).ok_or(CUDA_ERROR_INVALID_VALUE)?.nodes.clone();
        if st.streams[&s].capture.is_some() {
            return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        // Nodes only depend on earlier nodes, so index order is a dependency order.
        for node in nodes {
            match node {
                NodeKind::Empty => {}
                NodeKind::Kernel { function, arg0, .. } => {
                    st.submit(&d.client, s, Op::Kernel { function, arg0 }, &[])?;
                }
                NodeKind::Memset { dst, value, element_size, width, height, pitch } => {
                    memset_checked(st, dst, value, element_size, width, height, pitch)?;
                }
                NodeKind::Memcpy { dst, src, len } => copy_checked(st, dst, src, len)?,
                NodeKind::Host { func, data } => {
                    let key = (s, st.streams[&s].seq + 1);
                    let calls = &d.client.host_calls;
                    calls.lock().unwrap_or_else(|e| e.into_inner()).insert(key, HostCall::Func(func, data));
                    st.submit(&d.client, s, Op::HostFunc, &[])?;
                }
                NodeKind::EventWait { event } => {
                    if let Some((op, deps)) = st.events.get(&event).and_then(crate::api_event::wait_op) {
                        st.submit(&d.client, s, op, &deps)?;
                    }
                }
            }
        }
        Ok(())
    })
});

entry!(
    fn cuGraphNodeGetType(node: Handle, ty: *mut c_uint) {
        with_state(|_, st| {
            let &(g, i) = st
                .graph_nodes
                .get(&id(node))
                .ok_or(CUDA_ERROR_INVALID_VALUE)?;
            let kind = &st.graphs.get(&g).ok_or(CUDA_ERROR_INVALID_VALUE)?.nodes[i];
            // CUgraphNodeType values from cuda.h.
            let t = match kind {
                NodeKind::Kernel { .. } => 0,
                NodeKind::Memcpy { .. } => 1,
                NodeKind::Memset { .. } => 2,
                NodeKind::Host { .. } => 3,
                NodeKind::Empty => 5,
                NodeKind::EventWait { .. } => 6,
            };
            put(ty, t)
        })
    }
);

/// The graph and index of a node handle.
fn node_at(st: &State, node: Handle) -> CuResult<(u64, usize)> {
    st.graph_nodes
        .get(&id(node))
        .copied()
        .ok_or(CUDA_ERROR_INVALID_VALUE)
}

/// Fill `out` with a kernel node's parameters; the argument array stays valid as long as the
/// node is unchanged, as the driver documents.
fn kernel_node_params(kind: &NodeKind, out: *mut CUDA_KERNEL_NODE_PARAMS_v1) -> CuResult {
    let NodeKind::Kernel {
        function, launch, ..
    } = kind
    else {
        return Err(CUDA_ERROR_INVALID_VALUE);
    };
    let [gx, gy, gz] = launch.grid;
    let [bx, by, bz] = launch.block;
    put(
        out,
        CUDA_KERNEL_NODE_PARAMS_v1 {
            func: handle(*function),
            gridDimX: gx,
            gridDimY: gy,
            gridDimZ: gz,
            blockDimX: bx,
            blockDimY: by,
            blockDimZ: bz,
            sharedMemBytes: launch.shared,
            kernelParams: launch.arg_ptrs.as_ptr() as *mut *mut c_void,
            extra: std::ptr::null_mut(),
        },
    )
}

entry!(
    fn cuGraphKernelNodeGetParams(node: Handle, out: *mut CUDA_KERNEL_NODE_PARAMS_v1) {
        with_state(|_, st| {
            let (g, i) = node_at(st, node)?;
            kernel_node_params(
                &st.graphs.get(&g).ok_or(CUDA_ERROR_INVALID_VALUE)?.nodes[i],
                out,
            )
        })
    }
);

entry!(
    fn cuGraphKernelNodeGetParams_v2(node: Handle, out: *mut CUDA_KERNEL_NODE_PARAMS) {
        // The v1 record is a prefix of v2's; v2's own members (context, kernel) stay as given.
        with_state(|_, st| {
            let (g, i) = node_at(st, node)?;
            kernel_node_params(
                &st.graphs.get(&g).ok_or(CUDA_ERROR_INVALID_VALUE)?.nodes[i],
                out.cast(),
            )
        })
    }
);

/// `cuGraphExecKernelNodeSetParams`: the executable graph's copy of the node takes the new
/// parameters ("the node must be a kernel node of the graph the executable was instantiated
/// from, and the function's context must not change"); the graph itself is unchanged.
fn exec_set_kernel(exec: Handle, node: Handle, p: *const CUDA_KERNEL_NODE_PARAMS_v1) -> CuResult {
    let p = get(p)?;
    with_state(|_, st| {
        let (_, i) = node_at(st, node)?;
        let kind = kernel_node(st, &p)?;
        let e = st
            .execs
            .get_mut(&id(exec))
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        match e.nodes.get_mut(i) {
            Some(slot @ NodeKind::Kernel { .. }) => {
                *slot = kind;
                Ok(())
            }
            _ => Err(CUDA_ERROR_INVALID_VALUE),
        }
    })
}

entry!(
    fn cuGraphExecKernelNodeSetParams(
        exec: Handle,
        node: Handle,
        p: *const CUDA_KERNEL_NODE_PARAMS_v1,
    ) {
        exec_set_kernel(exec, node, p)
    }
);

entry!(
    fn cuGraphExecKernelNodeSetParams_v2(
        exec: Handle,
        node: Handle,
        p: *const CUDA_KERNEL_NODE_PARAMS,
    ) {
        exec_set_kernel(exec, node, p.cast())
    }
);
