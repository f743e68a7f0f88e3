//! `cudarc-client`: a real cudarc 0.19 program (safe API, libcuda loaded with dlopen at first
//! use) that exercises the CUDA driver. Each subcommand prints one JSON line of results on stdout
//! and exits non-zero with a message on stderr when a call fails or a result is wrong.
//!
//! Run it on the simulated GPU with `gpushare-sim run -- cudarc-client smoke`; it runs unchanged
//! on a real GPU.

use clap::{Parser, Subcommand};
use cudarc::driver::sys::{self, CUevent_flags, CUresult};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaStream, DriverError, LaunchConfig, PushKernelArg,
    result,
};
use cudarc::nvrtc::Ptx;
use gpushare_testkit::direct;
use gpushare_testkit::ptx::{SPIN_KERNEL, SPIN_PTX, TOUCH_KERNEL};
use gpushare_testkit::timeline::Timeline;
use gpushare_testkit::trace;
use rand::{RngExt as _, SeedableRng as _};
use rand_xoshiro::SplitMix64;
use serde_json::{Value, json};
use std::ffi::c_void;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

#[derive(Parser)]
#[command(
    name = "cudarc-client",
    about = "cudarc driver-API client for the simulated GPU"
)]
struct Cli {
    /// CUDA device ordinal to use.
    #[arg(long, default_value_t = 0, global = true)]
    device: usize,
    /// `spin` and `latency`: record each kernel's end with a CUDA timing event and write the
    /// kernels to FILE (JSON Lines, the simulated device's trace format): the measurement on a
    /// GPU without a device trace.
    #[arg(long, value_name = "FILE", global = true)]
    timeline: Option<std::path::PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Context, streams, allocation, copies, memset, PTX module, launches, events, stream waits.
    Smoke,
    /// Launch KERNELS spin kernels of MS each on one stream (per thread); print the wall time.
    Spin {
        /// Device time of each kernel, in milliseconds.
        #[arg(long)]
        ms_per_kernel: f64,
        /// Number of kernels (per thread); unlimited when only --duration-ms is given.
        #[arg(long, required_unless_present = "duration_ms")]
        kernels: Option<u64>,
        /// Stop launching once this much wall time has passed since the first launch (with
        /// --sync-every, so that the queue does not run far ahead of the clock).
        #[arg(long, value_name = "MS", requires = "sync_every")]
        duration_ms: Option<f64>,
        /// Synchronise the stream after every K kernels (default: only at the end).
        #[arg(long, value_name = "K")]
        sync_every: Option<u64>,
        /// Bursty load: after each synchronisation (--sync-every), sleep this long on the host.
        #[arg(long, value_name = "MS", requires = "sync_every")]
        idle_ms: Option<f64>,
        /// Launch from N threads at once, each on a stream of its own, each KERNELS kernels.
        #[arg(long, value_name = "N", default_value_t = 1)]
        threads: u32,
        /// Before the timed launches, launch one kernel and synchronise on the main thread (as
        /// a framework initialising CUDA does before its worker threads start).
        #[arg(long)]
        prelaunch: bool,
        /// Hold a device allocation of this many MiB while spinning.
        #[arg(long, value_name = "MIB")]
        alloc_mib: Option<usize>,
    },
    /// Allocating more than the device has fails with CUDA_ERROR_OUT_OF_MEMORY; 1 MiB then works.
    Oom {
        /// Also fill the device in quarters: four succeed, a fifth fails, freeing one makes room.
        #[arg(long)]
        fill: bool,
    },
    /// Requests arriving at random (Poisson, RATE_HZ per second) for DURATION_MS; each request
    /// is KERNELS spin kernels of MS each and a synchronisation. Prints the latency (arrival to
    /// completion, queueing included) p50/p90/p99/p99.9 in ms.
    Latency {
        /// Mean request arrival rate, per second.
        #[arg(long)]
        rate_hz: f64,
        /// Kernels per request.
        #[arg(long, default_value_t = 4)]
        kernels: u64,
        /// Device time of each kernel, in milliseconds.
        #[arg(long)]
        ms_per_kernel: f64,
        /// How long requests keep arriving.
        #[arg(long, value_name = "MS")]
        duration_ms: f64,
        /// Seed of the arrival process.
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// Host time per cuLaunchKernel of a 1 µs spin kernel, launched back to back, through the
    /// route the program resolves (where an interposer answers) and the driver's own.
    LaunchLatency {
        /// Number of timed launches by each route.
        #[arg(long, default_value_t = 20_000)]
        n: u64,
    },
}

/// A failure, with the call or check that failed.
struct Failure(String);

type Res<T> = Result<T, Failure>;

trait At<T> {
    /// Name the driver call that produced this result.
    fn at(self, what: &str) -> Res<T>;
}

impl<T> At<T> for Result<T, DriverError> {
    fn at(self, what: &str) -> Res<T> {
        self.map_err(|e| Failure(format!("{what}: {}", error_name(&e))))
    }
}

fn error_name(e: &DriverError) -> String {
    match e.error_name() {
        Ok(name) => format!("{} ({:?} = {})", name.to_string_lossy(), e.0, e.0 as i32),
        Err(_) => format!("{:?} = {} (cuGetErrorName failed)", e.0, e.0 as i32),
    }
}

fn check(ok: bool, what: impl FnOnce() -> String) -> Res<()> {
    if ok { Ok(()) } else { Err(Failure(what())) }
}

const ONE_THREAD: LaunchConfig = LaunchConfig {
    grid_dim: (1, 1, 1),
    block_dim: (1, 1, 1),
    shared_mem_bytes: 0,
};

fn timing_event_flags() -> Option<CUevent_flags> {
    Some(CUevent_flags::CU_EVENT_DEFAULT)
}

/// Load the PTX module and its two functions.
fn load(ctx: &Arc<CudaContext>) -> Res<(Arc<CudaModule>, CudaFunction, CudaFunction)> {
    let module = ctx
        .load_module(Ptx::from_src(SPIN_PTX))
        .at("cuModuleLoadData (gpushare_spin.ptx)")?;
    let spin = module
        .load_function(SPIN_KERNEL)
        .at("cuModuleGetFunction(gpushare_spin)")?;
    let touch = module
        .load_function(TOUCH_KERNEL)
        .at("cuModuleGetFunction(touch)")?;
    Ok((module, spin, touch))
}

/// Launch `gpushare_spin(ns)` with one thread on `stream`.
fn spin(stream: &CudaStream, f: &CudaFunction, ns: u64) -> Res<()> {
    let mut b = stream.launch_builder(f);
    b.arg(&ns);
    // SAFETY: gpushare_spin takes exactly one u64 parameter and touches no memory.
    unsafe { b.launch(ONE_THREAD) }.at("cuLaunchKernel(gpushare_spin)")?;
    Ok(())
}

/// Device time of a 5 ms kernel queued ahead of timed work by [`timed`].
const PAD_NS: u64 = 5_000_000;

/// Device time between two timing events recorded around `work` on `stream`, in ms.
///
/// With `pad`, a [`PAD_NS`] spin kernel is queued first, so the start event completes when it
/// does and `work` follows at once on the device: the result is the device time of `work`
/// alone, without the host's launch latency (as when timing a kernel on a busy real GPU).
fn timed(
    stream: &Arc<CudaStream>,
    pad: Option<&CudaFunction>,
    what: &str,
    work: impl FnOnce() -> Res<()>,
) -> Res<f32> {
    if let Some(spin_f) = pad {
        spin(stream, spin_f, PAD_NS)?;
    }
    let start = stream
        .record_event(timing_event_flags())
        .at(&format!("cuEventRecord (start of {what})"))?;
    work()?;
    let end = stream
        .record_event(timing_event_flags())
        .at(&format!("cuEventRecord (end of {what})"))?;
    start
        .elapsed_ms(&end)
        .at(&format!("cuEventElapsedTime ({what})"))
}

fn smoke(device: usize) -> Res<Value> {
    let ctx = CudaContext::new(device).at("CudaContext::new")?;
    let device_count = CudaContext::device_count().at("cuDeviceGetCount")?;
    let name = ctx.name().at("cuDeviceGetName")?;
    let total_mem = ctx.total_mem().at("cuDeviceTotalMem")?;
    let (cc_major, cc_minor) = ctx
        .compute_capability()
        .at("cuDeviceGetAttribute(compute capability)")?;
    let (free, total) = ctx.mem_get_info().at("cuMemGetInfo")?;
    check(total as u64 == total_mem as u64 && free <= total, || {
        format!("cuMemGetInfo: free {free} total {total}, but cuDeviceTotalMem says {total_mem}")
    })?;

    let stream = ctx.new_stream().at("cuStreamCreate")?;

    // Copies round-trip.
    const N: usize = 1 << 20;
    let host: Vec<u32> = (0..N as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) ^ 0x5555)
        .collect();
    // SAFETY: the buffer is written before it is read.
    let mut buf = unsafe { stream.alloc::<u32>(N) }.at("cuMemAlloc (4 MiB)")?;
    stream
        .memcpy_htod(&host, &mut buf)
        .at("cuMemcpyHtoDAsync (4 MiB)")?;
    let back = stream.clone_dtoh(&buf).at("cuMemcpyDtoHAsync (4 MiB)")?;
    check(back == host, || {
        let i = back.iter().zip(&host).position(|(a, b)| a != b);
        format!("HtoD/DtoH round trip differs (first difference at index {i:?})")
    })?;
    let copy = stream.clone_dtod(&buf).at("cuMemcpyDtoDAsync (4 MiB)")?;
    let back = stream
        .clone_dtoh(&copy)
        .at("cuMemcpyDtoHAsync (DtoD copy)")?;
    check(back == host, || "DtoD copy differs from the source".into())?;
    stream.memset_zeros(&mut buf).at("cuMemsetD8Async")?;
    let zeros = stream
        .clone_dtoh(&buf)
        .at("cuMemcpyDtoHAsync (after memset)")?;
    check(zeros.iter().all(|&v| v == 0), || {
        format!(
            "memset_zeros left {} non-zero words",
            zeros.iter().filter(|&&v| v != 0).count()
        )
    })?;
    let (free_after, _) = ctx.mem_get_info().at("cuMemGetInfo (after alloc)")?;
    check(free_after + 2 * N * 4 <= free, || {
        format!("two 4 MiB buffers allocated, but free memory went from {free} to {free_after}")
    })?;

