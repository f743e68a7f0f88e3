//! The process's driver objects (contexts, streams, events, modules, graphs, allocations) and
//! the stream-ordering rules that turn a call into device work with the right dependencies.

use crate::client::Client;
use crate::ffi::*;
use gpushare_sim_wire::{Op, OpRef, Request};
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

/// The initialised driver of this process.
pub struct Driver {
    pid: u32,
    pub client: Client,
    state: Mutex<State>,
}

static DRIVER: OnceLock<Result<Driver, CUresult>> = OnceLock::new();

/// Set at process exit by [`teardown`]: the driver is gone.
static TORN_DOWN: AtomicBool = AtomicBool::new(false);

/// `cuInit`: connect once; later calls report the first outcome. A successful connection
/// registers [`teardown`] to run at exit, as the real driver registers its own at `cuInit`.
pub fn init() -> CuResult {
    if TORN_DOWN.load(Ordering::Acquire) {
        return Err(CUDA_ERROR_DEINITIALIZED);
    }
    let r = DRIVER.get_or_init(|| {
        let driver = Client::connect().map(|client| Driver {
            pid: std::process::id(),
            state: Mutex::new(State::new(client.devices.len())),
            client,
        });
        if driver.is_ok() {
            // SAFETY: registers a handler that sets a flag, shuts a socket down and (traced)
            // writes to stderr, each fine at exit.
            unsafe { libc::atexit(teardown) };
        }
        driver
    });
    match r {
        Ok(d) if d.pid != std::process::id() => Err(CUDA_ERROR_NOT_INITIALIZED),
        Ok(_) => Ok(()),
        Err(e) => Err(*e),
    }
}

/// The driver's teardown at process exit, as the real driver's: its connection to the device
/// ends (the device drops this process's queued work and memory, as at exit) and from then on
/// every call that needs the driver answers `CUDA_ERROR_DEINITIALIZED` ("the driver is shutting
/// down"). Exit handlers run in reverse order of registration: those registered after `cuInit`
/// run before this one, those registered before it (and other threads) after it.
extern "C" fn teardown() {
    TORN_DOWN.store(true, Ordering::Release);
    // A forked child inherits the handler, not the connection: it must not end the parent's.
    if let Some(Ok(d)) = DRIVER.get()
        && d.pid == std::process::id()
    {
        d.client.shut_down();
    }
    if tracing_calls() {
        let _ = writeln!(std::io::stderr(), "gpushare-sim libcuda: torn down at exit");
    }
}

/// The driver, once `cuInit` succeeded in this process (a forked child must not reuse it) and
/// until its teardown at exit.
pub fn driver() -> CuResult<&'static Driver> {
    if TORN_DOWN.load(Ordering::Acquire) {
        return Err(CUDA_ERROR_DEINITIALIZED);
    }
    match DRIVER.get() {
        Some(Ok(d)) if d.pid == std::process::id() => Ok(d),
        Some(Ok(_)) => Err(CUDA_ERROR_NOT_INITIALIZED),
        _ => Err(CUDA_ERROR_NOT_INITIALIZED),
    }
}

impl Driver {
    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn device_count(&self) -> usize {
        self.client.devices.len()
    }

    pub fn check_device(&self, dev: CUdevice) -> CuResult<u32> {
        if dev >= 0 && (dev as usize) < self.device_count() {
            Ok(dev as u32)
        } else {
            Err(CUDA_ERROR_INVALID_DEVICE)
        }
    }
}

