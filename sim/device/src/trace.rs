//! The simulated device's trace, and the numbers tests and benchmarks assert on.
//!
//! `gpushare-sim run --trace FILE` writes JSON Lines, one object per kernel, or per slice of a
//! kernel that was preempted at the end of a time slice:
//!
//! ```json
//! {"device":0,"pid":4242,"ctx":1,"stream":3,"kernel":"gpushare_spin","start_ns":10,"end_ns":20,"preempted":false}
//! ```
//!
//! Times are `CLOCK_MONOTONIC` nanoseconds, so they compare with `clock_gettime` in the clients.
//! The trace is the ground truth for "who had the GPU when":
//!
//! - [`Trace::overlaps`]: records of one device that overlap in time (a real GPU never runs
//!   kernels of two contexts at once, so for a correct simulator this is empty);
//! - [`Trace::busy_ns`] / [`Trace::busy_by_pid`]: device time used inside a [`Window`];
//! - [`Trace::shares`]: each process's fraction of a window on one device;
//! - [`Trace::utilization`]: fraction of a window in which a device ran anything;
//! - [`common_window`]: the interval in which several processes were all active, which is where
//!   shares are meaningful.
//!
//! ```
//! use gpushare_sim_device::trace::{Trace, common_window};
//!
//! let trace = Trace::parse(concat!(
//!     r#"{"device":0,"pid":1,"ctx":1,"stream":1,"kernel":"k","start_ns":0,"end_ns":10,"preempted":false}"#, "\n",
//!     r#"{"device":0,"pid":2,"ctx":2,"stream":1,"kernel":"k","start_ns":10,"end_ns":20,"preempted":false}"#, "\n",
//! )).unwrap();
//! assert!(trace.overlaps().is_empty());
//! let window = common_window([trace.span_of_pid(1).unwrap(), trace.span_of_pid(2).unwrap()]);
//! assert!(window.is_none()); // they never ran at the same time
//! let all = trace.span().unwrap();
//! assert_eq!(trace.shares(0, all)[&1], 0.5);
//! assert_eq!(trace.utilization(0, all), 1.0);
//! ```

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};

/// One kernel, or one slice of a preempted kernel, as the device ran it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// Device ordinal.
    pub device: u32,
    /// Process that launched the kernel.
    pub pid: u32,
    /// Context, as the launching process knows it: `(pid, ctx)` identifies a context (different
    /// processes may use the same number).
    pub ctx: u64,
    /// Stream, as the launching process knows it: `(pid, stream)` identifies a stream.
    pub stream: u64,
    /// Kernel (entry point) name.
    pub kernel: String,
    /// When the device started running it, CLOCK_MONOTONIC ns.
    pub start_ns: u64,
    /// When the device stopped running it, CLOCK_MONOTONIC ns.
    pub end_ns: u64,
    /// The kernel was switched out at `end_ns` and continues in a later record.
    pub preempted: bool,
}

impl Record {
    /// The interval the record occupied the device.
    pub fn window(&self) -> Window {
        Window::new(self.start_ns, self.end_ns)
    }

    /// `end_ns - start_ns`.
    pub fn duration_ns(&self) -> u64 {
        self.end_ns - self.start_ns
    }
}

/// A half-open time interval `[start_ns, end_ns)` in CLOCK_MONOTONIC nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Window {
    pub start_ns: u64,
    pub end_ns: u64,
}

impl Window {
    /// `[start_ns, end_ns)`; panics if `end_ns < start_ns`.
    pub fn new(start_ns: u64, end_ns: u64) -> Self {
        assert!(
            start_ns <= end_ns,
            "window ends ({end_ns}) before it starts ({start_ns})"
        );
        Window { start_ns, end_ns }
    }

    /// Length in nanoseconds.
    pub fn len_ns(&self) -> u64 {
        self.end_ns - self.start_ns
    }

    /// Whether the window has zero length.
    pub fn is_empty(&self) -> bool {
        self.start_ns == self.end_ns
    }

    /// The common part of two windows, `None` if they share no time.
    pub fn intersect(&self, other: &Window) -> Option<Window> {
        let start = self.start_ns.max(other.start_ns);
        let end = self.end_ns.min(other.end_ns);
        (start < end).then(|| Window::new(start, end))
    }

    /// Nanoseconds the two windows share.
    pub fn overlap_ns(&self, other: &Window) -> u64 {
        self.intersect(other).map_or(0, |w| w.len_ns())
    }

    /// The window shrunk by `ns` at each end (empty if it is shorter than `2 * ns`).
    pub fn shrink(&self, ns: u64) -> Window {
        let start = self.start_ns.saturating_add(ns);
        let end = self.end_ns.saturating_sub(ns);
        if start < end {
            Window::new(start, end)
        } else {
            Window::new(start, start)
        }
    }
}

