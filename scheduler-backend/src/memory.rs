//! GPU memory books: per group and GPU, what its processes hold against the group's cap.
//! Pure bookkeeping, no I/O; the node core ([`crate::node`]) keeps it.
//!
//! A process reserves before it allocates and gives back on free or failure, so two processes
//! of a group can never overshoot the cap together. A process's holdings vanish with it.
//!
//! The books outlive the daemon through its journal ([`crate::journal`]): what a process held
//! when the daemon died comes back as a *ghost* holding, counted against the cap until the
//! process reconnects and states what it holds ([`MemoryBooks::sync`]) or is gone.

use gpushare_policy::overcommit::promise;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};

pub type GpuUuid = [u8; 16];

/// A process, told apart from a later one that reuses its pid by its start time (clock ticks
/// since boot, `/proc/<pid>/stat` field 22; 0 when unknown).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ProcessId {
    pub pid: u32,
    pub start: u64,
}

/// One line of the books as the journal keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holding {
    pub process: ProcessId,
    pub group: String,
    pub gpu: GpuUuid,
    pub bytes: u64,
}

#[derive(Debug, Default)]
pub struct MemoryBooks {
    /// Cap per group in bytes as asked (absent: uncapped).
    caps: HashMap<String, u64>,
    /// The capped groups in the order their caps came: on a GPU whose caps may promise only
    /// so much, the earlier keep theirs ([`promise`]).
    cap_order: Vec<String>,
    /// Per group and GPU, the cap it got there when lower than asked ([`Self::promise_caps`]).
    clamped: HashMap<(String, GpuUuid), u64>,
    /// A cap changed since [`Self::promise_caps`] last settled them.
    caps_changed: bool,
    /// What each client holds per GPU, and its group.
    held: HashMap<(u64, GpuUuid), (String, u64)>,
    /// The process behind each client that may hold memory.
    processes: HashMap<u64, ProcessId>,
    /// Holdings of processes that have not reconnected since the daemon restarted.
    ghosts: HashMap<(ProcessId, GpuUuid), (String, u64)>,
    /// Reservations asked for per group and GPU, granted or not (each is a round trip a
    /// process waited for; hooks lease so that small allocations rarely need one).
    reservations: HashMap<(String, GpuUuid), u64>,
    /// The holdings changed since [`take_changed`](Self::take_changed) last said so.
    changed: bool,
}

/// Outcome of a reservation or query.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub granted: bool,
    pub cap: Option<u64>,
    pub used: u64,
}

impl MemoryBooks {
    /// Set (or, `None`, lift) `group`'s cap; a group whose cap changes keeps its place in the
    /// order caps came. What it gets on each GPU is settled by [`Self::promise_caps`].
    pub fn set_cap(&mut self, group: &str, cap: Option<u64>) {
        self.caps_changed |= self.asked_cap(group) != cap;
        match cap {
            Some(c) => {
                if self.caps.insert(group.to_string(), c).is_none() {
                    self.cap_order.push(group.to_string());
                }
            }
            None => {
                if self.caps.remove(group).is_some() {
                    self.cap_order.retain(|g| g != group);
                }
            }
        };
    }

    /// Whether a cap changed since the caps were last settled on the GPUs.
    pub fn caps_changed(&self) -> bool {
        self.caps_changed
    }

    /// The cap `group` asked for (`None`: uncapped).
    pub fn asked_cap(&self, group: &str) -> Option<u64> {
        self.caps.get(group).copied()
    }

    /// `group`'s cap on `gpu`: as asked, or lower where the caps before it promise the rest.
    pub fn cap(&self, group: &str, gpu: &GpuUuid) -> Option<u64> {
        let clamped = self.clamped.get(&(group.to_string(), *gpu)).copied();
        clamped.or_else(|| self.asked_cap(group))
    }

    /// `group`'s cap on `gpu` when it is lower than the one asked: `(asked, given)`.
    pub fn clamped(&self, group: &str, gpu: &GpuUuid) -> Option<(u64, u64)> {
        let given = *self.clamped.get(&(group.to_string(), *gpu))?;
        Some((self.asked_cap(group)?, given))
    }

