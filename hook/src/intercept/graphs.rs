//! Graphs: a graph launch is gated as the launch of all its kernels.

use super::P;
use super::launch::gated_launches;
use crate::real;
use gpushare_cuda_abi::result::{CUDA_ERROR_NOT_INITIALIZED, CUDA_SUCCESS};
use gpushare_cuda_abi::types::{
    CU_GRAPH_NODE_TYPE_KERNEL, CUDA_GRAPH_INSTANTIATE_PARAMS, CUgraphNodeType, CUresult,
};
use std::collections::HashMap;
use std::ffi::c_char;
use std::sync::{Mutex, OnceLock};

/// Kernels of each executable graph instantiated in this process (exec handle → kernels).
fn graph_kernels() -> &'static Mutex<HashMap<usize, u64>> {
    static KERNELS: OnceLock<Mutex<HashMap<usize, u64>>> = OnceLock::new();
    KERNELS.get_or_init(Default::default)
}

/// The kernel nodes of `graph` (at least 1: a graph of other nodes counts as one launch).
fn kernel_nodes(graph: P) -> u64 {
    let (Some(get_nodes), Some(node_type)) = (real::cuGraphGetNodes(), real::cuGraphNodeGetType())
    else {
        return 1;
    };
    let mut n = 0usize;
    // SAFETY: real driver calls; the node array has room for the count the driver reported.
    unsafe {
        if get_nodes(graph, std::ptr::null_mut(), &mut n) != CUDA_SUCCESS || n == 0 {
            return 1;
        }
        let mut nodes = vec![std::ptr::null_mut(); n];
        if get_nodes(graph, nodes.as_mut_ptr(), &mut n) != CUDA_SUCCESS {
            return 1;
        }
        let kernels = nodes[..n.min(nodes.len())]
            .iter()
            .filter(|&&node| {
                let mut t: CUgraphNodeType = CUgraphNodeType::MAX;
                node_type(node, &mut t) == CUDA_SUCCESS && t == CU_GRAPH_NODE_TYPE_KERNEL
            })
            .count();
        kernels.max(1) as u64
    }
}

/// Run an instantiation; on success remember the executable graph's kernel count.
fn instantiated(exec: *mut P, graph: P, call: impl FnOnce() -> Option<CUresult>) -> CUresult {
    let r = call().unwrap_or(CUDA_ERROR_NOT_INITIALIZED);
    if r == CUDA_SUCCESS && !exec.is_null() {
        // SAFETY: the driver just wrote the new executable graph through this out-pointer.
        let e = unsafe { *exec } as usize;
        let kernels = kernel_nodes(graph);
        graph_kernels()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(e, kernels);
    }
    r
}

/// Launch the executable graph `exec` into `stream` (a `_ptsz` entry point's if `per_thread`)
/// through the gate, as the launch of its kernels.
fn graph_launch(
    exec: P,
    stream: P,
    per_thread: bool,
    launch: impl FnOnce() -> Option<CUresult>,
) -> CUresult {
    let kernels = graph_kernels()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&(exec as usize))
        .copied()
        .unwrap_or(1);
    gated_launches(Some((stream, per_thread)), kernels, launch)
}

hooked! {
    fn cuGraphInstantiate(e: *mut P, g: P, err: *mut P, log: *mut c_char, n: usize) |real| {
        instantiated(e, g, real)
    }
    fn cuGraphInstantiate_v2(e: *mut P, g: P, err: *mut P, log: *mut c_char, n: usize) |real| {
        instantiated(e, g, real)
    }
    fn cuGraphInstantiateWithFlags(e: *mut P, g: P, flags: u64) |real| {
        instantiated(e, g, real)
    }
    fn cuGraphInstantiateWithParams(e: *mut P, g: P, params: *mut CUDA_GRAPH_INSTANTIATE_PARAMS)
        |real| {
        instantiated(e, g, real)
    }
    fn cuGraphInstantiateWithParams_ptsz(e: *mut P, g: P,
        params: *mut CUDA_GRAPH_INSTANTIATE_PARAMS) |real| {
        instantiated(e, g, real)
    }
    fn cuGraphExecDestroy(exec: P) |real| {
        graph_kernels()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(exec as usize));
        real().unwrap_or(CUDA_ERROR_NOT_INITIALIZED)
    }
    fn cuGraphLaunch(exec: P, stream: P) |real| { graph_launch(exec, stream, false, real) }
    fn cuGraphLaunch_ptsz(exec: P, stream: P) |real| { graph_launch(exec, stream, true, real) }
}