thread_local! {
    /// This thread's context stack; the top is the current context.
    static CTX_STACK: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

pub fn current_ctx() -> Option<u64> {
    CTX_STACK
        .try_with(|s| s.borrow().last().copied())
        .ok()
        .flatten()
}

pub fn set_current(ctx: Option<u64>) {
    CTX_STACK.with(|s| {
        let mut s = s.borrow_mut();
        s.pop();
        if let Some(c) = ctx {
            s.push(c);
        }
    })
}

pub fn push_current(ctx: u64) {
    CTX_STACK.with(|s| s.borrow_mut().push(ctx))
}

pub fn pop_current() -> Option<u64> {
    CTX_STACK.with(|s| s.borrow_mut().pop())
}

/// Forget `ctx` in this thread's stack after it was destroyed.
pub fn forget_ctx(ctx: u64) {
    // At thread exit (a runtime releasing its context from a destructor) the stack may be gone.
    let _ = CTX_STACK.try_with(|s| s.borrow_mut().retain(|&c| c != ctx));
}

pub fn thread_key() -> u64 {
    // SAFETY: pthread_self has no preconditions.
    unsafe { libc::pthread_self() as u64 }
}

pub struct Context {
    pub device: u32,
    pub flags: u32,
    pub legacy: u64,
    /// Every stream of the context, the legacy one included.
    pub streams: Vec<u64>,
    /// Limits set with cuCtxSetLimit: (limit, value).
    pub limits: Vec<(CUlimit, usize)>,
    /// Contexts whose memory this one may access (cuCtxEnablePeerAccess).
    pub peers: Vec<u64>,
    /// Work every later op of the context waits for (cuGreenCtxWaitEvent): per stream, the
    /// latest record waited for.
    pub waits: Vec<OpRef>,
}

/// A green context (`cuGreenCtxCreate`): its own context (what `cuCtxFromGreenCtx` returns)
/// on `device`, provisioned with `sms` of the device's SMs.
pub struct Green {
    pub ctx: u64,
    pub device: u32,
    pub sms: u32,
}

pub struct Stream {
    pub ctx: u64,
    pub flags: u32,
    pub priority: i32,
    /// Sequence number of the last op submitted (0: none).
    pub seq: u64,
    pub legacy: bool,
    pub capture: Option<Capture>,
}

/// A stream being captured into a graph: new work becomes nodes after `deps`.
#[derive(Clone)]
pub struct Capture {
    pub graph: u64,
    pub id: u64,
    pub deps: Vec<usize>,
    pub invalidated: bool,
    /// `CUstreamCaptureMode` it was begun with, and the thread that began it.
    pub mode: CUstreamCaptureMode,
    pub thread: u64,
}

thread_local! {
    /// This thread's capture interaction mode (`cuThreadExchangeStreamCaptureMode`).
    static CAPTURE_MODE: std::cell::Cell<CUstreamCaptureMode> =
        const { std::cell::Cell::new(CU_STREAM_CAPTURE_MODE_GLOBAL) };
}

/// Set this thread's capture interaction mode; returns the previous one.
pub fn exchange_capture_mode(mode: CUstreamCaptureMode) -> CUstreamCaptureMode {
    CAPTURE_MODE
        .try_with(|m| m.replace(mode))
        .unwrap_or(CU_STREAM_CAPTURE_MODE_GLOBAL)
}

#[derive(Default)]
pub struct Event {
    /// The context it was created in: it is destroyed with it.
    pub ctx: u64,
    pub flags: u32,
    /// Its slot on the event board, and the generation of its latest record there.
    pub slot: u32,
    pub generation: u64,
    pub record: Option<OpRef>,
    /// Completion time once known, so repeated queries need no round trip.
    pub done_ns: Option<u64>,
    /// Recorded while capturing: the capture, with the nodes a waiter must follow as its deps.
    pub captured: Option<Capture>,
    /// Shared with other processes (an IPC event): its id on the device, whose latest record,
    /// by whichever process, is what waits and queries see. `exported`: this process shared it.
    pub shared: Option<u64>,
    pub exported: bool,
}

pub struct Module {
    /// Function ids in image order, by name.
    pub functions: Vec<(String, u64)>,
    pub globals: HashMap<String, (u64, usize)>,
    /// The library this module belongs to (`cuLibraryGetModule`), if any.
    pub library: Option<u64>,
}

impl Module {
    pub fn function(&self, name: &str) -> Option<u64> {
        self.functions
            .iter()
            .find(|(n, _)| n == name)
            .map(|&(_, f)| f)
    }
}

/// A kernel. Its id is both its `CUfunction` and, for a library's kernels, its `CUkernel`: the
/// simulated device runs a function in any context, so the two handles need not differ.
pub struct Function {
    /// NUL-terminated for cuFuncGetName.
    pub name: std::ffi::CString,
    pub params: Vec<usize>,
    pub resources: crate::image::Resources,
    pub ptx_version: i32,
    pub module: u64,
    /// Attributes set with cuFuncSetAttribute / cuKernelSetAttribute: (attribute, value).
    pub attrs: Vec<(CUfunction_attribute, i32)>,
}

impl Function {
    /// Byte offset and size of parameter `i`, each parameter aligned to its natural alignment
    /// (its size's lowest set bit, at most 8), as the ABI lays out the parameter buffer.
    pub fn param_info(&self, i: usize) -> Option<(usize, usize)> {
        let mut off = 0usize;
        for (k, &size) in self.params.iter().enumerate() {
            let align = (size & size.wrapping_neg()).clamp(1, 8);
            off = off.div_ceil(align) * align;
            if k == i {
                return Some((off, size));
            }
            off += size;
        }
        None
    }
}

/// A value the CUDA runtime keeps with a context (`cuGetExportTable`'s context-local storage),
/// and the callback to run when the context is destroyed.
#[derive(Clone, Copy)]
pub struct ContextStorage {
    pub value: usize,
    pub on_destroy: Option<ContextStorageDtor>,
}

pub type ContextStorageDtor =
    unsafe extern "C" fn(Handle, *mut std::ffi::c_void, *mut std::ffi::c_void);

/// What a device pointer range is.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum AllocKind {
    /// `cuMemAlloc` / `cuMemAllocPitch` and stream-ordered allocations.
    Device,
    Managed,
    /// Backing of a module `.global`; not counted against capacity.
    Global,
    /// A range of a physical allocation mapped with `cuMemMap`.
    Mapped,
    /// Another process's allocation, opened with `cuIpcOpenMemHandle`.
    Imported,
}

