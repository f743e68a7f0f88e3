//! The last minutes of each GPU's use, by scheduler group: share of GPU time and memory in use,
//! sampled from the scheduler's books as the daemon reads them. The web page plots it.
//!
//! Pure and bounded: at most [`SPAN_NS`] / [`RESOLUTION_NS`] samples per GPU, each of at most
//! [`MAX_GROUPS`] groups (the smallest beyond that are added up as [`OTHERS`]).

use crate::gpus::GpuInfo;
use gpushare_protocol::status::{GpuReport, Report};
use serde::Serialize;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

/// How far back the history goes.
pub const SPAN_NS: u64 = 10 * 60 * 1_000_000_000;
/// At most one sample per GPU this often, however often the books are read.
pub const RESOLUTION_NS: u64 = 1_000_000_000;
/// Groups kept per sample.
pub const MAX_GROUPS: usize = 12;
/// The name under which the groups beyond [`MAX_GROUPS`] are added up.
pub const OTHERS: &str = "other groups";

/// A group below this share of GPU time and without memory is left out of a sample.
const IDLE_SHARE: f64 = 0.0005;

#[derive(Debug, Clone, PartialEq)]
struct Point {
    group: Arc<str>,
    /// Of the GPU's time since the previous sample.
    share: f64,
    /// Bytes in use at the sample.
    memory: u64,
}

#[derive(Debug, Clone, PartialEq)]
struct Sample {
    t_ns: u64,
    points: Vec<Point>,
}

#[derive(Debug, Default)]
struct Series {
    samples: VecDeque<Sample>,
    /// Each group's busy time counted by the scheduler at the last sample, seconds.
    busy: BTreeMap<Arc<str>, f64>,
}

/// The use of each of the node's GPUs (in the order of the daemon's GPU list).
#[derive(Debug)]
pub struct UsageHistory {
    series: Vec<Series>,
}

impl UsageHistory {
    pub fn new(gpus: usize) -> UsageHistory {
        UsageHistory {
            series: (0..gpus).map(|_| Series::default()).collect(),
        }
    }

    /// Take a sample of each GPU from the scheduler's report at `now_ns` (unless the last one is
    /// younger than [`RESOLUTION_NS`]), and forget samples older than [`SPAN_NS`].
    pub fn record(&mut self, now_ns: u64, gpus: &[GpuInfo], report: &Report) {
        let from = now_ns.saturating_sub(SPAN_NS);
        for (series, gpu) in self.series.iter_mut().zip(gpus) {
            while series.samples.front().is_some_and(|s| s.t_ns < from) {
                series.samples.pop_front();
            }
            let last = series.samples.back().map(|s| s.t_ns);
            if last.is_some_and(|t| now_ns < t.saturating_add(RESOLUTION_NS)) {
                continue;
            }
            let books = report.gpus.iter().find(|g| g.uuid == gpu.uuid);
            let points = series.points(last.map(|t| now_ns - t), books);
            series.samples.push_back(Sample {
                t_ns: now_ns,
                points,
            });
        }
    }

    /// The history in columns, for plotting: the samples taken after `since` (seconds since
    /// the epoch, as in [`GpuUsage::times`]), all of them without it; `label` names a group for
    /// people.
    pub fn view(
        &self,
        gpus: &[GpuInfo],
        since: Option<f64>,
        label: impl Fn(&str) -> String,
    ) -> Vec<GpuUsage> {
        self.series
            .iter()
            .zip(gpus)
            .map(|(series, gpu)| {
                let samples: Vec<&Sample> = series
                    .samples
                    .iter()
                    .filter(|s| since.is_none_or(|t| seconds(s.t_ns) > t))
                    .collect();
                let n = samples.len();
                // Groups in the order they first appear: a group keeps its place (and colour).
                let mut groups: Vec<GroupUsage> = Vec::new();
                let mut at: BTreeMap<&str, usize> = BTreeMap::new();
                for (i, s) in samples.iter().enumerate() {
                    for p in &s.points {
                        let k = *at.entry(&p.group).or_insert_with(|| {
                            groups.push(GroupUsage {
                                name: p.group.to_string(),
                                label: label(&p.group),
                                share: vec![0.0; n],
                                memory: vec![0; n],
                            });
                            groups.len() - 1
                        });
                        groups[k].share[i] = (p.share * 1e4).round() / 1e4;
                        groups[k].memory[i] = p.memory;
                    }
                }
                GpuUsage {
                    index: gpu.index,
                    uuid: gpu.uuid.clone(),
                    name: gpu.name.clone(),
                    memory_total: gpu.memory,
                    span_seconds: seconds(SPAN_NS),
                    times: samples.iter().map(|s| seconds(s.t_ns)).collect(),
                    groups,
                }
            })
            .collect()
    }
}

/// Nanoseconds as the seconds of [`GpuUsage::times`].
fn seconds(ns: u64) -> f64 {
    ns as f64 / 1e9
}

