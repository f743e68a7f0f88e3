//! The queue's scheduling core: a pure state machine (no I/O, no clock), like the scheduler's
//! policy core. The daemon and `gpushare-queue replay` feed it the same inputs —
//! [`Core::submit`], [`Core::cancel`], [`Core::job_exited`], [`Core::gpu_state`] and
//! [`Core::tick`] with the current time — and carry out what [`Core::take_actions`] hands back:
//! start a job on some GPUs at a share, or kill one.
//!
//! Placement. A job asks for `gpus` GPUs (all at once), a guaranteed `share` of each (its
//! request to the scheduler; 1 = a whole GPU) and optionally `memory` on each. A GPU can take it
//! when (a) fewer than `max_jobs_per_gpu` of the queue's jobs run there, (b) the GPU's memory in
//! use (the scheduler's books) is under `memory_threshold` of its capacity, (c) the job's memory
//! fits beside what is in use and what running jobs may still take up to their caps, and (d) the
//! shares guaranteed there (the queue's jobs and the scheduler's other groups) leave room for
//! its share. With `memory_overcommit` R above 1, (b) and (c) count R times the GPU's capacity:
//! the caps may promise more than the GPU holds, and the scheduler (run with the same
//! overcommitment) makes the jobs wait or swaps them to host memory rather than fail them when
//! they use it all at once. Preferred GPUs (`prefer`) are taken first; in wait mode `queue` a job waits for
//! them, in `schedule` it takes any GPU that can take it when they cannot.
//!
//! Order. Queued jobs are considered highest priority first, and each that can be placed now
//! starts (so a job waiting for its preferred GPU does not hold back one that can run
//! elsewhere): `fifo` by submission time; `sjf` by timeout; `aging` and `shares` by
//! `P = α·p − β·T − γ·t` (p the submitter's priority, T the timeout and t the submission time in
//! seconds). `shares` is gpushare's own: when a job fits nowhere, it may start *beside* running
//! jobs, each then guaranteed a proportionally smaller share (the scheduler scales requests that
//! sum to more than 1), if it would be done before any of them even at the share it gets there:
//! with n jobs on the GPU, each has more than (n+1)·T left to its timeout (T the newcomer's
//! timeout; a job without one never starts beside others). No other tenant of the scheduler may
//! hold a guarantee there, and fewer than `max_jobs_per_gpu` (default
//! [`SHARES_DEFAULT_MAX_JOBS`]) jobs may run there.
//!
//! Timeouts run on a job's *entitled* time: a second counts in full while the job is guaranteed
//! all the share it asked for, and in proportion while requests on its GPU sum to more than 1 —
//! a job is not charged for time the queue itself gave to a job started beside it.

pub use gpushare_queue_protocol::{Demand, WaitMode};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::str::FromStr;

pub type JobId = u64;

/// Under `shares`, jobs started beside others stop at this many per GPU unless
/// `max_jobs_per_gpu` says otherwise.
pub const SHARES_DEFAULT_MAX_JOBS: u32 = 4;

/// A job without a timeout ranks (in `sjf`, `aging`, `shares`) as if its timeout were a day.
pub const UNTIMED_RANK_S: f64 = 86_400.0;

/// Which queued job goes first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Policy {
    Fifo,
    Sjf,
    Aging,
    Shares,
}

impl Policy {
    pub const ALL: [Policy; 4] = [Policy::Fifo, Policy::Sjf, Policy::Aging, Policy::Shares];

    pub fn name(self) -> &'static str {
        match self {
            Policy::Fifo => "fifo",
            Policy::Sjf => "sjf",
            Policy::Aging => "aging",
            Policy::Shares => "shares",
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Policy, String> {
        Policy::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| format!("unknown policy {s:?}; use fifo, sjf, aging or shares"))
    }
}

