//! Multicast objects (`cuMulticast*`, NVLink SHARP through an NVSwitch). The simulated GPUs
//! report `CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED` 0, so, as the driver documents for such
//! devices, every call answers `CUDA_ERROR_NOT_SUPPORTED` after checking its arguments. The
//! entry points exist because programs look them all up at start (PyTorch's driver table
//! does, and a failed lookup leaves an error behind in the CUDA runtime).

use crate::ffi::*;
use crate::state::driver;
use std::ffi::c_void;

fn unsupported() -> CuResult {
    driver()?;
    Err(CUDA_ERROR_NOT_SUPPORTED)
}

entry!(
    fn cuMulticastCreate(out: *mut u64, prop: *const c_void) {
        if out.is_null() || prop.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        unsupported()
    }
);

entry!(
    fn cuMulticastGetGranularity(
        gran: *mut usize,
        prop: *const c_void,
        _option: CUmulticastGranularity_flags,
    ) {
        if gran.is_null() || prop.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        unsupported()
    }
);

entry!(
    fn cuMulticastAddDevice(_mc: u64, dev: CUdevice) {
        driver()?.check_device(dev)?;
        unsupported()
    }
);

entry!(
    fn cuMulticastBindMem(
        _mc: u64,
        _mc_offset: usize,
        _mem: u64,
        _mem_offset: usize,
        _size: usize,
        _flags: u64,
    ) {
        unsupported()
    }
);

entry!(
    fn cuMulticastBindAddr(
        _mc: u64,
        _mc_offset: usize,
        _ptr: CUdeviceptr,
        _size: usize,
        _flags: u64,
    ) {
        unsupported()
    }
);

entry!(
    fn cuMulticastUnbind(_mc: u64, dev: CUdevice, _mc_offset: usize, _size: usize) {
        driver()?.check_device(dev)?;
        unsupported()
    }
);