impl Series {
    /// What each group used since the previous sample (`dt_ns` ago, if any): its share of GPU
    /// time from the scheduler's busy count (its recent share for a group new to us), and its
    /// memory now.
    fn points(&mut self, dt_ns: Option<u64>, books: Option<&GpuReport>) -> Vec<Point> {
        let groups = books.map_or(&[][..], |b| &b.groups[..]);
        let mut busy = BTreeMap::new();
        let mut points: Vec<Point> = Vec::new();
        for g in groups {
            // Reuse the name's allocation from the last sample.
            let name = self
                .busy
                .get_key_value(g.name.as_str())
                .map_or_else(|| Arc::from(g.name.as_str()), |(k, _)| k.clone());
            let share = match (self.busy.get(g.name.as_str()), dt_ns) {
                (Some(&before), Some(dt)) if dt > 0 => {
                    (g.busy_seconds - before).max(0.0) / (dt as f64 / 1e9)
                }
                _ => g.achieved_share,
            }
            .clamp(0.0, 1.0);
            busy.insert(name.clone(), g.busy_seconds);
            if share >= IDLE_SHARE || g.memory_used > 0 {
                points.push(Point {
                    group: name,
                    share,
                    memory: g.memory_used,
                });
            }
        }
        self.busy = busy;
        if points.len() > MAX_GROUPS {
            // The busiest, then the biggest, keep their own line.
            points.sort_by(|a, b| {
                b.share
                    .total_cmp(&a.share)
                    .then(b.memory.cmp(&a.memory))
                    .then(a.group.cmp(&b.group))
            });
            let rest = points.split_off(MAX_GROUPS - 1);
            points.push(Point {
                group: Arc::from(OTHERS),
                share: rest.iter().map(|p| p.share).sum::<f64>().min(1.0),
                memory: rest.iter().map(|p| p.memory).sum(),
            });
        }
        points
    }
}

