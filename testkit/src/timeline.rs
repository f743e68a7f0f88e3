//! Kernel timelines a program records itself with CUDA timing events: the measurement on a GPU
//! that writes no device trace (a real one).
//!
//! After each kernel the program records an event. An event's time relative to an anchor event
//! (`cuEventElapsedTime`, same context) placed on CLOCK_MONOTONIC gives the kernel's end; its
//! known device time (a `gpushare_spin` kernel's argument) gives its start. The anchor is placed
//! by polling events to completion on an idle stream and keeping the sample seen complete
//! soonest after the GPU completed it, so processes' timelines line up to about one poll (µs on
//! a real GPU; up to tens of µs on a loaded 2-core machine's simulator). The records have the
//! device trace's format, so the same analysis reads both; on the simulated GPU the two can be
//! compared (`gpushare-bench --source events` reports both).
//!
//! Nothing here synchronises through the driver's blocking calls (only `cuEventQuery`), so an
//! interposer that watches synchronisations sees the workload's own and nothing more.

use crate::trace::Record;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DriverError, result};
use std::collections::VecDeque;
use std::sync::Arc;

/// Calibration samples of the anchor's host time, and the pause between them (so that they meet
/// the machine in different moments; the best one counts).
const SAMPLES: usize = 32;
const SAMPLE_GAP: std::time::Duration = std::time::Duration::from_micros(300);

/// One stream's kernel timeline (one per launching thread: see [`Timeline::sibling`]).
pub struct Timeline {
    ctx: Arc<CudaContext>,
    device: u32,
    anchor: Arc<CudaEvent>,
    /// CLOCK_MONOTONIC ns at which `anchor` completed.
    anchor_ns: u64,
    /// Events recorded after kernels, oldest first, with the stream and the kernel's device time.
    pending: VecDeque<(CudaEvent, u64, u64)>,
    pool: Vec<CudaEvent>,
    records: Vec<Record>,
}

impl Timeline {
    /// Place an anchor on `stream`, which must be idle (nothing of this program queued on it).
    pub fn start(
        ctx: &Arc<CudaContext>,
        stream: &CudaStream,
        device: u32,
    ) -> Result<Timeline, DriverError> {
        let anchor = timing_event(ctx)?;
        anchor.record(stream)?;
        let mut anchor_ns = poll(&anchor)?;
        let probe = timing_event(ctx)?;
        for _ in 0..SAMPLES {
            std::thread::sleep(SAMPLE_GAP);
            probe.record(stream)?;
            let seen = poll(&probe)?;
            anchor_ns = anchor_ns.min(seen.saturating_sub(elapsed_ns(&anchor, &probe)?));
        }
        Ok(Timeline {
            ctx: ctx.clone(),
            device,
            anchor: Arc::new(anchor),
            anchor_ns,
            pending: VecDeque::new(),
            pool: vec![probe],
            records: Vec::new(),
        })
    }

    /// A timeline for another stream of the same context, on the same anchor (anchors placed
    /// apart, while other streams keep the GPU busy, need not line up as well).
    pub fn sibling(&self) -> Timeline {
        Timeline {
            ctx: self.ctx.clone(),
            device: self.device,
            anchor: self.anchor.clone(),
            anchor_ns: self.anchor_ns,
            pending: VecDeque::new(),
            pool: Vec::new(),
            records: Vec::new(),
        }
    }

    /// A kernel of `ns` device time was just launched on `stream`: record its end.
    pub fn kernel(&mut self, stream: &CudaStream, ns: u64) -> Result<(), DriverError> {
        let event = match self.pool.pop() {
            Some(e) => e,
            None => timing_event(&self.ctx)?,
        };
        event.record(stream)?;
        self.pending
            .push_back((event, stream.cu_stream() as u64, ns));
        Ok(())
    }

