//! A connection flood against a scheduler's tenant socket, shared by the flood test
//! (`tests/flood.rs`) and the benchmark's `[flood]` scenarios: connections that said Hello and
//! then nothing more, connections sending junk (each dropped by the scheduler and opened again
//! every `junk_renew_ms`), connections stalled with half a frame after their Hello, and
//! connections stalled halfway through their Hello. Also what a flooded run watches: the
//! scheduler's thread count and how long `gpushare status` takes.

use crate::node::status_json_at;
use gpushare_protocol::{ClientMsg, PROTOCOL_VERSION};
use serde::{Deserialize, Serialize};
use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How many connections of each kind (the defaults: the flood test's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FloodSpec {
    /// Connections that said Hello, then nothing more.
    pub idle: usize,
    /// Connections sending junk, each replaced by a new one every `junk_renew_ms`.
    pub junk: usize,
    pub junk_renew_ms: u64,
    /// Connections with half a frame after their Hello.
    pub stalled_after_hello: usize,
    /// Connections with half a Hello (the scheduler closes them after its `hello_timeout`).
    pub mid_hello: usize,
}

impl Default for FloodSpec {
    fn default() -> Self {
        FloodSpec {
            idle: 2000,
            junk: 300,
            junk_renew_ms: 100,
            stalled_after_hello: 100,
            mid_hello: 100,
        }
    }
}

impl FloodSpec {
    /// Connections open at once at most.
    pub fn connections(&self) -> usize {
        self.idle + self.junk + self.stalled_after_hello + self.mid_hello
    }
}

/// What became of a flood's connections, once stopped.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct FloodOutcome {
    /// Idle connections (said Hello) still open.
    pub idle_open: usize,
    /// Junk connections opened in all.
    pub junk_opened: u64,
    /// Connections stalled mid-frame after their Hello still open.
    pub stalled_after_hello_open: usize,
    /// Mid-Hello connections still open, and how long ago they were made (s).
    pub mid_hello_open: usize,
    pub mid_hello_age_s: f64,
}

/// A running flood; [`Flood::stop`] ends it (dropping it closes every connection too).
pub struct Flood {
    idle: Vec<UnixStream>,
    stalled_after_hello: Vec<UnixStream>,
    mid_hello: Vec<UnixStream>,
    mid_hello_sent: Instant,
    stop: Arc<AtomicBool>,
    opened: Arc<AtomicU64>,
    junk: Option<JoinHandle<()>>,
}

impl Flood {
    /// Open the idle and stalled connections to `socket` and start renewing the junk ones.
    /// Needs about [`FloodSpec::connections`] open files (see [`raise_open_files_limit`]).
    pub fn start(socket: &Path, spec: &FloodSpec) -> std::io::Result<Flood> {
        let hello = hello();
        let idle = (0..spec.idle)
            .map(|_| connect_and_send(socket, &hello))
            .collect::<std::io::Result<_>>()?;
        let stalled_after_hello = (0..spec.stalled_after_hello)
            .map(|_| {
                let mut bytes = hello.clone();
                bytes.extend_from_slice(&[40, 0, 0, 0, 1, 2, 3]);
                connect_and_send(socket, &bytes)
            })
            .collect::<std::io::Result<_>>()?;
        let mid_hello = (0..spec.mid_hello)
            .map(|_| connect_and_send(socket, &hello[..hello.len() - 1]))
            .collect::<std::io::Result<_>>()?;
        let mid_hello_sent = Instant::now();
        let stop = Arc::new(AtomicBool::new(false));
        let opened = Arc::new(AtomicU64::new(0));
        let junk = {
            let (socket, stop, opened) = (socket.to_path_buf(), stop.clone(), opened.clone());
            let (n, every) = (spec.junk, Duration::from_millis(spec.junk_renew_ms));
            std::thread::spawn(move || junk_senders(&socket, n, every, &stop, &opened))
        };
        Ok(Flood {
            idle,
            stalled_after_hello,
            mid_hello,
            mid_hello_sent,
            stop,
            opened,
            junk: Some(junk),
        })
    }

    /// Stop renewing the junk connections, and see which of the others the scheduler closed.
    pub fn stop(mut self) -> FloodOutcome {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(j) = self.junk.take() {
            let _ = j.join();
        }
        let open = |v: &[UnixStream]| v.iter().filter(|s| !closed(s)).count();
        FloodOutcome {
            idle_open: open(&self.idle),
            junk_opened: self.opened.load(Ordering::Relaxed),
            stalled_after_hello_open: open(&self.stalled_after_hello),
            mid_hello_open: open(&self.mid_hello),
            mid_hello_age_s: self.mid_hello_sent.elapsed().as_secs_f64(),
        }
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(j) = self.junk.take() {
            let _ = j.join();
        }
    }
}