    // Module, functions, a missing function.
    let (module, spin_f, touch_f) = load(&ctx)?;
    let missing = match module.load_function("no_such_kernel") {
        Err(DriverError(CUresult::CUDA_ERROR_NOT_FOUND)) => "CUDA_ERROR_NOT_FOUND".to_string(),
        Err(e) => {
            return Err(Failure(format!(
                "cuModuleGetFunction(no_such_kernel): expected CUDA_ERROR_NOT_FOUND, got {}",
                error_name(&e)
            )));
        }
        Ok(_) => {
            return Err(Failure(
                "cuModuleGetFunction(no_such_kernel) succeeded".into(),
            ));
        }
    };

    // A 2 ms spin timed with events: behind a pad kernel (device time only) and on an idle
    // stream (device time plus the host time from the start event's record to the launch).
    let pad = Some(&spin_f);
    let spin_ms = timed(&stream, pad, "2 ms spin", || {
        spin(&stream, &spin_f, 2_000_000)
    })?;
    let spin_idle_ms = timed(&stream, None, "2 ms spin, idle stream", || {
        spin(&stream, &spin_f, 2_000_000)
    })?;

    // The two-parameter kernel on the created stream.
    let mut b = stream.launch_builder(&touch_f);
    let n = N as u32;
    b.arg(&mut buf).arg(&n);
    // SAFETY: touch(ptr, n) writes n u32 values into buf, which holds N of them.
    unsafe { b.launch(LaunchConfig::for_num_elems(n)) }.at("cuLaunchKernel(touch)")?;
    stream.synchronize().at("cuStreamSynchronize")?;