/// The queue's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct QueueConfig {
    pub policy: Policy,
    /// At most this many of the queue's jobs per GPU (`None`: no limit but the shares, or
    /// [`SHARES_DEFAULT_MAX_JOBS`] for jobs started beside others).
    pub max_jobs_per_gpu: Option<u32>,
    /// A GPU whose memory in use is at or above this fraction of its capacity takes no job.
    pub memory_threshold: f64,
    /// Weights of P = α·p − β·T − γ·t.
    pub alpha: f64,
    pub beta: f64,
    pub gamma: f64,
    /// The jobs' memory caps on a GPU may sum to this many times its capacity (1: no more
    /// than it holds).
    pub memory_overcommit: f64,
    /// Which jobs may start on caps past the GPU's own memory (`memory_overcommit` above 1).
    pub overcommit_admission: OvercommitAdmission,
}

/// Which jobs may start on a GPU whose memory their cap would promise past its capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OvercommitAdmission {
    /// Any job whose cap fits in `memory_overcommit` times the GPU's memory.
    #[default]
    Caps,
    /// Only while the GPU's time is not taken: the GPU time measured in use there (the
    /// scheduler's achieved shares; a job not in its books yet counts at its limit) plus the
    /// newcomer's limit is at most the whole GPU. Within the GPU's own memory, as `caps`.
    GpuTime,
}

impl fmt::Display for OvercommitAdmission {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OvercommitAdmission::Caps => "caps",
            OvercommitAdmission::GpuTime => "gpu-time",
        })
    }
}

impl FromStr for OvercommitAdmission {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "caps" => Ok(OvercommitAdmission::Caps),
            "gpu-time" => Ok(OvercommitAdmission::GpuTime),
            _ => Err(format!(
                "unknown overcommit admission {s:?}; use caps or gpu-time"
            )),
        }
    }
}

impl Default for QueueConfig {
    /// `aging` with α = 10000, β = γ = 1, no job limit, memory threshold 0.9, no memory
    /// overcommitment.
    fn default() -> Self {
        QueueConfig {
            policy: Policy::Aging,
            max_jobs_per_gpu: None,
            memory_threshold: 0.9,
            alpha: 10_000.0,
            beta: 1.0,
            gamma: 1.0,
            memory_overcommit: 1.0,
            overcommit_admission: OvercommitAdmission::Caps,
        }
    }
}

impl QueueConfig {
    pub fn validate(&self) -> Result<(), String> {
        if !(self.memory_threshold > 0.0 && self.memory_threshold <= 1.0) {
            return Err(format!(
                "memory threshold {} must be a fraction in (0, 1], e.g. 0.9",
                self.memory_threshold
            ));
        }
        if self.max_jobs_per_gpu == Some(0) {
            return Err("max jobs per GPU must be at least 1".into());
        }
        if !(self.memory_overcommit.is_finite() && self.memory_overcommit >= 1.0) {
            return Err(format!(
                "memory overcommit {} must be a number >= 1 (1: caps hold no more than the GPU)",
                self.memory_overcommit
            ));
        }
        for (name, v) in [
            ("alpha", self.alpha),
            ("beta", self.beta),
            ("gamma", self.gamma),
        ] {
            if !v.is_finite() || v < 0.0 {
                return Err(format!("{name} must be a finite number >= 0, got {v}"));
            }
        }
        Ok(())
    }
}

/// What the scheduler's books say about one GPU, apart from the queue's own bookkeeping.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct GpuLoad {
    /// Shares guaranteed to the scheduler's groups that are not the queue's jobs (and have
    /// processes).
    pub foreign_request: f64,
    /// Memory held by those groups, bytes.
    pub foreign_memory: u64,
    /// Memory held by each of the queue's jobs on this GPU, bytes.
    pub job_memory: BTreeMap<JobId, u64>,
    /// The fraction of the GPU's time those groups were measured using (their achieved shares).
    #[serde(default)]
    pub foreign_busy: f64,
    /// The fraction of the GPU's time each of the queue's jobs was measured using.
    #[serde(default)]
    pub job_busy: BTreeMap<JobId, f64>,
}

impl GpuLoad {
    /// Memory in use on the GPU, bytes.
    pub fn memory_used(&self) -> u64 {
        self.foreign_memory + self.job_memory.values().sum::<u64>()
    }
}

/// Why the queue kills a running job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KillReason {
    Timeout,
    Cancel,
}

