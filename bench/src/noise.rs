//! Noisy-host mode (`--noisy`): a deterministic disturbance, so that robustness can be shown on
//! any machine, quiet or not.
//!
//! For the whole of each run:
//! - `hogs` CPU hog processes (default 1), each spinning on one core;
//! - random stalls: a process chosen uniformly among the run's tenants and the scheduler daemon
//!   is stopped (`SIGSTOP`) and continued (`SIGCONT`) after a duration uniform in
//!   `[stall_min_ms, stall_max_ms]` (default 0.1–5 ms); the waits between the end of one stall
//!   and the start of the next are exponential with mean `stall_mean_interval_ms` (default
//!   50 ms: a Poisson process of stalls). The simulated device is never stalled (it stands for
//!   the GPU).
//!
//! The sequence of `(wait, victim index, duration)` comes from a seeded generator
//! ([`StallSchedule`]): the same seed gives the same sequence. Each run's seed is derived from
//! `--noise-seed` and the run's label ([`run_seed`]), so a run's stalls do not depend on which
//! runs came before it.
//!
//! A stopped process is always continued: at the end of its stall, when the disturbance stops or
//! is dropped (error and panic paths), and, if the benchmark is interrupted (`SIGINT`,
//! `SIGTERM`, `SIGHUP`), by a signal handler before the benchmark dies. Hogs are killed with the
//! disturbance and die with the benchmark (`PR_SET_PDEATHSIG`). Signals go through pidfds, so a process
//! that has exited and been reaped is never confused with a new one with the same pid.

use rand::{RngExt as _, SeedableRng as _};
use rand_xoshiro::SplitMix64;
use serde::{Deserialize, Serialize};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Parameters of the noise model, as given on the command line and recorded in the report.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct NoiseParams {
    /// `--noise-seed`: every run's stall sequence is derived from it.
    pub seed: u64,
    /// `--hogs`: CPU hog processes, each spinning on one core for the whole run.
    pub hogs: u32,
    /// `--stall-mean-interval-ms`: mean wait between stalls (exponential).
    pub stall_mean_interval_ms: f64,
    /// `--stall-min-ms`, `--stall-max-ms`: a stall lasts a duration uniform in this range.
    pub stall_min_ms: f64,
    pub stall_max_ms: f64,
}

impl NoiseParams {
    /// The error says which option to change.
    pub fn validate(&self) -> Result<(), String> {
        let ok = |x: f64| x.is_finite() && x > 0.0;
        if !ok(self.stall_mean_interval_ms) {
            return Err(format!(
                "--stall-mean-interval-ms {} must be a positive number of milliseconds",
                self.stall_mean_interval_ms
            ));
        }
        if !ok(self.stall_min_ms) || !ok(self.stall_max_ms) || self.stall_min_ms > self.stall_max_ms
        {
            return Err(format!(
                "stall durations {}–{} ms: need 0 < --stall-min-ms <= --stall-max-ms",
                self.stall_min_ms, self.stall_max_ms
            ));
        }
        Ok(())
    }
}

/// What the noise did during one run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NoiseRecord {
    /// This run's seed (derived from `--noise-seed` and the run's label).
    pub seed: u64,
    /// Per process that could be stalled: the stalls applied and the time it spent stopped.
    pub stalls: Vec<ProcessStalls>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProcessStalls {
    /// Tenant name, or `scheduler`.
    pub process: String,
    pub stalls: u32,
    /// Measured from `SIGSTOP` to `SIGCONT`.
    pub stopped_ms: f64,
}

impl NoiseRecord {
    pub fn total_stalls(&self) -> u32 {
        self.stalls.iter().map(|s| s.stalls).sum()
    }
}

/// SplitMix64's finaliser: a 64-bit hash, here to derive a run's seed from a label.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The seed of the run labelled `label` (e.g. `three-requests/gpushare/2`) under `--noise-seed
/// seed`: FNV-1a of the label, mixed with the seed.
pub fn run_seed(seed: u64, label: &str) -> u64 {
    let h = label.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    mix(seed ^ h)
}

