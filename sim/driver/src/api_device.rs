//! Initialisation, driver version, errors and device queries. The simulated part is an
//! H100-class GPU; its attribute table answers what real programs ask.

use crate::ffi::*;
use crate::state::{driver, init};
use gpushare_cuda_abi::device_attribute_value;
use std::ffi::{c_char, c_int, c_uint};

/// The CUDA version this driver claims (12.9, the ABI it implements).
pub const DRIVER_VERSION: i32 = 12090;

entry!(
    fn cuInit(flags: c_uint) {
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        init()
    }
);

entry!(
    fn cuDriverGetVersion(version: *mut c_int) {
        put(version, DRIVER_VERSION)
    }
);

entry!(
    fn cuGetErrorString(error: CUresult, s: *mut *const c_char) {
        let text = gpushare_cuda_abi::error_string_cstr(error).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        put(s, text.as_ptr())
    }
);

entry!(
    fn cuGetErrorName(error: CUresult, s: *mut *const c_char) {
        let text = gpushare_cuda_abi::error_name_cstr(error).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        put(s, text.as_ptr())
    }
);

entry!(
    fn cuDeviceGetCount(count: *mut c_int) {
        put(count, driver()?.device_count() as c_int)
    }
);

entry!(
    fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int) {
        put(device, driver()?.check_device(ordinal)? as CUdevice)
    }
);

entry!(
    fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) {
        let d = driver()?;
        let info = &d.client.devices[d.check_device(dev)? as usize];
        if name.is_null() || len <= 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let bytes = info.name.as_bytes();
        let n = bytes.len().min(len as usize - 1);
        let mut out = bytes[..n].to_vec();
        out.push(0);
        copy_bytes(name as u64, out.as_ptr() as u64, out.len());
        Ok(())
    }
);

fn device_uuid(uuid: *mut CUuuid, dev: CUdevice) -> CuResult {
    let d = driver()?;
    let bytes = d.client.devices[d.check_device(dev)? as usize].uuid;
    put(
        uuid,
        CUuuid {
            bytes: bytes.map(|b| b as c_char),
        },
    )
}

entry!(
    fn cuDeviceGetUuid(uuid: *mut CUuuid, dev: CUdevice) {
        device_uuid(uuid, dev)
    }
);

// The same answer as v1, as the real driver gives for a whole GPU: the simulated GPUs are not
// partitioned (no MIG), and only a MIG instance's UUID differs between the two (v1: its parent
// GPU's, v2: its own).
entry!(
    fn cuDeviceGetUuid_v2(uuid: *mut CUuuid, dev: CUdevice) {
        device_uuid(uuid, dev)
    }
);

entry!(
    fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) {
        let d = driver()?;
        put(
            bytes,
            d.client.devices[d.check_device(dev)? as usize].total_memory as usize,
        )
    }
);

entry!(
    fn cuDeviceComputeCapability(major: *mut c_int, minor: *mut c_int, dev: CUdevice) {
        driver()?.check_device(dev)?;
        put(major, 9)?;
        put(minor, 0)
    }
);

entry!(
    fn cuDeviceGetPCIBusId(id: *mut c_char, len: c_int, dev: CUdevice) {
        let d = driver()?;
        let bus = d.client.devices[d.check_device(dev)? as usize].pci_bus;
        let text = format!("00000000:{bus:02X}:00.0\0");
        if id.is_null() || len <= 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let n = text.len().min(len as usize);
        copy_bytes(id as u64, text.as_ptr() as u64, n);
        if n == len as usize {
            put(id.wrapping_add(n - 1), 0)?;
        }
        Ok(())
    }
);

entry!(
    fn cuDeviceCanAccessPeer(can: *mut c_int, dev: CUdevice, peer: CUdevice) {
        let d = driver()?;
        // Every pair of distinct GPUs is linked (NVLink, as in an HGX H100 system); a device is
        // not its own peer.
        let linked = d.check_device(dev)? != d.check_device(peer)?;
        put(can, linked as c_int)
    }
);