pub struct Alloc {
    pub size: usize,
    pub mapped: usize,
    pub device: u32,
    pub charged: u64,
    pub kind: AllocKind,
    /// Lives in the process's shared arena (`api_ipc`): another process may map it.
    pub arena: bool,
}

/// One node of a graph. Graphs run their nodes one after another on the launch stream (a
/// valid order: nodes only ever depend on earlier nodes), so edges need not be kept.
#[derive(Clone)]
pub enum NodeKind {
    Empty,
    Kernel {
        function: u64,
        arg0: Option<u64>,
        launch: Box<KernelLaunch>,
    },
    Memset {
        dst: u64,
        value: u32,
        element_size: u32,
        width: usize,
        height: usize,
        pitch: usize,
    },
    Memcpy {
        dst: u64,
        src: u64,
        len: usize,
    },
    Host {
        func: HostFn,
        data: usize,
    },
    EventWait {
        event: u64,
    },
}

/// A kernel node's launch, kept as `cuGraphKernelNodeGetParams` returns it: its shape and a
/// copy of its arguments ("kernel parameters are copied when the node is created").
#[derive(Debug)]
pub struct KernelLaunch {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared: u32,
    /// Each argument's bytes (heap blocks that do not move with the node).
    pub args: Vec<Box<[u8]>>,
    /// The addresses of `args`, the `kernelParams` array handed out.
    pub arg_ptrs: Box<[usize]>,
}

impl KernelLaunch {
    pub fn new(grid: [u32; 3], block: [u32; 3], shared: u32, args: Vec<Box<[u8]>>) -> Self {
        let arg_ptrs = args.iter().map(|a| a.as_ptr() as usize).collect();
        KernelLaunch {
            grid,
            block,
            shared,
            args,
            arg_ptrs,
        }
    }
}

impl Clone for KernelLaunch {
    fn clone(&self) -> Self {
        KernelLaunch::new(self.grid, self.block, self.shared, self.args.clone())
    }
}

#[derive(Default)]
pub struct Graph {
    pub nodes: Vec<NodeKind>,
    /// References this graph holds on user objects: (object, count).
    pub user_refs: Vec<(u64, u32)>,
}

/// An executable graph: its nodes, the flags it was instantiated with, and the user-object
/// references it took over from its graph.
#[derive(Default)]
pub struct Exec {
    pub nodes: Vec<NodeKind>,
    pub flags: u64,
    pub user_refs: Vec<(u64, u32)>,
}

/// A user object (`cuUserObjectCreate`): a destructor run once its references are gone.
pub struct UserObject {
    pub refs: u32,
    pub ptr: usize,
    pub destroy: HostFn,
}

