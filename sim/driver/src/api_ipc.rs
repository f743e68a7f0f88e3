//! Interprocess handles (`cuIpc*`), as cuda.h documents them: a handle to a `cuMemAlloc`
//! allocation that another process opens to map the same memory, and a handle to an event
//! created with `CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING` that other processes record,
//! wait for and query. PyTorch hands CUDA tensors between processes (DataLoader workers,
//! `torch.multiprocessing`) this way.
//!
//! Simulated device memory is host memory, so for another process to map the same bytes,
//! `cuMemAlloc` memory lives in a shared file: one `memfd` per process (its "arena") holding
//! every allocation at the file offset equal to its device address (sparse: untouched memory
//! costs nothing; a freed range is punched out, so reused addresses read zeros). A memory
//! handle names the exporter's process, arena (descriptor and inode), range and a serial
//! unique to the allocation; the importer opens the arena through `/proc/PID/fd` (so only a
//! process allowed to read the exporter's descriptors, the same user or root, can open it)
//! and maps the range: the same pages. An event handle names the event the device shares
//! between processes (its latest record, by any process, is what everyone waits for).

use crate::ffi::*;
use crate::state::{Alloc, AllocKind, Event, driver, with_state};
use gpushare_sim_wire::{Reply, Request};
use std::collections::HashMap;
use std::ffi::{c_uint, c_void};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Mutex, MutexGuard, OnceLock};

/// The process's device-memory arena: a sparse shared file, offset = device address.
struct Arena {
    fd: OwnedFd,
    inode: u64,
}

/// The arena's size: every user-space address of a 48-bit address space fits.
const ARENA_BYTES: i64 = 1 << 48;

fn arena() -> Option<&'static Arena> {
    static ARENA: OnceLock<Option<Arena>> = OnceLock::new();
    ARENA
        .get_or_init(|| {
            // SAFETY: memfd_create with a valid name; the descriptor becomes ours.
            let fd = unsafe {
                libc::memfd_create(c"gpushare-sim-device-memory".as_ptr(), libc::MFD_CLOEXEC)
            };
            if fd < 0 {
                return None;
            }
            // SAFETY: a fresh descriptor nothing else owns.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            // SAFETY: fstat/ftruncate of our own descriptor into a zeroed stat buffer.
            let mut stat: libc::stat = unsafe { std::mem::zeroed() };
            let ok = unsafe {
                libc::ftruncate(fd.as_raw_fd(), ARENA_BYTES) == 0
                    && libc::fstat(fd.as_raw_fd(), &mut stat) == 0
            };
            ok.then_some(Arena {
                fd,
                inode: stat.st_ino,
            })
        })
        .as_ref()
}

fn page_round(size: usize) -> usize {
    size.div_ceil(4096) * 4096
}

/// Map `size` bytes of device memory that another process can map too (the arena at the
/// range's own address), zeroed; `None` if the arena is unavailable.
pub fn map_shared(size: usize) -> Option<u64> {
    let a = arena()?;
    let len = page_round(size);
    // SAFETY: reserve an address range the kernel chooses, then map the arena over exactly that
    // range; nothing else is affected.
    unsafe {
        let at = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        );
        if at == libc::MAP_FAILED {
            return None;
        }
        if at as i64 + len as i64 > ARENA_BYTES {
            libc::munmap(at, len);
            return None;
        }
        let p = libc::mmap(
            at,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_FIXED,
            a.fd.as_raw_fd(),
            at as libc::off_t,
        );
        if p == libc::MAP_FAILED {
            libc::munmap(at, len);
            return None;
        }
        Some(p as u64)
    }
}

/// Free memory of [`map_shared`]: its pages leave the arena and the range is unmapped.
pub fn unmap_shared(addr: u64, size: usize) {
    let len = page_round(size);
    if let Some(a) = arena() {
        // SAFETY: punches the range this allocation owned out of our own arena file.
        unsafe {
            libc::fallocate(
                a.fd.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                addr as libc::off_t,
                len as libc::off_t,
            )
        };
    }
    // SAFETY: the range was mapped by map_shared and is no longer handed out.
    unsafe { libc::munmap(addr as *mut c_void, len) };
}

/// What this process exported and opened.
#[derive(Default)]
struct Ipc {
    /// Exported allocations: base → serial.
    exported: HashMap<u64, u64>,
    /// Opened handles: (exporter pid, serial) → (local address, size, references).
    opened: HashMap<(u32, u64), (u64, usize, u32)>,
    next_serial: u64,
}

fn ipc() -> MutexGuard<'static, Ipc> {
    static IPC: OnceLock<Mutex<Ipc>> = OnceLock::new();
    IPC.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// The allocation at `base` was freed: a later allocation there gets another handle.
pub fn forget_export(base: u64) {
    ipc().exported.remove(&base);
}