impl fmt::Display for Window {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "[{}, {}) ({:.3} ms)",
            self.start_ns,
            self.end_ns,
            self.len_ns() as f64 / 1e6
        )
    }
}

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("cannot read trace {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("trace line {line}: {source}: {text}")]
    Json {
        line: usize,
        text: String,
        source: serde_json::Error,
    },
    #[error("trace line {line}: end_ns {end_ns} is before start_ns {start_ns}")]
    Backwards {
        line: usize,
        start_ns: u64,
        end_ns: u64,
    },
}

/// A parsed device trace: records sorted by `(device, start_ns, end_ns)`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Trace {
    records: Vec<Record>,
}

impl Trace {
    /// Parse JSON Lines. Every field of [`Record`] is required; other fields are ignored (the
    /// device may add some); blank lines are skipped.
    pub fn parse(text: &str) -> Result<Trace, TraceError> {
        let mut records = Vec::new();
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let record: Record = serde_json::from_str(line).map_err(|source| TraceError::Json {
                line: i + 1,
                text: line.to_string(),
                source,
            })?;
            if record.end_ns < record.start_ns {
                return Err(TraceError::Backwards {
                    line: i + 1,
                    start_ns: record.start_ns,
                    end_ns: record.end_ns,
                });
            }
            records.push(record);
        }
        Ok(Trace::from_records(records))
    }

    /// Read and [parse](Trace::parse) a trace file.
    pub fn read(path: impl AsRef<Path>) -> Result<Trace, TraceError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| TraceError::Io {
            path: path.to_owned(),
            source,
        })?;
        Trace::parse(&text)
    }

    /// Write as JSON Lines, what [`Trace::read`] reads.
    pub fn write(&self, path: impl AsRef<Path>) -> std::io::Result<()> {
        use std::io::Write;
        let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
        for r in &self.records {
            serde_json::to_writer(&mut out, r)?;
            out.write_all(b"\n")?;
        }
        out.flush()
    }

    /// A trace of the given records (in any order).
    pub fn from_records(mut records: Vec<Record>) -> Trace {
        records.sort_by_key(|r| (r.device, r.start_ns, r.end_ns));
        Trace { records }
    }

    /// All records, sorted by `(device, start_ns, end_ns)`.
    pub fn records(&self) -> &[Record] {
        &self.records
    }

    pub fn len(&self) -> usize {
        self.records.len()
    }

    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// The records for which `keep` is true, as a trace of their own.
    pub fn filter(&self, keep: impl Fn(&Record) -> bool) -> Trace {
        Trace {
            records: self.records.iter().filter(|r| keep(r)).cloned().collect(),
        }
    }

    /// Devices that appear in the trace.
    pub fn devices(&self) -> BTreeSet<u32> {
        self.records.iter().map(|r| r.device).collect()
    }

    /// Processes that appear in the trace.
    pub fn pids(&self) -> BTreeSet<u32> {
        self.records.iter().map(|r| r.pid).collect()
    }

    /// From the first start to the last end of any record; `None` for an empty trace.
    pub fn span(&self) -> Option<Window> {
        let start = self.records.iter().map(|r| r.start_ns).min()?;
        let end = self.records.iter().map(|r| r.end_ns).max()?;
        Some(Window::new(start, end))
    }

    /// [`span`](Trace::span) of one process's records.
    pub fn span_of_pid(&self, pid: u32) -> Option<Window> {
        self.filter(|r| r.pid == pid).span()
    }

    /// Pairs of records on the same device that share some time, `(earlier, later)`.
    ///
    /// Each record that starts before an earlier-starting record of its device has ended is
    /// reported once, paired with the record that ends last among those before it. Records that
    /// merely touch (`a.end_ns == b.start_ns`) do not overlap.
    pub fn overlaps(&self) -> Vec<(Record, Record)> {
        let mut found = Vec::new();
        let mut last: Option<&Record> = None; // the record ending last so far on this device
        for r in &self.records {
            match last {
                Some(prev) if prev.device == r.device => {
                    if r.start_ns < prev.end_ns {
                        found.push((prev.clone(), r.clone()));
                    }
                    if r.end_ns > prev.end_ns {
                        last = Some(r);
                    }
                }
                _ => last = Some(r),
            }
        }
        found
    }

    /// Time inside `window` during which at least one record of this trace ran (the union of
    /// the records' intervals, clipped to `window`). Devices are not told apart: filter first
    /// to count one device.
    pub fn busy_ns(&self, window: Window) -> u64 {
        let mut clipped: Vec<Window> = self
            .records
            .iter()
            .filter_map(|r| r.window().intersect(&window))
            .collect();
        clipped.sort();
        let mut total = 0;
        let mut current: Option<Window> = None;
        for w in clipped {
            current = match current {
                Some(c) if w.start_ns <= c.end_ns => {
                    Some(Window::new(c.start_ns, c.end_ns.max(w.end_ns)))
                }
                Some(c) => {
                    total += c.len_ns();
                    Some(w)
                }
                None => Some(w),
            };
        }
        total + current.map_or(0, |c| c.len_ns())
    }

    /// Device time each process used on `device` inside `window` (ns, clipped to the window).
    pub fn busy_by_pid(&self, device: u32, window: Window) -> BTreeMap<u32, u64> {
        let on_device = self.filter(|r| r.device == device);
        on_device
            .pids()
            .into_iter()
            .map(|pid| (pid, on_device.filter(|r| r.pid == pid).busy_ns(window)))
            .collect()
    }

    /// Each process's share of `window` on `device`: its busy time there divided by the
    /// window's length (so shares add up to the utilisation, not to 1, when the device idles).
    /// Processes without records on the device are absent.
    pub fn shares(&self, device: u32, window: Window) -> BTreeMap<u32, f64> {
        let len = window.len_ns().max(1) as f64;
        self.busy_by_pid(device, window)
            .into_iter()
            .map(|(pid, busy)| (pid, busy as f64 / len))
            .collect()
    }

    /// Fraction of `window` in which `device` ran any record.
    pub fn utilization(&self, device: u32, window: Window) -> f64 {
        let busy = self.filter(|r| r.device == device).busy_ns(window);
        busy as f64 / window.len_ns().max(1) as f64
    }

    /// Where `device` idled inside `window`, between its first and last records there: each
    /// gap goes to the process whose kernel ran last before it if that process's kernel also
    /// ends it (its host was late to launch more, e.g. waking from a synchronisation), else to
    /// a change of process (a handoff).
    pub fn idle_gaps(&self, device: u32, window: Window) -> IdleGaps {
        let mut on: Vec<(Window, u32)> = (self.records.iter())
            .filter(|r| r.device == device)
            .filter_map(|r| Some((r.window().intersect(&window)?, r.pid)))
            .collect();
        on.sort();
        let mut gaps = IdleGaps::default();
        // The end of the work so far, and whose kernel reached it.
        let mut reached: Option<(u64, u32)> = None;
        for (w, pid) in on {
            if let Some((end, last)) = reached
                && w.start_ns > end
            {
                let gap = (w.start_ns - end, 1);
                let slot = if last == pid {
                    gaps.within.entry(pid).or_default()
                } else {
                    &mut gaps.between
                };
                *slot = (slot.0 + gap.0, slot.1 + gap.1);
            }
            if reached.is_none_or(|(end, _)| w.end_ns >= end) {
                reached = Some((w.end_ns, pid));
            }
        }
        gaps
    }
}

