//! What this process has queued on one GPU, as far as its fence events tell: the fences pending,
//! the launches each stream has not had vouched for, the GPU time per launch learnt from the
//! fences' completions, and the estimates the gate paces and hands over by.
//!
//! A completed fence vouches only for the launches before it on its own stream, so every launch
//! is attributed to its stream: the launch fast path writes the stream into a ring
//! ([`LaunchStreams`]), read here whenever fences are recorded or the queue is estimated. The
//! launches queued are those not vouched for; the GPU time per launch is the time between
//! completions per launch they vouched for (on one stream, the launches between consecutive
//! fences; on several, the GPU's pace through all of them, whether it runs their kernels one at
//! a time or side by side).
//!
//! Only an interval the GPU surely worked through without a break teaches that pace as it is:
//! one whose later fence was recorded while the earlier was still pending (its launches were
//! queued before the GPU reached the earlier fence). Any other interval may hold idle time — a
//! launch-bound loop waiting on the host, a synchronisation, another route's kernels — and
//! bounds the pace from above only: it may lower the estimate, never raise it. Otherwise idle
//! time would pass for GPU work, and fences would come more often than the budget needs.
//!
//! Pure: the queue reads neither the driver nor the clock. Its caller feeds it the launch
//! counts, the times, and the driver's answers about the fence events ([`Gpu`]: the gate's is
//! the driver and CLOCK_MONOTONIC; the tests' a GPU in virtual time).

use crate::driver::{Handle, Stream as StreamHandle};
use gpushare_cuda_abi::types::{CU_STREAM_LEGACY, CU_STREAM_PER_THREAD};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};

/// The most streams tracked at once; launches on more leave the queue unestimated until the
/// next drain (no early handover).
const MAX_STREAMS: usize = 32;

/// What the caller observes of the GPU as the queue takes its fences in: the clock the fences'
/// times are read by, and the driver's answers about fence events.
pub trait Gpu {
    /// The time now (ns).
    fn now_ns(&mut self) -> u64;
    /// Whether the GPU has passed `event` (`None`: the driver would not say).
    fn passed(&mut self, event: Handle) -> Option<bool>;
    /// Wait until the GPU has passed `event`; false if the driver would not wait.
    fn wait(&mut self, event: Handle) -> bool;
    /// The GPU time (ms) from `start`'s completion to `end`'s: two completed events of one
    /// context (`None`: the driver would not say).
    fn elapsed_ms(&mut self, start: Handle, end: Handle) -> Option<f32>;
}

/// The launches whose streams are remembered: more than the launches between two fences.
const RING: usize = 8192;

/// A ring entry: the stream key in the low 48 bits (user-space addresses), whether the launch
/// call has returned (bit 48), and the launch count's low 15 bits above, so that a reader tells a
/// launch's entry from the one 8192 launches before it, and one not written yet.
const KEY_BITS: u32 = 48;
const KEY_MASK: u64 = (1 << KEY_BITS) - 1;
const RETURNED: u64 = 1 << KEY_BITS;
const TAG_SHIFT: u32 = KEY_BITS + 1;
const TAG_MASK: u64 = (1 << (64 - TAG_SHIFT)) - 1;

/// The stream key of a launch that named no stream (a multi-device cooperative launch).
const NO_STREAM: u64 = KEY_MASK;

/// The key of an admission withdrawn (the turn ended as it was admitted): no launch was made.
const VOID: u64 = KEY_MASK - 1;

/// The stream of each recent launch and whether its call has returned, written by the launch
/// fast path (a store on admission, one on return: no lock, no read-modify-write).
pub struct LaunchStreams(Box<[AtomicU64]>);

impl LaunchStreams {
    pub fn new() -> LaunchStreams {
        LaunchStreams((0..RING).map(|_| AtomicU64::new(u64::MAX)).collect())
    }

    /// Launches `first..=last` were admitted, to be made on the stream of `key`.
    #[inline]
    pub fn admitted(&self, first: u64, last: u64, key: u64) {
        for n in first..=last {
            self.slot(n).store(tag(n) | key, Ordering::Relaxed);
        }
    }

    /// The calls of launches `first..=last` returned (`key` [`VOID`]: withdrawn, not made).
    /// Release: what the driver did in them happens before a drain that sees this.
    #[inline]
    pub fn returned(&self, first: u64, last: u64, key: u64) {
        for n in first..=last {
            self.slot(n)
                .store(tag(n) | RETURNED | key, Ordering::Release);
        }
    }

    /// Launches `first..=last` were withdrawn.
    pub fn withdrawn(&self, first: u64, last: u64) {
        self.returned(first, last, VOID);
    }

    /// The launch count after `from` up to which every launch's call has returned, looking no
    /// further than `to`. Launches a whole ring older than `to` are taken as returned (their
    /// entries were written over: 8192 launches admitted while one call was still in the driver).
    pub fn returned_through(&self, from: u64, to: u64) -> u64 {
        let mut m = from.max(to.saturating_sub(RING as u64));
        while m < to {
            let e = self.slot(m + 1).load(Ordering::Acquire);
            if e >> TAG_SHIFT != (m + 1) & TAG_MASK || e & RETURNED == 0 {
                break;
            }
            m += 1;
        }
        m
    }

    #[inline]
    fn slot(&self, n: u64) -> &AtomicU64 {
        &self.0[n as usize % RING]
    }

    /// The stream key of launch `n`, if it has been written ([`VOID`] if withdrawn).
    fn get(&self, n: u64) -> Option<u64> {
        let e = self.slot(n).load(Ordering::Acquire);
        (e >> TAG_SHIFT == n & TAG_MASK).then_some(e & KEY_MASK)
    }
}

#[inline]
fn tag(n: u64) -> u64 {
    (n & TAG_MASK) << TAG_SHIFT
}

/// The ring key of a launch on `stream` (`per_thread`: through a `_ptsz` entry point); `None`:
/// no stream named. `thread_id`: the launching thread's identity (asked for only for a
/// per-thread default stream).
#[inline]
pub fn key_of(stream: Option<(StreamHandle, bool)>, thread_id: impl FnOnce() -> u64) -> u64 {
    stream.map_or(NO_STREAM, |(s, per_thread)| {
        stream_key(s, per_thread, thread_id)
    })
}

/// A stream's identity: its handle; 0 for the legacy default stream (null through a plain
/// entry point, or CU_STREAM_LEGACY); for a per-thread default stream (CU_STREAM_PER_THREAD
/// through any entry point, or null through a `_ptsz` one) the launching thread's, whose own
/// stream it is (`thread_id`).
#[inline]
fn stream_key(stream: StreamHandle, per_thread: bool, thread_id: impl FnOnce() -> u64) -> u64 {
    if stream == CU_STREAM_PER_THREAD || (stream.is_null() && per_thread) {
        thread_id()
    } else if stream == CU_STREAM_LEGACY {
        0
    } else {
        stream as u64
    }
}

struct Fence {
    event: Handle,
    ctx: Handle,
    /// Its place in the order fences were recorded in.
    id: u64,
    /// The fence recorded just before it was still pending when it was recorded: the GPU
    /// worked from that one's completion to this one's without a break.
    behind: bool,
    /// Its stream (index into `Queue::streams`) and the launches on it up to the fence.
    stream: usize,
    seq: u64,
    /// When it was recorded.
    recorded_ns: u64,
}

struct Stream {
    key: u64,
    /// Launches on it (read from the ring), and the launch count of the latest.
    launched: u64,
    latest: u64,
    /// Launches on it known to have completed (up to its last completed fence, or all of them
    /// at a drain).
    done: u64,
    /// Launched on since the last drain (the others are forgotten at the drain).
    used: bool,
}