/// One stall: wait `delay`, then stop victim `victim` for `duration`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stall {
    pub delay: Duration,
    pub victim: usize,
    pub duration: Duration,
}

/// The endless sequence of stalls for `victims` processes under `params`, from `seed`.
///
/// The draws come from SplitMix64 seeded with the seed itself: a fixed algorithm, so a seed
/// names the same stalls on every platform and release.
#[derive(Debug, Clone)]
pub struct StallSchedule {
    rng: SplitMix64,
    mean_interval_s: f64,
    min_s: f64,
    max_s: f64,
    victims: usize,
}

impl StallSchedule {
    pub fn new(seed: u64, params: &NoiseParams, victims: usize) -> StallSchedule {
        assert!(victims > 0, "a stall schedule needs a process to stall");
        StallSchedule {
            rng: SplitMix64::seed_from_u64(seed),
            mean_interval_s: params.stall_mean_interval_ms / 1e3,
            min_s: params.stall_min_ms / 1e3,
            max_s: params.stall_max_ms / 1e3,
            victims,
        }
    }
}

impl Iterator for StallSchedule {
    type Item = Stall;

    fn next(&mut self) -> Option<Stall> {
        // u lies in [0, 1), 1 − u in (0, 1]: its logarithm is finite.
        let u: f64 = self.rng.random();
        let delay = -self.mean_interval_s * (1.0 - u).ln();
        let victim = self.rng.random_range(0..self.victims as u64) as usize;
        let duration = self.min_s + (self.max_s - self.min_s) * self.rng.random::<f64>();
        Some(Stall {
            delay: Duration::from_secs_f64(delay),
            victim,
            duration: Duration::from_secs_f64(duration),
        })
    }
}

/// The pidfd of the process stopped right now (-1: none), for the signal handler.
static STOPPED_PIDFD: AtomicI32 = AtomicI32::new(-1);

/// Continue the stopped process, then die of `sig` as if there were no handler.
extern "C" fn continue_and_die(sig: libc::c_int) {
    let fd = STOPPED_PIDFD.load(Ordering::SeqCst);
    if fd >= 0 {
        // SAFETY: a raw system call (async-signal-safe); a stale fd only makes it fail.
        unsafe { pidfd_send_signal(fd, libc::SIGCONT) };
    }
    // SAFETY: async-signal-safe; the handler was installed with SA_RESETHAND and SA_NODEFER,
    // so the signal now takes its default action (termination).
    unsafe { libc::raise(sig) };
}

/// Install [`continue_and_die`] for SIGINT, SIGTERM and SIGHUP (once).
fn install_signal_handlers() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            // SAFETY: sigaction with a zeroed (empty-mask) action whose handler is an
            // async-signal-safe `extern "C" fn(c_int)`.
            unsafe {
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = continue_and_die as *const () as libc::sighandler_t;
                action.sa_flags = libc::SA_RESETHAND | libc::SA_NODEFER;
                libc::sigemptyset(&mut action.sa_mask);
                libc::sigaction(sig, &action, std::ptr::null_mut());
            }
        }
    });
}

/// `pidfd_send_signal(fd, sig, NULL, 0)`; 0 on success.
///
/// # Safety
/// Plain system call: any `fd` is allowed (a wrong one fails with EBADF or EINVAL).
unsafe fn pidfd_send_signal(fd: libc::c_int, sig: libc::c_int) -> libc::c_long {
    // SAFETY: see the function's contract.
    unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd,
            sig,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    }
}

/// A process that may be stalled, held by a pidfd.
struct Victim {
    /// `None`: it had already exited when the disturbance started.
    pidfd: Option<OwnedFd>,
}

