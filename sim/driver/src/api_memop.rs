//! Stream memory operations (`cuStreamWaitValue32/64`, `cuStreamWriteValue32/64`,
//! `cuStreamBatchMemOp`), which the device reports it supports (`CAN_USE_STREAM_MEM_OPS_V1`,
//! `..._64_BIT_...`, `..._WAIT_VALUE_NOR...`): libraries such as cuBLASLt look them up by name.
//!
//! A write stores its value as a memset does, when called, or as memset nodes of the graph a
//! capturing stream builds. A wait holds the stream until the word satisfies its condition; on
//! the simulated device only kernels could change a word behind the host's back, and they do
//! not execute, so a wait is taken as satisfied once the stream's earlier work is done (the
//! stream's own order): the memory a real program waits on is written by a kernel or another
//! stream before it, which is that order.

use crate::api_graph::capture_node;
use crate::api_memory::{check_dev, memset_checked};
use crate::ffi::*;
use crate::state::{NodeKind, State, with_state};
use std::ffi::{c_uint, c_void};

/// One `CUstreamBatchMemOpParams` as cuda.h declares the union: the operation, then for waits
/// and writes the address at 8, the value at 16 and the flags at 24 (48 bytes in all).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BatchMemOp {
    operation: CUstreamBatchMemOpType,
    _pad: u32,
    address: u64,
    value: u64,
    flags: u32,
    _rest: [u32; 5],
}
const _: () = assert!(std::mem::size_of::<BatchMemOp>() == 48);

/// What one operation does, checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MemOp {
    Wait,
    Write {
        address: u64,
        value: u64,
        wide: bool,
    },
    Barrier,
}