impl Stream {
    fn queued(&self) -> u64 {
        self.launched - self.done
    }
}

/// The queue of one process on one GPU.
#[derive(Default)]
pub struct Queue {
    /// Pending fences, in the order they were recorded.
    fences: VecDeque<Fence>,
    /// Fences recorded.
    recorded: u64,
    streams: Vec<Stream>,
    /// The launch count up to which the ring has been read.
    scanned: u64,
    /// Some launches since the last drain could not be attributed (too many streams, or the
    /// ring overran): no estimate until the next drain.
    untracked: bool,
    /// Launches up to this count have completed (a drain) or were lost (the ring overran): a
    /// fence recorded after one of them, taken in late, is dropped.
    settled: u64,
    /// Fence events to reuse, with their contexts.
    pool: Vec<(Handle, Handle)>,
    /// The completed fence that completed last (timing reference for the next), when it was
    /// seen to complete, and the launch count then: the launches up to that count were all
    /// queued by that moment, so the GPU has worked through them without a break since.
    last_done: Option<Fence>,
    last_done_ns: u64,
    done_seen_launches: u64,
    /// The GPU time between completions and the launches they vouched for, each sum decaying
    /// by 30 % an interval: their ratio is the GPU time per launch. (On several streams a fence
    /// can vouch for launches that ran in earlier intervals: sums, unlike a mean of ratios,
    /// still add up.) An interval that may hold idle time adds at most the estimate's time.
    busy: (f64, f64),
    /// The GPU time per launch of the recent intervals the GPU worked through without a
    /// break, kept near the shortest: it falls to a shorter interval at once and rises by a
    /// tenth of the way to a longer one; an interval that may hold idle time only lowers it. On a GPU that time-slices processes, another's kernels
    /// between two of this process's lengthen an interval without a break in it; its shortest
    /// is the time one launch takes ([`Queue::kernel_ns`]).
    fastest: Option<f64>,
}

impl Queue {
    /// Attribute launches up to `n` to their streams, stopping at one still being written.
    pub fn scan(&mut self, ring: &LaunchStreams, n: u64) {
        if n.saturating_sub(self.scanned) > RING as u64 {
            self.untracked = true;
            self.scanned = n;
            self.settled = n;
        }
        let mut last: Option<(u64, usize)> = None;
        while self.scanned < n {
            let Some(key) = ring.get(self.scanned + 1) else {
                return;
            };
            self.scanned += 1;
            if key == VOID {
                continue;
            }
            let i = match last {
                Some((k, i)) if k == key => i,
                _ => match self.stream_index(key) {
                    Some(i) => i,
                    None => {
                        self.untracked = true;
                        continue;
                    }
                },
            };
            last = Some((key, i));
            let s = &mut self.streams[i];
            s.launched += 1;
            s.latest = self.scanned;
            s.used = true;
        }
    }

    fn stream_index(&mut self, key: u64) -> Option<usize> {
        if let Some(i) = self.streams.iter().position(|s| s.key == key) {
            return Some(i);
        }
        if self.streams.len() == MAX_STREAMS {
            return None;
        }
        self.streams.push(Stream {
            key,
            launched: 0,
            latest: 0,
            done: 0,
            used: false,
        });
        Some(self.streams.len() - 1)
    }

    /// A pooled timing event of `ctx` (`None`: the caller creates one).
    pub fn take_event(&mut self, ctx: Handle) -> Option<Handle> {
        let i = self.pool.iter().position(|(c, _)| *c == ctx)?;
        Some(self.pool.swap_remove(i).1)
    }

    /// An event taken but not recorded.
    pub fn put_event(&mut self, ctx: Handle, event: Handle) {
        self.pool.push((ctx, event));
    }

    /// `event` was recorded on stream `key` at `now`, right after launch `n` (the ring is read
    /// up to it first); `behind`: the fence the driver said, after this record, had not
    /// completed yet (asked as the newest pending one, [`Ask::Newest`]): if no other fence was
    /// recorded since, the GPU works from its completion to this one's without a break. Returns the GPU
    /// time per launch, if learnt.
    pub fn push_fence(
        &mut self,
        ring: &LaunchStreams,
        (event, ctx): (Handle, Handle),
        key: u64,
        n: u64,
        now: u64,
        behind: Option<u64>,
    ) -> Option<f64> {
        self.scan(ring, n);
        let index = if n <= self.settled {
            None
        } else {
            self.stream_index(key)
        };
        let Some(i) = index else {
            self.untracked |= n > self.settled;
            self.pool.push((ctx, event));
            return self.ns_per_launch();
        };
        // Launches on it after `n` already read (another thread's estimate) are not before it.
        let later = (n + 1..=self.scanned)
            .filter(|&m| ring.get(m) == Some(key))
            .count() as u64;
        // (Unless another fence was recorded since.)
        let behind = behind == Some(self.recorded);
        self.recorded += 1;
        self.fences.push_back(Fence {
            event,
            ctx,
            id: self.recorded,
            behind,
            stream: i,
            seq: self.streams[i].launched.saturating_sub(later),
            recorded_ns: now,
        });
        self.ns_per_launch()
    }

    /// GPU time per launch, once learnt.
    fn ns_per_launch(&self) -> Option<f64> {
        let (ns, launches) = self.busy;
        (launches > 0.0).then(|| ns / launches)
    }

    /// The GPU time one launch takes when the GPU runs it, once learnt from intervals without
    /// a break: what launching just in time goes by (the time per launch, averaged over all
    /// intervals, also holds other processes' kernels run in between).
    pub fn kernel_ns(&self) -> Option<f64> {
        self.fastest
    }

    /// The oldest pending fence's event.
    #[cfg(test)]
    pub fn oldest_event(&self) -> Option<Handle> {
        self.fences.front().map(|f| f.event)
    }

    /// Launches not vouched for by a completed fence.
    fn queued(&self) -> u64 {
        self.streams.iter().map(Stream::queued).sum()
    }

    /// Estimated GPU time (ns) still queued at `now` (launches up to the last scan), and
    /// whether the estimate runs down with time: the launches not known to have completed times
    /// the GPU time per launch, less the time the GPU has surely been working through them —
    /// since the last completion, or since the oldest pending fence was recorded if that was
    /// later (the GPU may have idled in between); with no fence pending, since the last
    /// completion if all those launches were queued by then, else not at all (the estimate
    /// stays put). `None`: untracked launches, nothing learnt yet, or work queued on several
    /// streams with more than `tolerance_ns` of it after their streams' newest fences (vouched
    /// for only when a later fence on the stream completes, so counted as queued long after it
    /// ran: the estimate would run past the real end of the work).
    pub fn queued_ns(&self, now: u64, tolerance_ns: u64) -> Option<(u64, bool)> {
        if self.untracked {
            return None;
        }
        let queued = self.queued();
        if queued == 0 {
            return Some((0, true));
        }
        let est = self.ns_per_launch()?;
        let busy = || {
            self.streams
                .iter()
                .enumerate()
                .filter(|(_, s)| s.queued() > 0)
        };
        if busy().count() > 1 {
            let unvouched: u64 = busy()
                .map(|(i, s)| {
                    let newest = self.fences.iter().rev().find(|f| f.stream == i);
                    s.launched - newest.map_or(s.done, |f| f.seq.max(s.done))
                })
                .sum();
            if unvouched as f64 * est > tolerance_ns as f64 {
                return None;
            }
        }
        let work = queued as f64 * est;
        let latest = self
            .streams
            .iter()
            .filter(|s| s.queued() > 0)
            .map(|s| s.latest)
            .max();
        let since = match self.fences.front() {
            Some(f) => Some(now.saturating_sub(f.recorded_ns.max(self.last_done_ns))),
            None if self.last_done.is_some() && latest <= Some(self.done_seen_launches) => {
                Some(now.saturating_sub(self.last_done_ns))
            }
            None => None,
        };
        let tail = (work - since.unwrap_or(0) as f64).max(0.0) as u64;
        Some((tail, since.is_some()))
    }