/// Raise this process's soft limit of open files to at least `want` (the scheduler raises its
/// own); the limit now, or why it cannot reach `want` (the hard limit).
pub fn raise_open_files_limit(want: u64) -> Result<u64, String> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid rlimit struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return Err(format!("getrlimit: {}", std::io::Error::last_os_error()));
        }
        lim.rlim_cur = lim.rlim_cur.max(want.min(lim.rlim_max));
        if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
            return Err(format!("setrlimit: {}", std::io::Error::last_os_error()));
        }
    }
    if lim.rlim_cur < want {
        return Err(format!(
            "{want} open files needed; the hard limit is {}",
            lim.rlim_max
        ));
    }
    Ok(lim.rlim_cur)
}

/// A Hello frame.
pub fn hello() -> Vec<u8> {
    let mut frame = Vec::new();
    let msg = ClientMsg::Hello {
        version: PROTOCOL_VERSION,
        declared: None,
    };
    gpushare_protocol::encode(&msg, &mut frame).expect("encode Hello");
    frame
}

fn connect_and_send(socket: &Path, bytes: &[u8]) -> std::io::Result<UnixStream> {
    let mut s = UnixStream::connect(socket)?;
    s.write_all(bytes)?;
    Ok(s)
}

/// Whether the scheduler has closed `s` (what it sent before is skipped; never blocks).
fn closed(mut s: &UnixStream) -> bool {
    if s.set_nonblocking(true).is_err() {
        return true;
    }
    let mut buf = [0u8; 256];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return false,
            Err(_) => return true,
        }
    }
}

/// Keep `n` connections sending junk until `stop`: every `every` a round replaces each one with
/// a new connection and new junk (a garbage frame, a huge length, a Hello then garbage),
/// counting them in `opened`.
fn junk_senders(socket: &Path, n: usize, every: Duration, stop: &AtomicBool, opened: &AtomicU64) {
    let mut hello_then_garbage = hello();
    hello_then_garbage.extend_from_slice(&[5, 0, 0, 0, 0xfe, 0xfe, 0xfe, 0xfe, 0xfe]);
    let junk: [&[u8]; 3] = [
        &[8, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
        &[0xf0, 0xff, 0xff, 0xff, 1, 2, 3, 4],
        &hello_then_garbage,
    ];
    // The flooder competes with the tenants for a small machine's CPU: at low priority, what is
    // measured is what the flood does to the scheduler, not what it does to the CPU.
    // SAFETY: setpriority on this thread (Linux: a thread id is a PRIO_PROCESS id).
    unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 10) };
    let mut slots: Vec<Option<UnixStream>> = (0..n).map(|_| None).collect();
    let mut round = 0;
    while !stop.load(Ordering::Relaxed) {
        for (i, slot) in slots.iter_mut().enumerate() {
            *slot = UnixStream::connect(socket).ok().inspect(|mut s| {
                let _ = s.write_all(junk[(i + round) % junk.len()]);
            });
            opened.fetch_add(1, Ordering::Relaxed);
        }
        round += 1;
        // Paced, so that the flood is many connections rather than all of the machine's CPU.
        std::thread::sleep(every);
    }
}

/// Threads of process `pid` (`/proc/PID/task`); `None` once it is gone.
pub fn threads_of(pid: u32) -> Option<usize> {
    Some(std::fs::read_dir(format!("/proc/{pid}/task")).ok()?.count())
}

/// What [`Watch`] saw.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Watched {
    /// The scheduler's thread count at each sample.
    pub threads: Vec<usize>,
    /// How long each `gpushare status --json` took (s), the failed ones included.
    pub status_s: Vec<f64>,
    /// Why `gpushare status` failed, when it did.
    pub status_failures: Vec<String>,
}

/// Samples, every `period` until stopped, the thread count of a scheduler and the time
/// `gpushare status --json` takes against its socket.
pub struct Watch {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Watched>>,
}

impl Watch {
    pub fn start(pid: u32, socket: PathBuf, period: Duration) -> Watch {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut w = Watched::default();
                while !stop.load(Ordering::Relaxed) {
                    w.threads.extend(threads_of(pid));
                    let t = Instant::now();
                    // A status call that overran its 5 s panics in its own thread.
                    let result = std::thread::scope(|s| {
                        s.spawn(|| status_json_at(&socket))
                            .join()
                            .unwrap_or_else(|_| Err("did not answer within 5 s".into()))
                    });
                    w.status_s.push(t.elapsed().as_secs_f64());
                    match result {
                        Ok(v) if v["gpus"].is_array() => {}
                        Ok(v) => w.status_failures.push(format!("no gpus in {v}")),
                        Err(e) => w.status_failures.push(e),
                    }
                    let until = Instant::now() + period;
                    while !stop.load(Ordering::Relaxed) && Instant::now() < until {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
                w
            })
        };
        Watch {
            stop,
            thread: Some(thread),
        }
    }

    pub fn stop(mut self) -> Watched {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .take()
            .and_then(|t| t.join().ok())
            .unwrap_or_default()
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}