pub struct State {
    next_id: u64,
    pub primary: Vec<Primary>,
    pub contexts: HashMap<u64, Context>,
    pub streams: HashMap<u64, Stream>,
    pub per_thread: HashMap<(u64, u64), u64>,
    pub events: HashMap<u64, Event>,
    /// Event board slots given back by destroyed events, and the first never used.
    free_event_slots: Vec<u32>,
    next_event_slot: u32,
    pub modules: HashMap<u64, Module>,
    pub functions: HashMap<u64, Function>,
    /// Loaded libraries: library → its module, or, for a library whose image has nothing the
    /// device runs, the error its loading gives once something of it is needed (lazy loading).
    pub libraries: HashMap<u64, CuResult<u64>>,
    /// Link states of cuLinkCreate: their images so far, and the last completed output.
    pub links: HashMap<u64, crate::api_link::LinkState>,
    /// Context-local storage: (context, key) → value.
    pub ctx_storage: HashMap<(u64, usize), ContextStorage>,
    pub graphs: HashMap<u64, Graph>,
    pub execs: HashMap<u64, Exec>,
    pub user_objects: HashMap<u64, UserObject>,
    /// Green contexts by handle, and the resource descriptors made for them: descriptor →
    /// (device, SMs).
    pub greens: HashMap<u64, Green>,
    pub resource_descs: HashMap<u64, (u32, u32)>,
    /// Graph node handles: id → (graph, index).
    pub graph_nodes: HashMap<u64, (u64, usize)>,
    pub allocs: BTreeMap<u64, Alloc>,
    /// Page-locked host buffers (cuMemAllocHost / HostAlloc / HostRegister): base → size and
    /// the flags they were made with.
    pub pinned: BTreeMap<u64, Pinned>,
}

/// A page-locked host buffer. With unified addressing it is mapped into every context: its
/// host address is also its device address.
#[derive(Clone, Copy)]
pub struct Pinned {
    pub size: usize,
    /// `CU_MEMHOSTALLOC_*` / `CU_MEMHOSTREGISTER_*` flags as given.
    pub flags: u32,
    /// Allocated by the driver (freed with cuMemFreeHost) rather than registered.
    pub allocated: bool,
}

/// A device's primary context. Its handle is the device's for the process's lifetime, as the
/// driver's is: a reset destroys its state, not the context a module retained, and a retain
/// after the last release brings it back under the same handle.
#[derive(Default, Clone, Copy)]
pub struct Primary {
    /// The context while it is active.
    pub ctx: Option<u64>,
    /// Its handle, once it has been created.
    pub handle: Option<u64>,
    pub refs: u32,
    pub flags: u32,
}

impl State {
    fn new(devices: usize) -> State {
        State {
            // Ids stay clear of the special stream handles 0x1 and 0x2.
            next_id: 0x1000,
            primary: vec![Primary::default(); devices],
            contexts: HashMap::new(),
            streams: HashMap::new(),
            per_thread: HashMap::new(),
            events: HashMap::new(),
            free_event_slots: Vec::new(),
            next_event_slot: 0,
            modules: HashMap::new(),
            functions: HashMap::new(),
            libraries: HashMap::new(),
            links: HashMap::new(),
            ctx_storage: HashMap::new(),
            graphs: HashMap::new(),
            execs: HashMap::new(),
            user_objects: HashMap::new(),
            greens: HashMap::new(),
            resource_descs: HashMap::new(),
            graph_nodes: HashMap::new(),
            allocs: BTreeMap::new(),
            pinned: BTreeMap::new(),
        }
    }

    /// A free event board slot of the `slots` there are, if any is left.
    pub fn take_event_slot(&mut self, slots: u32) -> Option<u32> {
        self.free_event_slots.pop().or_else(|| {
            (self.next_event_slot < slots).then(|| {
                self.next_event_slot += 1;
                self.next_event_slot - 1
            })
        })
    }

    pub fn free_event_slot(&mut self, slot: u32) {
        self.free_event_slots.push(slot);
    }

    pub fn new_id(&mut self) -> u64 {
        self.next_id += 0x10;
        self.next_id
    }

    /// Create a context with its legacy default stream, on the device and here.
    pub fn create_context(&mut self, client: &Client, device: u32, flags: u32) -> CuResult<u64> {
        let ctx = self.new_id();
        self.create_context_as(client, ctx, device, flags)
    }

    /// Create a context under the handle `ctx` (a primary context coming back).
    pub fn create_context_as(
        &mut self,
        client: &Client,
        ctx: u64,
        device: u32,
        flags: u32,
    ) -> CuResult<u64> {
        client.send(&Request::CreateContext {
            ctx,
            device: client.physical(device),
        })?;
        self.contexts.insert(
            ctx,
            Context {
                device,
                flags,
                legacy: 0,
                streams: Vec::new(),
                limits: Vec::new(),
                peers: Vec::new(),
                waits: Vec::new(),
            },
        );
        let legacy = self.create_stream(client, ctx, 0, 0, true)?;
        self.contexts.get_mut(&ctx).expect("just inserted").legacy = legacy;
        Ok(ctx)
    }