    /// A synchronisation waited `waited_ns` for the work queued when it began (the launches not
    /// vouched for then, read from the ring first): the GPU worked that long through them
    /// without a break, so its time per launch is at least that over them. Fences further
    /// apart than the synchronisations see no interval without a break; this is how an
    /// estimate left too low by a launch-bound spell is corrected.
    pub fn waited(&mut self, waited_ns: f64) {
        let queued = self.queued();
        if self.untracked || queued == 0 {
            return;
        }
        let at_least = waited_ns / queued as f64;
        let (ns, launches) = self.busy;
        if launches == 0.0 {
            self.busy = (waited_ns, queued as f64);
        } else if ns < at_least * launches {
            self.busy.0 = at_least * launches;
        }
    }

    /// Whether a launcher should wait for its oldest fence: more than `limit_ns` of work is
    /// queued (or launches are queued and nothing is learnt yet), and there is a fence before
    /// the newest to wait for.
    pub fn too_much(&self, limit_ns: f64) -> bool {
        let queued = self.queued();
        let over = self.untracked
            || queued > 0
                && self
                    .ns_per_launch()
                    .is_none_or(|est| queued as f64 * est > limit_ns);
        over && self.fences.len() >= 2
    }

    /// Take in the fences that have completed, without waiting (`launched`: the launch count
    /// now); on several streams, in whatever order they completed. (The gate asks in three
    /// steps, [`Queue::to_ask`], [`Asked::ask`], [`Queue::take_in`], so as not to hold its lock
    /// across the driver's answers.)
    #[cfg(test)]
    pub fn complete_finished(&mut self, launched: u64, gpu: &mut impl Gpu) {
        let mut asked = Asked::default();
        self.to_ask(Ask::All, &mut asked);
        asked.ask(gpu);
        self.take_in(&asked, launched);
    }

    /// The pending fences `which` to ask the driver about, into `asked` (its buffer reused),
    /// with the completed fence the GPU time of the next completion is measured from.
    pub fn to_ask(&self, which: Ask, asked: &mut Asked) {
        asked.fences.clear();
        asked.now_ns = 0;
        asked.reference = self.last_done.as_ref().map(Fence::known);
        let n = self.fences.len();
        let (from, to) = match which {
            Ask::All => (0, n),
            Ask::AllButNewest => (0, n.saturating_sub(1)),
            Ask::Oldest => (0, n.min(1)),
            Ask::Newest => (n.saturating_sub(1), n),
        };
        asked
            .fences
            .extend(self.fences.range(from..to).map(|f| Asking {
                fence: f.known(),
                passed: None,
                since: None,
                refused: false,
            }));
    }

    /// Take in what `asked` learnt (`launched`: the launch count when it was asked): the fences
    /// it found completed that are still pending, as found then. The queue may have changed
    /// since it was asked (a drain, another thread's answers, new fences): an answer is about
    /// one record of a fence (its id), never an event reused since; a completion is timed only
    /// against the completed fence it was measured from, if that is still the reference. A
    /// fence the driver would not wait for is dropped (its event kept for reuse).
    pub fn take_in(&mut self, asked: &Asked, launched: u64) {
        for a in &asked.fences {
            if a.passed != Some(true) && !a.refused {
                continue;
            }
            let Some(i) = self.fences.iter().position(|f| f.id == a.fence.id) else {
                continue;
            };
            let f = self.fences.remove(i).expect("in range");
            if a.refused {
                self.pool.push((f.ctx, f.event));
                continue;
            }
            let reference = self.last_done.as_ref().map(|f| f.id);
            let ms = match a.since {
                Some((from, ms)) if Some(from) == reference => ms.map(f64::from),
                _ => None,
            };
            self.completed_after(f, ms, launched, asked.now_ns);
        }
    }

    /// Fence `f` has completed, seen at `now` (`launched`: the launch count then), `ms` after
    /// the reference fence completed (`None`: not comparable): the launches on its stream up to
    /// it have, and the time since the reference is theirs (if it completed after that; on
    /// several streams fences can complete out of the order they were recorded in).
    fn completed_after(&mut self, f: Fence, ms: Option<f64>, launched: u64, now: u64) {
        let s = &mut self.streams[f.stream];
        let vouched = f.seq.saturating_sub(s.done) as f64;
        s.done = s.done.max(f.seq);
        match ms {
            Some(ms) if ms < 0.0 => {
                // Completed before the reference: its launches ran in time already counted.
                self.busy.1 += vouched;
                self.pool.push((f.ctx, f.event));
                return;
            }
            Some(ms) => {
                let unbroken = f.behind
                    && self
                        .last_done
                        .as_ref()
                        .is_some_and(|prev| prev.id + 1 == f.id);
                let mut ns = ms * 1e6;
                if vouched > 0.0 {
                    let one = ns / vouched;
                    self.fastest = match self.fastest {
                        Some(f) if f < one && unbroken => Some(f + 0.1 * (one - f)),
                        // Perhaps idle in part: only lowers it (an upper bound).
                        Some(f) if f < one => Some(f),
                        None if !unbroken => None,
                        _ => Some(one),
                    };
                }
                if !unbroken && let Some(est) = self.ns_per_launch() {
                    // Perhaps idle in part: an upper bound of its launches' GPU time.
                    ns = ns.min(est * vouched);
                }
                let (sum, launches) = self.busy;
                self.busy = (0.7 * sum + ns, 0.7 * launches + vouched);
            }
            None => {}
        }
        if let Some(prev) = self.last_done.replace(f) {
            self.pool.push((prev.ctx, prev.event));
        }
        self.last_done_ns = now;
        self.done_seen_launches = launched;
    }

    /// The events of context `ctx` (`None`: of every context) were destroyed with it: forget
    /// them (never recorded or waited for again), and every launch up to `n` with them (the
    /// driver waits for a context's work before destroying it).
    pub fn forget_context(&mut self, ring: &LaunchStreams, ctx: Option<Handle>, n: u64) {
        let dead = |c: &Handle| ctx.is_none_or(|d| d == *c);
        self.fences.retain(|f| !dead(&f.ctx));
        self.pool.retain(|(c, _)| !dead(c));
        if self.last_done.as_ref().is_some_and(|f| dead(&f.ctx)) {
            self.last_done = None;
        }
        self.drained(ring, n);
    }

    /// Every launch up to `n` has completed (a drain): recycle the fences; forget the streams
    /// not launched on since the last drain, keep what was learnt of the others.
    pub fn drained(&mut self, ring: &LaunchStreams, n: u64) {
        self.scan(ring, n);
        self.scanned = n;
        self.settled = n;
        for f in self.fences.drain(..) {
            self.pool.push((f.ctx, f.event));
        }
        if let Some(f) = self.last_done.take() {
            self.pool.push((f.ctx, f.event));
        }
        for s in &mut self.streams {
            s.done = s.launched;
        }
        self.streams.retain(|s| s.used);
        for s in &mut self.streams {
            s.used = false;
        }
        self.untracked = false;
    }
}