/// One run of a job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Run {
    pub gpus: Vec<u32>,
    pub started_ns: u64,
    /// Entitled running time up to `credited_at_ns` (the timeout clock).
    pub credited_ns: u64,
    pub credited_at_ns: u64,
    /// Set once the queue decided to kill it.
    pub kill: Option<KillReason>,
}

/// How a job ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    Succeeded,
    /// Exited with a non-zero code, was killed by a signal the queue did not send, or could
    /// not be started (neither set).
    Failed {
        code: Option<i32>,
        signal: Option<i32>,
    },
    TimedOut,
    Cancelled,
    /// Its process went away and nobody saw how (its supervisor was killed).
    Lost,
}

impl Outcome {
    pub fn name(self) -> &'static str {
        match self {
            Outcome::Succeeded => "succeeded",
            Outcome::Failed { .. } => "failed",
            Outcome::TimedOut => "timed out",
            Outcome::Cancelled => "cancelled",
            Outcome::Lost => "lost",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum JobState {
    Queued,
    Running(Run),
    Finished {
        outcome: Outcome,
        /// The last run, if it started.
        run: Option<Run>,
        ended_ns: u64,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Job {
    pub id: JobId,
    pub demand: Demand,
    pub submitted_ns: u64,
    /// Runs started so far (a retry is another run).
    pub runs: u32,
    pub state: JobState,
}

impl Job {
    pub fn running(&self) -> Option<&Run> {
        match &self.state {
            JobState::Running(r) => Some(r),
            _ => None,
        }
    }
}

/// How a job's process ended, as the shell saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Exit {
    Code(i32),
    Signal(i32),
    /// Unknown: its supervisor went away.
    Lost,
    /// It could not be started.
    SpawnFailed,
}

/// What the shell must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Start `job` on `gpus`, guaranteed `share` of each and capped at `limit`.
    Start {
        job: JobId,
        gpus: Vec<u32>,
        share: f64,
        limit: f64,
    },
    /// Kill `job`; it is reported through [`Core::job_exited`] once gone.
    Kill { job: JobId, reason: KillReason },
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SubmitError {
    #[error("{0}")]
    Invalid(String),
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum JobError {
    #[error("no job {0}; `gpushare jobs` lists them")]
    Unknown(JobId),
    #[error("job {0} has already finished")]
    Finished(JobId),
}

/// One GPU as the queue knows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Gpu {
    /// Memory capacity, bytes.
    pub memory: u64,
}

pub struct Core {
    cfg: QueueConfig,
    gpus: Vec<Gpu>,
    loads: Vec<GpuLoad>,
    jobs: BTreeMap<JobId, Job>,
    next_id: JobId,
    actions: Vec<Action>,
    dirty: BTreeSet<JobId>,
}

const SHARE_EPS: f64 = 1e-9;

impl Core {
    pub fn new(cfg: QueueConfig, gpus: Vec<Gpu>) -> Core {
        Core::restore(cfg, gpus, Vec::new())
    }

    /// A core holding `jobs` (as persisted). Jobs being killed are killed again.
    pub fn restore(cfg: QueueConfig, gpus: Vec<Gpu>, jobs: Vec<Job>) -> Core {
        let next_id = jobs.iter().map(|j| j.id + 1).max().unwrap_or(1);
        let mut actions = Vec::new();
        for j in &jobs {
            if let Some(Run {
                kill: Some(reason), ..
            }) = j.running()
            {
                actions.push(Action::Kill {
                    job: j.id,
                    reason: *reason,
                });
            }
        }
        Core {
            cfg,
            loads: vec![GpuLoad::default(); gpus.len()],
            gpus,
            jobs: jobs.into_iter().map(|j| (j.id, j)).collect(),
            next_id,
            actions,
            dirty: BTreeSet::new(),
        }
    }

    pub fn config(&self) -> &QueueConfig {
        &self.cfg
    }

    pub fn gpus(&self) -> &[Gpu] {
        &self.gpus
    }

    pub fn loads(&self) -> &[GpuLoad] {
        &self.loads
    }

    pub fn job(&self, id: JobId) -> Option<&Job> {
        self.jobs.get(&id)
    }

    pub fn jobs(&self) -> impl Iterator<Item = &Job> {
        self.jobs.values()
    }

    /// Check a demand against this node without queueing it.
    pub fn check(&self, d: &Demand) -> Result<(), SubmitError> {
        let bad = |m: String| Err(SubmitError::Invalid(m));
        let n = self.gpus.len() as u32;
        if d.gpus == 0 {
            return bad("--gpus must be at least 1".into());
        }
        if d.gpus > n {
            return bad(format!(
                "the job asks for {} GPUs, but this node has {n}; ask for at most {n}",
                d.gpus
            ));
        }
        gpushare_policy::GroupParams {
            request: d.share,
            limit: d.limit,
            weight: 1.0,
            ..Default::default()
        }
        .validate()
        .map_err(|e| SubmitError::Invalid(format!("--share/--limit: {e}")))?;
        let mut seen = BTreeSet::new();
        for &g in &d.prefer {
            if g >= n {
                return bad(format!(
                    "preferred GPU {g} does not exist: this node has GPUs 0..={}",
                    n.saturating_sub(1)
                ));
            }
            if !seen.insert(g) {
                return bad(format!("preferred GPU {g} is listed twice"));
            }
        }
        if d.wait_mode == WaitMode::Queue
            && !d.prefer.is_empty()
            && d.prefer.len() < d.gpus as usize
        {
            return bad(format!(
                "the job waits (--wait-mode queue) for {} preferred GPUs but needs {}; prefer more GPUs or use --wait-mode schedule",
                d.prefer.len(),
                d.gpus
            ));
        }
        if d.timeout_ns == Some(0) {
            return bad("--timeout must be longer than 0".into());
        }
        if let Some(m) = d.memory {
            let candidates: Vec<u32> = if d.wait_mode == WaitMode::Queue && !d.prefer.is_empty() {
                d.prefer.clone()
            } else {
                (0..n).collect()
            };
            let big = candidates
                .iter()
                .filter(|&&g| self.gpus[g as usize].memory >= m)
                .count();
            if big < d.gpus as usize {
                let most = self.gpus.iter().map(|g| g.memory).max().unwrap_or(0);
                return bad(format!(
                    "the job asks for {m} bytes of memory on each of {} GPUs, but only {big} of the GPUs it may use have that much (largest: {most} bytes); ask for less --memory",
                    d.gpus
                ));
            }
        }
        Ok(())
    }

    /// Queue a job submitted at `now`; it starts at a later [`tick`](Core::tick).
    pub fn submit(&mut self, demand: Demand, now: u64) -> Result<JobId, SubmitError> {
        self.check(&demand)?;
        let id = self.next_id;
        self.next_id += 1;
        self.jobs.insert(
            id,
            Job {
                id,
                demand,
                submitted_ns: now,
                runs: 0,
                state: JobState::Queued,
            },
        );
        self.dirty.insert(id);
        Ok(id)
    }

    /// Cancel a job: a queued one finishes at once, a running one is killed.
    pub fn cancel(&mut self, id: JobId, now: u64) -> Result<(), JobError> {
        let job = self.jobs.get_mut(&id).ok_or(JobError::Unknown(id))?;
        match &mut job.state {
            JobState::Queued => {
                job.state = JobState::Finished {
                    outcome: Outcome::Cancelled,
                    run: None,
                    ended_ns: now,
                };
            }
            JobState::Running(run) => {
                if run.kill.is_none() {
                    run.kill = Some(KillReason::Cancel);
                    self.actions.push(Action::Kill {
                        job: id,
                        reason: KillReason::Cancel,
                    });
                }
            }
            JobState::Finished { .. } => return Err(JobError::Finished(id)),
        }
        self.dirty.insert(id);
        Ok(())
    }

    /// A running job's process ended. A failure (or a lost process) is retried while the job
    /// has retries left.
    pub fn job_exited(&mut self, id: JobId, exit: Exit, now: u64) -> Result<(), JobError> {
        match self.jobs.get(&id).map(|j| &j.state) {
            None => return Err(JobError::Unknown(id)),
            Some(JobState::Running(_)) => {}
            Some(_) => return Err(JobError::Finished(id)),
        }
        self.advance(now);
        self.touch_running();
        let job = self.jobs.get_mut(&id).expect("checked above");
        let JobState::Running(run) = std::mem::replace(&mut job.state, JobState::Queued) else {
            unreachable!("checked above")
        };
        let outcome = match (run.kill, exit) {
            (Some(KillReason::Timeout), _) => Outcome::TimedOut,
            (Some(KillReason::Cancel), _) => Outcome::Cancelled,
            (None, Exit::Code(0)) => Outcome::Succeeded,
            (None, Exit::Code(c)) => Outcome::Failed {
                code: Some(c),
                signal: None,
            },
            (None, Exit::Signal(s)) => Outcome::Failed {
                code: None,
                signal: Some(s),
            },
            (None, Exit::SpawnFailed) => Outcome::Failed {
                code: None,
                signal: None,
            },
            (None, Exit::Lost) => Outcome::Lost,
        };
        let retry = matches!(outcome, Outcome::Failed { .. } | Outcome::Lost)
            && exit != Exit::SpawnFailed
            && job.runs <= job.demand.retries;
        if !retry {
            job.state = JobState::Finished {
                outcome,
                run: Some(run),
                ended_ns: now,
            };
        }
        self.dirty.insert(id);
        Ok(())
    }

    /// The scheduler's books changed (one entry per GPU; missing GPUs count as unloaded).
    pub fn gpu_state(&mut self, mut loads: Vec<GpuLoad>, now: u64) {
        loads.resize(self.gpus.len(), GpuLoad::default());
        if loads == self.loads {
            return;
        }
        self.advance(now);
        let rates_before: Vec<f64> = (0..self.gpus.len()).map(|g| self.scale(g as u32)).collect();
        self.loads = loads;
        if (0..self.gpus.len()).any(|g| self.scale(g as u32) != rates_before[g]) {
            self.touch_running();
        }
    }

    /// Enforce timeouts and start what can start now.
    pub fn tick(&mut self, now: u64) {
        self.advance(now);
        let mut kills = Vec::new();
        for j in self.jobs.values_mut() {
            if let (JobState::Running(run), Some(t)) = (&mut j.state, j.demand.timeout_ns)
                && run.kill.is_none()
                && run.credited_ns >= t
            {
                run.kill = Some(KillReason::Timeout);
                kills.push(j.id);
            }
        }
        for job in kills {
            self.dirty.insert(job);
            self.actions.push(Action::Kill {
                job,
                reason: KillReason::Timeout,
            });
        }
        for id in self.queue_order() {
            let d = &self.jobs[&id].demand;
            if let Some(gpus) = self.place(d) {
                let (share, limit) = (d.share, d.limit);
                self.touch_running();
                let job = self.jobs.get_mut(&id).expect("queued job");
                job.runs += 1;
                job.state = JobState::Running(Run {
                    gpus: gpus.clone(),
                    started_ns: now,
                    credited_ns: 0,
                    credited_at_ns: now,
                    kill: None,
                });
                self.dirty.insert(id);
                self.actions.push(Action::Start {
                    job: id,
                    gpus,
                    share,
                    limit,
                });
            }
        }
    }

    /// When [`tick`](Core::tick) must run next for a timeout (placement needs a tick only after
    /// an input).
    pub fn next_wakeup(&self) -> Option<u64> {
        self.jobs
            .values()
            .filter_map(|j| {
                let run = j.running()?;
                let t = j.demand.timeout_ns?;
                if run.kill.is_some() {
                    return None;
                }
                let left = t.saturating_sub(run.credited_ns) as f64;
                Some(run.credited_at_ns + (left / self.rate(run)).ceil() as u64)
            })
            .min()
    }

    pub fn take_actions(&mut self) -> Vec<Action> {
        std::mem::take(&mut self.actions)
    }

    /// Jobs changed since the last call (to persist).
    pub fn take_dirty(&mut self) -> Vec<JobId> {
        std::mem::take(&mut self.dirty).into_iter().collect()
    }

    /// Queued jobs, first to be considered first.
    pub fn queue_order(&self) -> Vec<JobId> {
        let mut q: Vec<(&Job, f64)> = self
            .jobs
            .values()
            .filter(|j| j.state == JobState::Queued)
            .map(|j| (j, self.rank(j)))
            .collect();
        q.sort_by(|(a, ra), (b, rb)| {
            rb.total_cmp(ra)
                .then(a.submitted_ns.cmp(&b.submitted_ns))
                .then(a.id.cmp(&b.id))
        });
        q.into_iter().map(|(j, _)| j.id).collect()
    }

    /// The policy's priority of a queued job (higher first; ties by submission).
    pub fn rank(&self, j: &Job) -> f64 {
        let t_s = j
            .demand
            .timeout_ns
            .map_or(UNTIMED_RANK_S, |t| t as f64 / 1e9);
        match self.cfg.policy {
            Policy::Fifo => 0.0,
            Policy::Sjf => -t_s,
            Policy::Aging | Policy::Shares => {
                self.cfg.alpha * j.demand.priority as f64
                    - self.cfg.beta * t_s
                    - self.cfg.gamma * (j.submitted_ns as f64 / 1e9)
            }
        }
    }

    /// Guaranteed shares on GPU `g`: the queue's running jobs and the scheduler's other groups.
    pub fn committed(&self, g: u32) -> f64 {
        self.loads[g as usize].foreign_request + self.on_gpu(g).map(|j| j.demand.share).sum::<f64>()
    }

    /// The queue's running jobs on GPU `g`.
    pub fn on_gpu(&self, g: u32) -> impl Iterator<Item = &Job> {
        self.jobs
            .values()
            .filter(move |j| j.running().is_some_and(|r| r.gpus.contains(&g)))
    }

    /// Fraction of its request each tenant of GPU `g` is guaranteed (requests summing to more
    /// than 1 are scaled down).
    fn scale(&self, g: u32) -> f64 {
        let c = self.committed(g);
        if c > 1.0 { 1.0 / c } else { 1.0 }
    }

    /// How fast a run's timeout clock goes: its worst GPU's scale.
    fn rate(&self, run: &Run) -> f64 {
        run.gpus
            .iter()
            .map(|&g| self.scale(g))
            .fold(1.0, f64::min)
            .max(1e-6)
    }

    /// Bring every running job's timeout clock to `now` at the current rates.
    fn advance(&mut self, now: u64) {
        let rates: BTreeMap<JobId, f64> = self
            .jobs
            .values()
            .filter_map(|j| j.running().map(|r| (j.id, self.rate(r))))
            .collect();
        for (id, rate) in rates {
            if let Some(JobState::Running(run)) = self.jobs.get_mut(&id).map(|j| &mut j.state)
                && now > run.credited_at_ns
            {
                run.credited_ns += ((now - run.credited_at_ns) as f64 * rate) as u64;
                run.credited_at_ns = now;
            }
        }
    }

    /// Running jobs' clocks are about to change rate: persist them.
    fn touch_running(&mut self) {
        let ids: Vec<JobId> = self
            .jobs
            .values()
            .filter(|j| j.running().is_some())
            .map(|j| j.id)
            .collect();
        self.dirty.extend(ids);
    }

    /// Entitled seconds a running job has left before its timeout (∞ without one).
    fn remaining_s(&self, j: &Job) -> f64 {
        match (j.running(), j.demand.timeout_ns) {
            (Some(r), Some(t)) => t.saturating_sub(r.credited_ns) as f64 / 1e9,
            _ => f64::INFINITY,
        }
    }

    /// Whether GPU `g` can take a job of demand `d`, apart from the shares.
    fn has_room(&self, g: u32, d: &Demand, max_jobs: Option<u32>) -> bool {
        let load = &self.loads[g as usize];
        // What the caps may promise on this GPU.
        let total = (self.gpus[g as usize].memory as f64 * self.cfg.memory_overcommit) as u64;
        let jobs = self.on_gpu(g).count() as u32;
        if max_jobs.is_some_and(|m| jobs >= m) {
            return false;
        }
        let used = load.memory_used();
        if total > 0 && used as f64 >= self.cfg.memory_threshold * total as f64 {
            return false;
        }
        if let Some(m) = d.memory {
            // Running jobs may still grow up to their caps.
            let promised: u64 = self
                .on_gpu(g)
                .filter_map(|j| {
                    let cap = j.demand.memory?;
                    Some(cap.saturating_sub(load.job_memory.get(&j.id).copied().unwrap_or(0)))
                })
                .sum();
            if used + promised + m > total {
                return false;
            }
            let capacity = self.gpus[g as usize].memory;
            if self.cfg.overcommit_admission == OvercommitAdmission::GpuTime
                && used + promised + m > capacity
                && self.busy(g) + d.limit > 1.0 + SHARE_EPS
            {
                return false;
            }
        }
        true
    }

    /// The fraction of GPU `g`'s time measured in use: the scheduler's other groups and the
    /// queue's jobs (one not in the books yet at its limit).
    fn busy(&self, g: u32) -> f64 {
        let load = &self.loads[g as usize];
        let jobs = self
            .on_gpu(g)
            .map(|j| (load.job_busy.get(&j.id).copied()).unwrap_or(j.demand.limit));
        load.foreign_busy + jobs.sum::<f64>()
    }

    /// The GPUs to start a job of demand `d` on now, if any.
    fn place(&self, d: &Demand) -> Option<Vec<u32>> {
        let fits = |g: u32| {
            self.has_room(g, d, self.cfg.max_jobs_per_gpu)
                && self.committed(g) + d.share <= 1.0 + SHARE_EPS
        };
        // Best fit: the most committed GPU that still fits keeps whole GPUs free.
        let packed = |g: u32| (-self.committed(g), g as f64);
        if let Some(p) = self.pick(d, fits, packed) {
            return Some(p);
        }
        if self.cfg.policy != Policy::Shares {
            return None;
        }
        let t = d.timeout_ns? as f64 / 1e9;
        let max = Some(self.cfg.max_jobs_per_gpu.unwrap_or(SHARES_DEFAULT_MAX_JOBS));
        let beside = |g: u32| {
            // Beside n jobs the newcomer gets about 1/(n+1) of the GPU: it must be done
            // before any of them would be, even so.
            let slowdown = (self.on_gpu(g).count() + 1) as f64;
            self.loads[g as usize].foreign_request <= SHARE_EPS
                && self.has_room(g, d, max)
                && self.on_gpu(g).all(|j| self.remaining_s(j) > slowdown * t)
        };
        // Beside the fewest jobs: the smallest slowdown for everyone.
        let least = |g: u32| (self.on_gpu(g).count() as f64, g as f64);
        self.pick(d, beside, least)
    }

    /// `d.gpus` GPUs that pass `ok`: preferred ones first (in the order given), then, unless
    /// the job waits for its preferred GPUs, the others in the order of `key`.
    fn pick(
        &self,
        d: &Demand,
        ok: impl Fn(u32) -> bool,
        key: impl Fn(u32) -> (f64, f64),
    ) -> Option<Vec<u32>> {
        let k = d.gpus as usize;
        let mut chosen: Vec<u32> = d.prefer.iter().copied().filter(|&g| ok(g)).collect();
        let may_go_elsewhere = d.prefer.is_empty() || d.wait_mode == WaitMode::Schedule;
        if chosen.len() < k && may_go_elsewhere {
            let mut others: Vec<u32> = (0..self.gpus.len() as u32)
                .filter(|g| !d.prefer.contains(g) && ok(*g))
                .collect();
            others.sort_by(|&a, &b| {
                let (ka, kb) = (key(a), key(b));
                ka.0.total_cmp(&kb.0).then(ka.1.total_cmp(&kb.1))
            });
            chosen.extend(others);
        }
        (chosen.len() >= k).then(|| chosen[..k].to_vec())
    }
}

#[cfg(test)]
pub(crate) mod tests;