    pub fn create_stream(
        &mut self,
        client: &Client,
        ctx: u64,
        flags: u32,
        priority: i32,
        legacy: bool,
    ) -> CuResult<u64> {
        let id = self.new_id();
        client.send(&Request::CreateStream {
            stream: id,
            ctx,
            priority,
        })?;
        self.streams.insert(
            id,
            Stream {
                ctx,
                flags,
                priority,
                seq: 0,
                legacy,
                capture: None,
            },
        );
        self.contexts
            .get_mut(&ctx)
            .ok_or(CUDA_ERROR_INVALID_CONTEXT)?
            .streams
            .push(id);
        Ok(id)
    }

    /// Destroy a context's objects here and on the device. Returns the context-local storage
    /// callbacks to run once the state is unlocked: `(callback, context, key, value)`.
    pub fn destroy_context(&mut self, client: &Client, ctx: u64) -> CuResult<Vec<StorageCallback>> {
        let c = self
            .contexts
            .remove(&ctx)
            .ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        for s in &c.streams {
            self.streams.remove(s);
        }
        // Its events go with it (their handles are invalid from now on).
        let dead: Vec<u64> = (self.events.iter())
            .filter(|(_, e)| e.ctx == ctx)
            .map(|(&id, _)| id)
            .collect();
        for id in dead {
            if let Some(e) = self.events.remove(&id) {
                self.free_event_slot(e.slot);
            }
        }
        self.per_thread.retain(|k, _| k.1 != ctx);
        forget_ctx(ctx);
        let mut callbacks = Vec::new();
        self.ctx_storage.retain(|&(c, key), v| {
            if c != ctx {
                return true;
            }
            if let Some(f) = v.on_destroy {
                callbacks.push((f, ctx, key, v.value));
            }
            false
        });
        client.send(&Request::DestroyContext { ctx })?;
        Ok(callbacks)
    }

    pub fn current(&self) -> CuResult<u64> {
        let ctx = current_ctx().ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        if self.contexts.contains_key(&ctx) {
            Ok(ctx)
        } else {
            Err(CUDA_ERROR_INVALID_CONTEXT)
        }
    }

    pub fn current_device(&self) -> CuResult<u32> {
        Ok(self.contexts[&self.current()?].device)
    }

    /// The stream a `CUstream` handle means for this thread. `per_thread` selects what the null
    /// handle means: the legacy default stream, or this thread's per-thread default stream.
    pub fn resolve_stream(
        &mut self,
        client: &Client,
        h: Handle,
        per_thread: bool,
    ) -> CuResult<u64> {
        let raw = h as usize;
        let special = if h.is_null() {
            Some(per_thread)
        } else if h == CU_STREAM_LEGACY {
            Some(false)
        } else if h == CU_STREAM_PER_THREAD {
            Some(true)
        } else {
            None
        };
        let Some(pt) = special else {
            let id = raw as u64;
            return if self.streams.contains_key(&id) {
                Ok(id)
            } else {
                Err(CUDA_ERROR_INVALID_HANDLE)
            };
        };
        let ctx = self.current()?;
        if !pt {
            return Ok(self.contexts[&ctx].legacy);
        }
        let key = (thread_key(), ctx);
        if let Some(&s) = self.per_thread.get(&key) {
            return Ok(s);
        }
        let s = self.create_stream(client, ctx, 0, 0, false)?;
        self.per_thread.insert(key, s);
        Ok(s)
    }

    /// The implicit dependencies of new work on `stream`: what its context was made to wait for,
    /// and the legacy default stream waits for every blocking stream of its context, and
    /// blocking streams wait for the legacy stream.
    fn implicit_deps(&self, stream: u64, out: &mut Vec<OpRef>) {
        let s = &self.streams[&stream];
        out.extend_from_slice(&self.contexts[&s.ctx].waits);
        if s.flags & CU_STREAM_NON_BLOCKING != 0 {
            return;
        }
        let ctx = &self.contexts[&s.ctx];
        if s.legacy {
            for &other in &ctx.streams {
                let o = &self.streams[&other];
                if other != stream && o.flags & CU_STREAM_NON_BLOCKING == 0 && o.seq > 0 {
                    out.push((other, o.seq));
                }
            }
        } else {
            let l = &self.streams[&ctx.legacy];
            if l.seq > 0 {
                out.push((ctx.legacy, l.seq));
            }
        }
    }

