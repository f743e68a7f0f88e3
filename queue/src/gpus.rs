//! The node's GPUs as the CUDA driver lists them (count, UUID, name, memory), asked once when
//! the daemon starts. What is in use on them comes from the scheduler's books, never from here.

use cudarc::driver::result::{self, device};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuInfo {
    /// Ordinal as the daemon's driver numbers it (`CUDA_VISIBLE_DEVICES` of the daemon applied).
    pub index: u32,
    /// `GPU-…`, as `nvidia-smi` prints it and `CUDA_VISIBLE_DEVICES` accepts it.
    pub uuid: String,
    pub name: String,
    /// Memory capacity, bytes.
    pub memory: u64,
}

/// Every GPU the driver (`libcuda.so.1`) reports.
pub fn discover() -> Result<Vec<GpuInfo>, String> {
    // cudarc panics when it cannot load the library: make that an error that says what to do.
    let quiet = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let found = std::panic::catch_unwind(query);
    std::panic::set_hook(quiet);
    found.unwrap_or_else(|_| {
        Err("cannot load the CUDA driver (libcuda.so.1): install the NVIDIA driver, or point LD_LIBRARY_PATH at it".into())
    })
}

fn query() -> Result<Vec<GpuInfo>, String> {
    let fail = |what: &str, e: result::DriverError| format!("CUDA driver: {what} failed: {e}");
    result::init().map_err(|e| fail("cuInit", e))?;
    let n = device::get_count().map_err(|e| fail("cuDeviceGetCount", e))?;
    (0..n)
        .map(|i| {
            let dev = device::get(i).map_err(|e| fail("cuDeviceGet", e))?;
            let uuid = device::get_uuid(dev).map_err(|e| fail("cuDeviceGetUuid", e))?;
            let bytes: [u8; 16] = uuid.bytes.map(|b| b as u8);
            // SAFETY: `dev` was returned by cuDeviceGet just above.
            let memory =
                unsafe { device::total_mem(dev) }.map_err(|e| fail("cuDeviceTotalMem", e))?;
            Ok(GpuInfo {
                index: i as u32,
                uuid: gpushare_protocol::status::uuid_string(&bytes),
                name: device::get_name(dev).map_err(|e| fail("cuDeviceGetName", e))?,
                memory: memory as u64,
            })
        })
        .collect()
}