    // The legacy default stream and the per-thread default stream.
    let default = ctx.default_stream();
    let default_ms = timed(&default, pad, "spin on the default stream", || {
        spin(&default, &spin_f, 500_000)
    })?;
    default
        .synchronize()
        .at("cuStreamSynchronize (default stream)")?;
    let per_thread = ctx.per_thread_stream();
    let per_thread_ms = timed(&per_thread, pad, "spin on the per-thread stream", || {
        spin(&per_thread, &spin_f, 500_000)
    })?;
    per_thread
        .synchronize()
        .at("cuStreamSynchronize (per-thread stream)")?;

    // Cross-stream ordering: 1 ms on `stream`; s2 waits for it and runs 0.5 ms; `stream` joins
    // s2 and runs 0.25 ms. Measured on `stream`, the whole chain takes 1.75 ms.
    let s2 = ctx.new_stream().at("cuStreamCreate (second stream)")?;
    let cross_stream_ms = timed(&stream, pad, "cross-stream chain", || {
        spin(&stream, &spin_f, 1_000_000)?;
        let ev = stream
            .record_event(None)
            .at("cuEventRecord (stream -> s2)")?;
        s2.wait(&ev).at("cuStreamWaitEvent (s2 waits on stream)")?;
        spin(&s2, &spin_f, 500_000)?;
        stream.join(&s2).at("cuStreamWaitEvent (stream joins s2)")?;
        spin(&stream, &spin_f, 250_000)
    })?;
    ctx.synchronize().at("cuCtxSynchronize")?;