impl Victim {
    fn open(pid: u32) -> Victim {
        // SAFETY: pidfd_open(pid, 0) is a plain system call; a non-negative result is a new
        // file descriptor that nothing else owns.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        Victim {
            pidfd: (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as i32) }),
        }
    }

    /// Send `sig`; false if the process is gone.
    fn signal(&self, sig: libc::c_int) -> bool {
        // SAFETY: the fd is a pidfd owned by `self`.
        self.pidfd
            .as_ref()
            .is_some_and(|fd| unsafe { pidfd_send_signal(fd.as_raw_fd(), sig) } == 0)
    }
}

/// Continues its victim when dropped (the end of a stall, or unwinding).
struct Stopped<'a>(&'a Victim);

impl Drop for Stopped<'_> {
    fn drop(&mut self) {
        self.0.signal(libc::SIGCONT);
        STOPPED_PIDFD.store(-1, Ordering::SeqCst);
    }
}

/// Per victim: stalls applied and time stopped.
type Tally = Vec<(u32, Duration)>;

/// Apply `schedule` to `victims` until told to stop (or the sender is dropped).
fn stall_loop(schedule: StallSchedule, victims: Vec<Victim>, stop: mpsc::Receiver<()>) -> Tally {
    let mut tally = vec![(0u32, Duration::ZERO); victims.len()];
    let wait = |d: Duration| matches!(stop.recv_timeout(d), Err(RecvTimeoutError::Timeout));
    for s in schedule {
        if !wait(s.delay) {
            break;
        }
        let v = &victims[s.victim];
        let Some(fd) = &v.pidfd else { continue };
        STOPPED_PIDFD.store(fd.as_raw_fd(), Ordering::SeqCst);
        if !v.signal(libc::SIGSTOP) {
            STOPPED_PIDFD.store(-1, Ordering::SeqCst);
            continue; // it has exited
        }
        let stopped = Stopped(v);
        let t = Instant::now();
        let go_on = wait(s.duration);
        drop(stopped);
        tally[s.victim].0 += 1;
        tally[s.victim].1 += t.elapsed();
        if !go_on {
            break;
        }
    }
    tally
}

/// The noise of one run: started with its processes known, stopped when they have finished.
pub struct Disturbance {
    seed: u64,
    names: Vec<String>,
    hogs: Vec<Child>,
    stop: Option<mpsc::Sender<()>>,
    stalls: Option<JoinHandle<Tally>>,
}

impl Disturbance {
    /// Start `params.hogs` hogs (`hog()` builds each one's command) and the stalls of `victims`
    /// (name, pid) from `seed`.
    pub fn start(
        params: &NoiseParams,
        seed: u64,
        victims: &[(String, u32)],
        hog: impl Fn() -> Command,
    ) -> std::io::Result<Disturbance> {
        install_signal_handlers();
        let mut disturbance = Disturbance {
            seed,
            names: victims.iter().map(|(n, _)| n.clone()).collect(),
            hogs: Vec::new(),
            stop: None,
            stalls: None,
        };
        for _ in 0..params.hogs {
            let mut c = hog();
            c.stdin(Stdio::null()).stdout(Stdio::null());
            disturbance.hogs.push(c.spawn()?);
        }
        if !victims.is_empty() {
            let schedule = StallSchedule::new(seed, params, victims.len());
            let open: Vec<Victim> = victims.iter().map(|(_, pid)| Victim::open(*pid)).collect();
            let (tx, rx) = mpsc::channel();
            disturbance.stop = Some(tx);
            disturbance.stalls = Some(
                std::thread::Builder::new()
                    .name("noise-stalls".into())
                    .spawn(move || stall_loop(schedule, open, rx))?,
            );
        }
        Ok(disturbance)
    }

    /// Pids of the hogs.
    pub fn hog_pids(&self) -> Vec<u32> {
        self.hogs.iter().map(Child::id).collect()
    }