    /// Turn the kernels that have completed into records (does not wait).
    pub fn collect(&mut self) -> Result<(), DriverError> {
        while let Some((event, _, _)) = self.pending.front() {
            if !event.try_is_complete()? {
                break;
            }
            let (event, stream, ns) = self.pending.pop_front().expect("front exists");
            let end_ns = self.anchor_ns + elapsed_ns(&self.anchor, &event)?;
            self.records.push(Record {
                device: self.device,
                pid: std::process::id(),
                ctx: self.ctx.cu_ctx() as u64,
                stream,
                kernel: crate::ptx::SPIN_KERNEL.into(),
                start_ns: end_ns.saturating_sub(ns),
                end_ns,
                preempted: false,
            });
            self.pool.push(event);
        }
        Ok(())
    }

    /// The records, once every kernel has completed (after a synchronisation).
    pub fn finish(mut self) -> Result<Vec<Record>, DriverError> {
        self.collect()?;
        tighten(&mut self.records);
        Ok(self.records)
    }
}

/// An event completes when the GPU reaches it, which is after its kernel ended if the program
/// was held up between the launch and the record (a launch call that waited in an interposer):
/// its time is only an upper bound of the kernel's end. A kernel ends before the next one on its
/// stream starts, no later than that one's end less its device time: `records` (one stream's,
/// in launch order) take the tighter bound, exact when the next kernel followed at once.
fn tighten(records: &mut [Record]) {
    for i in (1..records.len()).rev() {
        let (earlier, later) = records.split_at_mut(i);
        let (prev, next) = (&mut earlier[i - 1], &later[0]);
        if prev.stream == next.stream && next.start_ns < prev.end_ns {
            let ns = prev.end_ns - prev.start_ns;
            prev.end_ns = next.start_ns;
            prev.start_ns = next.start_ns.saturating_sub(ns);
        }
    }
}

/// A new event of `ctx` that records time (cudarc's default disables timing).
fn timing_event(ctx: &Arc<CudaContext>) -> Result<CudaEvent, DriverError> {
    ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
}

/// Poll until `event` has completed; the CLOCK_MONOTONIC ns when it was seen complete. It
/// yields between polls: on a machine with few cores, whatever completes the event (a simulated
/// device, the driver's threads) needs the CPU.
fn poll(event: &CudaEvent) -> Result<u64, DriverError> {
    while !event.try_is_complete()? {
        std::thread::yield_now();
    }
    Ok(gpushare_units::monotonic_ns())
}

/// ns from `start` to `end`, both completed events of one context (never negative).
fn elapsed_ns(start: &CudaEvent, end: &CudaEvent) -> Result<u64, DriverError> {
    // SAFETY: two live events of the same context, both recorded and completed.
    let ms = unsafe { result::event::elapsed(start.cu_event(), end.cu_event()) }?;
    Ok((f64::from(ms) * 1e6).max(0.0).round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(stream: u64, start_ns: u64, end_ns: u64) -> Record {
        Record {
            device: 0,
            pid: 1,
            ctx: 1,
            stream,
            kernel: "gpushare_spin".into(),
            start_ns,
            end_ns,
            preempted: false,
        }
    }

    #[test]
    fn a_late_event_is_corrected_by_the_kernel_after_it() {
        // Kernels of 100 ns back to back from 0; the second one's event came 50 ns late, and
        // that moved the first one's (through its start) no further.
        let mut r = vec![
            rec(1, 0, 100),
            rec(1, 150, 250),
            rec(1, 200, 300),
            rec(1, 900, 1000),
        ];
        tighten(&mut r);
        let spans: Vec<_> = r.iter().map(|r| (r.start_ns, r.end_ns)).collect();
        assert_eq!(spans, [(0, 100), (100, 200), (200, 300), (900, 1000)]);
        // Another stream's kernel says nothing about this one's.
        let mut r = vec![rec(1, 150, 250), rec(2, 200, 300)];
        tighten(&mut r);
        assert_eq!((r[0].start_ns, r[0].end_ns), (150, 250));
    }
}