    Ok(json!({
        "pid": std::process::id(),
        "device": device,
        "device_count": device_count,
        "name": name,
        "compute_capability": [cc_major, cc_minor],
        "total_mem": total_mem,
        "mem_free": free,
        "mem_total": total,
        "round_trip_bytes": N * 4,
        "missing_function": missing,
        "spin_ms": spin_ms,
        "spin_idle_stream_ms": spin_idle_ms,
        "default_stream_ms": default_ms,
        "per_thread_stream_ms": per_thread_ms,
        "cross_stream_ms": cross_stream_ms,
    }))
}

/// What `spin` launches: how many kernels of how long, and how it pauses.
struct SpinPlan {
    ns: u64,
    kernels: u64,
    duration: Option<std::time::Duration>,
    sync_every: Option<u64>,
    idle: Option<std::time::Duration>,
}

impl SpinPlan {
    /// Launch the plan on `stream` (with the stream's context bound to this thread); returns
    /// the number of kernels launched. The last kernels may still be queued.
    fn run(
        &self,
        stream: &Arc<CudaStream>,
        f: &CudaFunction,
        t0: Instant,
        mut timeline: Option<&mut Timeline>,
    ) -> Res<u64> {
        let mut launched = 0;
        while launched < self.kernels && self.duration.is_none_or(|d| t0.elapsed() < d) {
            spin(stream, f, self.ns)?;
            launched += 1;
            if let Some(t) = timeline.as_deref_mut() {
                t.kernel(stream, self.ns).at("cuEventRecord (timeline)")?;
            }
            if self.sync_every.is_some_and(|k| launched % k == 0) {
                stream.synchronize().at("cuStreamSynchronize")?;
                if let Some(t) = timeline.as_deref_mut() {
                    t.collect().at("cuEventElapsedTime (timeline)")?;
                }
                if let Some(idle) = self.idle {
                    std::thread::sleep(idle);
                }
            }
        }
        Ok(launched)
    }
}

/// With `--timeline`, a timeline anchored on `stream` (idle: nothing of this program queued).
fn anchor_timeline(
    to: Option<&Path>,
    ctx: &Arc<CudaContext>,
    stream: &CudaStream,
    device: usize,
) -> Res<Option<Timeline>> {
    to.map(|_| Timeline::start(ctx, stream, device as u32))
        .transpose()
        .at("timeline anchor (cuEventRecord, cuEventQuery)")
}

/// The kernels a timeline recorded (none without one), once its stream is synchronised.
fn timeline_records(t: Option<Timeline>) -> Res<Vec<trace::Record>> {
    t.map_or(Ok(Vec::new()), |t| {
        t.finish().at("cuEventElapsedTime (timeline)")
    })
}

/// Write the kernels of `--timeline`.
fn write_timeline(path: &Path, records: Vec<trace::Record>) -> Res<()> {
    trace::Trace::from_records(records)
        .write(path)
        .map_err(|e| Failure(format!("cannot write the timeline {}: {e}", path.display())))
}

