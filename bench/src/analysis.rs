//! Figures computed from kernel records: the device trace, or the tenants' timelines.

use gpushare_testkit::trace::{Trace, Window};
use serde::{Deserialize, Serialize};

/// Measurement windows start this long after the last tenant's first kernel.
pub const WARMUP_NS: u64 = 1_000_000_000;
/// Length of a measurement window.
pub const WINDOW_NS: u64 = 1_000_000_000;
/// Bin of the shares-over-time plot.
pub const PLOT_BIN_NS: u64 = 250_000_000;

/// The `q`-quantile (0..=1) of sorted `v` (nearest rank), or 0 when empty.
pub fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let i = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    v[i]
}

/// A run's headline figures.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct RunSummary {
    /// Largest |share − target| of any tenant in any window.
    pub max_abs_error: f64,
    /// Mean over tenants and windows of |share − target|.
    pub mean_abs_error: f64,
    /// Busy fraction of the GPUs over the measurement span (mean over GPUs).
    pub device_utilization: f64,
    /// Changes of the process running on a GPU, and the idle time at them (µs).
    pub handoffs: usize,
    pub handoff_p50_us: f64,
    pub handoff_p99_us: f64,
}

/// One run's figures (with gpushare, or the native baseline).
#[derive(Debug, Clone, Default)]
pub struct RunFigures {
    /// Per tenant: target share over the measurement span.
    pub target: Vec<f64>,
    /// Per tenant: busy share of its GPU over the measurement span.
    pub achieved: Vec<f64>,
    /// Per tenant: |achieved − target| over the measurement span.
    pub abs_error: Vec<f64>,
    /// Per tenant: the largest |share − target| of a window.
    pub max_window_error: Vec<f64>,
    pub summary: RunSummary,
    /// Measurement windows (s, from the first kernel of the run).
    pub windows: Vec<(f64, f64)>,
    /// The whole measurement span (CLOCK_MONOTONIC ns).
    pub measure_ns: (u64, u64),
    /// Plot: bin starts (s from the first kernel) and per tenant shares per bin.
    pub plot_t: Vec<f64>,
    pub plot_shares: Vec<Vec<f64>>,
}

/// Figures for tenants `pids[i]` on GPU `gpus[i]`, whose target shares over a window are
/// `targets(window)[i]` (they depend on the window when a tenant's demand does).
pub fn analyse(
    trace: &Trace,
    pids: &[u32],
    gpus: &[u32],
    targets: &impl Fn(Window) -> Vec<f64>,
) -> RunFigures {
    let n = pids.len();
    let mut f = RunFigures {
        target: vec![0.0; n],
        achieved: vec![0.0; n],
        abs_error: vec![0.0; n],
        max_window_error: vec![0.0; n],
        ..Default::default()
    };
    let spans: Vec<Option<Window>> = pids.iter().map(|p| trace.span_of_pid(*p)).collect();
    let Some(origin) = spans.iter().flatten().map(|w| w.start_ns).min() else {
        return f;
    };
    let last_start = spans.iter().flatten().map(|w| w.start_ns).max().unwrap();
    let first_end = spans.iter().flatten().map(|w| w.end_ns).min().unwrap();
    // Measurement span: every tenant started, warmed up, and none finished yet.
    let mut start = last_start + WARMUP_NS;
    if start + WINDOW_NS / 2 > first_end {
        start = last_start; // short run: no warm-up
    }
    let mut windows = Vec::new();
    let mut w0 = start;
    while w0 + WINDOW_NS <= first_end {
        windows.push(Window::new(w0, w0 + WINDOW_NS));
        w0 += WINDOW_NS;
    }
    if windows.is_empty() && first_end > start {
        windows.push(Window::new(start, first_end));
    }
    let Some(measure) = windows
        .first()
        .map(|a| Window::new(a.start_ns, windows.last().unwrap().end_ns))
    else {
        return f;
    };
    f.measure_ns = (measure.start_ns, measure.end_ns);
    let devices: Vec<u32> = {
        let mut d = gpus.to_vec();
        d.sort_unstable();
        d.dedup();
        d
    };
    let share = |i: usize, w: Window| -> f64 {
        let by = trace.busy_by_pid(gpus[i], w);
        by.get(&pids[i]).copied().unwrap_or(0) as f64 / w.len_ns().max(1) as f64
    };
    let mut err_sum = 0.0;
    let mut err_n = 0usize;
    f.target = targets(measure);
    let window_targets: Vec<Vec<f64>> = windows.iter().map(|w| targets(*w)).collect();
    for i in 0..n {
        f.achieved[i] = share(i, measure);
        f.abs_error[i] = (f.achieved[i] - f.target[i]).abs();
        for (w, t) in windows.iter().zip(&window_targets) {
            let e = (share(i, *w) - t[i]).abs();
            f.max_window_error[i] = f.max_window_error[i].max(e);
            f.summary.max_abs_error = f.summary.max_abs_error.max(e);
            err_sum += e;
            err_n += 1;
        }
    }
    f.summary.mean_abs_error = err_sum / err_n.max(1) as f64;
    f.summary.device_utilization = devices
        .iter()
        .map(|&d| trace.utilization(d, measure))
        .sum::<f64>()
        / devices.len().max(1) as f64;
    let mut gaps: Vec<f64> = devices
        .iter()
        .flat_map(|&d| handoff_gaps(trace, d, measure))
        .map(|g| g as f64 / 1e3)
        .collect();
    gaps.sort_by(f64::total_cmp);
    f.summary.handoffs = gaps.len();
    f.summary.handoff_p50_us = quantile(&gaps, 0.5);
    f.summary.handoff_p99_us = quantile(&gaps, 0.99);
    f.windows = windows
        .iter()
        .map(|w| {
            (
                (w.start_ns - origin) as f64 / 1e9,
                (w.end_ns - origin) as f64 / 1e9,
            )
        })
        .collect();
    let end = spans.iter().flatten().map(|w| w.end_ns).max().unwrap();
    let mut b = origin;
    let mut series = vec![Vec::new(); n];
    while b + PLOT_BIN_NS / 2 <= end {
        let w = Window::new(b, (b + PLOT_BIN_NS).min(end));
        f.plot_t.push((b - origin) as f64 / 1e9);
        for (i, s) in series.iter_mut().enumerate() {
            s.push(share(i, w));
        }
        b += PLOT_BIN_NS;
    }
    f.plot_shares = series;
    f
}

/// Idle ns between the end of one process's last kernel and the start of the next process's
/// first kernel, at each change of the process running on `device` inside `window` (0 when
/// the next one starts at once).
pub fn handoff_gaps(trace: &Trace, device: u32, window: Window) -> Vec<u64> {
    let mut recs: Vec<_> = trace
        .records()
        .iter()
        .filter(|r| r.device == device && r.end_ns > window.start_ns && r.start_ns < window.end_ns)
        .collect();
    recs.sort_by_key(|r| (r.start_ns, r.end_ns));
    let mut gaps = Vec::new();
    let mut prev: Option<(u32, u64)> = None;
    for r in recs {
        if let Some((pid, end)) = prev {
            if pid != r.pid {
                gaps.push(r.start_ns.saturating_sub(end));
            } else if r.end_ns <= end {
                continue;
            }
        }
        prev = Some((r.pid, r.end_ns.max(prev.map_or(0, |p| p.1))));
    }
    gaps
}