/// Whether `base` is a `cuMemAlloc` allocation in the arena (legacy IPC capable).
pub fn in_arena(base: u64, a: &Alloc) -> bool {
    a.kind == AllocKind::Device && a.arena && base != 0
}

const MEM_MAGIC: &[u8; 8] = b"GSIPCMEM";
const EVENT_MAGIC: &[u8; 8] = b"GSIPCEVT";

/// A memory handle's contents.
struct MemHandle {
    pid: u32,
    fd: i32,
    inode: u64,
    base: u64,
    size: u64,
    serial: u64,
    device: u32,
}

impl MemHandle {
    fn encode(&self) -> [u8; 64] {
        let mut b = [0u8; 64];
        b[..8].copy_from_slice(MEM_MAGIC);
        b[8..12].copy_from_slice(&self.pid.to_le_bytes());
        b[12..16].copy_from_slice(&self.fd.to_le_bytes());
        b[16..24].copy_from_slice(&self.inode.to_le_bytes());
        b[24..32].copy_from_slice(&self.base.to_le_bytes());
        b[32..40].copy_from_slice(&self.size.to_le_bytes());
        b[40..48].copy_from_slice(&self.serial.to_le_bytes());
        b[48..52].copy_from_slice(&self.device.to_le_bytes());
        b
    }