/// One GPU's recent use, in columns: `groups[g].share[i]` is group `g`'s share of GPU time
/// between `times[i - 1]` and `times[i]`, `groups[g].memory[i]` its bytes in use at `times[i]`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuUsage {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    /// Bytes.
    pub memory_total: u64,
    /// How far back the history goes: a client that keeps the samples it was sent forgets
    /// those older than this before its newest.
    pub span_seconds: f64,
    /// Seconds since the epoch, oldest first.
    pub times: Vec<f64>,
    pub groups: Vec<GroupUsage>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GroupUsage {
    /// The scheduler's group.
    pub name: String,
    /// For people (e.g. `job 7 (alice)`).
    pub label: String,
    pub share: Vec<f64>,
    pub memory: Vec<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_protocol::status::{Durations, GroupReport};
    use proptest::prelude::*;

    const S: u64 = 1_000_000_000;

    fn gpu(uuid: &str) -> GpuInfo {
        GpuInfo {
            index: 0,
            uuid: uuid.into(),
            name: "sim".into(),
            memory: 1 << 30,
        }
    }

    fn group(name: &str, busy_seconds: f64, memory_used: u64) -> GroupReport {
        GroupReport {
            name: name.into(),
            request: 0.5,
            limit: 1.0,
            weight: 1.0,
            latency: false,
            effective_request: 0.5,
            target_share: 0.5,
            achieved_share: 0.25,
            busy_seconds,
            tokens: 0,
            waits: 0,
            overruns: 0,
            revocations: 0,
            preempted: 0,
            pids: vec![1],
            active: true,
            memory_used,
            memory_cap: None,
            memory_clamped: None,
            memory_reservations: 0,
            memory_swapped: 0,
            memory_state: Default::default(),
            memory_refused: None,
            pod: None,
        }
    }

    fn report(uuid: &str, groups: Vec<GroupReport>) -> Report {
        Report {
            dev_mode: true,
            pods: vec![],
            unhooked: vec![],
            event_loop: Durations::default(),
            memory_swaps: Default::default(),
            gpus: vec![GpuReport {
                uuid: uuid.into(),
                holder: None,
                waiting: vec![],
                groups,
                physical: None,
            }],
        }
    }

    #[test]
    fn shares_come_from_the_busy_time_between_samples() {
        let gpus = [gpu("GPU-a")];
        let mut h = UsageHistory::new(1);
        h.record(10 * S, &gpus, &report("GPU-a", vec![group("a", 1.0, 100)]));
        // Half a second later: too soon for another sample.
        h.record(
            10 * S + S / 2,
            &gpus,
            &report("GPU-a", vec![group("a", 9.0, 7)]),
        );
        h.record(
            12 * S,
            &gpus,
            &report("GPU-a", vec![group("a", 2.5, 200), group("b", 4.0, 0)]),
        );
        let v = h.view(&gpus, None, |g| format!("<{g}>"));
        assert_eq!(v[0].times, vec![10.0, 12.0]);
        assert_eq!(v[0].groups.len(), 2);
        let (a, b) = (&v[0].groups[0], &v[0].groups[1]);
        assert_eq!((a.name.as_str(), a.label.as_str()), ("a", "<a>"));
        // First seen: the scheduler's recent share; then 1.5 s busy of 2 s.
        assert_eq!(a.share, vec![0.25, 0.75]);
        assert_eq!(a.memory, vec![100, 200]);
        assert_eq!(
            b.share,
            vec![0.0, 0.25],
            "new to the history: its recent share"
        );
        assert_eq!(b.memory, vec![0, 0]);
    }

    #[test]
    fn since_a_sample_only_the_later_ones_are_sent() {
        let gpus = [gpu("GPU-a")];
        let mut h = UsageHistory::new(1);
        h.record(S, &gpus, &report("GPU-a", vec![group("a", 1.0, 100)]));
        h.record(2 * S, &gpus, &report("GPU-a", vec![group("a", 1.5, 100)]));
        h.record(
            3 * S,
            &gpus,
            &report("GPU-a", vec![group("a", 2.5, 300), group("b", 1.0, 0)]),
        );
        let all = h.view(&gpus, None, str::to_string);
        let later = h.view(&gpus, Some(all[0].times[0]), str::to_string);
        assert_eq!(later[0].times, vec![2.0, 3.0]);
        assert_eq!(later[0].groups[0].share, vec![0.5, 1.0]);
        assert_eq!(later[0].groups[0].memory, vec![100, 300]);
        assert_eq!(later[0].groups[1].name, "b");
        assert_eq!(later[0].groups[1].share, vec![0.0, 0.25]);
        // The last sample's time: nothing new, and no group without a sample.
        let none = h.view(&gpus, Some(3.0), str::to_string);
        assert!(none[0].times.is_empty() && none[0].groups.is_empty());
        // A time before the history: all of it.
        assert_eq!(h.view(&gpus, Some(0.5), str::to_string), all);
        assert_eq!(all[0].span_seconds, 600.0);
    }

    #[test]
    fn a_gpu_missing_from_the_books_has_an_empty_sample() {
        let gpus = [gpu("GPU-a"), gpu("GPU-b")];
        let mut h = UsageHistory::new(2);
        h.record(S, &gpus, &report("GPU-a", vec![group("a", 1.0, 1)]));
        let v = h.view(&gpus, None, str::to_string);
        assert_eq!(v[1].times, vec![1.0]);
        assert!(v[1].groups.is_empty());
        assert_eq!(v[0].groups[0].memory, vec![1]);
    }

    #[test]
    fn a_busy_count_that_goes_back_is_no_negative_share() {
        // The scheduler restarted: its counts start again from zero.
        let gpus = [gpu("GPU-a")];
        let mut h = UsageHistory::new(1);
        h.record(S, &gpus, &report("GPU-a", vec![group("a", 100.0, 1)]));
        h.record(2 * S, &gpus, &report("GPU-a", vec![group("a", 0.5, 1)]));
        assert_eq!(
            h.view(&gpus, None, str::to_string)[0].groups[0].share[1],
            0.0
        );
    }

    #[test]
    fn past_the_group_limit_the_smallest_are_added_up() {
        let gpus = [gpu("GPU-a")];
        let mut h = UsageHistory::new(1);
        let groups = (0..20)
            .map(|i| group(&format!("g{i:02}"), 0.0, 100 + i))
            .collect();
        h.record(S, &gpus, &report("GPU-a", groups));
        let v = h.view(&gpus, None, str::to_string);
        let names: Vec<&str> = v[0].groups.iter().map(|g| g.name.as_str()).collect();
        assert_eq!(names.len(), MAX_GROUPS);
        assert_eq!(names[0], "g19", "the biggest first");
        assert_eq!(names[MAX_GROUPS - 1], OTHERS);
        let others = &v[0].groups[MAX_GROUPS - 1];
        assert_eq!(others.memory[0], (0..9).map(|i| 100 + i).sum::<u64>());
        assert_eq!(
            others.share[0], 1.0,
            "shares add up to at most the whole GPU"
        );
    }

    proptest! {
        /// Whatever the books say and however often they are read, the history holds at most
        /// SPAN / RESOLUTION samples, none older than SPAN, each of at most MAX_GROUPS groups
        /// with shares in [0, 1].
        #[test]
        fn the_history_stays_bounded(
            steps in prop::collection::vec(
                (1u64..5_000, prop::collection::vec((0u8..40, 0.0f64..1e4, 0u64..1 << 34), 0..30)),
                1..800,
            ),
        ) {
            let gpus = [gpu("GPU-a")];
            let mut h = UsageHistory::new(1);
            let mut now = 0;
            for (dt_ms, groups) in steps {
                now += dt_ms * 1_000_000;
                let groups = groups
                    .into_iter()
                    .map(|(n, busy, mem)| group(&format!("g{n}"), busy, mem))
                    .collect();
                h.record(now, &gpus, &report("GPU-a", groups));
                let s = &h.series[0];
                prop_assert!(s.samples.len() as u64 <= SPAN_NS / RESOLUTION_NS + 1);
                prop_assert!(s.samples.iter().all(|x| x.t_ns >= now.saturating_sub(SPAN_NS)));
                for sample in &s.samples {
                    prop_assert!(sample.points.len() <= MAX_GROUPS);
                    prop_assert!(sample.points.iter().all(|p| (0.0..=1.0).contains(&p.share)));
                }
                prop_assert!(s.busy.len() <= 40);
            }
        }
    }
}