    /// Settle each capped group's cap on each GPU of `capacity` (its memory) when the caps of
    /// the groups that may use it (`on_gpu`) may promise at most `ratio` × that memory: the
    /// earlier groups keep theirs, a later one gets what is left ([`promise`]). Returns the
    /// clamps that changed (group, GPU, asked, given; given = asked: no longer clamped).
    pub fn promise_caps(
        &mut self,
        capacity: &BTreeMap<GpuUuid, u64>,
        ratio: f64,
        on_gpu: impl Fn(&str, &GpuUuid) -> bool,
    ) -> Vec<(String, GpuUuid, u64, u64)> {
        let mut clamped = HashMap::new();
        for (gpu, &bytes) in capacity {
            let groups: Vec<&String> = (self.cap_order.iter()).filter(|g| on_gpu(g, gpu)).collect();
            let caps: Vec<u64> = groups.iter().map(|g| self.caps[*g]).collect();
            for (g, p) in groups.into_iter().zip(promise(&caps, bytes, ratio)) {
                if p.clamped {
                    clamped.insert((g.clone(), *gpu), p.cap);
                }
            }
        }
        let mut changed: Vec<(String, GpuUuid, u64, u64)> = (clamped.iter())
            .filter(|(k, v)| self.clamped.get(*k) != Some(*v))
            .map(|((g, gpu), given)| (g.clone(), *gpu, self.caps[g], *given))
            .chain(
                (self.clamped.keys())
                    .filter(|k| !clamped.contains_key(*k))
                    .filter_map(|(g, gpu)| {
                        let asked = self.asked_cap(g)?;
                        Some((g.clone(), *gpu, asked, asked))
                    }),
            )
            .collect();
        changed.sort();
        self.clamped = clamped;
        self.caps_changed = false;
        changed
    }

    /// Bytes the group holds on `gpu`, over all its processes, connected or not yet back.
    pub fn used(&self, group: &str, gpu: &GpuUuid) -> u64 {
        let live = self.held.iter().map(|((_, g), h)| (g, h));
        let ghosts = self.ghosts.iter().map(|((_, g), h)| (g, h));
        live.chain(ghosts)
            .filter(|(g, (grp, _))| *g == gpu && grp == group)
            .map(|(_, (_, b))| *b)
            .sum()
    }

    /// Client `client` is process `process`: its holdings are journaled under it, and replace
    /// that process's ghosts when it syncs.
    pub fn attach(&mut self, client: u64, process: ProcessId) {
        self.processes.insert(client, process);
    }

    /// Reserve `bytes` for `client` of `group` on `gpu`, unless that would exceed the cap.
    pub fn reserve(&mut self, client: u64, group: &str, gpu: GpuUuid, bytes: u64) -> Usage {
        *self
            .reservations
            .entry((group.to_string(), gpu))
            .or_default() += 1;
        let cap = self.cap(group, &gpu);
        let used = self.used(group, &gpu);
        let granted = cap.is_none_or(|c| used.saturating_add(bytes) <= c);
        if granted && bytes > 0 {
            self.held
                .entry((client, gpu))
                .or_insert_with(|| (group.to_string(), 0))
                .1 += bytes;
            self.changed = true;
        }
        Usage {
            granted,
            cap,
            used: if granted { used + bytes } else { used },
        }
    }

    pub fn free(&mut self, client: u64, gpu: GpuUuid, bytes: u64) {
        if let Some((_, held)) = self.held.get_mut(&(client, gpu)) {
            *held = held.saturating_sub(bytes);
            self.changed = true;
        }
    }

    /// A reconnecting client states what it holds on `gpu`; the books take its word for it,
    /// and its process's ghost holding there is laid to rest.
    pub fn sync(&mut self, client: u64, group: &str, gpu: GpuUuid, bytes: u64) {
        self.held.insert((client, gpu), (group.to_string(), bytes));
        if let Some(p) = self.processes.get(&client) {
            self.ghosts.remove(&(*p, gpu));
        }
        self.changed = true;
    }

    /// Reservations the group's processes asked for on `gpu` since the daemon started.
    pub fn reservations(&self, group: &str, gpu: &GpuUuid) -> u64 {
        self.reservations
            .get(&(group.to_string(), *gpu))
            .copied()
            .unwrap_or(0)
    }

    pub fn query(&self, group: &str, gpu: &GpuUuid) -> Usage {
        Usage {
            granted: true,
            cap: self.cap(group, gpu),
            used: self.used(group, gpu),
        }
    }

    /// The client is gone: everything it held is free again.
    pub fn forget_client(&mut self, client: u64) {
        self.held.retain(|(c, _), _| *c != client);
        self.processes.remove(&client);
        self.changed = true;
    }

    /// The clients holding memory, with their processes: those whose process has exited are
    /// forgotten (`forget_client`) even while their connection lives on — a forked child may
    /// have kept a copy of it. Whether a process lives is read from `/proc` off the event loop,
    /// once per process.
    pub fn holders(&self) -> Vec<(u64, ProcessId)> {
        let clients: std::collections::BTreeSet<u64> = self
            .held
            .iter()
            .filter(|(_, (_, b))| *b > 0)
            .map(|((c, _), _)| *c)
            .collect();
        clients
            .into_iter()
            .filter_map(|c| Some((c, *self.processes.get(&c)?)))
            .collect()
    }