impl Fence {
    fn known(&self) -> Known {
        Known {
            id: self.id,
            event: self.event,
            ctx: self.ctx,
        }
    }
}

/// Which pending fences to ask the driver about ([`Queue::to_ask`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ask {
    All,
    /// All but the one just recorded (it has hardly completed).
    AllButNewest,
    /// The oldest, to wait for.
    Oldest,
    /// The newest, as the next is recorded: whether the GPU is behind it.
    Newest,
}

/// A fence as asked about: its record (`id`), event and context.
#[derive(Debug, Clone, Copy)]
struct Known {
    id: u64,
    event: Handle,
    ctx: Handle,
}

#[derive(Debug, Clone, Copy)]
struct Asking {
    fence: Known,
    /// Whether the GPU has passed it (`None`: not asked, or the driver would not say).
    passed: Option<bool>,
    /// Completed: the completed fence its time was measured from (by id) and the GPU time
    /// since that one's completion (ms; `None`: not comparable).
    since: Option<(u64, Option<f32>)>,
    /// The driver would not wait for it.
    refused: bool,
}

/// Questions about pending fences and the driver's answers, asked without the gate's lock:
/// taken from the queue under the lock ([`Queue::to_ask`]), asked of the driver without it
/// ([`Asked::ask`], [`Asked::wait_oldest`]: a process the driver holds locked, by a
/// checkpoint say, blocks in these calls until it is let go), taken in under the lock again
/// ([`Queue::take_in`]). The buffer is kept and reused: no allocation once it has grown.
#[derive(Debug, Default)]
pub struct Asked {
    fences: Vec<Asking>,
    /// The completed fence the first completion is measured from.
    reference: Option<Known>,
    /// When the driver was asked (what the completions found are seen at).
    now_ns: u64,
}

impl Asked {
    /// Nothing to ask about.
    pub fn is_empty(&self) -> bool {
        self.fences.is_empty()
    }

    /// Ask whether the GPU has passed each fence, and for each it has, the GPU time since the
    /// previous completion (the reference, then each completed fence in turn, as
    /// [`Queue::take_in`] will take them in).
    pub fn ask(&mut self, gpu: &mut impl Gpu) {
        self.ask_after(gpu, false);
    }

    /// [`Asked::ask`], knowing already (`first_passed`) that the GPU has passed the first fence.
    fn ask_after(&mut self, gpu: &mut impl Gpu, first_passed: bool) {
        self.now_ns = gpu.now_ns();
        let mut reference = self.reference;
        for (i, a) in self.fences.iter_mut().enumerate() {
            a.passed = if i == 0 && first_passed {
                Some(true)
            } else {
                gpu.passed(a.fence.event)
            };
            if a.passed != Some(true) {
                continue;
            }
            let f = a.fence;
            let ms = reference
                .filter(|r| r.ctx == f.ctx)
                .map(|r| (r.id, gpu.elapsed_ms(r.event, f.event)));
            a.since = ms;
            // (A completion found before the reference's leaves the reference in place.)
            if ms.is_none_or(|(_, ms)| ms.is_none_or(|ms| ms >= 0.0)) {
                reference = Some(f);
            }
        }
    }

    /// Wait until the GPU has passed the oldest fence asked about, then [`Asked::ask`] (the
    /// oldest known passed: only its GPU time is asked for); false if there is none or the
    /// driver would not wait (it is then dropped when taken in).
    pub fn wait_oldest(&mut self, gpu: &mut impl Gpu) -> bool {
        let Some(first) = self.fences.first_mut() else {
            return false;
        };
        if !gpu.wait(first.fence.event) {
            first.refused = true;
            self.fences.truncate(1);
            self.now_ns = gpu.now_ns();
            return false;
        }
        self.ask_after(gpu, true);
        true
    }