    /// End the stalls (the stopped process, if any, is continued) and kill the hogs.
    pub fn stop(mut self) -> NoiseRecord {
        let tally = self.end();
        NoiseRecord {
            seed: self.seed,
            stalls: self
                .names
                .iter()
                .zip(tally)
                .map(|(process, (stalls, stopped))| ProcessStalls {
                    process: process.clone(),
                    stalls,
                    stopped_ms: (stopped.as_secs_f64() * 1e6).round() / 1e3,
                })
                .collect(),
        }
    }

    fn end(&mut self) -> Tally {
        drop(self.stop.take());
        let tally = self
            .stalls
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_else(|| vec![(0, Duration::ZERO); self.names.len()]);
        for mut h in self.hogs.drain(..) {
            let _ = h.kill();
            let _ = h.wait();
        }
        tally
    }
}

impl Drop for Disturbance {
    fn drop(&mut self) {
        self.end();
    }
}

/// The hog process (`gpushare-bench hog --parent PID`): spin on one core until killed, or until
/// the benchmark `parent` dies.
pub fn hog(parent: u32) -> ! {
    // SAFETY: prctl(PR_SET_PDEATHSIG, signal) and getppid are plain system calls.
    let orphan = unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
        libc::getppid() as u32 != parent
    };
    if orphan {
        std::process::exit(0); // the benchmark died before the death signal was set up
    }
    let mut x = 0u64;
    loop {
        x = std::hint::black_box(x.wrapping_add(1));
    }
}

