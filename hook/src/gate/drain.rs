//! A GPU's drains: waiting, on a thread of its own, for the work of the contexts a turn
//! launched into, for as long as the turn's drain limit allows.

use crate::driver::{self, Handle};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// One GPU's drains, on a thread of their own: `cuCtxSynchronize` cannot be given a time
/// limit, so the watcher asks this thread to wait and waits for it only until the drain's
/// limit (which a turn cut short or revoked meanwhile brings forward).
#[derive(Default)]
pub(super) struct Drainer {
    state: Mutex<DrainState>,
    cv: Condvar,
}

#[derive(Default)]
struct DrainState {
    /// Drains asked for and done (a later one covers the earlier ones' work too).
    asked: u64,
    done: u64,
    ctxs: Vec<Handle>,
    /// When the drain under way stops being waited for.
    until_ns: u64,
}

impl Drainer {
    fn lock(&self) -> MutexGuard<'_, DrainState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The drain under way (or the next) is waited for until `until_ns`.
    pub(super) fn until(&self, until_ns: u64) {
        self.lock().until_ns = until_ns;
        self.cv.notify_all();
    }

    /// Drain `ctxs`; true once their work completed, false if the limit came first (the drain
    /// goes on, and a later one waits for it).
    pub(super) fn drain(&self, ctxs: Vec<Handle>) -> bool {
        let mut s = self.lock();
        s.asked += 1;
        let ticket = s.asked;
        s.ctxs = ctxs;
        self.cv.notify_all();
        loop {
            if s.done >= ticket {
                return true;
            }
            let now = crate::now_ns();
            if now >= s.until_ns {
                return false;
            }
            let wait = Duration::from_nanos(s.until_ns - now);
            s = self
                .cv
                .wait_timeout(s, wait)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    pub(super) fn run(&self) {
        loop {
            let mut s = self.lock();
            while s.done == s.asked {
                s = self.cv.wait(s).unwrap_or_else(|e| e.into_inner());
            }
            let ticket = s.asked;
            let ctxs = std::mem::take(&mut s.ctxs);
            drop(s);
            for ctx in ctxs {
                driver::synchronize_context(ctx);
            }
            self.lock().done = ticket;
            self.cv.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How long a test waits for a drain to return before it fails rather than hangs (a
    /// broken drainer may never return).
    const HANG: Duration = Duration::from_secs(20);

    /// `d.drain()` on a thread of its own, as the watcher calls it: what it returned.
    fn drained(d: &'static Drainer) -> bool {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(d.drain(Vec::new())));
        rx.recv_timeout(HANG).expect("the drain did not return")
    }

    /// A drain that does not complete by its limit (a kernel waiting for a peer GPU) lets the
    /// gate go on; the next drain waits for the first.
    #[test]
    fn a_drain_is_bounded_and_settles_later() {
        let d: &'static Drainer = Box::leak(Box::default());
        // No drainer thread yet: nothing completes, and the drain is waited for until its
        // limit, not less.
        let limit = crate::now_ns() + 20_000_000;
        d.until(limit);
        assert!(!drained(d));
        assert!(crate::now_ns() >= limit);
        // A limit brought forward (the turn revoked) ends a wait that had no end.
        d.until(u64::MAX);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(d.drain(Vec::new())));
        // Asked for under the lock, which the drain lets go of only to wait: it is waiting.
        while d.lock().asked < 2 {
            std::thread::yield_now();
        }
        d.until(0);
        assert_eq!(rx.recv_timeout(HANG), Ok(false));
        std::thread::spawn(move || d.run());
        d.until(u64::MAX);
        assert!(drained(d));
        assert_eq!(d.lock().done, 3, "one drain covers the earlier ones");
    }
}