    /// The newest fence asked about, if the GPU had not passed it when asked: what the fence
    /// recorded next is `behind` ([`Queue::push_fence`]).
    pub fn pending_newest(&self) -> Option<u64> {
        self.fences
            .last()
            .filter(|a| a.passed == Some(false))
            .map(|a| a.fence.id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver;
    use crate::turn::pacing;
    use std::collections::HashMap;

    const A: u64 = 0x1000;
    const B: u64 = 0x2000;

    /// Launches `from..=to` on stream `key`.
    fn launch(ring: &LaunchStreams, from: u64, to: u64, key: u64) {
        ring.admitted(from, to, key);
        ring.returned(from, to, key);
    }

    /// A fence on `key` after launch `n`, recorded at `at`.
    fn fence(q: &mut Queue, ring: &LaunchStreams, key: u64, n: u64, at: u64) {
        let null = Handle::null();
        q.push_fence(ring, (null, null), key, n, at, None);
    }

    /// The oldest fence completed, seen at `now` with `launched` launches made (its GPU time
    /// since the last not known).
    fn complete(q: &mut Queue, launched: u64, now: u64) {
        let f = q.fences.pop_front().expect("a pending fence");
        q.completed_after(f, None, launched, now);
    }

    /// A GPU in virtual time, as the driver and the clock answer for it: the time now, and when
    /// the GPU passes each fence event (by key; one not listed it never passes).
    #[derive(Default)]
    struct VirtualGpu {
        now: u64,
        passes: HashMap<u64, u64>,
        /// The driver will not wait (the event was destroyed, say).
        refuses_waits: bool,
        /// The driver errs when asked whether an event has passed.
        queries_fail: bool,
        /// The elapsed times asked for, by event keys.
        timed: Vec<(u64, u64)>,
    }

    impl Gpu for VirtualGpu {
        fn now_ns(&mut self) -> u64 {
            self.now
        }

        fn passed(&mut self, event: Handle) -> Option<bool> {
            if self.queries_fail {
                return None;
            }
            Some(
                self.passes
                    .get(&event.key())
                    .is_some_and(|&t| t <= self.now),
            )
        }

        fn wait(&mut self, event: Handle) -> bool {
            match self.passes.get(&event.key()) {
                Some(&t) if !self.refuses_waits => {
                    self.now = self.now.max(t);
                    true
                }
                _ => false,
            }
        }

        fn elapsed_ms(&mut self, start: Handle, end: Handle) -> Option<f32> {
            self.timed.push((start.key(), end.key()));
            let (s, e) = (self.passes.get(&start.key())?, self.passes.get(&end.key())?);
            Some(((*e as f64 - *s as f64) / 1e6) as f32)
        }
    }

    #[test]
    fn the_ring_tells_a_launch_written_from_one_not_written_yet() {
        let ring = LaunchStreams::new();
        assert_eq!(ring.get(5), None);
        launch(&ring, 5, 5, A);
        assert_eq!(ring.get(5), Some(A));
        assert_eq!(
            ring.get(5 + RING as u64),
            None,
            "the entry of 8192 launches before"
        );
        ring.admitted(6, 6, key_of(None, driver::thread_id));
        assert_eq!(
            ring.get(6),
            Some(NO_STREAM),
            "admitted: its stream is known"
        );
    }

    /// A drain waits for the calls admitted before the gate closed: the returned ones are
    /// those up to the first still in the driver (or not written yet); a withdrawn admission
    /// has returned and is no launch.
    #[test]
    fn the_ring_tells_which_launch_calls_have_returned() {
        let ring = LaunchStreams::new();
        ring.admitted(1, 3, A);
        assert_eq!(ring.returned_through(0, 3), 0);
        ring.returned(1, 1, A);
        ring.returned(3, 3, A);
        assert_eq!(ring.returned_through(0, 3), 1, "launch 2 is in the driver");
        ring.withdrawn(2, 2);
        assert_eq!(ring.returned_through(1, 3), 3);
        assert_eq!(ring.returned_through(3, 5), 3, "4 and 5 not written yet");
        let far = 10 + 2 * RING as u64;
        assert_eq!(
            ring.returned_through(3, far),
            far - RING as u64,
            "entries written over are taken as returned"
        );
        let mut q = Queue::default();
        q.scan(&ring, 3);
        assert_eq!(q.queued(), 2, "the withdrawn admission is no launch");
    }

    /// A per-thread default stream is the launching thread's own, however it is named.
    #[test]
    fn per_thread_default_streams_are_each_threads_own() {
        let null = std::ptr::null_mut();
        let here = stream_key(null, true, driver::thread_id);
        assert_eq!(
            stream_key(CU_STREAM_PER_THREAD, false, driver::thread_id),
            here
        );
        assert_eq!(
            stream_key(null, false, driver::thread_id),
            0,
            "the legacy default stream"
        );
        assert_eq!(stream_key(CU_STREAM_LEGACY, true, driver::thread_id), 0);
        assert_eq!(
            stream_key(A as StreamHandle, true, driver::thread_id),
            A,
            "a created stream"
        );
        let there =
            std::thread::spawn(|| stream_key(std::ptr::null_mut(), true, driver::thread_id))
                .join()
                .unwrap();
        assert_ne!(there, here);
    }

    /// On one stream the queued work runs down between fences, from when the GPU surely worked
    /// on it.
    #[test]
    fn queued_work_is_estimated_continuously() {
        let ring = LaunchStreams::new();
        let mut q = Queue::default();
        launch(&ring, 1, 4, A);
        fence(&mut q, &ring, A, 4, 0);
        assert_eq!(q.queued_ns(0, 0), None, "nothing learnt yet");
        q.busy = (100.0, 1.0);
        complete(&mut q, 4, 1_000);
        launch(&ring, 5, 10, A);
        q.scan(&ring, 10);
        // Launches 5..=10 queued; none pending fenced and launched after the completion was
        // seen: no time to count down from.
        assert_eq!(q.queued_ns(1_200, 0), Some((600, false)));
        // Unless all were queued when the last fence was seen to complete: from then.
        q.done_seen_launches = 10;
        assert_eq!(q.queued_ns(1_200, 0), Some((400, true)));
        // A fence recorded before the last one completed: the GPU has worked since that.
        fence(&mut q, &ring, A, 8, 500);
        assert_eq!(q.queued_ns(1_200, 0), Some((400, true)));
        // One recorded after it (the GPU may have idled in between): from its recording.
        q.fences[0].recorded_ns = 1_100;
        assert_eq!(q.queued_ns(1_200, 0), Some((500, true)));
        assert_eq!(q.queued_ns(5_000, 0), Some((0, true)));
    }

    /// On several streams a completed fence vouches for the launches before it on its own
    /// stream only; every launch is attributed to its stream, fenced or not.
    #[test]
    fn several_streams_count_what_each_fence_vouches_for() {
        let ring = LaunchStreams::new();
        let mut q = Queue::default();
        // 1, 2, 4 on A; 3, 5, 6 on B; fences after 4 (A) and 6 (B).
        for (n, key) in [(1, A), (2, A), (3, B), (4, A), (5, B), (6, B)] {
            launch(&ring, n, n, key);
        }
        fence(&mut q, &ring, A, 4, 0);
        fence(&mut q, &ring, B, 6, 0);
        q.busy = (100.0, 1.0);
        assert_eq!(q.queued_ns(0, 0), Some((600, true)));
        complete(&mut q, 6, 400);
        assert_eq!(
            q.queued(),
            3,
            "A's fence vouches for A's 3 launches, not B's"
        );
        assert_eq!(
            q.queued_ns(400, 0),
            Some((300, true)),
            "from the completion seen at 400"
        );
        // More on A and on a stream never fenced, with B's work queued too: launches after a
        // stream's newest fence are vouched for late, if at all; 300 of them is over a
        // tolerance of 200, within one of 300.
        launch(&ring, 7, 8, A);
        launch(&ring, 9, 9, 0x3000);
        q.scan(&ring, 9);
        assert_eq!(q.queued(), 6);
        assert_eq!(q.queued_ns(500, 200), None);
        assert_eq!(q.queued_ns(500, 300), Some((500, true)));
        complete(&mut q, 9, 600);
        assert_eq!(q.queued(), 3);
        assert_eq!(q.queued_ns(600, 0), None, "A and the new stream");
        // A fence after each stream's newest launch: estimated again.
        fence(&mut q, &ring, A, 8, 700);
        fence(&mut q, &ring, 0x3000, 9, 700);
        assert_eq!(
            q.queued_ns(800, 0),
            Some((200, true)),
            "300 less the 100 since A's fence"
        );
    }

    /// Ten launches on stream A up to `n`, fenced (recorded `behind` the previous fence or not),
    /// the fence completing `ms` after the previous one (`None`: not comparable).
    fn interval(q: &mut Queue, ring: &LaunchStreams, n: u64, behind: bool, ms: Option<f64>) {
        launch(ring, n - 9, n, A);
        let behind = behind.then_some(q.recorded);
        q.push_fence(ring, (Handle::null(), Handle::null()), A, n, 0, behind);
        let f = q.fences.pop_front().expect("pending");
        q.completed_after(f, ms, n, 0);
    }

    /// An interval the GPU worked through without a break (its later fence recorded behind the
    /// earlier) teaches the GPU time per launch as it is; any other only lowers it.
    #[test]
    fn only_an_unbroken_interval_raises_the_gpu_time_per_launch() {
        let ring = LaunchStreams::new();
        let mut q = Queue::default();
        interval(&mut q, &ring, 10, false, None);
        // 10 launches in 50 us, perhaps with idle time: the first bound learnt.
        interval(&mut q, &ring, 20, false, Some(0.05));
        assert_eq!(q.ns_per_launch(), Some(5_000.0));
        // 10 in 100 us, perhaps idle: no higher.
        interval(&mut q, &ring, 30, false, Some(0.1));
        assert_eq!(q.ns_per_launch(), Some(5_000.0));
        // 10 in 20 us: lower.
        interval(&mut q, &ring, 40, false, Some(0.02));
        let lowered = q.ns_per_launch().unwrap();
        assert!((2_000.0..5_000.0).contains(&lowered), "{lowered}");
        // 10 in 100 us without a break: higher.
        interval(&mut q, &ring, 50, true, Some(0.1));
        assert!(q.ns_per_launch().unwrap() > lowered + 1_000.0);
        // Behind a fence other than the reference (one dropped in between): perhaps idle.
        let est = q.ns_per_launch().unwrap();
        q.recorded += 1;
        interval(&mut q, &ring, 60, true, Some(1.0));
        assert_eq!(q.ns_per_launch(), Some(est));
    }

    /// The time one launch takes, for launching just in time: learnt from intervals without a
    /// break, kept near the shortest (another process's kernels run in between lengthen an
    /// interval without a break in it), where the mean GPU time per launch follows them; lowered
    /// by any interval shorter.
    #[test]
    fn the_time_one_launch_takes_is_kept_near_the_shortest_unbroken_interval() {
        let ring = LaunchStreams::new();
        let mut q = Queue::default();
        interval(&mut q, &ring, 10, false, None);
        // Perhaps idle in part: nothing learnt.
        interval(&mut q, &ring, 20, false, Some(5.0));
        assert_eq!(q.kernel_ns(), None);
        // 10 launches in 10 ms without a break: 1 ms each.
        interval(&mut q, &ring, 30, true, Some(10.0));
        assert_eq!(q.kernel_ns(), Some(1e6));
        // 20 ms without a break (another process's kernels in between): a tenth of the way up.
        interval(&mut q, &ring, 40, true, Some(20.0));
        let k = q.kernel_ns().unwrap();
        assert!((k - 1.1e6).abs() < 1.0, "{k}");
        let mean = q.ns_per_launch().unwrap();
        assert!(mean > 1.3e6, "the mean follows: {mean}");
        // Shorter again: down at once.
        interval(&mut q, &ring, 50, true, Some(9.0));
        assert_eq!(q.kernel_ns(), Some(0.9e6));
        // An interval that may hold idle time (not recorded behind) only lowers it: the
        // kernels got shorter, and a launcher waiting for the longer ones leaves the GPU idle.
        interval(&mut q, &ring, 60, false, Some(50.0));
        assert_eq!(q.kernel_ns(), Some(0.9e6));
        interval(&mut q, &ring, 70, false, Some(1.0));
        assert_eq!(q.kernel_ns(), Some(0.1e6));
    }

    /// A host launching on one stream every `host_ns`, a GPU running each kernel for `gpu_ns`,
    /// and the gate's pacing between them, in virtual time: fences every K launches, the
    /// newest pending one asked about as the next is recorded, a launcher waiting for the oldest
    /// while more than half the budget is queued, and synchronisations.
    struct Loop {
        q: Queue,
        ring: LaunchStreams,
        host_ns: u64,
        gpu_ns: u64,
        budget: f64,
        /// Host time, when the GPU finishes what is queued, launches made, next fenced launch.
        now: u64,
        gpu_free: u64,
        n: u64,
        next_pace: u64,
        /// When each pending or reference fence completes on the GPU (by id).
        done_at: std::collections::HashMap<u64, u64>,
        /// Fence spacing (K) and queued work (real, estimated) at each fence.
        spacing: Vec<u64>,
        queue: Vec<(u64, u64)>,
    }

    impl Loop {
        fn new(host_ns: u64, gpu_ns: u64) -> Loop {
            Loop {
                q: Queue::default(),
                ring: LaunchStreams::new(),
                host_ns,
                gpu_ns,
                budget: 2_500_000.0,
                now: 0,
                gpu_free: 0,
                n: 0,
                next_pace: 1,
                done_at: Default::default(),
                spacing: Vec::new(),
                queue: Vec::new(),
            }
        }

        /// Take in fence `f`, complete at `done` on the GPU.
        fn take_in(&mut self, f: Fence) {
            let reference = self.q.last_done.as_ref().map(|r| self.done_at[&r.id]);
            let ms = reference.map(|r| (self.done_at[&f.id] as f64 - r as f64) / 1e6);
            self.q.completed_after(f, ms, self.n, self.now);
        }

        /// Take in the oldest pending fences completed by now.
        fn take_in_passed(&mut self) {
            while let Some(f) = self.q.fences.front()
                && self.done_at[&f.id] <= self.now
            {
                let f = self.q.fences.pop_front().unwrap();
                self.take_in(f);
            }
        }

        /// `count` launches, one every `host_ns`, paced as the gate paces them.
        fn launches(&mut self, count: u64) {
            for _ in 0..count {
                self.launch();
            }
        }

        fn launch(&mut self) {
            let wait_above = pacing(self.budget, 0.0).1;
            self.q.scan(&self.ring, self.n);
            while self.q.too_much(wait_above) {
                // Wait for the oldest fence.
                let f = self.q.fences.pop_front().unwrap();
                self.now = self.now.max(self.done_at[&f.id]);
                self.take_in(f);
            }
            self.now += self.host_ns;
            self.n += 1;
            launch(&self.ring, self.n, self.n, A);
            self.gpu_free = self.gpu_free.max(self.now) + self.gpu_ns;
            if self.n < self.next_pace {
                return;
            }
            let behind = match self.q.fences.back() {
                Some(p) if self.done_at[&p.id] <= self.now => {
                    let p = self.q.fences.pop_back().unwrap();
                    self.take_in(p);
                    None
                }
                Some(p) => Some(p.id),
                None => None,
            };
            self.done_at.insert(self.q.recorded + 1, self.gpu_free);
            let null = Handle::null();
            let est = self
                .q
                .push_fence(&self.ring, (null, null), A, self.n, self.now, behind);
            let (k, wait_above) = pacing(self.budget, est.unwrap_or(0.0));
            if self.q.too_much(wait_above) {
                self.take_in_passed();
            }
            let tail = self.q.queued_ns(self.now, 0).map_or(0, |(t, _)| t);
            self.queue
                .push((self.gpu_free.saturating_sub(self.now), tail));
            self.spacing.push(k);
            self.next_pace = self.n + k;
        }

        /// The application synchronises, then the host does something else for `gap_ns`.
        fn sync(&mut self, gap_ns: u64) {
            let began = self.now;
            self.now = self.now.max(self.gpu_free);
            if (self.now - began) as f64 > 2.0 * self.budget {
                self.q.scan(&self.ring, self.n);
                self.q.waited((self.now - began) as f64);
            }
            self.take_in_passed();
            self.now += gap_ns;
        }

        fn est(&self) -> f64 {
            self.q.ns_per_launch().expect("learnt")
        }
    }

    /// A launch-bound loop (the GPU idles between kernels, and between blocks of launches while
    /// the host synchronises and does other work, or launches elsewhere) learns no more GPU
    /// time per launch than the same loop without the gaps, and no less than the GPU's own: its
    /// fences come no more often than the budget needs.
    #[test]
    fn idle_time_does_not_make_fences_more_frequent() {
        let mut steady = Loop::new(2_000, 1_000);
        steady.launches(20_000);
        let mut gaps = Loop::new(2_000, 1_000);
        let mut pauses = Loop::new(2_000, 1_000);
        for _ in 0..200 {
            gaps.launches(100);
            gaps.sync(300_000);
            pauses.launches(100);
            // A pause without a synchronisation: the host is busy elsewhere.
            pauses.now += 300_000;
        }
        let est = steady.est();
        assert!((1_000.0..=2_000.0).contains(&est), "{est}");
        for l in [&gaps, &pauses] {
            assert!(
                (1_000.0..=est).contains(&l.est()),
                "{} against {est} without gaps",
                l.est()
            );
            let k = *l.spacing.last().unwrap();
            assert!(k >= *steady.spacing.last().unwrap(), "fences every {k}");
        }
    }

    /// A GPU-bound loop learns its GPU time per launch, keeps its queue within the budget, and
    /// estimates it within a fence's worth of work; also when, its estimate left low by a
    /// launch-bound start, it synchronises before a second fence follows the first (no interval
    /// without a break: its synchronisations' waits correct the estimate).
    #[test]
    fn a_gpu_bound_loop_learns_its_gpu_time_and_keeps_its_queue() {
        for gap in [None, Some(3_000_000)] {
            let mut l = Loop::new(1_000, 5_000);
            // A launch-bound start (small kernels) teaches a lower bound first.
            l.gpu_ns = 500;
            l.launches(2_000);
            l.gpu_ns = 5_000;
            for _ in 0..10 {
                l.launches(2_000);
                if let Some(gap) = gap {
                    l.sync(gap);
                }
            }
            let est = l.est();
            assert!((4_750.0..=5_250.0).contains(&est), "{est} ({gap:?})");
            assert_eq!(*l.spacing.last().unwrap(), 250, "half the budget");
            for &(real, estimate) in &l.queue[l.queue.len() / 2..] {
                assert!(real as f64 <= l.budget, "{real} ns queued ({gap:?})");
                let off = (real as f64 - estimate as f64).abs();
                assert!(
                    off <= l.budget / 2.0,
                    "{estimate} ns estimated, {real} ns real"
                );
            }
        }
    }

    /// With nothing learnt, any queued launch is too much; and there must be an older fence to
    /// wait for.
    #[test]
    fn a_launcher_waits_while_too_much_is_queued() {
        let ring = LaunchStreams::new();
        let mut q = Queue::default();
        launch(&ring, 1, 3, A);
        fence(&mut q, &ring, A, 1, 0);
        assert!(!q.too_much(1_000.0), "no older fence to wait for");
        fence(&mut q, &ring, A, 3, 0);
        assert!(q.too_much(1_000.0), "nothing learnt");
        q.busy = (500.0, 1.0);
        assert!(q.too_much(1_000.0), "1500 queued");
        complete(&mut q, 3, 0);
        fence(&mut q, &ring, A, 3, 0);
        assert!(!q.too_much(1_000.0), "1000 queued");
    }

    /// A drain completes everything, forgets the streams not launched on since the previous
    /// drain, and keeps what was learnt of the others.
    #[test]
    fn a_drain_forgets_idle_streams_and_keeps_what_was_learnt() {
        let ring = LaunchStreams::new();
        let mut q = Queue::default();
        launch(&ring, 1, 2, A);
        launch(&ring, 3, 3, B);
        fence(&mut q, &ring, A, 2, 0);
        q.busy = (100.0, 1.0);
        q.drained(&ring, 3);
        assert_eq!(q.streams.len(), 2);
        assert!(q.fences.is_empty() && q.streams.iter().all(|s| s.queued() == 0));
        assert_eq!(q.pool.len(), 1, "the fence's event is kept for reuse");
        launch(&ring, 4, 5, A);
        q.drained(&ring, 5);
        assert_eq!(q.streams.len(), 1, "B idle for a whole turn");
        assert_eq!(q.ns_per_launch(), Some(100.0));
        // Launches the ring lost track of: no estimate until the next drain.
        let lost = 6 + RING as u64;
        q.scan(&ring, lost);
        assert_eq!(q.queued_ns(0, 0), None);
        q.drained(&ring, lost);
        assert_eq!(q.queued_ns(0, 0), Some((0, true)));
    }

    /// A fence after a launch that a drain covered, taken in late (its launcher waited for the
    /// lock through the drain and the next), is dropped: its stream may be forgotten, and the
    /// launches after it on the stream were counted before the drain.
    #[test]
    fn a_fence_taken_in_after_a_drain_is_dropped() {
        let ring = LaunchStreams::new();
        let mut q = Queue::default();
        launch(&ring, 1, 4, A);
        q.drained(&ring, 4);
        q.drained(&ring, 4);
        assert!(q.streams.is_empty(), "A idle for a whole turn");
        fence(&mut q, &ring, A, 1, 0);
        assert!(q.fences.is_empty());
        assert_eq!(q.queued(), 0);
        assert_eq!(q.queued_ns(0, 0), Some((0, true)));
    }

    /// Fence event `event` (of context 1) on `key` after launch `n`, recorded at `at`, which the
    /// GPU passes at `passes`.
    fn fence_passing(
        q: &mut Queue,
        gpu: &mut VirtualGpu,
        ring: &LaunchStreams,
        (event, key, n): (u64, u64, u64),
        at: u64,
        passes: u64,
    ) {
        gpu.passes.insert(event, passes);
        let e = (Handle::from_key(event), Handle::from_key(1));
        q.push_fence(ring, e, key, n, at, None);
    }

    /// The fences the GPU has passed are taken in, in whatever order it passed them, and none it
    /// has not; the time between two completions is the GPU time of the launches the later one
    /// vouches for.
    #[test]
    fn the_fences_the_gpu_passed_are_taken_in_in_any_order() {
        let ring = LaunchStreams::new();
        let mut q = Queue::default();
        let mut gpu = VirtualGpu::default();
        launch(&ring, 1, 4, A);
        fence_passing(&mut q, &mut gpu, &ring, (10, A, 4), 0, 3_000_000);
        launch(&ring, 5, 8, B);
        fence_passing(&mut q, &mut gpu, &ring, (11, B, 8), 0, 1_000_000);
        gpu.now = 2_000_000;
        q.complete_finished(8, &mut gpu);
        assert_eq!(q.queued(), 4, "B's launches done, A's not");
        assert_eq!(q.oldest_event(), Some(Handle::from_key(10)));
        assert_eq!(q.ns_per_launch(), None, "one completion: no interval yet");
        gpu.now = 3_000_000;
        q.complete_finished(8, &mut gpu);
        assert_eq!(q.queued(), 0);
        assert_eq!(gpu.timed, vec![(11, 10)]);
        assert_eq!(
            q.ns_per_launch(),
            Some(500_000.0),
            "2 ms over A's 4 launches"
        );
        assert_eq!(q.last_done_ns, 3_000_000, "seen to complete when asked");
    }

    /// The fence just recorded is not asked about: it has hardly completed.
    #[test]
    fn the_newest_fence_is_left_for_later() {
        let ring = LaunchStreams::new();
        let mut q = Queue::default();
        let mut gpu = VirtualGpu::default();
        launch(&ring, 1, 2, A);
        fence_passing(&mut q, &mut gpu, &ring, (10, A, 2), 0, 100);
        launch(&ring, 3, 4, A);
        fence_passing(&mut q, &mut gpu, &ring, (11, A, 4), 0, 200);
        gpu.now = 1_000;
        let mut asked = Asked::default();
        q.to_ask(Ask::AllButNewest, &mut asked);
        asked.ask(&mut gpu);
        q.take_in(&asked, 4);
        assert_eq!(q.queued(), 2);
        assert_eq!(q.oldest_event(), Some(Handle::from_key(11)));
    }

    /// Two fences on one stream: after launches 1–4 (the GPU passes it at 5 µs) and 5–8
    /// (recorded at 0.1 µs, passed at 9 µs).
    fn two_fences() -> (Queue, VirtualGpu) {
        let ring = LaunchStreams::new();
        let mut q = Queue::default();
        let mut gpu = VirtualGpu::default();
        launch(&ring, 1, 4, A);
        fence_passing(&mut q, &mut gpu, &ring, (10, A, 4), 0, 5_000);
        launch(&ring, 5, 8, A);
        fence_passing(&mut q, &mut gpu, &ring, (11, A, 8), 100, 9_000);
        (q, gpu)
    }

    /// Waiting for the oldest fence takes it in once the GPU passes it (when the wait
    /// returned); a fence the driver will not wait for is dropped, its event kept for reuse.
    #[test]
    fn the_oldest_fence_is_waited_for_or_dropped() {
        let (mut q, mut gpu) = two_fences();
        let mut asked = Asked::default();
        q.to_ask(Ask::Oldest, &mut asked);
        assert!(asked.wait_oldest(&mut gpu));
        q.take_in(&asked, 8);
        assert_eq!(
            (gpu.now, q.last_done_ns),
            (5_000, 5_000),
            "waited until it passed"
        );
        assert_eq!(q.queued(), 4);
        gpu.refuses_waits = true;
        q.to_ask(Ask::Oldest, &mut asked);
        assert!(!asked.wait_oldest(&mut gpu));
        q.take_in(&asked, 8);
        assert_eq!(gpu.now, 5_000, "no wait");
        assert_eq!(q.oldest_event(), None, "dropped");
        assert_eq!(q.queued(), 4, "its launches not vouched for");
        assert_eq!(
            q.take_event(Handle::from_key(1)),
            Some(Handle::from_key(11))
        );
        assert_eq!(
            q.take_event(Handle::from_key(1)),
            None,
            "a new one is the caller's"
        );
        q.to_ask(Ask::Oldest, &mut asked);
        assert!(!asked.wait_oldest(&mut gpu), "nothing pending");
    }

    /// A wait that returned tells that the GPU passed the fence, whatever a query about it
    /// says afterwards: it is taken in (a launcher waiting for the queue would otherwise wait
    /// for it again and again).
    #[test]
    fn a_fence_waited_for_is_taken_in_though_a_query_errs() {
        let (mut q, mut gpu) = two_fences();
        gpu.queries_fail = true;
        let mut asked = Asked::default();
        q.to_ask(Ask::Oldest, &mut asked);
        assert!(asked.wait_oldest(&mut gpu));
        q.take_in(&asked, 8);
        assert_eq!((gpu.now, q.last_done_ns), (5_000, 5_000));
        assert_eq!(q.queued(), 4);
        assert_eq!(q.oldest_event(), Some(Handle::from_key(11)));
    }

    /// Answers asked without the lock and taken in after the queue changed: a drain recycled
    /// the fences' events into new fences meanwhile. An answer is about the record it asked
    /// about: the new fences, on the same events, are not taken for completed.
    #[test]
    fn answers_about_recycled_events_do_not_complete_the_new_fences() {
        let ring = LaunchStreams::new();
        let mut q = Queue::default();
        let mut gpu = VirtualGpu::default();
        launch(&ring, 1, 4, A);
        fence_passing(&mut q, &mut gpu, &ring, (10, A, 4), 0, 1_000);
        let mut asked = Asked::default();
        q.to_ask(Ask::All, &mut asked);
        gpu.now = 2_000;
        asked.ask(&mut gpu);
        // Meanwhile: a drain, and the event reused for a fence of later launches.
        q.drained(&ring, 4);
        launch(&ring, 5, 8, A);
        let event = q.take_event(Handle::from_key(1)).expect("recycled");
        assert_eq!(event, Handle::from_key(10));
        q.push_fence(&ring, (event, Handle::from_key(1)), A, 8, 2_500, None);
        q.take_in(&asked, 8);
        assert_eq!(q.queued(), 4, "launches 5 to 8 are still queued");
        assert_eq!(q.oldest_event(), Some(event), "the new fence is pending");
    }

    /// A fence recorded between the questions and their answers' taking in is left pending;
    /// one completed meanwhile by another thread (a launcher's wait) is not taken in twice, and
    /// a completion measured from a reference that changed since teaches no GPU time.
    #[test]
    fn answers_taken_in_late_tolerate_what_happened_meanwhile() {
        let ring = LaunchStreams::new();
        let mut q = Queue::default();
        let mut gpu = VirtualGpu::default();
        launch(&ring, 1, 4, A);
        fence_passing(&mut q, &mut gpu, &ring, (10, A, 4), 0, 1_000_000);
        launch(&ring, 5, 8, A);
        fence_passing(&mut q, &mut gpu, &ring, (11, A, 8), 0, 3_000_000);
        gpu.now = 3_000_000;
        let mut asked = Asked::default();
        q.to_ask(Ask::All, &mut asked);
        asked.ask(&mut gpu);
        assert_eq!(gpu.timed, vec![(10, 11)], "11 timed against 10, as found");
        // Meanwhile another thread took the oldest in, and a fence was recorded.
        let mut oldest = Asked::default();
        q.to_ask(Ask::Oldest, &mut oldest);
        assert!(oldest.wait_oldest(&mut gpu));
        q.take_in(&oldest, 8);
        launch(&ring, 9, 12, A);
        fence_passing(&mut q, &mut gpu, &ring, (12, A, 12), 0, 4_000_000);
        q.take_in(&asked, 8);
        assert_eq!(
            q.queued(),
            4,
            "launches 9 to 12: their fence was not asked about"
        );
        assert_eq!(q.oldest_event(), Some(Handle::from_key(12)));
        assert_eq!(
            q.ns_per_launch(),
            Some(500_000.0),
            "10 to 11: 2 ms over 4 launches, taken in once"
        );

        // The reference changes between the questions and the answers (another thread took
        // a fence of another stream in): the completion is not timed against it.
        let mut q = Queue::default();
        launch(&ring, 13, 16, A);
        fence_passing(&mut q, &mut gpu, &ring, (20, A, 16), 0, 5_000_000);
        gpu.now = 5_000_000;
        q.complete_finished(16, &mut gpu);
        launch(&ring, 17, 20, A);
        fence_passing(&mut q, &mut gpu, &ring, (21, A, 20), 0, 6_000_000);
        launch(&ring, 21, 24, B);
        fence_passing(&mut q, &mut gpu, &ring, (22, B, 24), 0, 7_000_000);
        gpu.now = 6_500_000;
        q.to_ask(Ask::All, &mut asked);
        asked.ask(&mut gpu);
        gpu.now = 7_000_000;
        let mut other = Asked::default();
        q.to_ask(Ask::Newest, &mut other);
        other.ask(&mut gpu);
        q.take_in(&other, 24);
        assert_eq!(
            q.ns_per_launch(),
            Some(500_000.0),
            "2 ms over B's 4 launches"
        );
        q.take_in(&asked, 24);
        assert_eq!(q.queued(), 0, "A's launches vouched for");
        assert_eq!(
            q.ns_per_launch(),
            Some(500_000.0),
            "A's completion, measured from a reference gone, is not timed"
        );
    }

    /// A fence is recorded `behind` the one the driver said was pending only if no other fence
    /// was recorded in between (another thread's): then the interval may hold idle time.
    #[test]
    fn behind_holds_only_for_the_fence_recorded_just_before() {
        let ring = LaunchStreams::new();
        let mut q = Queue::default();
        let null = (Handle::null(), Handle::null());
        launch(&ring, 1, 12, A);
        q.push_fence(&ring, null, A, 4, 0, None);
        let first = q.recorded;
        q.push_fence(&ring, null, A, 8, 0, Some(first));
        assert!(q.fences[1].behind);
        q.push_fence(&ring, null, A, 12, 0, Some(first));
        assert!(!q.fences[2].behind, "another fence was recorded since");
    }

    /// Completions of two contexts' events are not timed against each other (the driver cannot
    /// compare them): the GPU time per launch is learnt from one context's pairs only.
    #[test]
    fn fences_of_two_contexts_are_not_timed_against_each_other() {
        let ring = LaunchStreams::new();
        let mut q = Queue::default();
        let mut gpu = VirtualGpu::default();
        launch(&ring, 1, 4, A);
        fence_passing(&mut q, &mut gpu, &ring, (10, A, 4), 0, 1_000);
        launch(&ring, 5, 8, A);
        gpu.passes.insert(20, 3_000);
        let other = (Handle::from_key(20), Handle::from_key(2));
        q.push_fence(&ring, other, A, 8, 0, None);
        gpu.now = 3_000;
        q.complete_finished(8, &mut gpu);
        assert_eq!(q.queued(), 0);
        assert!(gpu.timed.is_empty(), "{:?}", gpu.timed);
        assert_eq!(q.ns_per_launch(), None);
    }
}
