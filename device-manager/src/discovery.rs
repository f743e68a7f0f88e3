//! GPU discovery through the CUDA driver API (the FFI layer of this crate). It runs in a child
//! process (`gpushare-device-manager --list-gpus`), a fresh one per look: the driver reports
//! its devices once per process, a hung driver cannot stall the plugin, and a GPU that fell
//! off the bus is simply missing from the next answer.

use crate::inventory::Gpu;
use cudarc::driver::result;
use gpushare_protocol::admin::gpu_uuid_string;
use std::path::Path;
use std::time::Duration;

/// The GPUs the CUDA driver (`libcuda.so.1` as the loader finds it) reports.
pub fn list_gpus() -> Result<Vec<Gpu>, String> {
    let err = |what: &str, e: result::DriverError| format!("CUDA driver: {what}: {e:?}");
    result::init().map_err(|e| err("cuInit", e))?;
    let n = result::device::get_count().map_err(|e| err("cuDeviceGetCount", e))?;
    let mut gpus = Vec::new();
    for i in 0..n {
        let dev = result::device::get(i).map_err(|e| err("cuDeviceGet", e))?;
        let uuid = result::device::get_uuid(dev).map_err(|e| err("cuDeviceGetUuid", e))?;
        let bytes: [u8; 16] = uuid.bytes.map(|b| b as u8);
        // SAFETY: `dev` was returned by cuDeviceGet above.
        let memory =
            unsafe { result::device::total_mem(dev) }.map_err(|e| err("cuDeviceTotalMem", e))?;
        let name = result::device::get_name(dev).map_err(|e| err("cuDeviceGetName", e))?;
        gpus.push(Gpu {
            uuid: gpu_uuid_string(&bytes),
            memory: memory as u64,
            name,
        });
    }
    Ok(gpus)
}

/// Run `exe --list-gpus` and read its answer (at most `timeout`).
pub async fn probe(exe: &Path, timeout: Duration) -> Result<Vec<Gpu>, String> {
    let run = tokio::process::Command::new(exe)
        .arg("--list-gpus")
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(timeout, run)
        .await
        .map_err(|_| format!("GPU discovery did not answer within {timeout:?}"))?
        .map_err(|e| format!("cannot run {} --list-gpus: {e}", exe.display()))?;
    if !out.status.success() {
        return Err(format!(
            "GPU discovery failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    serde_json::from_slice(&out.stdout)
        .map_err(|e| format!("GPU discovery printed no GPU list: {e}"))
}
