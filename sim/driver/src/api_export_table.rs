//! `cuGetExportTable`: the private tables NVIDIA's CUDA runtime (`libcudart`, shared and static)
//! asks the driver for, by UUID, before it does anything else. Without them `cudaGetDeviceCount`
//! fails with `cudaErrorNotSupported`.
//!
//! Nothing of these tables is documented by NVIDIA. What they must contain was learnt from the
//! public interoperability project ZLUDA (github.com/vosen/ZLUDA, `dark_api/src/lib.rs` and
//! `zluda/src/impl/driver.rs`: the UUIDs, each table's length and the meaning of its slots, and
//! the integrity check's inputs), and checked by running the real runtime 12.9 against this
//! driver. The code here is our own.
//!
//! Each table is an array of pointers; where the runtime expects it, slot 0 holds the table's
//! size in bytes. Slots the runtime does not call stay null.

use crate::api_context::primary_context;
use crate::api_device::DRIVER_VERSION;
use crate::api_module::create_module;
use crate::ffi::*;
use crate::image;
use crate::state::{ContextStorage, ContextStorageDtor, driver, with_state};
use std::ffi::{c_uint, c_void};

/// A table of function pointers (and sizes), immutable for the library's lifetime.
#[repr(transparent)]
struct Table<const N: usize>([*const c_void; N]);
// SAFETY: the table is never written after its constant initialisation.
unsafe impl<const N: usize> Sync for Table<N> {}

impl<const N: usize> Table<N> {
    fn start(&'static self) -> *const c_void {
        self.0.as_ptr().cast()
    }
}

/// Slot 0 of most tables: the table's size in bytes.
const fn size_of_table(n: usize) -> *const c_void {
    (n * std::mem::size_of::<usize>()) as *const c_void
}

const NULL: *const c_void = std::ptr::null();

/// Run a table function's body, turning its error or a panic into a `CUresult`.
fn call(f: impl FnOnce() -> CuResult) -> CUresult {
    guard(f)
}

// --- the CUDA runtime's interface: modules from registered fat binaries, primary contexts ---

const CUDART_INTERFACE_ID: [u8; 16] = uuid(0x6bd5fb6c_5bf4_e74a_8987_d93912fd9df9);
static CUDART_INTERFACE: Table<13> = Table([
    size_of_table(13),
    module_from_fatbin_wrapper as *const c_void,
    primary_ctx as *const c_void,
    NULL,
    NULL,
    NULL,
    module_from_fatbin_wrapper_ext as *const c_void,
    cudart_fn7 as *const c_void,
    module_from_fatbin_ext as *const c_void,
    NULL,
    NULL,
    NULL,
    load_compilers as *const c_void,
]);

/// Load the fat binary a program registered (`__cudaRegisterFatBinary`) as a module.
fn module_from(out: *mut Handle, image: *const c_void) -> CuResult {
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let info = image::load_at(image)?;
    put(out, handle(create_module(info, None)?))
}

extern "C" fn module_from_fatbin_wrapper(out: *mut Handle, wrapper: *const c_void) -> CUresult {
    call(|| module_from(out, wrapper))
}

extern "C" fn module_from_fatbin_wrapper_ext(
    out: *mut Handle,
    wrapper: *const c_void,
    _a: *mut c_void,
    _b: *mut c_void,
    _c: c_uint,
) -> CUresult {
    call(|| module_from(out, wrapper))
}

extern "C" fn module_from_fatbin_ext(
    fatbin: *const c_void,
    out: *mut Handle,
    _a: *mut c_void,
    _b: *mut c_void,
    _c: c_uint,
) -> CUresult {
    call(|| module_from(out, fatbin))
}

/// The runtime's context of a device: its primary context, created if needed.
extern "C" fn primary_ctx(out: *mut Handle, dev: CUdevice) -> CUresult {
    call(|| {
        if out.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        put(out, handle(primary_context(dev, false)?))
    })
}

/// Called by the runtime with one word; has no observable effect.
extern "C" fn cudart_fn7(_arg: usize) {}

/// Loads the PTX compiler and NVVM on a real driver; the simulated one needs neither.
extern "C" fn load_compilers() -> CUresult {
    CUDA_SUCCESS
}

// --- tools (profiler) hooks: buffers the runtime writes callback state into ---