/// The command of a hog: this executable's `hog` subcommand.
pub fn hog_command() -> Command {
    let exe = std::env::current_exe().unwrap_or_else(|_| "gpushare-bench".into());
    let mut c = Command::new(exe);
    c.args(["hog", "--parent", &std::process::id().to_string()]);
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(mean_ms: f64, min_ms: f64, max_ms: f64) -> NoiseParams {
        NoiseParams {
            seed: 1,
            hogs: 1,
            stall_mean_interval_ms: mean_ms,
            stall_min_ms: min_ms,
            stall_max_ms: max_ms,
        }
    }

    #[test]
    fn the_same_seed_gives_the_same_stalls() {
        let p = params(50.0, 0.1, 5.0);
        let a: Vec<Stall> = StallSchedule::new(7, &p, 3).take(200).collect();
        let b: Vec<Stall> = StallSchedule::new(7, &p, 3).take(200).collect();
        let c: Vec<Stall> = StallSchedule::new(8, &p, 3).take(200).collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
        // Run seeds: stable, and different per label and per seed.
        assert_eq!(run_seed(1, "x/gpushare/1"), run_seed(1, "x/gpushare/1"));
        assert_ne!(run_seed(1, "x/gpushare/1"), run_seed(1, "x/gpushare/2"));
        assert_ne!(run_seed(1, "x/gpushare/1"), run_seed(2, "x/gpushare/1"));
    }

    /// A seed names the same stalls whatever the version of the crates that provide the
    /// generator and its sampling.
    #[test]
    fn a_seed_names_fixed_stalls() {
        let p = params(50.0, 0.1, 5.0);
        let first: Vec<(u128, usize, u128)> = StallSchedule::new(7, &p, 3)
            .take(3)
            .map(|s| (s.delay.as_nanos(), s.victim, s.duration.as_nanos()))
            .collect();
        assert_eq!(
            first,
            [
                (24_700_863, 0, 4_513_727),
                (43_725_095, 1, 1_322_214),
                (31_551_173, 0, 757_866)
            ]
        );
    }

    #[test]
    fn stalls_follow_the_parameters() {
        let p = params(50.0, 0.1, 5.0);
        let n = 20_000;
        let stalls: Vec<Stall> = StallSchedule::new(42, &p, 4).take(n).collect();
        let mean_ms = stalls
            .iter()
            .map(|s| s.delay.as_secs_f64() * 1e3)
            .sum::<f64>()
            / n as f64;
        assert!((mean_ms - 50.0).abs() < 2.0, "mean wait {mean_ms} ms");
        for s in &stalls {
            let d = s.duration.as_secs_f64() * 1e3;
            assert!((0.1 - 1e-9..=5.0 + 1e-9).contains(&d), "{d} ms");
            assert!(s.victim < 4);
        }
        for v in 0..4 {
            let k = stalls.iter().filter(|s| s.victim == v).count();
            assert!((4_500..5_500).contains(&k), "victim {v} chosen {k} times");
        }
    }

    #[test]
    fn parameters_out_of_range_are_refused() {
        assert!(params(50.0, 0.1, 5.0).validate().is_ok());
        assert!(params(0.0, 0.1, 5.0).validate().is_err());
        assert!(params(50.0, 5.0, 0.1).validate().is_err());
        assert!(params(50.0, 0.0, 5.0).validate().is_err());
        assert!(params(f64::NAN, 0.1, 5.0).validate().is_err());
    }

    /// Process state letter from /proc/PID/stat (`T`: stopped), `None` once it is gone.
    fn state(pid: u32) -> Option<char> {
        let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        s[s.rfind(')')? + 1..].trim_start().chars().next()
    }

    fn sleeper() -> Child {
        Command::new("sleep")
            .arg("60")
            .spawn()
            .expect("start sleep")
    }

    /// Wait (polling, at most 10 s) until `pid` is in state `c`.
    fn wait_state(pid: u32, c: char) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while state(pid) != Some(c) {
            assert!(Instant::now() < deadline, "{pid} never reached state {c}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn victims_are_stalled_and_continued_and_the_hog_is_killed() {
        let mut a = sleeper();
        let mut b = sleeper();
        let victims = [("a".to_string(), a.id()), ("b".to_string(), b.id())];
        let p = params(2.0, 0.5, 1.0);
        let s = Disturbance::start(&p, 3, &victims, || {
            let mut c = Command::new("sleep");
            c.arg("60");
            c
        })
        .unwrap();
        let hogs = s.hog_pids();
        assert_eq!(hogs.len(), 1);
        // Poll until both have been stalled at least once.
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut seen = [false; 2];
        while !(seen[0] && seen[1]) {
            assert!(Instant::now() < deadline, "no stall seen: {seen:?}");
            seen[0] |= state(a.id()) == Some('T');
            seen[1] |= state(b.id()) == Some('T');
            std::thread::sleep(Duration::from_micros(100));
        }
        let record = s.stop();
        assert_eq!(record.seed, 3);
        assert_eq!(record.stalls.len(), 2);
        for p in &record.stalls {
            assert!(p.stalls > 0 && p.stopped_ms > 0.0, "{record:?}");
        }
        for pid in [a.id(), b.id()] {
            assert!(state(pid).is_some_and(|c| c != 'T'), "{pid} left stopped");
        }
        assert_eq!(state(hogs[0]), None, "hog still there");
        for c in [&mut a, &mut b] {
            c.kill().unwrap();
            c.wait().unwrap();
        }
    }

    #[test]
    fn a_stopped_victim_is_continued_when_the_run_fails() {
        let mut v = sleeper();
        let pid = v.id();
        // Long stalls, at once: the victim is stopped when the run "fails".
        let p = params(0.1, 10_000.0, 10_000.0);
        let s = Disturbance::start(&p, 1, &[("v".into(), pid)], || {
            let mut c = Command::new("sleep");
            c.arg("60");
            c
        })
        .unwrap();
        let hog = s.hog_pids()[0];
        let failed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let _disturbance = s;
            wait_state(pid, 'T');
            panic!("the run failed");
        }));
        assert!(failed.is_err());
        assert!(state(pid).is_some_and(|c| c != 'T'), "victim left stopped");
        assert_eq!(state(hog), None, "hog still there");
        v.kill().unwrap();
        v.wait().unwrap();
    }
}