    /// Every non-zero holding of a known process, connected or ghost: what the journal keeps.
    pub fn holdings(&self) -> Vec<Holding> {
        let live = self
            .held
            .iter()
            .filter_map(|((client, gpu), (group, bytes))| {
                let process = *self.processes.get(client)?;
                Some((process, *gpu, group, *bytes))
            });
        let ghosts = self
            .ghosts
            .iter()
            .map(|((process, gpu), (group, bytes))| (*process, *gpu, group, *bytes));
        live.chain(ghosts)
            .filter(|(.., bytes)| *bytes > 0)
            .map(|(process, gpu, group, bytes)| Holding {
                process,
                group: group.clone(),
                gpu,
                bytes,
            })
            .collect()
    }

    /// Take the journal's holdings as ghosts (a restarted daemon, before any client connects).
    pub fn adopt(&mut self, holdings: Vec<Holding>) {
        for h in holdings {
            let ghost = self
                .ghosts
                .entry((h.process, h.gpu))
                .or_insert_with(|| (h.group, 0));
            ghost.1 = ghost.1.saturating_add(h.bytes);
        }
        self.changed = true;
    }

    /// Keep only the ghosts of processes `keep` accepts (the others have exited).
    pub fn retain_ghosts(&mut self, mut keep: impl FnMut(&ProcessId) -> bool) {
        let before = self.ghosts.len();
        self.ghosts.retain(|(p, _), _| keep(p));
        self.changed |= self.ghosts.len() != before;
    }

    /// The processes of the ghost holdings.
    pub fn ghost_processes(&self) -> Vec<ProcessId> {
        let mut p: Vec<ProcessId> = self.ghosts.keys().map(|(p, _)| *p).collect();
        p.sort_unstable();
        p.dedup();
        p
    }

    /// The ghost holdings: process, GPU, group, bytes.
    pub fn ghosts(&self) -> impl Iterator<Item = (ProcessId, GpuUuid, &str, u64)> {
        (self.ghosts.iter()).map(|((p, g), (grp, b))| (*p, *g, grp.as_str(), *b))
    }

    /// Whether a connected client is process `p`.
    pub fn connected(&self, p: &ProcessId) -> bool {
        self.processes.values().any(|x| x == p)
    }

    /// Whether any ghost holding is left.
    pub fn has_ghosts(&self) -> bool {
        !self.ghosts.is_empty()
    }