entry!(
    fn cuDeviceGetAttribute(value: *mut c_int, attrib: CUdevice_attribute, dev: CUdevice) {
        let d = driver()?;
        let info = &d.client.devices[d.check_device(dev)? as usize];
        let v = match attribute(attrib) {
            Some(Attr::Fixed(v)) => v,
            Some(Attr::PciBus) => info.pci_bus as c_int,
            None => return Err(CUDA_ERROR_INVALID_VALUE),
        };
        put(value, v)
    }
);

enum Attr {
    Fixed(c_int),
    PciBus,
}

/// H100 SXM5 values of every attribute CUDA 12.9 defines (`PCI_BUS_ID` comes from the device);
/// others answer `CUDA_ERROR_INVALID_VALUE`.
const ATTRIBUTES: &[(&str, i32)] = &[
    ("MAX_THREADS_PER_BLOCK", 1024),
    ("MAX_BLOCK_DIM_X", 1024),
    ("MAX_BLOCK_DIM_Y", 1024),
    ("MAX_BLOCK_DIM_Z", 64),
    ("MAX_GRID_DIM_X", i32::MAX),
    ("MAX_GRID_DIM_Y", 65535),
    ("MAX_GRID_DIM_Z", 65535),
    ("MAX_SHARED_MEMORY_PER_BLOCK", 49152),
    ("TOTAL_CONSTANT_MEMORY", 65536),
    ("WARP_SIZE", 32),
    ("MAX_PITCH", i32::MAX),
    // Texture and surface limits of compute capability 9.0 (CUDA C++ Programming Guide,
    // "Features and Technical Specifications").
    ("MAXIMUM_TEXTURE1D_WIDTH", 131_072),
    ("MAXIMUM_TEXTURE2D_WIDTH", 131_072),
    ("MAXIMUM_TEXTURE2D_HEIGHT", 65_536),
    ("MAXIMUM_TEXTURE3D_WIDTH", 16_384),
    ("MAXIMUM_TEXTURE3D_HEIGHT", 16_384),
    ("MAXIMUM_TEXTURE3D_DEPTH", 16_384),
    ("MAXIMUM_TEXTURE2D_LAYERED_WIDTH", 32_768),
    ("MAXIMUM_TEXTURE2D_LAYERED_HEIGHT", 32_768),
    ("MAXIMUM_TEXTURE2D_LAYERED_LAYERS", 2048),
    ("MAXIMUM_TEXTURE1D_LAYERED_WIDTH", 32_768),
    ("MAXIMUM_TEXTURE1D_LAYERED_LAYERS", 2048),
    ("CAN_TEX2D_GATHER", 1),
    ("MAXIMUM_TEXTURE2D_GATHER_WIDTH", 32_768),
    ("MAXIMUM_TEXTURE2D_GATHER_HEIGHT", 32_768),
    ("MAXIMUM_TEXTURE3D_WIDTH_ALTERNATE", 8192),
    ("MAXIMUM_TEXTURE3D_HEIGHT_ALTERNATE", 8192),
    ("MAXIMUM_TEXTURE3D_DEPTH_ALTERNATE", 32_768),
    ("MAXIMUM_TEXTURECUBEMAP_WIDTH", 32_768),
    ("MAXIMUM_TEXTURECUBEMAP_LAYERED_WIDTH", 32_768),
    ("MAXIMUM_TEXTURECUBEMAP_LAYERED_LAYERS", 2046),
    ("MAXIMUM_SURFACE1D_WIDTH", 32_768),
    ("MAXIMUM_SURFACE2D_WIDTH", 131_072),
    ("MAXIMUM_SURFACE2D_HEIGHT", 65_536),
    ("MAXIMUM_SURFACE3D_WIDTH", 16_384),
    ("MAXIMUM_SURFACE3D_HEIGHT", 16_384),
    ("MAXIMUM_SURFACE3D_DEPTH", 16_384),
    ("MAXIMUM_SURFACE1D_LAYERED_WIDTH", 32_768),
    ("MAXIMUM_SURFACE1D_LAYERED_LAYERS", 2048),
    ("MAXIMUM_SURFACE2D_LAYERED_WIDTH", 32_768),
    ("MAXIMUM_SURFACE2D_LAYERED_HEIGHT", 32_768),
    ("MAXIMUM_SURFACE2D_LAYERED_LAYERS", 2048),
    ("MAXIMUM_SURFACECUBEMAP_WIDTH", 32_768),
    ("MAXIMUM_SURFACECUBEMAP_LAYERED_WIDTH", 32_768),
    ("MAXIMUM_SURFACECUBEMAP_LAYERED_LAYERS", 2046),
    ("MAXIMUM_TEXTURE1D_LINEAR_WIDTH", 268_435_456),
    ("MAXIMUM_TEXTURE2D_LINEAR_WIDTH", 131_072),
    ("MAXIMUM_TEXTURE2D_LINEAR_HEIGHT", 65_000),
    ("MAXIMUM_TEXTURE2D_LINEAR_PITCH", 2_097_120),
    ("MAXIMUM_TEXTURE2D_MIPMAPPED_WIDTH", 32_768),
    ("MAXIMUM_TEXTURE2D_MIPMAPPED_HEIGHT", 32_768),
    ("MAXIMUM_TEXTURE1D_MIPMAPPED_WIDTH", 32_768),
    ("MAX_REGISTERS_PER_BLOCK", 65536),
    ("CLOCK_RATE", 1_980_000),
    ("TEXTURE_ALIGNMENT", 512),
    ("GPU_OVERLAP", 1),
    ("MULTIPROCESSOR_COUNT", 132),
    ("KERNEL_EXEC_TIMEOUT", 0),
    ("INTEGRATED", 0),
    ("CAN_MAP_HOST_MEMORY", 1),
    ("COMPUTE_MODE", 0),
    ("SURFACE_ALIGNMENT", 512),
    ("CONCURRENT_KERNELS", 1),
    ("ECC_ENABLED", 1),
    ("PCI_DEVICE_ID", 0),
    ("TCC_DRIVER", 0),
    ("MEMORY_CLOCK_RATE", 2_619_000),
    ("GLOBAL_MEMORY_BUS_WIDTH", 5120),
    ("L2_CACHE_SIZE", 52_428_800),
    ("MAX_THREADS_PER_MULTIPROCESSOR", 2048),
    ("ASYNC_ENGINE_COUNT", 3),
    ("UNIFIED_ADDRESSING", 1),
    ("PCI_DOMAIN_ID", 0),
    ("TEXTURE_PITCH_ALIGNMENT", 32),
    ("COMPUTE_CAPABILITY_MAJOR", 9),
    ("COMPUTE_CAPABILITY_MINOR", 0),
    ("STREAM_PRIORITIES_SUPPORTED", 1),
    ("GLOBAL_L1_CACHE_SUPPORTED", 1),
    ("LOCAL_L1_CACHE_SUPPORTED", 1),
    ("MAX_SHARED_MEMORY_PER_MULTIPROCESSOR", 233_472),
    ("MAX_REGISTERS_PER_MULTIPROCESSOR", 65536),
    ("MANAGED_MEMORY", 1),
    ("MULTI_GPU_BOARD", 0),
    ("MULTI_GPU_BOARD_GROUP_ID", 0),
    ("HOST_NATIVE_ATOMIC_SUPPORTED", 0),
    ("SINGLE_TO_DOUBLE_PRECISION_PERF_RATIO", 2),
    ("PAGEABLE_MEMORY_ACCESS", 0),
    ("CONCURRENT_MANAGED_ACCESS", 1),
    ("COMPUTE_PREEMPTION_SUPPORTED", 1),
    ("CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM", 1),
    ("COOPERATIVE_LAUNCH", 1),
    ("COOPERATIVE_MULTI_DEVICE_LAUNCH", 1),
    ("MAX_SHARED_MEMORY_PER_BLOCK_OPTIN", 232_448),
    ("CAN_FLUSH_REMOTE_WRITES", 0),
    ("HOST_REGISTER_SUPPORTED", 1),
    ("PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES", 0),
    ("DIRECT_MANAGED_MEM_ACCESS_FROM_HOST", 0),
    ("VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED", 1),
    ("HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED", 1),
    ("HANDLE_TYPE_WIN32_HANDLE_SUPPORTED", 0),
    ("HANDLE_TYPE_WIN32_KMT_HANDLE_SUPPORTED", 0),
    ("MAX_BLOCKS_PER_MULTIPROCESSOR", 32),
    ("GENERIC_COMPRESSION_SUPPORTED", 1),
    ("MAX_PERSISTING_L2_CACHE_SIZE", 32_505_856),
    ("MAX_ACCESS_POLICY_WINDOW_SIZE", 134_213_632),
    ("RESERVED_SHARED_MEMORY_PER_BLOCK", 1024),
    ("SPARSE_CUDA_ARRAY_SUPPORTED", 1),
    ("READ_ONLY_HOST_REGISTER_SUPPORTED", 1),
    ("TIMELINE_SEMAPHORE_INTEROP_SUPPORTED", 1),
    // cudarc and others then use the plain allocator, like on drivers without pools.
    ("MEMORY_POOLS_SUPPORTED", 0),
    ("GPU_DIRECT_RDMA_SUPPORTED", 0),
    ("GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED", 0),
    ("GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS", 0),
    ("GPU_DIRECT_RDMA_WRITES_ORDERING", 0),
    // No pools, so no shareable pool handle types.
    ("MEMPOOL_SUPPORTED_HANDLE_TYPES", 0),
    ("CAN_USE_STREAM_MEM_OPS_V1", 1),
    ("CAN_USE_64_BIT_STREAM_MEM_OPS_V1", 1),
    ("CAN_USE_STREAM_WAIT_VALUE_NOR_V1", 1),
    ("TENSOR_MAP_ACCESS_SUPPORTED", 1),
    ("HANDLE_TYPE_FABRIC_SUPPORTED", 0),
    ("UNIFIED_FUNCTION_POINTERS", 0),
    ("MULTICAST_SUPPORTED", 0),
    ("D3D12_CIG_SUPPORTED", 0),
    ("MEM_DECOMPRESS_ALGORITHM_MASK", 0),
    ("MEM_DECOMPRESS_MAXIMUM_LENGTH", 0),
    ("VULKAN_CIG_SUPPORTED", 0),
    // PCI IDs of an H100 SXM5 80GB: device 0x2330, subsystem 0x16C1, vendor NVIDIA 0x10DE.
    ("GPU_PCI_DEVICE_ID", 0x2330_10DE),
    ("GPU_PCI_SUBSYSTEM_ID", 0x16C1_10DE),
    ("HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED", 0),
    ("HOST_NUMA_MEMORY_POOLS_SUPPORTED", 0),
    ("HOST_NUMA_MULTINODE_IPC_SUPPORTED", 0),
    ("CLUSTER_LAUNCH", 1),
    ("DEFERRED_MAPPING_CUDA_ARRAY_SUPPORTED", 1),
    ("CAN_USE_64_BIT_STREAM_MEM_OPS", 1),
    ("CAN_USE_STREAM_WAIT_VALUE_NOR", 1),
    ("DMA_BUF_SUPPORTED", 1),
    ("IPC_EVENT_SUPPORTED", 1),
    ("MEM_SYNC_DOMAIN_COUNT", 4),
    ("NUMA_CONFIG", 0),
    ("NUMA_ID", -1),
    ("MPS_ENABLED", 0),
    ("HOST_NUMA_ID", 0),
];

fn attribute(attr: u32) -> Option<Attr> {
    if device_attribute_value("CU_DEVICE_ATTRIBUTE_PCI_BUS_ID") == Some(attr) {
        return Some(Attr::PciBus);
    }
    ATTRIBUTES
        .iter()
        .find(|(name, _)| {
            device_attribute_value(&format!("CU_DEVICE_ATTRIBUTE_{name}")) == Some(attr)
        })
        .map(|&(_, v)| Attr::Fixed(v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_listed_attribute_exists_in_the_header() {
        for (name, _) in ATTRIBUTES {
            assert!(
                device_attribute_value(&format!("CU_DEVICE_ATTRIBUTE_{name}")).is_some(),
                "{name}"
            );
        }
        assert!(
            matches!(attribute(115), Some(Attr::Fixed(0))),
            "memory pools reported off"
        );
        assert!(attribute(9999).is_none());
        for &(value, name) in gpushare_cuda_abi::DEVICE_ATTRIBUTES {
            assert!(attribute(value).is_some(), "{name} has no value");
        }
    }
}