/// CLOCK_MONOTONIC in nanoseconds, the time base of the device trace.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[allow(clippy::too_many_arguments)]
fn spin_cmd(
    device: usize,
    ms_per_kernel: f64,
    kernels: Option<u64>,
    duration_ms: Option<f64>,
    sync_every: Option<u64>,
    idle_ms: Option<f64>,
    threads: u32,
    prelaunch: bool,
    alloc_mib: Option<usize>,
    timeline_to: Option<&Path>,
) -> Res<Value> {
    check(ms_per_kernel >= 0.0 && ms_per_kernel.is_finite(), || {
        format!("--ms-per-kernel {ms_per_kernel} must be a non-negative number")
    })?;
    check(sync_every != Some(0), || {
        "--sync-every must be at least 1".into()
    })?;
    check(threads >= 1, || "--threads must be at least 1".into())?;
    let ms = |what: &str, v: Option<f64>| -> Res<Option<std::time::Duration>> {
        match v {
            Some(v) if !(v >= 0.0 && v.is_finite()) => Err(Failure(format!(
                "--{what} {v} must be a non-negative number of milliseconds"
            ))),
            v => Ok(v.map(|v| std::time::Duration::from_secs_f64(v / 1e3))),
        }
    };
    let plan = SpinPlan {
        ns: (ms_per_kernel * 1e6).round() as u64,
        kernels: kernels.unwrap_or(u64::MAX),
        duration: ms("duration-ms", duration_ms)?,
        sync_every,
        idle: ms("idle-ms", idle_ms)?,
    };
    let ctx = CudaContext::new(device).at("CudaContext::new")?;
    let streams = (0..threads)
        .map(|_| ctx.new_stream().at("cuStreamCreate"))
        .collect::<Res<Vec<_>>>()?;
    let (_module, spin_f, _) = load(&ctx)?;
    // SAFETY: never read.
    let _held = match alloc_mib {
        Some(mib) => {
            Some(unsafe { streams[0].alloc::<u8>(mib << 20) }.at("cuMemAlloc (--alloc-mib)")?)
        }
        None => None,
    };
    if prelaunch {
        spin(&streams[0], &spin_f, plan.ns)?;
        streams[0]
            .synchronize()
            .at("cuStreamSynchronize (prelaunch)")?;
    }
    // One anchor, placed before anything is launched; a timeline per launching thread.
    let anchored = anchor_timeline(timeline_to, &ctx, &streams[0], device)?;
    let mut records = Vec::new();
    let start_ns = monotonic_ns();
    let wall = Instant::now();
    let (launched, device_ms) = if threads == 1 {
        let mut launched = 0;
        let mut tl = anchored;
        let device_ms = timed(&streams[0], None, "spin kernels", || {
            launched = plan.run(&streams[0], &spin_f, wall, tl.as_mut())?;
            Ok(())
        })?;
        streams[0].synchronize().at("cuStreamSynchronize")?;
        records = timeline_records(tl)?;
        (launched, Some(device_ms))
    } else {
        let per_thread = std::thread::scope(|scope| {
            let handles: Vec<_> = streams
                .iter()
                .map(|stream| {
                    let (ctx, plan, f) = (&ctx, &plan, &spin_f);
                    let mut tl = anchored.as_ref().map(Timeline::sibling);
                    scope.spawn(move || {
                        ctx.bind_to_thread()
                            .at("cuCtxSetCurrent (launcher thread)")?;
                        let launched = plan.run(stream, f, wall, tl.as_mut())?;
                        stream.synchronize().at("cuStreamSynchronize")?;
                        Ok((launched, timeline_records(tl)?))
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(Failure("a launcher thread panicked".into())))
                })
                .collect::<Res<Vec<(u64, Vec<trace::Record>)>>>()
        })?;
        let mut launched = 0;
        for (n, r) in per_thread {
            launched += n;
            records.extend(r);
        }
        (launched, None)
    };
    ctx.synchronize().at("cuCtxSynchronize")?;
    if let Some(path) = timeline_to {
        write_timeline(path, records)?;
    }
    let wall_ms = wall.elapsed().as_secs_f64() * 1e3;
    Ok(json!({
        "pid": std::process::id(),
        "device": device,
        "threads": threads,
        "kernels": launched,
        "ms_per_kernel": ms_per_kernel,
        "sync_every": sync_every,
        "idle_ms": idle_ms,
        "start_ns": start_ns,
        "end_ns": monotonic_ns(),
        "wall_ms": wall_ms,
        "device_ms": device_ms,
    }))
}

fn oom(device: usize, fill: bool) -> Res<Value> {
    let ctx = CudaContext::new(device).at("CudaContext::new")?;
    let stream = ctx.default_stream();
    let total = ctx.total_mem().at("cuDeviceTotalMem")?;
    // SAFETY: never read; this allocation must fail.
    match unsafe { stream.alloc::<u8>(total + 1) } {
        Err(DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY)) => {}
        Err(e) => {
            return Err(Failure(format!(
                "cuMemAlloc(total + 1 = {} bytes): expected CUDA_ERROR_OUT_OF_MEMORY, got {}",
                total + 1,
                error_name(&e)
            )));
        }
        Ok(_) => {
            return Err(Failure(format!(
                "cuMemAlloc(total + 1 = {} bytes) succeeded on a {total}-byte device",
                total + 1
            )));
        }
    }
    // SAFETY: never read.
    let small = unsafe { stream.alloc::<u8>(1 << 20) }.at("cuMemAlloc (1 MiB after OOM)")?;
    drop(small);

    let mut quarters_allocated = None;
    let mut realloc_after_free = None;
    if fill {
        let quarter = total / 4;
        let mut held = Vec::new();
        let mut first_error = None;
        for _ in 0..5 {
            // SAFETY: never read.
            match unsafe { stream.alloc::<u8>(quarter) } {
                Ok(b) => held.push(b),
                Err(e) => {
                    first_error = Some(e);
                    break;
                }
            }
        }
        check(held.len() == 4, || {
            format!(
                "filling the device with {quarter}-byte quarters: {} succeeded, expected 4",
                held.len()
            )
        })?;
        check(
            first_error == Some(DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY)),
            || {
                format!(
                    "the fifth quarter should fail with CUDA_ERROR_OUT_OF_MEMORY, got {:?}",
                    first_error.as_ref().map(error_name)
                )
            },
        )?;
        let (free, _) = ctx.mem_get_info().at("cuMemGetInfo (device full)")?;
        check(free < quarter, || {
            format!("device full but cuMemGetInfo reports {free} bytes free")
        })?;
        held.pop();
        // SAFETY: never read.
        let again = unsafe { stream.alloc::<u8>(quarter) }
            .at("cuMemAlloc (a quarter after freeing one)")?;
        held.push(again);
        quarters_allocated = Some(4);
        realloc_after_free = Some(true);
    }
    Ok(json!({
        "pid": std::process::id(),
        "device": device,
        "total": total,
        "oom": "CUDA_ERROR_OUT_OF_MEMORY",
        "small_alloc_after_oom": true,
        "quarters_allocated": quarters_allocated,
        "realloc_after_free": realloc_after_free,
    }))
}