/// Check a wait on the `wide` (8-byte) or 4-byte word at `address` with `flags`.
fn wait(st: &State, address: u64, wide: bool, flags: u32) -> CuResult<MemOp> {
    let condition = flags & !CU_STREAM_WAIT_VALUE_FLUSH;
    let size = if wide { 8 } else { 4 };
    // CU_STREAM_WAIT_VALUE_FLUSH needs CAN_FLUSH_REMOTE_WRITES, which the device reports 0.
    if condition > CU_STREAM_WAIT_VALUE_NOR
        || flags & CU_STREAM_WAIT_VALUE_FLUSH != 0
        || !address.is_multiple_of(size)
    {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    check_dev(st, address, size as usize)?;
    Ok(MemOp::Wait)
}

/// Check a write of `value` to the `wide` or 4-byte word at `address` with `flags`.
fn write(st: &State, address: u64, value: u64, wide: bool, flags: u32) -> CuResult<MemOp> {
    let size = if wide { 8 } else { 4 };
    if flags & !CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER != 0 || !address.is_multiple_of(size) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    check_dev(st, address, size as usize)?;
    Ok(MemOp::Write {
        address,
        value,
        wide,
    })
}

/// Queue checked operations on `stream` (or into the graph it captures), in order.
fn submit(st: &mut State, stream: u64, ops: &[MemOp]) -> CuResult {
    for &op in ops {
        let MemOp::Write {
            address,
            value,
            wide,
        } = op
        else {
            capture_node(st, stream, NodeKind::Empty)?;
            continue;
        };
        let words: &[(u64, u32)] = if wide {
            &[(address, value as u32), (address + 4, (value >> 32) as u32)]
        } else {
            &[(address, value as u32)]
        };
        for &(dst, value) in words {
            let node = NodeKind::Memset {
                dst,
                value,
                element_size: 4,
                width: 1,
                height: 1,
                pitch: 0,
            };
            if !capture_node(st, stream, node)? {
                memset_checked(st, dst, value, 4, 1, 1, 0)?;
            }
        }
    }
    Ok(())
}

/// One operation on `stream`, checked by `check` with the state in hand.
fn single(stream: Handle, pt: bool, check: impl FnOnce(&State) -> CuResult<MemOp>) -> CuResult {
    with_state(|d, st| {
        let s = st.resolve_stream(&d.client, stream, pt)?;
        let op = check(st)?;
        submit(st, s, &[op])
    })
}

entry_pt!(cuStreamWaitValue32 / cuStreamWaitValue32_ptsz, |pt| fn(
    stream: Handle,
    address: CUdeviceptr,
    _value: cuuint32_t,
    flags: c_uint,
) {
    single(stream, pt, |st| wait(st, address, false, flags))
});

entry_pt!(cuStreamWaitValue32_v2 / cuStreamWaitValue32_v2_ptsz, |pt| fn(
    stream: Handle,
    address: CUdeviceptr,
    _value: cuuint32_t,
    flags: c_uint,
) {
    single(stream, pt, |st| wait(st, address, false, flags))
});

entry_pt!(cuStreamWaitValue64 / cuStreamWaitValue64_ptsz, |pt| fn(
    stream: Handle,
    address: CUdeviceptr,
    _value: cuuint64_t,
    flags: c_uint,
) {
    single(stream, pt, |st| wait(st, address, true, flags))
});

entry_pt!(cuStreamWaitValue64_v2 / cuStreamWaitValue64_v2_ptsz, |pt| fn(
    stream: Handle,
    address: CUdeviceptr,
    _value: cuuint64_t,
    flags: c_uint,
) {
    single(stream, pt, |st| wait(st, address, true, flags))
});

entry_pt!(cuStreamWriteValue32 / cuStreamWriteValue32_ptsz, |pt| fn(
    stream: Handle,
    address: CUdeviceptr,
    value: cuuint32_t,
    flags: c_uint,
) {
    single(stream, pt, |st| write(st, address, value as u64, false, flags))
});

entry_pt!(cuStreamWriteValue32_v2 / cuStreamWriteValue32_v2_ptsz, |pt| fn(
    stream: Handle,
    address: CUdeviceptr,
    value: cuuint32_t,
    flags: c_uint,
) {
    single(stream, pt, |st| write(st, address, value as u64, false, flags))
});

entry_pt!(cuStreamWriteValue64 / cuStreamWriteValue64_ptsz, |pt| fn(
    stream: Handle,
    address: CUdeviceptr,
    value: cuuint64_t,
    flags: c_uint,
) {
    single(stream, pt, |st| write(st, address, value as u64, true, flags))
});

entry_pt!(cuStreamWriteValue64_v2 / cuStreamWriteValue64_v2_ptsz, |pt| fn(
    stream: Handle,
    address: CUdeviceptr,
    value: cuuint64_t,
    flags: c_uint,
) {
    single(stream, pt, |st| write(st, address, value as u64, true, flags))
});

/// `cuStreamBatchMemOp`: every operation is checked before any is queued ("count" at most 256,
/// flags 0, as documented).
fn batch(stream: Handle, pt: bool, count: c_uint, ops: *mut c_void, flags: c_uint) -> CuResult {
    if flags != 0 || count == 0 || count > 256 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let params = slice(ops as *const BatchMemOp, count as usize)?;
    with_state(|d, st| {
        let s = st.resolve_stream(&d.client, stream, pt)?;
        let checked = params
            .iter()
            .map(|p| match p.operation {
                CU_STREAM_MEM_OP_WAIT_VALUE_32 => wait(st, p.address, false, p.flags),
                CU_STREAM_MEM_OP_WAIT_VALUE_64 => wait(st, p.address, true, p.flags),
                CU_STREAM_MEM_OP_WRITE_VALUE_32 => {
                    write(st, p.address, p.value & 0xffff_ffff, false, p.flags)
                }
                CU_STREAM_MEM_OP_WRITE_VALUE_64 => write(st, p.address, p.value, true, p.flags),
                CU_STREAM_MEM_OP_BARRIER => Ok(MemOp::Barrier),
                // Needs CAN_FLUSH_REMOTE_WRITES, which the device reports 0.
                _ => Err(CUDA_ERROR_NOT_SUPPORTED),
            })
            .collect::<CuResult<Vec<_>>>()?;
        submit(st, s, &checked)
    })
}

entry_pt!(cuStreamBatchMemOp / cuStreamBatchMemOp_ptsz, |pt| fn(
    stream: Handle,
    count: c_uint,
    ops: *mut c_void,
    flags: c_uint,
) {
    batch(stream, pt, count, ops, flags)
});

entry_pt!(cuStreamBatchMemOp_v2 / cuStreamBatchMemOp_v2_ptsz, |pt| fn(
    stream: Handle,
    count: c_uint,
    ops: *mut c_void,
    flags: c_uint,
) {
    batch(stream, pt, count, ops, flags)
});