const TOOLS_RUNTIME_CALLBACK_HOOKS_ID: [u8; 16] = uuid(0xa094798c_2e74_2e74_93f2_0800200c0a66);
static TOOLS_RUNTIME_CALLBACK_HOOKS: Table<7> = Table([
    size_of_table(7),
    NULL,
    tools_buffer_1 as *const c_void,
    NULL,
    NULL,
    NULL,
    tools_buffer_2 as *const c_void,
]);

/// Zeroed, process-lifetime buffers handed to the runtime (no tool is attached here).
fn tools_buffer(words: usize) -> usize {
    Box::leak(vec![0u32; words].into_boxed_slice()).as_mut_ptr() as usize
}

extern "C" fn tools_buffer_1(ptr: *mut *mut c_void, size: *mut usize) {
    static BUF: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let _ = put(ptr, *BUF.get_or_init(|| tools_buffer(1024)) as *mut c_void);
    let _ = put(size, 1024);
}

extern "C" fn tools_buffer_2(ptr: *mut *mut c_void, size: *mut usize) {
    static BUF: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let _ = put(ptr, *BUF.get_or_init(|| tools_buffer(14)) as *mut c_void);
    let _ = put(size, 14);
}

// Thread-local state for tools. cuBLASLt calls slot 2 with one out-pointer and passes what it
// gets to slot 4 of the context-identity table below, whose answer keys its per-context state:
// slot 2 answers the calling thread's current context. (Answering "not supported" there sends
// cuBLASLt down a path on which every matmul fails with CUBLAS_STATUS_NOT_SUPPORTED.)
const TOOLS_TLS_ID: [u8; 16] = uuid(0x42d85a81_23f6_cb47_8298_f6e78a3aecdc);
static TOOLS_TLS: Table<4> = Table([
    size_of_table(4),
    not_supported_2 as *const c_void,
    tls_current_ctx as *const c_void,
    not_supported_2 as *const c_void,
]);

extern "C" fn tls_current_ctx(out: *mut Handle) -> CUresult {
    call(|| put(out, handle(crate::state::current_ctx().unwrap_or(0))))
}

// A context's identity: slot 4 maps a context (from the tools table's slot 2) to its unique id,
// the one cuCtxGetId reports.
const CONTEXT_IDENTITY_ID: [u8; 16] = uuid(0x21318c60_9714_3248_8ca6_41ff7324c8f2);
static CONTEXT_IDENTITY: Table<5> = Table([
    size_of_table(5),
    not_supported_2 as *const c_void,
    not_supported_2 as *const c_void,
    not_supported_2 as *const c_void,
    context_id as *const c_void,
]);

extern "C" fn context_id(ctx: Handle, out: *mut u64) -> CUresult {
    call(|| {
        with_state(|_, st| {
            let c = storage_ctx(st, ctx)?;
            put(out, c)
        })
    })
}

// --- context-local storage: the runtime keeps its per-context state with the context ---

const CONTEXT_LOCAL_STORAGE_ID: [u8; 16] = uuid(0xc693336e_1121_df11_a8c3_68f355d89593);
static CONTEXT_LOCAL_STORAGE: Table<4> = Table([
    storage_put as *const c_void,
    storage_delete as *const c_void,
    storage_get as *const c_void,
    NULL,
]);

/// The context a storage call means: the given one, or the current one for null.
fn storage_ctx(st: &crate::state::State, ctx: Handle) -> CuResult<u64> {
    if ctx.is_null() {
        return st.current();
    }
    st.contexts
        .contains_key(&id(ctx))
        .then_some(id(ctx))
        .ok_or(CUDA_ERROR_INVALID_CONTEXT)
}

extern "C" fn storage_put(
    ctx: Handle,
    key: *mut c_void,
    value: *mut c_void,
    on_destroy: Option<ContextStorageDtor>,
) -> CUresult {
    call(|| {
        with_state(|_, st| {
            let c = storage_ctx(st, ctx)?;
            st.ctx_storage.insert(
                (c, key as usize),
                ContextStorage {
                    value: value as usize,
                    on_destroy,
                },
            );
            Ok(())
        })
    })
}

extern "C" fn storage_delete(ctx: Handle, key: *mut c_void) -> CUresult {
    call(|| {
        with_state(|_, st| {
            let c = storage_ctx(st, ctx)?;
            st.ctx_storage.remove(&(c, key as usize));
            Ok(())
        })
    })
}