/// The `q`-quantile (0..=1) of sorted `v` (nearest rank), or 0 when empty.
fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let i = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    v[i]
}

fn latency_cmd(
    device: usize,
    rate_hz: f64,
    kernels: u64,
    ms_per_kernel: f64,
    duration_ms: f64,
    seed: u64,
    timeline_to: Option<&Path>,
) -> Res<Value> {
    check(rate_hz > 0.0 && rate_hz.is_finite(), || {
        format!("--rate-hz {rate_hz} must be positive")
    })?;
    check(kernels >= 1, || "--kernels must be at least 1".into())?;
    check(ms_per_kernel >= 0.0 && duration_ms >= 0.0, || {
        "--ms-per-kernel and --duration-ms must be non-negative".into()
    })?;
    let ctx = CudaContext::new(device).at("CudaContext::new")?;
    let stream = ctx.new_stream().at("cuStreamCreate")?;
    let (_module, spin_f, _) = load(&ctx)?;
    let ns = (ms_per_kernel * 1e6).round() as u64;
    // Warm the launch path so the first request does not pay for module loading.
    spin(&stream, &spin_f, 1_000)?;
    stream.synchronize().at("cuStreamSynchronize (warm-up)")?;
    let mut tl = anchor_timeline(timeline_to, &ctx, &stream, device)?;
    // Exponential inter-arrival times from a fixed algorithm: a seed names the same arrivals on
    // every platform and release.
    let mut rng = SplitMix64::seed_from_u64(seed);
    let start_ns = monotonic_ns();
    let t0 = Instant::now();
    let end = std::time::Duration::from_secs_f64(duration_ms / 1e3);
    let mut next = std::time::Duration::ZERO;
    let mut lat_ms = Vec::new();
    let mut arrivals_ns = Vec::new();
    loop {
        // 1 − u lies in (0, 1]: its logarithm is finite.
        let u: f64 = rng.random();
        next += std::time::Duration::from_secs_f64(-(1.0 - u).ln() / rate_hz);
        if next >= end {
            break;
        }
        arrivals_ns.push(start_ns + next.as_nanos() as u64);
        let now = t0.elapsed();
        if now < next {
            std::thread::sleep(next - now);
        }
        for _ in 0..kernels {
            spin(&stream, &spin_f, ns)?;
            if let Some(t) = tl.as_mut() {
                t.kernel(&stream, ns).at("cuEventRecord (timeline)")?;
            }
        }
        stream.synchronize().at("cuStreamSynchronize (request)")?;
        if let Some(t) = tl.as_mut() {
            t.collect().at("cuEventElapsedTime (timeline)")?;
        }
        lat_ms.push((t0.elapsed().saturating_sub(next)).as_secs_f64() * 1e3);
    }
    if let Some(path) = timeline_to {
        write_timeline(path, timeline_records(tl)?)?;
    }
    let mut sorted = lat_ms.clone();
    sorted.sort_by(f64::total_cmp);
    let mean = sorted.iter().sum::<f64>() / sorted.len().max(1) as f64;
    Ok(json!({
        "pid": std::process::id(),
        "device": device,
        "requests": sorted.len(),
        "kernels_per_request": kernels,
        "ms_per_kernel": ms_per_kernel,
        "rate_hz": rate_hz,
        "start_ns": start_ns,
        "end_ns": monotonic_ns(),
        "latency_mean_ms": mean,
        "latency_p50_ms": quantile(&sorted, 0.50),
        "latency_p90_ms": quantile(&sorted, 0.90),
        "latency_p99_ms": quantile(&sorted, 0.99),
        "latency_p999_ms": quantile(&sorted, 0.999),
        "latency_max_ms": sorted.last().copied().unwrap_or(0.0),
        "arrivals_ns": arrivals_ns,
        "latencies_ms": lat_ms,
    }))
}

