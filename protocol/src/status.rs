//! The scheduler's report (`gpushare status`): what it sees on each GPU, the Kubernetes
//! containers it knows, the GPU processes without the hook, and how promptly its event loop
//! serves. Carried typed in [`ServerMsg::Status`]; [`fetch`] asks a running scheduler for it.

use crate::{ClientMsg, PROTOCOL_VERSION, ServerMsg};
use serde::{Deserialize, Serialize};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Report {
    pub dev_mode: bool,
    pub gpus: Vec<GpuReport>,
    /// Kubernetes containers the node agent registered (empty without one).
    pub pods: Vec<PodReport>,
    /// Processes of the node that use the GPU driver without a connection here: ungated.
    pub unhooked: Vec<Unhooked>,
    /// How late the daemon's event loop handled what was due, since it started.
    pub event_loop: Durations,
    /// Memory overcommit's swaps, waits and refusals on the node since the daemon started.
    pub memory_swaps: MemorySwaps,
}

/// Memory overcommit's swaps, waits and refusals on the node since the daemon started.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct MemorySwaps {
    /// Swap-outs begun: a group's memory on a GPU on its way to host memory (a failed one
    /// counts here and in `swap_out_failures`).
    pub swap_outs: u64,
    /// Restores begun: a swapped group's memory on its way back to its GPU.
    pub swap_ins: u64,
    /// Device memory the swap-outs begun moved to host memory, in bytes.
    #[serde(default)]
    pub swap_out_bytes: u64,
    /// Host memory the restores begun moved back to the device, in bytes.
    #[serde(default)]
    pub swap_in_bytes: u64,
    /// Swap-outs that failed (lock timed out, checkpoint refused): another victim was tried.
    pub swap_out_failures: u64,
    /// Restores that failed: the group's processes lost their device memory.
    pub swap_in_failures: u64,
    /// Allocations within their cap that did not fit the GPU and waited.
    pub allocation_waits: u64,
    /// Allocations within their cap refused for lack of physical memory.
    pub allocations_refused: u64,
    /// How long the swap-outs that succeeded took, from the decision to the memory free.
    pub swap_out_seconds: Durations,
    /// How long the restores that succeeded took, from the decision to the group resumed.
    pub swap_in_seconds: Durations,
    /// How long the allocations that waited waited, until granted or refused.
    pub allocation_wait_seconds: Durations,
}

/// A Kubernetes container known to the scheduler through the admin socket.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PodReport {
    pub namespace: String,
    pub pod: String,
    pub container: String,
    pub pod_uid: String,
    pub container_id: Option<String>,
    /// Its scheduler group.
    pub group: String,
    pub gpus: Vec<String>,
    pub request: f64,
    pub limit: f64,
    pub weight: f64,
    pub memory: Option<u64>,
    /// Removed from the node; the group lives until its last process disconnects.
    pub removed: bool,
}

/// `namespace`, `pod`, `container` of a group that is a Kubernetes container.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PodLabels {
    pub namespace: String,
    pub pod: String,
    pub container: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct GpuReport {
    /// `GPU-xxxxxxxx-xxxx-…`, as nvidia-smi prints it.
    pub uuid: String,
    pub holder: Option<ClientReport>,
    pub waiting: Vec<ClientReport>,
    pub groups: Vec<GroupReport>,
    /// The GPU's physical memory, under memory overcommit (once a hook told its size).
    pub physical: Option<PhysicalMemory>,
}

/// A GPU's physical memory under memory overcommit: what its processes hold there against
/// what it has, and what swapped-out groups hold in host memory.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PhysicalMemory {
    pub total: u64,
    /// Held by processes whose memory is on the GPU (resident or mid-swap).
    pub used: u64,
    pub free: u64,
    /// Held in host memory by swapped-out processes.
    pub swapped: u64,
    /// How far the groups' caps may sum past `total` (`memory_overcommit`).
    pub overcommit: f64,
    /// Allocations waiting for memory on this GPU now.
    pub waiting: u64,
}

/// Where a group's memory on a GPU is under memory overcommit.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum MemoryState {
    /// On the GPU: the group runs.
    #[default]
    Resident,
    /// Being checkpointed to host memory (its processes are locked).
    SwappingOut,
    /// In host memory: the group's processes are locked until it is restored.
    SwappedOut,
    /// Being restored to the GPU.
    SwappingIn,
}