    /// Whether the holdings changed since the last call (the journal is then rewritten).
    pub fn take_changed(&mut self) -> bool {
        std::mem::take(&mut self.changed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const GPU: GpuUuid = [1; 16];
    const GIB: u64 = 1 << 30;

    #[test]
    fn cap_is_shared_by_the_group_and_released_with_a_client() {
        let mut m = MemoryBooks::default();
        m.set_cap("a", Some(4 * GIB));
        assert!(m.reserve(1, "a", GPU, 3 * GIB).granted);
        let r = m.reserve(2, "a", GPU, 2 * GIB);
        assert_eq!(
            r,
            Usage {
                granted: false,
                cap: Some(4 * GIB),
                used: 3 * GIB
            }
        );
        assert!(m.reserve(2, "a", GPU, GIB).granted, "exactly the cap fits");
        assert_eq!(
            m.reservations("a", &GPU),
            3,
            "granted or not, each is counted"
        );
        assert!(m.reserve(3, "b", GPU, 100 * GIB).granted, "uncapped group");
        assert!(
            m.reserve(1, "a", [2; 16], 4 * GIB).granted,
            "caps are per GPU"
        );
        m.forget_client(1);
        assert_eq!(m.used("a", &GPU), GIB);
        assert!(
            m.reserve(4, "a", GPU, 3 * GIB).granted,
            "a dead process's memory is free at once"
        );
        m.free(4, GPU, 3 * GIB);
        assert_eq!(m.query("a", &GPU).used, GIB);
    }

    #[test]
    fn a_ghost_counts_until_its_process_restates_or_is_gone() {
        let p = |pid| ProcessId { pid, start: 7 };
        let mut m = MemoryBooks::default();
        m.set_cap("a", Some(4 * GIB));
        m.adopt(vec![Holding {
            process: p(10),
            group: "a".into(),
            gpu: GPU,
            bytes: 3 * GIB,
        }]);
        assert!(m.has_ghosts());
        m.attach(1, p(11));
        assert!(!m.reserve(1, "a", GPU, 2 * GIB).granted, "the ghost counts");
        m.sync(1, "a", GPU, 0);
        assert!(m.has_ghosts(), "another process's sync leaves the ghost");
        m.attach(2, p(10));
        m.sync(2, "a", GPU, 3 * GIB);
        assert!(!m.has_ghosts(), "its own process's sync replaces it");
        assert_eq!(m.used("a", &GPU), 3 * GIB, "not counted twice");
        assert_eq!(m.holdings().len(), 1);
        m.forget_client(2);
        m.adopt(m.holdings());
        assert!(!m.has_ghosts(), "nothing held, nothing adopted");
        m.adopt(vec![Holding {
            process: p(12),
            group: "a".into(),
            gpu: GPU,
            bytes: 4 * GIB,
        }]);
        m.retain_ghosts(|q| q.pid != 12);
        assert!(
            m.reserve(1, "a", GPU, 4 * GIB).granted,
            "a dead ghost frees its bytes"
        );
    }

    #[test]
    fn an_exited_process_frees_its_memory_whoever_keeps_its_connection() {
        let mut m = MemoryBooks::default();
        m.set_cap("a", Some(4 * GIB));
        m.attach(1, ProcessId { pid: 10, start: 1 });
        m.attach(2, ProcessId { pid: 11, start: 1 });
        assert!(m.reserve(1, "a", GPU, 3 * GIB).granted);
        assert!(m.reserve(2, "a", GPU, GIB).granted);
        assert_eq!(
            m.holders(),
            vec![
                (1, ProcessId { pid: 10, start: 1 }),
                (2, ProcessId { pid: 11, start: 1 })
            ]
        );
        m.attach(3, ProcessId { pid: 12, start: 1 });
        assert_eq!(
            m.holders().len(),
            2,
            "a client holding nothing is not looked at"
        );
        m.forget_client(1);
        assert_eq!(
            m.used("a", &GPU),
            GIB,
            "only the exited process's bytes are free"
        );
    }

    #[test]
    fn caps_past_what_a_gpu_may_promise_are_clamped_in_the_order_they_came() {
        let other: GpuUuid = [2; 16];
        let capacity = BTreeMap::from([(GPU, 4 * GIB), (other, 4 * GIB)]);
        let mut m = MemoryBooks::default();
        m.set_cap("a", Some(3 * GIB));
        m.set_cap("b", Some(2 * GIB));
        m.set_cap("c", Some(GIB));
        // c only on the other GPU.
        let on_gpu = |g: &str, gpu: &GpuUuid| g != "c" || *gpu == other;
        assert!(m.caps_changed());
        let changed = m.promise_caps(&capacity, 1.0, on_gpu);
        assert_eq!(
            changed,
            vec![
                ("b".into(), GPU, 2 * GIB, GIB),
                ("b".into(), other, 2 * GIB, GIB),
                ("c".into(), other, GIB, 0)
            ]
        );
        assert!(!m.caps_changed());
        assert_eq!(m.cap("b", &GPU), Some(GIB));
        assert_eq!(m.clamped("b", &GPU), Some((2 * GIB, GIB)));
        assert_eq!(m.cap("c", &other), Some(0), "nothing left for the last");
        assert_eq!(m.cap("a", &GPU), Some(3 * GIB));
        assert!(
            !m.reserve(1, "b", GPU, GIB + 1).granted,
            "past the clamped cap"
        );
        assert!(m.reserve(1, "b", GPU, GIB).granted);
        // a's cap raised: it keeps its place, before b.
        m.set_cap("a", Some(4 * GIB));
        m.promise_caps(&capacity, 1.0, on_gpu);
        assert_eq!(m.cap("b", &GPU), Some(0));
        // a's cap lifted: it no longer counts, and b has its whole cap back.
        m.set_cap("a", None);
        let changed = m.promise_caps(&capacity, 1.0, on_gpu);
        assert!(
            changed.contains(&("b".into(), GPU, 2 * GIB, 2 * GIB)),
            "{changed:?}"
        );
        assert_eq!(m.clamped("b", &GPU), None);
        assert_eq!(m.cap("b", &GPU), Some(2 * GIB));
        assert_eq!(m.cap("c", &other), Some(GIB));
        // A GPU whose memory is not known clamps nothing.
        assert_eq!(m.cap("b", &[3; 16]), Some(2 * GIB));
    }

    proptest! {
        #[test]
        fn never_over_the_cap(ops in proptest::collection::vec((0u64..4, 0u64..3 * GIB, any::<bool>()), 1..200)) {
            let mut m = MemoryBooks::default();
            m.set_cap("g", Some(4 * GIB));
            for (client, bytes, free) in ops {
                if free {
                    m.free(client, GPU, bytes);
                } else {
                    m.reserve(client, "g", GPU, bytes);
                }
                prop_assert!(m.used("g", &GPU) <= 4 * GIB);
            }
        }
    }
}
