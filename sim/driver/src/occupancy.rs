//! The occupancy calculator of an H100 SXM5 (compute capability 9.0): how many blocks of a
//! kernel fit on one SM at once, the dynamic shared memory that lets a number of blocks fit,
//! and how many thread block clusters fit on the GPU. Libraries size their launches from these
//! answers (cuBLASLt probes cluster shapes), so they follow the device's limits as
//! `cuDeviceGetAttribute` reports them: 2048 threads, 32 blocks, 64 Ki registers and 228 KiB of
//! shared memory per SM, of which 1 KiB is reserved per block; 132 SMs in 8 GPCs, a cluster
//! being placed within one GPC.

/// Threads an SM holds.
const THREADS_PER_SM: u32 = 2048;
const WARP: u32 = 32;
const BLOCKS_PER_SM: u32 = 32;
const REGISTERS_PER_SM: u32 = 65536;
/// Registers are allocated to warps in units of this many.
const REGISTER_UNIT: u32 = 256;
const SHARED_PER_SM: u32 = 233_472;
/// Shared memory the system reserves for each resident block.
pub const SHARED_RESERVED_PER_BLOCK: u32 = 1024;
/// The most shared memory one block may use (static and dynamic), once opted in.
pub const SHARED_PER_BLOCK_OPTIN: u32 = 232_448;
/// Shared memory is allocated in units of this many bytes.
const SHARED_UNIT: u32 = 128;
/// SMs of each GPC (132 in all).
const GPCS: [u32; 8] = [16, 16, 16, 16, 16, 16, 18, 18];
/// Largest cluster size allowed everywhere, and with `NON_PORTABLE_CLUSTER_SIZE_ALLOWED`.
pub const PORTABLE_CLUSTER: u32 = 8;
pub const NON_PORTABLE_CLUSTER: u32 = 16;

/// What of a kernel bounds its occupancy.
#[derive(Debug, Clone, Copy)]
pub struct KernelLimits {
    pub registers_per_thread: u32,
    pub static_shared: u32,
    /// Dynamic shared memory a launch may ask for (`MAX_DYNAMIC_SHARED_SIZE_BYTES`).
    pub max_dynamic_shared: u32,
    pub max_threads_per_block: u32,
}

fn warps(block: u32) -> u32 {
    block.div_ceil(WARP)
}

fn round_up(x: u32, unit: u32) -> u32 {
    x.div_ceil(unit) * unit
}

/// Blocks of `block` threads with `dynamic` bytes of dynamic shared memory each that fit on one
/// SM at once (0 if one does not fit).
pub fn blocks_per_sm(k: &KernelLimits, block: u32, dynamic: u32) -> u32 {
    if block == 0 || block > k.max_threads_per_block || dynamic > k.max_dynamic_shared {
        return 0;
    }
    let shared = k.static_shared.saturating_add(dynamic);
    if shared > SHARED_PER_BLOCK_OPTIN {
        return 0;
    }
    let by_threads = (THREADS_PER_SM / WARP) / warps(block);
    let per_warp = round_up(k.registers_per_thread.max(1) * WARP, REGISTER_UNIT);
    let by_registers = (REGISTERS_PER_SM / per_warp) / warps(block);
    let by_shared = SHARED_PER_SM / (round_up(shared, SHARED_UNIT) + SHARED_RESERVED_PER_BLOCK);
    BLOCKS_PER_SM
        .min(by_threads)
        .min(by_registers)
        .min(by_shared)
}

/// The most dynamic shared memory per block that still lets `blocks` blocks of `block`
/// threads fit on one SM (0 if they do not fit whatever the shared memory).
pub fn available_dynamic_shared(k: &KernelLimits, blocks: u32, block: u32) -> u32 {
    if blocks == 0 || blocks_per_sm(k, block, 0) < blocks {
        return 0;
    }
    let per_block = SHARED_PER_SM / blocks;
    let room = per_block
        .saturating_sub(SHARED_RESERVED_PER_BLOCK)
        .min(SHARED_PER_BLOCK_OPTIN);
    (room / SHARED_UNIT * SHARED_UNIT)
        .saturating_sub(k.static_shared)
        .min(k.max_dynamic_shared)
}