extern "C" fn storage_get(value: *mut *mut c_void, ctx: Handle, key: *mut c_void) -> CUresult {
    call(|| {
        let v = with_state(|_, st| {
            let c = storage_ctx(st, ctx)?;
            st.ctx_storage
                .get(&(c, key as usize))
                .map(|s| s.value)
                .ok_or(CUDA_ERROR_INVALID_HANDLE)
        })?;
        put(value, v as *mut c_void)
    })
}

// --- context creation bypassing the runtime's own bookkeeping ---

const CTX_CREATE_BYPASS_ID: [u8; 16] = uuid(0x0ca50b8c_1004_929a_89a7_d0df10e77286);
static CTX_CREATE_BYPASS: Table<2> = Table([size_of_table(2), ctx_create as *const c_void]);

extern "C" fn ctx_create(out: *mut Handle, flags: c_uint, dev: CUdevice) -> CUresult {
    call(|| {
        let d = driver()?;
        let device = d.check_device(dev)?;
        let ctx = d.lock().create_context(&d.client, device, flags)?;
        put(out, handle(ctx))
    })
}

// --- device-side heap and extended attributes: not provided by the simulated device ---

const HEAP_ACCESS_ID: [u8; 16] = uuid(0x195bcbf4_d67d_024a_acc5_1d29cea631ae);
static HEAP_ACCESS: Table<3> = Table([
    size_of_table(3),
    not_supported_3 as *const c_void,
    not_supported_2 as *const c_void,
]);

const DEVICE_EXTENDED_RT_ID: [u8; 16] = uuid(0xb10541e1_f7c7_c74a_9f64_f223be99f1e2);
static DEVICE_EXTENDED_RT: Table<26> = {
    let mut t = [NULL; 26];
    t[0] = size_of_table(26);
    t[5] = not_supported_4 as *const c_void;
    t[13] = not_supported_2 as *const c_void;
    Table(t)
};

extern "C" fn not_supported_2(_: usize, _: usize) -> CUresult {
    CUDA_ERROR_NOT_SUPPORTED
}
extern "C" fn not_supported_3(_: usize, _: usize, _: usize) -> CUresult {
    CUDA_ERROR_NOT_SUPPORTED
}
extern "C" fn not_supported_4(_: usize, _: usize, _: usize, _: usize) -> CUresult {
    CUDA_ERROR_NOT_SUPPORTED
}

// --- a table cuBLASLt's reduced-precision heuristics ask for ---
//
// cuBLASLt calls slot 4 with two out-pointers it zeroed, and takes its own path when the call
// fails; it does not check that the table was found, so a driver that does not serve it makes
// the first bfloat16 matmul crash. Every slot answers "not supported".
const LT_HEURISTICS_ID: [u8; 16] = uuid(0x1734dc26_800d_4745_8726_c0f1e7dd8bca);
static LT_HEURISTICS: Table<8> = {
    let mut t = [not_supported_2 as *const c_void; 8];
    t[0] = size_of_table(8);
    Table(t)
};

// --- context checks ---

const CONTEXT_CHECKS_ID: [u8; 16] = uuid(0x263e8860_7cd2_6143_92f6_bbd5006dfa7e);
static CONTEXT_CHECKS: Table<4> = Table([
    size_of_table(4),
    NULL,
    context_check as *const c_void,
    context_flags as *const c_void,
]);

/// Reports no special state for any context.
extern "C" fn context_check(
    _ctx: Handle,
    result: *mut u32,
    _extra: *mut *const c_void,
) -> CUresult {
    call(|| put(result, 0))
}

extern "C" fn context_flags() -> u32 {
    0
}

// --- the integrity check: the runtime verifies the driver is the one it talks to ---

const INTEGRITY_CHECK_ID: [u8; 16] = uuid(0xd4082055_bde6_704b_8d34_ba123c66e1f2);
static INTEGRITY_CHECK: Table<3> =
    Table([size_of_table(3), integrity_check as *const c_void, NULL]);

