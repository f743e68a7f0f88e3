//! CUDA 12.9 driver ABI tables shared by the simulated driver and the GPU
//! sharing hook.
//!
//! The data lives in [`generated`], [`types`] and [`functions`], produced by
//! `scripts/gen_cuda_abi.py` from the real `cuda.h`/`cudaTypedefs.h`:
//!
//! * [`types`]: cuda.h's typedefs (handles, enums, callbacks), every enumerator and
//!   `#define` constant, and the records the code reads (`#[repr(C)]`, layout checked).
//! * [`functions`]: `PFN_<symbol>`, the function-pointer type of every exported driver
//!   symbol, also as [`pfn`]`::<symbol>` for macros.
//!
//! An exported entry point (the hook's wrappers, the simulator's functions) is checked against
//! cuda.h by coercing it to its symbol's type, which only builds if every parameter matches:
//!
//! ```
//! use gpushare_cuda_abi::pfn;
//! use gpushare_cuda_abi::types::{CUdeviceptr, CUresult};
//!
//! extern "C" fn cuMemAlloc_v2(_dptr: *mut CUdeviceptr, _bytesize: usize) -> CUresult {
//!     0
//! }
//! const _: pfn::cuMemAlloc_v2 = cuMemAlloc_v2;
//! ```
//!
//! while one typed otherwise (here `size_t` as 32 bits) does not:
//!
//! ```compile_fail
//! use gpushare_cuda_abi::pfn;
//!
//! extern "C" fn cuMemAlloc_v2(_dptr: *mut u64, _bytesize: u32) -> u32 {
//!     0
//! }
//! const _: pfn::cuMemAlloc_v2 = cuMemAlloc_v2;
//! ```
//!
//! The modules here add lookups on top:
//!
//! * [`proc_address`]: `cuGetProcAddress` resolution ([`resolve`]).
//! * [`errors`]: `CUresult` names/descriptions, also as static C strings.
//! * [`arrays`]: array descriptors and their size in memory.
//! * [`device_attributes`]: `CUdevice_attribute` names.

pub mod arrays;
pub mod device_attributes;
pub mod errors;
#[rustfmt::skip]
pub mod functions;
#[rustfmt::skip]
pub mod generated;
#[cfg(test)]
mod headers;
pub mod proc_address;
#[rustfmt::skip]
pub mod types;

pub use device_attributes::{device_attribute_name, device_attribute_value};
pub use errors::{error_name, error_name_cstr, error_string, error_string_cstr};
pub use functions::pfn;
pub use generated::{
    DEVICE_ATTRIBUTES, ENTRY_POINTS, ERROR_CSTRS, ERRORS, HEADER_CUDA_VERSION, SYMBOLS, result,
};
pub use proc_address::{
    CU_GET_PROC_ADDRESS_DEFAULT, CU_GET_PROC_ADDRESS_LEGACY_STREAM,
    CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, EntryPoint, Resolution, entry_points, resolve,
    symbols,
};