/// Clusters of `cluster` blocks that fit on the GPU at once: each GPC holds as many as its
/// SMs' blocks make whole clusters.
pub fn max_active_clusters(k: &KernelLimits, block: u32, dynamic: u32, cluster: u32) -> u32 {
    let per_sm = blocks_per_sm(k, block, dynamic);
    if cluster == 0 {
        return 0;
    }
    GPCS.iter().map(|sms| sms * per_sm / cluster).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    const PLAIN: KernelLimits = KernelLimits {
        registers_per_thread: 32,
        static_shared: 0,
        max_dynamic_shared: 49152,
        max_threads_per_block: 1024,
    };

    #[test]
    fn blocks_are_bounded_by_threads_blocks_registers_and_shared_memory() {
        assert_eq!(blocks_per_sm(&PLAIN, 32, 0), 32, "32 blocks at most");
        assert_eq!(blocks_per_sm(&PLAIN, 256, 0), 8, "2048 threads");
        assert_eq!(blocks_per_sm(&PLAIN, 1024, 0), 2);
        assert_eq!(blocks_per_sm(&PLAIN, 1025, 0), 0, "too many threads");
        let heavy = KernelLimits {
            registers_per_thread: 128,
            ..PLAIN
        };
        assert_eq!(blocks_per_sm(&heavy, 256, 0), 2, "64 Ki registers");
        // 48 KiB + 1 KiB reserved: four blocks in 228 KiB.
        assert_eq!(blocks_per_sm(&PLAIN, 128, 49152), 4);
        assert_eq!(
            blocks_per_sm(&PLAIN, 128, 49153),
            0,
            "over the kernel's maximum"
        );
        let opted = KernelLimits {
            max_dynamic_shared: SHARED_PER_BLOCK_OPTIN,
            ..PLAIN
        };
        assert_eq!(blocks_per_sm(&opted, 128, SHARED_PER_BLOCK_OPTIN), 1);
    }

    #[test]
    fn available_shared_memory_lets_the_blocks_fit() {
        let opted = KernelLimits {
            max_dynamic_shared: SHARED_PER_BLOCK_OPTIN,
            static_shared: 4096,
            ..PLAIN
        };
        for blocks in 1..=32 {
            for block in [32, 128, 256, 1024] {
                let s = available_dynamic_shared(&opted, blocks, block);
                if blocks_per_sm(&opted, block, 0) < blocks {
                    assert_eq!(s, 0);
                    continue;
                }
                assert!(
                    blocks_per_sm(&opted, block, s) >= blocks,
                    "{blocks} x {block}: {s}"
                );
                assert!(
                    blocks_per_sm(&opted, block, s + SHARED_UNIT) < blocks
                        || s + SHARED_UNIT > SHARED_PER_BLOCK_OPTIN - 4096,
                    "{blocks} x {block}: {s} is not the most"
                );
            }
        }
        assert_eq!(
            available_dynamic_shared(&PLAIN, 1, 128),
            49152,
            "the kernel's maximum"
        );
    }

    #[test]
    fn clusters_fill_whole_gpcs() {
        let one_per_sm = KernelLimits {
            max_dynamic_shared: SHARED_PER_BLOCK_OPTIN,
            ..PLAIN
        };
        let dynamic = 200_000;
        assert_eq!(blocks_per_sm(&one_per_sm, 128, dynamic), 1);
        assert_eq!(max_active_clusters(&one_per_sm, 128, dynamic, 1), 132);
        assert_eq!(max_active_clusters(&one_per_sm, 128, dynamic, 2), 66);
        assert_eq!(max_active_clusters(&one_per_sm, 128, dynamic, 8), 16);
        assert_eq!(max_active_clusters(&one_per_sm, 128, dynamic, 16), 8);
        assert_eq!(max_active_clusters(&PLAIN, 1024, 0, 4), 66);
    }
}