/// The runtime sends a version and the time and expects a 16-byte answer it can recompute: for
/// versions ending in 0 or 1 a fixed one, otherwise an HMAC (with MD2) under a fixed key over
/// this process's identity, the two tables' and the function's addresses, the time, and each
/// device's UUID and PCI location.
extern "C" fn integrity_check(version: u32, unix_seconds: u64, result: *mut [u8; 16]) -> CUresult {
    call(|| {
        let digest = match version % 10 {
            0 => digest_of([0x3341181C03CB675C, 0x8ED383AA1F4CD1E8]),
            1 => digest_of([0x1841181C03CB675C, 0x8ED383AA1F4CD1E8]),
            _ => {
                let mut msg = Vec::with_capacity(48 + 28 * 8);
                msg.extend_from_slice(&(DRIVER_VERSION as u32).to_ne_bytes());
                msg.extend_from_slice(&version.to_ne_bytes());
                msg.extend_from_slice(&std::process::id().to_ne_bytes());
                // SAFETY: pthread_self has no preconditions.
                msg.extend_from_slice(&(unsafe { libc::pthread_self() } as u32).to_ne_bytes());
                for p in [
                    CUDART_INTERFACE.start() as usize,
                    INTEGRITY_CHECK.start() as usize,
                    INTEGRITY_CHECK.0[1] as usize,
                ] {
                    msg.extend_from_slice(&p.to_ne_bytes());
                }
                msg.extend_from_slice(&unix_seconds.to_ne_bytes());
                let d = driver()?;
                for dev in &d.client.devices {
                    msg.extend_from_slice(&dev.uuid);
                    msg.extend_from_slice(&0i32.to_ne_bytes()); // PCI domain
                    msg.extend_from_slice(&(dev.pci_bus as i32).to_ne_bytes());
                    msg.extend_from_slice(&0i32.to_ne_bytes()); // PCI device
                }
                hmac_md2(&INTEGRITY_KEY, &msg)
            }
        };
        put(result, digest)
    })
}

/// The key of the integrity HMAC.
const INTEGRITY_KEY: [u8; 16] = [
    0x14, 0x6A, 0xDD, 0xAE, 0x53, 0xA9, 0xA7, 0x52, 0xAA, 0x08, 0x41, 0x36, 0x0B, 0xF5, 0x5A, 0x9F,
];

fn digest_of(words: [u64; 2]) -> [u8; 16] {
    let mut d = [0u8; 16];
    d[..8].copy_from_slice(&words[0].to_ne_bytes());
    d[8..].copy_from_slice(&words[1].to_ne_bytes());
    d
}

/// HMAC (RFC 2104) over MD2, whose block is 16 bytes: the key is used as it is.
fn hmac_md2(key: &[u8; 16], msg: &[u8]) -> [u8; 16] {
    let pad = |x: u8| key.map(|k| k ^ x);
    let mut inner = Md2::default();
    inner.update(&pad(0x36));
    inner.update(msg);
    let mut outer = Md2::default();
    outer.update(&pad(0x5c));
    outer.update(&inner.finish());
    outer.finish()
}

/// MD2 (RFC 1319).
struct Md2 {
    x: [u8; 48],
    checksum: [u8; 16],
    block: [u8; 16],
    filled: usize,
}

/// MD2's permutation of 0..=255, from the digits of pi (RFC 1319, section 3.2).
const PI_SUBST: [u8; 256] = [
    41, 46, 67, 201, 162, 216, 124, 1, 61, 54, 84, 161, 236, 240, 6, 19, 98, 167, 5, 243, 192, 199,
    115, 140, 152, 147, 43, 217, 188, 76, 130, 202, 30, 155, 87, 60, 253, 212, 224, 22, 103, 66,
    111, 24, 138, 23, 229, 18, 190, 78, 196, 214, 218, 158, 222, 73, 160, 251, 245, 142, 187, 47,
    238, 122, 169, 104, 121, 145, 21, 178, 7, 63, 148, 194, 16, 137, 11, 34, 95, 33, 128, 127, 93,
    154, 90, 144, 50, 39, 53, 62, 204, 231, 191, 247, 151, 3, 255, 25, 48, 179, 72, 165, 181, 209,
    215, 94, 146, 42, 172, 86, 170, 198, 79, 184, 56, 210, 150, 164, 125, 182, 118, 252, 107, 226,
    156, 116, 4, 241, 69, 157, 112, 89, 100, 113, 135, 32, 134, 91, 207, 101, 230, 45, 168, 2, 27,
    96, 37, 173, 174, 176, 185, 246, 28, 70, 97, 105, 52, 64, 126, 15, 85, 71, 163, 35, 221, 81,
    175, 58, 195, 92, 249, 206, 186, 197, 234, 38, 44, 83, 13, 110, 133, 40, 132, 9, 211, 223, 205,
    244, 65, 129, 77, 82, 106, 220, 55, 200, 108, 193, 171, 250, 36, 225, 123, 8, 12, 189, 177, 74,
    120, 136, 149, 139, 227, 99, 232, 109, 233, 203, 213, 254, 59, 0, 29, 57, 242, 239, 183, 14,
    102, 88, 208, 228, 166, 119, 114, 248, 235, 117, 75, 10, 49, 68, 80, 180, 143, 237, 31, 26,
    219, 153, 141, 51, 159, 17, 131, 20,
];

