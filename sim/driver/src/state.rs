//! The process's driver objects (contexts, streams, events, modules, graphs, allocations) and
//! the stream-ordering rules that turn a call into device work with the right dependencies.

use crate::client::Client;
use crate::ffi::*;
use gpushare_sim_wire::{Op, OpRef, Request};
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, MutexGuard, OnceLock};

/// The initialised driver of this process.
pub struct Driver {
    pid: u32,
    pub client: Client,
    state: Mutex<State>,
}

static DRIVER: OnceLock<Result<Driver, CUresult>> = OnceLock::new();

/// `cuInit`: connect once; later calls report the first outcome.
pub fn init() -> CuResult {
    let r = DRIVER.get_or_init(|| {
        Client::connect().map(|client| Driver {
            pid: std::process::id(),
            state: Mutex::new(State::new(client.devices.len())),
            client,
        })
    });
    match r {
        Ok(d) if d.pid != std::process::id() => Err(CUDA_ERROR_NOT_INITIALIZED),
        Ok(_) => Ok(()),
        Err(e) => Err(*e),
    }
}

/// The driver, once `cuInit` succeeded in this process (a forked child must not reuse it).
pub fn driver() -> CuResult<&'static Driver> {
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
    CTX_STACK.with(|s| s.borrow().last().copied())
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
    CTX_STACK.with(|s| s.borrow_mut().retain(|&c| c != ctx))
}

fn thread_key() -> u64 {
    // SAFETY: pthread_self has no preconditions.
    unsafe { libc::pthread_self() as u64 }
}

pub struct Context {
    pub device: u32,
    pub flags: u32,
    pub legacy: u64,
    /// Every stream of the context, the legacy one included.
    pub streams: Vec<u64>,
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
}

#[derive(Default)]
pub struct Event {
    pub flags: u32,
    /// Its slot on the event board, and the generation of its latest record there.
    pub slot: u32,
    pub generation: u64,
    pub record: Option<OpRef>,
    /// Completion time once known, so repeated queries need no round trip.
    pub done_ns: Option<u64>,
    /// Recorded while capturing: the graph and the nodes a waiter must follow.
    pub captured: Option<(u64, u64, Vec<usize>)>,
}

pub struct Module {
    pub functions: HashMap<String, u64>,
    pub globals: HashMap<String, (u64, usize)>,
}

pub struct Function {
    /// NUL-terminated for cuFuncGetName.
    pub name: std::ffi::CString,
    pub params: Vec<usize>,
    pub ptx_version: i32,
    pub module: u64,
}

/// What a device pointer range is.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum AllocKind {
    Device,
    Managed,
    /// Backing of a module `.global`; not counted against capacity.
    Global,
}

pub struct Alloc {
    pub size: usize,
    pub mapped: usize,
    pub device: u32,
    pub charged: u64,
    pub kind: AllocKind,
}

/// One node of a graph. Graphs run their nodes one after another on the launch stream (a
/// valid order: nodes only ever depend on earlier nodes), so edges need not be kept.
#[derive(Clone)]
pub enum NodeKind {
    Empty,
    Kernel {
        function: u64,
        arg0: Option<u64>,
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

#[derive(Default)]
pub struct Graph {
    pub nodes: Vec<NodeKind>,
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
    pub graphs: HashMap<u64, Graph>,
    pub execs: HashMap<u64, Vec<NodeKind>>,
    /// Graph node handles: id → (graph, index).
    pub graph_nodes: HashMap<u64, (u64, usize)>,
    pub allocs: BTreeMap<u64, Alloc>,
    /// Page-locked host buffers (cuMemAllocHost / HostAlloc / HostRegister): base → size.
    pub pinned: BTreeMap<u64, usize>,
}

#[derive(Default, Clone, Copy)]
pub struct Primary {
    pub ctx: Option<u64>,
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
            graphs: HashMap::new(),
            execs: HashMap::new(),
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

    /// Destroy a context's objects here and on the device.
    pub fn destroy_context(&mut self, client: &Client, ctx: u64) -> CuResult {
        let c = self
            .contexts
            .remove(&ctx)
            .ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        for s in &c.streams {
            self.streams.remove(s);
        }
        self.per_thread.retain(|k, _| k.1 != ctx);
        forget_ctx(ctx);
        client.send(&Request::DestroyContext { ctx })
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
        let special = match raw {
            0 if per_thread => Some(true),
            0 | CU_STREAM_LEGACY => Some(false),
            CU_STREAM_PER_THREAD => Some(true),
            _ => None,
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

    /// The implicit dependencies of new work on `stream`: the legacy default stream waits for
    /// every blocking stream of its context, and blocking streams wait for the legacy stream.
    fn implicit_deps(&self, stream: u64, out: &mut Vec<OpRef>) {
        let s = &self.streams[&stream];
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
    pub fn check_not_capturing(&mut self, stream: u64) -> CuResult {
        let s = self
            .streams
            .get_mut(&stream)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if let Some(c) = s.capture.as_mut() {
            c.invalidated = true;
            return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        Ok(())
    }

    /// The allocation containing `[ptr, ptr + len)`, if any.
    pub fn find_alloc(&self, ptr: u64, len: usize) -> Option<(u64, &Alloc)> {
        let (&base, a) = self.allocs.range(..=ptr).next_back()?;
        (ptr.checked_add(len as u64)? <= base + a.size as u64).then_some((base, a))
    }

    pub fn is_pinned(&self, ptr: u64, len: usize) -> bool {
        self.pinned
            .range(..=ptr)
            .next_back()
            .is_some_and(|(&b, &sz)| ptr + len as u64 <= b + sz as u64)
    }
}

/// Lock the driver's state after `cuInit`.
pub fn with_state<T>(f: impl FnOnce(&'static Driver, &mut State) -> CuResult<T>) -> CuResult<T> {
    let d = driver()?;
    let mut st = d.lock();
    f(d, &mut st)
}