/// A device's idle time between its kernels ([`Trace::idle_gaps`]), as `(ns, gaps)`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IdleGaps {
    /// Per process: gaps between two of its own kernels.
    pub within: BTreeMap<u32, (u64, u32)>,
    /// Gaps between kernels of two processes.
    pub between: (u64, u32),
}

/// The interval common to all `windows` (e.g. the spans of several processes: where they were
/// all active); `None` if there is none or no window was given.
pub fn common_window(windows: impl IntoIterator<Item = Window>) -> Option<Window> {
    let mut it = windows.into_iter();
    let first = it.next()?;
    it.try_fold(first, |acc, w| acc.intersect(&w))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(device: u32, pid: u32, start_ns: u64, end_ns: u64) -> Record {
        Record {
            device,
            pid,
            ctx: pid as u64,
            stream: 1,
            kernel: "gpushare_spin".into(),
            start_ns,
            end_ns,
            preempted: false,
        }
    }

    /// Idle time is told apart by who ran around it: one process's own gaps, or a change of
    /// process; overlapping kernels (time-slicing) leave no gap, and other devices do not count.
    #[test]
    fn idle_gaps_are_split_between_processes_own_and_handoffs() {
        let t = Trace::from_records(vec![
            rec(0, 1, 0, 10),
            rec(0, 1, 12, 20), // 2 ns: pid 1's own
            rec(0, 2, 25, 40), // 5 ns: a handoff
            rec(0, 1, 30, 35), // inside pid 2's kernel: no gap
            rec(0, 2, 41, 50), // 1 ns: pid 2's own (its kernel reached 40)
            rec(1, 3, 60, 70), // another device
            rec(0, 1, 80, 90), // 30 ns: a handoff
        ]);
        let gaps = t.idle_gaps(0, Window::new(0, 100));
        assert_eq!(gaps.within, BTreeMap::from([(1, (2, 1)), (2, (1, 1))]));
        assert_eq!(gaps.between, (35, 2));
        // The gaps and the busy time fill the span between the first and last kernel.
        let busy = t.filter(|r| r.device == 0).busy_ns(Window::new(0, 100));
        assert_eq!(busy + 2 + 1 + 35, 90);
        // Clipped to a window: only what lies inside it.
        let gaps = t.idle_gaps(0, Window::new(15, 45));
        assert_eq!(gaps.within, BTreeMap::from([(2, (1, 1))]));
        assert_eq!(gaps.between, (5, 1));
    }

    #[test]
    fn parses_all_fields_and_sorts() {
        let text = "\n{\"device\":1,\"pid\":7,\"ctx\":3,\"stream\":9,\"kernel\":\"k\",\"start_ns\":50,\"end_ns\":60,\"preempted\":true}\n\
                    {\"device\":0,\"pid\":8,\"ctx\":4,\"stream\":2,\"kernel\":\"gpushare_spin\",\"start_ns\":5,\"end_ns\":6,\"preempted\":false}\n";
        let t = Trace::parse(text).unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t.records()[0].device, 0);
        assert_eq!(
            t.records()[1],
            Record {
                device: 1,
                pid: 7,
                ctx: 3,
                stream: 9,
                kernel: "k".into(),
                start_ns: 50,
                end_ns: 60,
                preempted: true
            }
        );
        assert_eq!(t.devices(), [0, 1].into());
        assert_eq!(t.pids(), [7, 8].into());
        assert_eq!(t.span(), Some(Window::new(5, 60)));
    }

    #[test]
    fn rejects_missing_and_backwards_accepts_extra() {
        let missing =
            r#"{"device":0,"pid":1,"ctx":1,"stream":1,"kernel":"k","start_ns":1,"end_ns":2}"#;
        assert!(matches!(
            Trace::parse(missing),
            Err(TraceError::Json { line: 1, .. })
        ));
        let extra = r#"{"device":0,"pid":1,"ctx":1,"stream":1,"kernel":"k","start_ns":1,"end_ns":2,"preempted":false,"x":1}"#;
        assert_eq!(Trace::parse(extra).unwrap().len(), 1);
        let backwards = r#"{"device":0,"pid":1,"ctx":1,"stream":1,"kernel":"k","start_ns":3,"end_ns":2,"preempted":false}"#;
        assert!(matches!(
            Trace::parse(backwards),
            Err(TraceError::Backwards { .. })
        ));
    }

    #[test]
    fn overlaps_only_within_a_device() {
        let t = Trace::from_records(vec![
            rec(0, 1, 0, 10),
            rec(0, 2, 10, 20), // touches: fine
            rec(1, 3, 5, 15),  // other device: fine
            rec(0, 2, 15, 25), // overlaps the previous one
            rec(0, 1, 30, 40),
        ]);
        let o = t.overlaps();
        assert_eq!(o.len(), 1);
        assert_eq!((o[0].0.start_ns, o[0].1.start_ns), (10, 15));
        // Contained record: reported against the long one.
        let t = Trace::from_records(vec![
            rec(0, 1, 0, 100),
            rec(0, 2, 10, 20),
            rec(0, 2, 30, 40),
        ]);
        assert_eq!(t.overlaps().len(), 2);
    }

    #[test]
    fn busy_shares_and_utilization() {
        let t = Trace::from_records(vec![
            rec(0, 1, 0, 10),
            rec(0, 2, 10, 30),
            rec(0, 1, 40, 50),
            rec(1, 3, 0, 100),
        ]);
        let w = Window::new(5, 45);
        assert_eq!(t.busy_by_pid(0, w), [(1, 10), (2, 20)].into());
        let s = t.shares(0, w);
        assert_eq!(s[&1], 0.25);
        assert_eq!(s[&2], 0.5);
        assert_eq!(t.utilization(0, w), 0.75);
        assert_eq!(t.utilization(1, w), 1.0);
        // Overlapping records count once.
        let t = Trace::from_records(vec![rec(0, 1, 0, 10), rec(0, 2, 5, 15)]);
        assert_eq!(t.busy_ns(Window::new(0, 100)), 15);
    }

    #[test]
    fn windows() {
        let a = Window::new(0, 10);
        let b = Window::new(5, 20);
        assert_eq!(a.intersect(&b), Some(Window::new(5, 10)));
        assert_eq!(a.intersect(&Window::new(10, 20)), None);
        assert_eq!(a.overlap_ns(&b), 5);
        assert_eq!(
            common_window([a, b, Window::new(7, 30)]),
            Some(Window::new(7, 10))
        );
        assert_eq!(common_window([a, Window::new(11, 12)]), None);
        assert_eq!(common_window(std::iter::empty()), None);
        assert_eq!(Window::new(0, 100).shrink(10), Window::new(10, 90));
        assert!(Window::new(0, 10).shrink(10).is_empty());
    }
}