impl Default for Md2 {
    fn default() -> Md2 {
        Md2 {
            x: [0; 48],
            checksum: [0; 16],
            block: [0; 16],
            filled: 0,
        }
    }
}

impl Md2 {
    fn update(&mut self, data: &[u8]) {
        for &b in data {
            self.block[self.filled] = b;
            self.filled += 1;
            if self.filled == 16 {
                self.compress();
                self.filled = 0;
            }
        }
    }

    fn compress(&mut self) {
        let mut l = self.checksum[15];
        for j in 0..16 {
            self.checksum[j] ^= PI_SUBST[(self.block[j] ^ l) as usize];
            l = self.checksum[j];
        }
        for j in 0..16 {
            self.x[16 + j] = self.block[j];
            self.x[32 + j] = self.block[j] ^ self.x[j];
        }
        let mut t = 0u8;
        for round in 0..18u8 {
            for k in 0..48 {
                self.x[k] ^= PI_SUBST[t as usize];
                t = self.x[k];
            }
            t = t.wrapping_add(round);
        }
    }

    fn finish(mut self) -> [u8; 16] {
        let pad = (16 - self.filled) as u8;
        self.update(&vec![pad; pad as usize]);
        let checksum = self.checksum;
        self.update(&checksum);
        self.x[..16].try_into().expect("16 bytes")
    }
}

// --- lookup ---

/// A UUID as the bytes of its canonical text form.
const fn uuid(v: u128) -> [u8; 16] {
    v.to_be_bytes()
}

fn table(uuid: &[u8; 16]) -> Option<*const c_void> {
    Some(match *uuid {
        CUDART_INTERFACE_ID => CUDART_INTERFACE.start(),
        TOOLS_RUNTIME_CALLBACK_HOOKS_ID => TOOLS_RUNTIME_CALLBACK_HOOKS.start(),
        TOOLS_TLS_ID => TOOLS_TLS.start(),
        CONTEXT_LOCAL_STORAGE_ID => CONTEXT_LOCAL_STORAGE.start(),
        CTX_CREATE_BYPASS_ID => CTX_CREATE_BYPASS.start(),
        HEAP_ACCESS_ID => HEAP_ACCESS.start(),
        DEVICE_EXTENDED_RT_ID => DEVICE_EXTENDED_RT.start(),
        CONTEXT_CHECKS_ID => CONTEXT_CHECKS.start(),
        INTEGRITY_CHECK_ID => INTEGRITY_CHECK.start(),
        CONTEXT_IDENTITY_ID => CONTEXT_IDENTITY.start(),
        LT_HEURISTICS_ID => LT_HEURISTICS.start(),
        _ => return None,
    })
}

entry!(
    fn cuGetExportTable(out: *mut *const c_void, uuid: *const CUuuid) {
        let t = table(&get(uuid)?.bytes.map(|b| b as u8)).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        put(out, t)
    }
);

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(d: [u8; 16]) -> String {
        d.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn md2_matches_the_rfc_test_suite() {
        let md2 = |s: &[u8]| {
            let mut m = Md2::default();
            m.update(s);
            hex(m.finish())
        };
        assert_eq!(md2(b""), "8350e5a3e24c153df2275c9f80692773");
        assert_eq!(md2(b"abc"), "da853b0d3f88d99b30283a69e6ded6bb");
        assert_eq!(md2(b"message digest"), "ab4f496bfb2a530b219ff33031fe06b0");
        assert_eq!(
            md2(
                b"12345678901234567890123456789012345678901234567890123456789012345678901234567890"
            ),
            "d5976f79d83d3a0dc9806c3c66f3efd8"
        );
    }

    #[test]
    fn every_table_is_found_by_its_uuid() {
        for id in [
            CUDART_INTERFACE_ID,
            INTEGRITY_CHECK_ID,
            CONTEXT_LOCAL_STORAGE_ID,
        ] {
            assert!(table(&id).is_some());
        }
        assert_eq!(CUDART_INTERFACE_ID[..4], [0x6b, 0xd5, 0xfb, 0x6c]);
        assert!(table(&[0; 16]).is_none());
        assert_eq!(CUDART_INTERFACE.0[0] as usize, 13 * 8);
    }
}
