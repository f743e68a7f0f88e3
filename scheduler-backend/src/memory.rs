//! GPU memory books: per group and GPU, what its processes hold against the group's cap.
//! Pure bookkeeping, no I/O; the daemon calls it from its message handlers.
//!
//! A process reserves before it allocates and gives back on free or failure, so two processes
//! of a group can never overshoot the cap together. A process's holdings vanish with it.

use std::collections::HashMap;

pub type GpuUuid = [u8; 16];

#[derive(Debug, Default)]
pub struct MemoryBooks {
    /// Cap per group in bytes (absent: uncapped).
    caps: HashMap<String, u64>,
    /// What each client holds per GPU, and its group.
    held: HashMap<(u64, GpuUuid), (String, u64)>,
}

/// Outcome of a reservation or query.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub granted: bool,
    pub cap: Option<u64>,
    pub used: u64,
}

impl MemoryBooks {
    pub fn set_cap(&mut self, group: &str, cap: Option<u64>) {
        match cap {
            Some(c) => self.caps.insert(group.to_string(), c),
            None => self.caps.remove(group),
        };
    }

    pub fn cap(&self, group: &str) -> Option<u64> {
        self.caps.get(group).copied()
    }

    /// Bytes the group holds on `gpu`, over all its processes.
    pub fn used(&self, group: &str, gpu: &GpuUuid) -> u64 {
        self.held
            .iter()
            .filter(|((_, g), (grp, _))| g == gpu && grp == group)
            .map(|(_, (_, b))| *b)
            .sum()
    }

    /// Reserve `bytes` for `client` of `group` on `gpu`, unless that would exceed the cap.
    pub fn reserve(&mut self, client: u64, group: &str, gpu: GpuUuid, bytes: u64) -> Usage {
        let cap = self.cap(group);
        let used = self.used(group, &gpu);
        let granted = cap.is_none_or(|c| used.saturating_add(bytes) <= c);
        if granted {
            self.held
                .entry((client, gpu))
                .or_insert_with(|| (group.to_string(), 0))
                .1 += bytes;
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
        }
    }

    /// A reconnecting client states what it holds; the books take its word for it.
    pub fn sync(&mut self, client: u64, group: &str, gpu: GpuUuid, bytes: u64) {
        self.held.insert((client, gpu), (group.to_string(), bytes));
    }

    pub fn query(&self, group: &str, gpu: &GpuUuid) -> Usage {
        Usage {
            granted: true,
            cap: self.cap(group),
            used: self.used(group, gpu),
        }
    }

    /// The client is gone: everything it held is free again.
    pub fn forget_client(&mut self, client: u64) {
        self.held.retain(|(c, _), _| *c != client);
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
