//! Pacing: every K launches a fence event is recorded on the launching stream; while more than
//! half the queue budget is queued, the next launch waits for the oldest fence before it is
//! submitted.

use super::{Driver, Gate, Inner};
use crate::driver::{self, Stream};
use crate::queue::Ask;
use crate::turn::{UNLIMITED, pacing};
use std::sync::atomic::Ordering;
use std::time::Duration;

impl Gate {
    /// Record a fence after launch `n` (on `stream`, whose key is `key`); when too much work is
    /// queued, the next launch waits. The driver is called without the gate's lock
    /// ([`Gate::ask`]): what changed meanwhile (a drain, another thread's fence) is tolerated.
    pub(super) fn fence(&self, stream: Stream, per_thread: bool, key: u64, n: u64) {
        // A drain makes a fence pointless: fence the next launch instead of holding this launch
        // call (already submitted) for the gate's lock.
        if self.draining.load(Ordering::Acquire) {
            self.next_pace.store(n + 1, Ordering::Relaxed);
            return;
        }
        let Some(ctx) = driver::current_context() else {
            return;
        };
        let mut g = self.lock();
        if !self.fences_apply(&g, n) {
            return;
        }
        if !g.ctxs.contains(&ctx) {
            g.ctxs.push(ctx);
        }
        let pooled = g.queue.take_event(ctx);
        // Whether the GPU had not reached the newest fence yet once this one is recorded (then
        // the time between the two completions is all GPU work); if it had, that fence is taken
        // in now.
        let mut asked = g.asked.pop().unwrap_or_default();
        g.queue.to_ask(Ask::Newest, &mut asked);
        drop(g);
        // A new event is created in the calling thread's current context (`ctx`).
        let event = pooled.or_else(driver::event_create);
        let recorded = event.map(|e| driver::event_record(e, stream, per_thread));
        if recorded == Some(driver::Recorded::Yes) {
            asked.ask(&mut Driver);
        }
        let now = crate::now_ns();
        let mut g = self.lock();
        g.queue.take_in(&asked, n);
        let behind = asked.pending_newest();
        g.asked.push(asked);
        let Some(event) = event else {
            return;
        };
        match recorded {
            Some(driver::Recorded::Yes) => {}
            Some(driver::Recorded::No) | None => return g.queue.put_event(ctx, event),
            // Destroyed with its context behind the hook's back: dropped, never used again.
            Some(driver::Recorded::Dead) => return,
        }
        // (The turn may have ended meanwhile: the fence is kept for the next.)
        let Some(budget) = g.turns.queue_budget() else {
            return g.queue.put_event(ctx, event);
        };
        let est = g
            .queue
            .push_fence(&self.launch_streams, (event, ctx), key, n, now, behind);
        g.turns.paced(n, now);
        let (k, wait_above) = pacing(budget, est.unwrap_or(0.0));
        // Fences the GPU has passed already are taken in first (a query each, no wait): the
        // next launch waits only for work still queued, not for the news that it ran.
        if g.queue.too_much(wait_above) {
            g = self.ask(g, Ask::AllButNewest, false).0;
            if g.queue.too_much(wait_above) {
                self.pace_due.store(true, Ordering::Relaxed);
            }
        }
        if let (Some(budget), Some(est)) = (g.turns.just_in_time(), g.queue.kernel_ns()) {
            g.runway.launched(now, n, est);
            if g.runway.launch_at(now, budget, est).is_some() {
                self.pace_due.store(true, Ordering::Relaxed);
            }
        }
        self.next_pace.store(n + k, Ordering::Relaxed);
    }

    /// Whether fences are recorded now: only while a queue budget applies. Without one, the
    /// next fence is due at the next launch, or never while without limits (until they apply
    /// again: `apply`).
    fn fences_apply(&self, g: &Inner, n: u64) -> bool {
        if g.turns.queue_budget().is_some() {
            return true;
        }
        let unthrottled = g.turns.gate_deadline() == UNLIMITED;
        let next = if unthrottled { u64::MAX } else { n + 1 };
        self.next_pace.store(next, Ordering::Relaxed);
        false
    }

    /// Before a launch, after a fence found too much work queued: wait for the oldest fences
    /// until it is not (or a drain empties the queue).
    pub(super) fn wait_for_queue(&self) {
        let mut g = self.lock();
        // The runway's launch time waited for last.
        let mut waited_for = None;
        while let Some(budget) = g.turns.queue_budget()
            && !self.draining.load(Ordering::Acquire)
        {
            let launched = self.launches.load(Ordering::Relaxed);
            g.queue.scan(&self.launch_streams, launched);
            // Launching just in time: not before the work queued runs down to the budget
            // (woken early by a change; a closing turn ends the wait).
            if let (Some(budget), Some(est)) = (g.turns.just_in_time(), g.queue.kernel_ns()) {
                let now = crate::now_ns();
                if let Some(at) = g.runway.launch_at(now, budget, est) {
                    self.pacing.fetch_add(1, Ordering::AcqRel);
                    g = self.wait(g, Duration::from_nanos(at - now));
                    self.pacing.fetch_sub(1, Ordering::AcqRel);
                    waited_for = Some(at);
                    continue;
                }
                if let Some(at) = waited_for.take() {
                    g.runway.woke(at, now);
                }
                // What the GPU has passed meanwhile, without waiting.
                g = self.ask(g, Ask::All, false).0;
            }
            if !g.queue.too_much(pacing(budget, 0.0).1) {
                break;
            }
            // Wait without the lock, so grants, cut-short turns and the watcher are not held
            // up by a launcher waiting for its GPU work. (If a drain recycled the event
            // meanwhile, this waits for its new record: longer, never wrong; a fence taken in
            // meanwhile by another thread is not taken in twice.)
            self.pacing.fetch_add(1, Ordering::AcqRel);
            let waited;
            (g, waited) = self.ask(g, Ask::Oldest, true);
            self.pacing.fetch_sub(1, Ordering::AcqRel);
            if !waited {
                break;
            }
            // The GPU was behind where the runway had it: it ends what is queued from now.
            if g.turns.just_in_time().is_some()
                && let Some((tail, _)) = g.queue.queued_ns(crate::now_ns(), u64::MAX)
            {
                g.runway.reached(crate::now_ns(), tail);
            }
        }
        self.pace_due.store(false, Ordering::Relaxed);
    }
}