    fn decode(b: &[u8; 64]) -> Option<MemHandle> {
        if &b[..8] != MEM_MAGIC {
            return None;
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        Some(MemHandle {
            pid: u32_at(8),
            fd: u32_at(12) as i32,
            inode: u64_at(16),
            base: u64_at(24),
            size: u64_at(32),
            serial: u64_at(40),
            device: u32_at(48),
        })
    }
}

fn handle_bytes(h: &CUipcMemHandle) -> [u8; 64] {
    h.reserved.map(|c| c as u8)
}

fn to_handle(b: [u8; 64]) -> CUipcMemHandle {
    CUipcMemHandle {
        reserved: b.map(|c| c as _),
    }
}

entry!(
    fn cuIpcGetMemHandle(out: *mut CUipcMemHandle, ptr: CUdeviceptr) {
        let d = driver()?;
        let (size, device) = {
            let st = d.lock();
            st.current()?;
            // "A pointer to the base of an existing device memory allocation created with
            // cuMemAlloc": not an interior pointer, nor pool, virtual or imported memory.
            let a = st.allocs.get(&ptr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
            if !in_arena(ptr, a) {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            (a.size, d.client.physical(a.device))
        };
        let arena = arena().ok_or(CUDA_ERROR_MAP_FAILED)?;
        // "May be called multiple times on an allocation": the same handle each time; a new
        // allocation at the same address gets another serial, so a "unique handle".
        let serial = {
            let mut i = ipc();
            let next = i.next_serial + 1;
            let serial = *i.exported.entry(ptr).or_insert(next);
            i.next_serial = i.next_serial.max(serial);
            serial
        };
        let h = MemHandle {
            pid: std::process::id(),
            fd: arena.fd.as_raw_fd(),
            inode: arena.inode,
            base: ptr,
            size: size as u64,
            serial,
            device,
        };
        put(out, to_handle(h.encode()))
    }
);

/// Map `h`'s range of its exporter's arena here.
fn map_exported(h: &MemHandle) -> CuResult<u64> {
    let path = format!("/proc/{}/fd/{}\0", h.pid, h.fd);
    // SAFETY: opens a NUL-terminated path; the descriptor is ours and closed below.
    let fd = unsafe { libc::open(path.as_ptr().cast(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        // The exporter exited, or this user may not reach its descriptors.
        return Err(CUDA_ERROR_MAP_FAILED);
    }
    // SAFETY: a descriptor we just opened.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: fstat into a zeroed buffer; mmap of the file's range at an address the kernel
    // chooses.
    unsafe {
        let mut stat: libc::stat = std::mem::zeroed();
        if libc::fstat(fd.as_raw_fd(), &mut stat) != 0 || stat.st_ino != h.inode {
            // The descriptor is no longer the exporter's arena.
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        let p = libc::mmap(
            std::ptr::null_mut(),
            page_round(h.size as usize),
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            h.base as libc::off_t,
        );
        if p == libc::MAP_FAILED {
            return Err(CUDA_ERROR_MAP_FAILED);
        }
        Ok(p as u64)
    }
}

fn open_mem(out: *mut CUdeviceptr, ipc_handle: CUipcMemHandle, flags: c_uint) -> CuResult {
    let d = driver()?;
    // "Flags ... Must be specified as CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS."
    if flags != CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS || out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let current_device = with_state(|_, st| st.current_device())?;
    let h = MemHandle::decode(&handle_bytes(&ipc_handle)).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    // A handle is for another process: the exporter itself cannot open it.
    if h.pid == std::process::id() {
        return Err(CUDA_ERROR_INVALID_CONTEXT);
    }
    let mut i = ipc();
    // "If the memory handle has already been opened by the current context, the reference
    // count on the handle is incremented by 1 and the existing device pointer is returned."
    if let Some(o) = i.opened.get_mut(&(h.pid, h.serial)) {
        o.2 += 1;
        return put(out, o.0);
    }
    let addr = map_exported(&h)?;
    // The exporter's GPU as this process numbers it (the current one if not visible here).
    let device = (0..d.device_count() as u32)
        .find(|&o| d.client.physical(o) == h.device)
        .unwrap_or(current_device);
    d.lock().allocs.insert(
        addr,
        Alloc {
            size: h.size as usize,
            mapped: 0,
            device,
            charged: 0,
            kind: AllocKind::Imported,
            arena: false,
        },
    );
    i.opened
        .insert((h.pid, h.serial), (addr, h.size as usize, 1));
    put(out, addr)
}

entry!(
    fn cuIpcOpenMemHandle(out: *mut CUdeviceptr, handle: CUipcMemHandle, flags: c_uint) {
        open_mem(out, handle, flags)
    }
);

entry!(
    fn cuIpcOpenMemHandle_v2(out: *mut CUdeviceptr, handle: CUipcMemHandle, flags: c_uint) {
        open_mem(out, handle, flags)
    }
);

entry!(
    fn cuIpcCloseMemHandle(ptr: CUdeviceptr) {
        let d = driver()?;
        with_state(|_, st| st.current().map(|_| ()))?;
        let mut i = ipc();
        let key = (i.opened.iter())
            .find(|(_, o)| o.0 == ptr)
            .map(|(&k, _)| k)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let o = i.opened.get_mut(&key).expect("found above");
        // "Decrements the reference count ... When the reference count reaches 0, this API
        // unmaps the memory"; the exporter's allocation is unaffected.
        o.2 -= 1;
        if o.2 == 0 {
            let (addr, size, _) = i.opened.remove(&key).expect("found above");
            d.lock().allocs.remove(&addr);
            // SAFETY: the mapping was made by cuIpcOpenMemHandle and is no longer handed out.
            unsafe { libc::munmap(addr as *mut c_void, page_round(size)) };
        }
        Ok(())
    }
);

fn event_handle_bytes(h: &CUipcEventHandle) -> [u8; 64] {
    h.reserved.map(|c| c as u8)
}

entry!(
    fn cuIpcGetEventHandle(out: *mut CUipcEventHandle, event: Handle) {
        let d = driver()?;
        if out.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (shared, record) = {
            let st = d.lock();
            let ev = st.events.get(&id(event)).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
            // "This event must have been created with the CU_EVENT_INTERPROCESS and
            // CU_EVENT_DISABLE_TIMING flags set."
            let needed = CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING;
            if ev.flags & needed != needed {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            (ev.shared, ev.record)
        };
        let shared = match shared {
            Some(s) => s,
            None => {
                let s = match d.client.call(|req| Request::ShareEvent { req, record })? {
                    Reply::SharedEvent { event, .. } => event,
                    _ => return Err(CUDA_ERROR_UNKNOWN),
                };
                let mut st = d.lock();
                let ev = st
                    .events
                    .get_mut(&id(event))
                    .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
                ev.shared = Some(s);
                ev.exported = true;
                s
            }
        };
        let mut b = [0u8; 64];
        b[..8].copy_from_slice(EVENT_MAGIC);
        b[8..16].copy_from_slice(&shared.to_le_bytes());
        b[16..20].copy_from_slice(&std::process::id().to_le_bytes());
        put(
            out,
            CUipcEventHandle {
                reserved: b.map(|c| c as _),
            },
        )
    }
);

entry!(
    fn cuIpcOpenEventHandle(out: *mut Handle, ipc_handle: CUipcEventHandle) {
        let d = driver()?;
        if out.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let b = event_handle_bytes(&ipc_handle);
        if &b[..8] != EVENT_MAGIC {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let shared = u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"));
        let ctx = with_state(|_, st| st.current())?;
        match d
            .client
            .call(|req| Request::OpenSharedEvent { req, event: shared })
        {
            Ok(Reply::SharedEvent { .. }) => {}
            _ => return Err(CUDA_ERROR_INVALID_HANDLE),
        }
        with_state(|d, st| {
            let slot = st
                .take_event_slot(d.client.events.slots())
                .ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
            let e = st.new_id();
            // "A CUevent that behaves like a locally created event with the
            // CU_EVENT_DISABLE_TIMING flag specified."
            st.events.insert(
                e,
                Event {
                    ctx,
                    flags: CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS,
                    slot,
                    shared: Some(shared),
                    ..Event::default()
                },
            );
            put(out, handle(e))
        })
    }
);