impl MemoryState {
    /// As `gpushare status` prints it.
    pub fn as_str(self) -> &'static str {
        match self {
            MemoryState::Resident => "resident",
            MemoryState::SwappingOut => "swapping out",
            MemoryState::SwappedOut => "swapped out",
            MemoryState::SwappingIn => "swapping in",
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ClientReport {
    pub pid: u32,
    pub group: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct GroupReport {
    pub name: String,
    pub request: f64,
    pub limit: f64,
    pub weight: f64,
    /// The latency class ([`crate::GroupSpec::latency`]).
    #[serde(default)]
    pub latency: bool,
    pub effective_request: f64,
    pub target_share: f64,
    pub achieved_share: f64,
    pub busy_seconds: f64,
    pub tokens: u64,
    pub waits: u64,
    pub overruns: u64,
    pub revocations: u64,
    /// Tokens cut short for a returning group owed more.
    pub preempted: u64,
    pub pids: Vec<u32>,
    pub active: bool,
    /// GPU memory the group's processes hold on this GPU, and its cap (`None`: uncapped).
    pub memory_used: u64,
    pub memory_cap: Option<u64>,
    /// Set when `memory_cap` is lower than the cap the group asked for (this value): the caps
    /// of the groups that came before it on this GPU already promise what `memory_overcommit`
    /// allows, less `memory_cap`.
    #[serde(default)]
    pub memory_clamped: Option<u64>,
    /// Memory reservations (round trips) its processes asked for on this GPU since the daemon
    /// started, granted or not.
    pub memory_reservations: u64,
    /// Of `memory_used`, bytes swapped to host memory (or on their way out or in) under memory
    /// overcommit; 0: resident.
    pub memory_swapped: u64,
    /// Where the group's memory on this GPU is under memory overcommit.
    #[serde(default)]
    pub memory_state: MemoryState,
    /// Why the group's last allocation within its cap was refused under memory overcommit.
    pub memory_refused: Option<String>,
    /// Set when the group is a Kubernetes container.
    pub pod: Option<PodLabels>,
}

/// A process using the GPU driver without a connection to this scheduler.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Unhooked {
    pub pid: u32,
    /// Its command name (`/proc/<pid>/comm`).
    pub command: String,
    /// The hook is loaded in it (not connected yet); false: it runs without the hook.
    pub hook_loaded: bool,
}

/// A histogram of durations: `counts[i]` events took at most `bounds_s[i]` seconds (and more
/// than the bound before); the last count is of those beyond the last bound. The event loop's
/// lateness is one: how late it handled each thing it had to do, against when it was due (a
/// timer against its deadline, a socket ready against the poll that reported it, another
/// thread's request against when it was posted).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Durations {
    pub bounds_s: Vec<f64>,
    pub counts: Vec<u64>,
    /// Events counted, and their latencies summed (s).
    pub count: u64,
    pub sum_s: f64,
    /// The latest any event was handled (s).
    pub max_s: f64,
}

impl Durations {
    /// The bound below which at least a fraction `q` of the events were handled (s): the upper
    /// bound of the bucket where the quantile falls, or the worst one seen beyond the last
    /// bound. `None` before the first event.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.count == 0 {
            return None;
        }
        let want = (q.clamp(0.0, 1.0) * self.count as f64).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, n) in self.counts.iter().enumerate() {
            seen += n;
            if seen >= want {
                return Some(
                    self.bounds_s
                        .get(i)
                        .map_or(self.max_s, |b| b.min(self.max_s)),
                );
            }
        }
        Some(self.max_s)
    }
}

/// `GPU-8-4-4-4-12` hex form of a driver UUID, as nvidia-smi prints it.
pub use crate::admin::gpu_uuid_string as uuid_string;

#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    #[error(
        "cannot reach gpushare-scheduler at {path}: {error}; is it running? (set GPUSHARE_SOCKET if it listens elsewhere)"
    )]
    Connect { path: String, error: std::io::Error },
    #[error("talking to gpushare-scheduler: {0}")]
    Wire(#[from] crate::WireError),
    #[error("talking to gpushare-scheduler: {0}")]
    Io(#[from] std::io::Error),
    #[error("scheduler: {0}")]
    Refused(String),
    #[error("the scheduler closed the connection")]
    Closed,
}

/// The report of the scheduler listening at `socket` (at most 5 s): the request behind
/// `gpushare status`, and the job queue's view of what is in use on each GPU.
pub fn fetch(socket: &Path) -> Result<Report, StatusError> {
    let mut s = UnixStream::connect(socket).map_err(|error| StatusError::Connect {
        path: socket.display().to_string(),
        error,
    })?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    crate::send(
        &mut s,
        &ClientMsg::Hello {
            version: PROTOCOL_VERSION,
            declared: None,
        },
    )?;
    crate::send(&mut s, &ClientMsg::Status)?;
    let mut buf = Vec::new();
    loop {
        match crate::recv::<ServerMsg>(&mut s, &mut buf)? {
            Some(ServerMsg::Status { report }) => return Ok(*report),
            Some(ServerMsg::Error { message, .. }) => return Err(StatusError::Refused(message)),
            Some(_) => continue,
            None => return Err(StatusError::Closed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_bucket_bounds_capped_by_the_worst() {
        let mut l = Durations {
            bounds_s: vec![0.001, 0.01],
            counts: vec![0, 0, 0],
            ..Durations::default()
        };
        assert_eq!(l.quantile(0.5), None, "nothing seen yet");
        l.counts = vec![90, 9, 1];
        l.count = 100;
        l.max_s = 0.5;
        assert_eq!(l.quantile(0.5), Some(0.001));
        assert_eq!(l.quantile(0.99), Some(0.01));
        assert_eq!(
            l.quantile(1.0),
            Some(0.5),
            "beyond the last bound: the worst"
        );
        l.counts = vec![100, 0, 0];
        l.max_s = 0.0002;
        assert_eq!(l.quantile(0.99), Some(0.0002), "never above the worst seen");
    }
}