fn launch_latency(device: usize, n: u64) -> Res<Value> {
    check(n > 0, || "--n must be at least 1".into())?;
    const KERNEL_NS: u64 = 1_000;
    const WARM_UP: u64 = 100;
    let ctx = CudaContext::new(device).at("CudaContext::new")?;
    let stream = ctx.new_stream().at("cuStreamCreate")?;
    let (_module, spin_f, _) = load(&ctx)?;
    // Warm up the launch path (connection buffers, allocator, caches) with a tenth of the run.
    for _ in 0..WARM_UP.max(n / 10) {
        spin(&stream, &spin_f, KERNEL_NS)?;
    }
    stream.synchronize().at("cuStreamSynchronize (warm-up)")?;

    // Raw cuLaunchKernel, as a framework calling the driver directly would, by two routes to
    // the same driver function: the one the application resolves (dynamic linker, dlsym: where
    // an interposer such as gpushare's hook answers) and the driver's own, past any
    // interposition. Timed in blocks of each route, paired and in alternating order: each
    // figure is the median block, so a pause of the whole machine (a virtual machine may stop
    // for milliseconds every few seconds) does not land in it, and the ratio of the routes is the
    // median of the pairs' ratios, both measured under the same conditions. Each block starts
    // with the stream idle (synchronised, untimed): the measure is the launch path while the
    // GPU keeps up, and neither route inherits the kernels the other left queued (the hook would
    // pace a queue that the driver's own entry built up).
    const BLOCK: u64 = 100;
    type LaunchFn = unsafe extern "C" fn(
        sys::CUfunction,
        u32,
        u32,
        u32,
        u32,
        u32,
        u32,
        u32,
        sys::CUstream,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> CUresult;
    let found = direct::loaded_symbol("libcuda.so", "cuLaunchKernel").map_err(Failure)?;
    // SAFETY: the driver's cuLaunchKernel, whose C signature this is.
    let direct: LaunchFn = unsafe { std::mem::transmute(found) };
    let f = spin_f.cu_function();
    let s = stream.cu_stream();
    let mut arg = KERNEL_NS;
    let mut launch = |direct_route: bool| -> Res<()> {
        let mut params = [&mut arg as *mut u64 as *mut c_void];
        // SAFETY: gpushare_spin takes one u64; `arg` outlives the call (params are copied).
        if direct_route {
            let r = unsafe {
                direct(
                    f,
                    1,
                    1,
                    1,
                    1,
                    1,
                    1,
                    0,
                    s,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            };
            r.result().at("cuLaunchKernel (driver's own)")
        } else {
            unsafe { result::launch_kernel(f, (1, 1, 1), (1, 1, 1), 0, s, &mut params) }
                .at("cuLaunchKernel")
        }
    };
    let (mut linked, mut own, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    let t = Instant::now();
    for pair in 0..n.div_ceil(BLOCK) {
        let len = BLOCK.min(n - pair * BLOCK);
        let mut times = [0.0; 2];
        for i in 0..2 {
            let direct_route = (pair + i) % 2 == 1;
            let tb = Instant::now();
            for _ in 0..len {
                launch(direct_route)?;
            }
            times[direct_route as usize] = tb.elapsed().as_nanos() as f64 / len as f64;
            stream
                .synchronize()
                .at("cuStreamSynchronize (between blocks)")?;
        }
        linked.push(times[0]);
        own.push(times[1]);
        ratios.push(times[1] / times[0]);
    }
    let mean_ns = t.elapsed().as_nanos() as f64 / (2 * n) as f64;
    for v in [&mut linked, &mut own, &mut ratios] {
        v.sort_by(f64::total_cmp);
    }
    stream.synchronize().at("cuStreamSynchronize")?;

    // Through cudarc's launch builder (adds a cuCtxGetCurrent per launch).
    let t = Instant::now();
    for _ in 0..n {
        spin(&stream, &spin_f, KERNEL_NS)?;
    }
    let builder_ns = t.elapsed().as_nanos() as f64 / n as f64;
    let t = Instant::now();
    stream.synchronize().at("cuStreamSynchronize")?;
    let drain_ms = t.elapsed().as_secs_f64() * 1e3;
    Ok(json!({
        "pid": std::process::id(),
        "device": device,
        "n": n,
        "warm_up": WARM_UP.max(n / 10),
        "kernel_ns": KERNEL_NS,
        "ns_per_launch": quantile(&linked, 0.5),
        "ns_per_launch_direct": quantile(&own, 0.5),
        "direct_over_linked": quantile(&ratios, 0.5),
        "direct_over_linked_p25": quantile(&ratios, 0.25),
        "direct_over_linked_p75": quantile(&ratios, 0.75),
        "ns_per_launch_mean": mean_ns,
        "ns_per_launch_builder": builder_ns,
        "final_sync_ms": drain_ms,
    }))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if cli.timeline.is_some() && !matches!(cli.cmd, Cmd::Spin { .. } | Cmd::Latency { .. }) {
        eprintln!("cudarc-client: --timeline records the kernels of `spin` and `latency` only");
        return ExitCode::FAILURE;
    }
    let (name, result) = match cli.cmd {
        Cmd::Smoke => ("smoke", smoke(cli.device)),
        Cmd::Spin {
            ms_per_kernel,
            kernels,
            duration_ms,
            sync_every,
            idle_ms,
            threads,
            prelaunch,
            alloc_mib,
        } => (
            "spin",
            spin_cmd(
                cli.device,
                ms_per_kernel,
                kernels,
                duration_ms,
                sync_every,
                idle_ms,
                threads,
                prelaunch,
                alloc_mib,
                cli.timeline.as_deref(),
            ),
        ),
        Cmd::Oom { fill } => ("oom", oom(cli.device, fill)),
        Cmd::Latency {
            rate_hz,
            kernels,
            ms_per_kernel,
            duration_ms,
            seed,
        } => (
            "latency",
            latency_cmd(
                cli.device,
                rate_hz,
                kernels,
                ms_per_kernel,
                duration_ms,
                seed,
                cli.timeline.as_deref(),
            ),
        ),
        Cmd::LaunchLatency { n } => ("launch-latency", launch_latency(cli.device, n)),
    };
    match result {
        Ok(v) => {
            println!("{v}");
            ExitCode::SUCCESS
        }
        Err(Failure(msg)) => {
            eprintln!("cudarc-client {name}: FAILED: {msg}");
            ExitCode::FAILURE
        }
    }
}
