//! CPU time of a process (the scheduler's, while the tenants run), from `/proc`.

/// A reading of a process's CPU seconds: `(from /proc/PID/stat, from /proc/PID/task/*/schedstat)`.
/// The first is utime + stime of all threads, living and exited, in clock ticks (10 ms); the
/// second is ns-precise but only counts the threads alive now (None when unreadable).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CpuReading {
    ticks_s: f64,
    precise_s: Option<f64>,
}

/// CPU seconds of process `pid` so far, or `None` if it cannot be read.
pub fn read(pid: u32) -> Option<CpuReading> {
    let ticks_s = stat_cpu_seconds(pid)?;
    let precise_s = std::fs::read_dir(format!("/proc/{pid}/task"))
        .ok()
        .and_then(|tasks| {
            tasks
                .map(|t| {
                    let s = std::fs::read_to_string(t.ok()?.path().join("schedstat")).ok()?;
                    s.split_whitespace().next()?.parse::<u64>().ok()
                })
                .sum::<Option<u64>>()
        })
        .map(|ns| ns as f64 / 1e9);
    Some(CpuReading { ticks_s, precise_s })
}

/// CPU seconds between two readings: the precise figure, unless a thread exited in between
/// (the tick-based figure then exceeds it by more than two ticks).
pub fn delta(a: CpuReading, b: CpuReading) -> f64 {
    let ticks = (b.ticks_s - a.ticks_s).max(0.0);
    match (a.precise_s, b.precise_s) {
        (Some(x), Some(y)) if y >= x && ticks <= y - x + 0.02 => y - x,
        _ => ticks,
    }
}

/// User + system CPU seconds of process `pid` so far, from `/proc/PID/stat`.
fn stat_cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which is in parentheses and may contain spaces):
    // state is field 3, utime field 14, stime field 15.
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = f.get(11)?.parse().ok()?;
    let stime: f64 = f.get(12)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (ticks > 0).then(|| (utime + stime) / ticks as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This thread's CPU seconds, from the kernel's clock (independent of `/proc`).
    fn thread_cpu_s() -> f64 {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes into the timespec given.
        unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
    }

    #[test]
    fn cpu_reading_of_own_process() {
        let a = read(std::process::id()).expect("read /proc/self");
        // Spin for 50 ms of CPU, not of wall time: on a busy machine the thread may get a
        // fraction of the wall time.
        let start = thread_cpu_s();
        while thread_cpu_s() - start < 0.05 {
            std::hint::black_box(0u64);
        }
        let b = read(std::process::id()).unwrap();
        let d = delta(a, b);
        assert!((0.045..1.0).contains(&d), "{d} s of CPU for a 50 ms spin");
    }
}