    /// Queue `op` on `stream` after its implicit dependencies and `extra`; returns its ref.
    pub fn submit(
        &mut self,
        client: &Client,
        stream: u64,
        op: Op,
        extra: &[OpRef],
    ) -> CuResult<OpRef> {
        if !self.streams.contains_key(&stream) {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        self.check_legacy_use(stream)?;
        let mut deps = extra.to_vec();
        self.implicit_deps(stream, &mut deps);
        let s = self
            .streams
            .get_mut(&stream)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        s.seq += 1;
        let seq = s.seq;
        client.send(&Request::Submit {
            stream,
            seq,
            deps,
            op,
        })?;
        Ok((stream, seq))
    }

    /// The op a host-side synchronous call on `stream` must wait for: everything before it.
    pub fn fence(&mut self, client: &Client, stream: u64) -> CuResult<OpRef> {
        self.submit(client, stream, Op::Marker, &[])
    }

    /// Ops that must complete for the context to be idle (`cuCtxSynchronize`).
    pub fn ctx_tail(&self, ctx: u64) -> Vec<OpRef> {
        self.contexts[&ctx]
            .streams
            .iter()
            .filter_map(|s| {
                self.streams
                    .get(s)
                    .filter(|st| st.seq > 0)
                    .map(|st| (*s, st.seq))
            })
            .collect()
    }

    /// Error unless `stream` may be used for host-synchronous work (not being captured).
    /// Synchronising or querying a capturing stream invalidates its capture.
    pub fn check_not_capturing(&mut self, stream: u64) -> CuResult {
        let s = self.streams.get(&stream).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if let Some(graph) = s.capture.as_ref().map(|c| c.graph) {
            self.invalidate_capture(graph);
            return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        Ok(())
    }

    /// Error unless no stream of `ctx` is capturing: synchronising a context (or device) with
    /// a capture under way invalidates the capture.
    pub fn check_ctx_not_capturing(&mut self, ctx: u64) -> CuResult {
        let graphs: Vec<u64> = self.contexts[&ctx]
            .streams
            .iter()
            .filter_map(|s| self.streams.get(s)?.capture.as_ref().map(|c| c.graph))
            .collect();
        if graphs.is_empty() {
            return Ok(());
        }
        for g in graphs {
            self.invalidate_capture(g);
        }
        Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
    }

    /// Whether a capture into `graph` is still under way on some stream.
    pub fn capture_active(&self, graph: u64) -> bool {
        self.streams
            .values()
            .any(|s| s.capture.as_ref().is_some_and(|c| c.graph == graph))
    }

    /// Mark the capture into `graph` invalidated on every stream taking part in it: it goes on
    /// until `cuStreamEndCapture`, which then fails.
    pub fn invalidate_capture(&mut self, graph: u64) {
        for s in self.streams.values_mut() {
            if let Some(c) = s.capture.as_mut().filter(|c| c.graph == graph) {
                c.invalidated = true;
            }
        }
    }

    /// A potentially unsafe call (one that may synchronise implicitly, such as a plain
    /// allocation or a synchronous copy) from this thread: prohibited while this thread has a
    /// capture that is not relaxed, or, unless this thread's interaction mode is thread-local
    /// or relaxed, while another thread has a global-mode capture. A prohibited call fails and
    /// invalidates the captures that prohibit it, as the driver documents.
    pub fn check_unsafe_call(&mut self) -> CuResult {
        let mode = CAPTURE_MODE
            .try_with(|m| m.get())
            .unwrap_or(CU_STREAM_CAPTURE_MODE_GLOBAL);
        if mode == CU_STREAM_CAPTURE_MODE_RELAXED {
            return Ok(());
        }
        let me = thread_key();
        let offending: Vec<u64> = self
            .streams
            .values()
            .filter_map(|s| s.capture.as_ref())
            .filter(|c| {
                (c.thread == me && c.mode != CU_STREAM_CAPTURE_MODE_RELAXED)
                    || (mode == CU_STREAM_CAPTURE_MODE_GLOBAL
                        && c.thread != me
                        && c.mode == CU_STREAM_CAPTURE_MODE_GLOBAL)
            })
            .map(|c| c.graph)
            .collect();
        if offending.is_empty() {
            return Ok(());
        }
        for g in offending {
            self.invalidate_capture(g);
        }
        Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
    }

    /// Error if work on the legacy stream `stream` would wait for a capturing blocking stream
    /// of its context (an implicit dependency a capture cannot hold); invalidates that capture.
    fn check_legacy_use(&mut self, stream: u64) -> CuResult {
        let s = &self.streams[&stream];
        if !s.legacy {
            return Ok(());
        }
        let graphs: Vec<u64> = self.contexts[&s.ctx]
            .streams
            .iter()
            .filter_map(|o| self.streams.get(o))
            .filter(|o| o.flags & CU_STREAM_NON_BLOCKING == 0)
            .filter_map(|o| o.capture.as_ref().map(|c| c.graph))
            .collect();
        if graphs.is_empty() {
            return Ok(());
        }
        for g in graphs {
            self.invalidate_capture(g);
        }
        Err(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)
    }

    /// The allocation containing `[ptr, ptr + len)`, if any.
    pub fn find_alloc(&self, ptr: u64, len: usize) -> Option<(u64, &Alloc)> {
        let (&base, a) = self.allocs.range(..=ptr).next_back()?;
        (ptr.checked_add(len as u64)? <= base + a.size as u64).then_some((base, a))
    }

    /// Drop `count` references to a user object; its destructor, if they were the last, to run
    /// once the state is unlocked.
    pub fn release_user_object(
        &mut self,
        obj: u64,
        count: u32,
    ) -> CuResult<Option<(HostFn, usize)>> {
        let o = self
            .user_objects
            .get_mut(&obj)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if count == 0 || count > o.refs {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        o.refs -= count;
        if o.refs > 0 {
            return Ok(None);
        }
        let o = self.user_objects.remove(&obj).expect("present");
        Ok(Some((o.destroy, o.ptr)))
    }

    /// The page-locked buffer containing `[ptr, ptr + len)`, if any.
    pub fn find_pinned(&self, ptr: u64, len: usize) -> Option<(u64, &Pinned)> {
        let (&base, p) = self.pinned.range(..=ptr).next_back()?;
        (ptr.checked_add(len as u64)? <= base + p.size as u64).then_some((base, p))
    }

    pub fn is_pinned(&self, ptr: u64, len: usize) -> bool {
        self.find_pinned(ptr, len).is_some()
    }

    /// Base and size of the memory a device may address at `[ptr, ptr + len)`: an allocation,
    /// or a page-locked host buffer (mapped, with unified addressing).
    pub fn device_range(&self, ptr: u64, len: usize) -> Option<(u64, usize)> {
        self.find_alloc(ptr, len)
            .map(|(b, a)| (b, a.size))
            .or_else(|| self.find_pinned(ptr, len).map(|(b, p)| (b, p.size)))
    }
}

/// A context-local storage destructor due: (callback, context, key, value).
pub type StorageCallback = (ContextStorageDtor, u64, usize, usize);

/// Run the destructors [`State::destroy_context`] collected (with the state unlocked: they may
/// call back into the driver).
pub fn run_storage_callbacks(callbacks: Vec<StorageCallback>) {
    for (f, ctx, key, value) in callbacks {
        // SAFETY: the runtime registered this destructor for exactly these arguments.
        unsafe {
            f(
                handle(ctx),
                key as *mut std::ffi::c_void,
                value as *mut std::ffi::c_void,
            )
        };
    }
}

/// Run user-object destructors on a thread of their own, as the driver does (they may not call
/// into CUDA, and must not run under the state lock).
pub fn run_user_object_destructors(due: Vec<(HostFn, usize)>) {
    if due.is_empty() {
        return;
    }
    let _ = std::thread::Builder::new()
        .name("sim-driver-userobj".into())
        .spawn(move || {
            for (f, ptr) in due {
                // SAFETY: the application registered `f` for `ptr` with cuUserObjectCreate.
                unsafe { f(ptr as *mut std::ffi::c_void) };
            }
        });
}

/// Lock the driver's state after `cuInit`.
pub fn with_state<T>(f: impl FnOnce(&'static Driver, &mut State) -> CuResult<T>) -> CuResult<T> {
    let d = driver()?;
    let mut st = d.lock();
    f(d, &mut st)
}
