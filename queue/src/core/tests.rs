use super::*;
use proptest::prelude::*;

const S: u64 = 1_000_000_000;
const GIB: u64 = 1 << 30;

fn core(policy: Policy, gpus: usize) -> Core {
    Core::new(
        QueueConfig {
            policy,
            ..QueueConfig::default()
        },
        vec![Gpu { memory: 80 * GIB }; gpus],
    )
}

fn timed(secs: u64) -> Demand {
    Demand {
        timeout_ns: Some(secs * S),
        ..Demand::default()
    }
}

fn starts(c: &mut Core) -> Vec<(JobId, Vec<u32>)> {
    c.take_actions()
        .into_iter()
        .filter_map(|a| match a {
            Action::Start { job, gpus, .. } => Some((job, gpus)),
            Action::Kill { .. } => None,
        })
        .collect()
}

fn started(c: &mut Core) -> Vec<JobId> {
    starts(c).into_iter().map(|(j, _)| j).collect()
}

/// One GPU busy with job 1; jobs 2..=4 queued at t = 1, 2, 3 s with timeouts `t2, t3, t4`:
/// the order in which they start as each predecessor exits.
fn order_after_busy(policy: Policy, timeouts: [u64; 3]) -> Vec<JobId> {
    let mut c = core(policy, 1);
    c.submit(timed(100), 0).unwrap();
    c.tick(0);
    assert_eq!(started(&mut c), vec![1]);
    for (i, t) in timeouts.iter().enumerate() {
        c.submit(timed(*t), (i as u64 + 1) * S).unwrap();
    }
    let mut order = Vec::new();
    let mut running = 1;
    for step in 0..3 {
        let now = (10 + step) * S;
        c.job_exited(running, Exit::Code(0), now).unwrap();
        c.tick(now);
        let s = started(&mut c);
        assert_eq!(s.len(), 1);
        running = s[0];
        order.push(running);
    }
    order
}

#[test]
fn fifo_goes_by_submission() {
    assert_eq!(
        order_after_busy(Policy::Fifo, [300, 20, 100]),
        vec![2, 3, 4]
    );
}

#[test]
fn sjf_goes_by_timeout() {
    assert_eq!(order_after_busy(Policy::Sjf, [300, 20, 100]), vec![3, 4, 2]);
}

#[test]
fn aging_weighs_waiting_time_against_length() {
    // P = −T − t (seconds). Job 4 (T 5, t 3: −8) passes jobs 2 and 3 (T 30: −31, −32).
    assert_eq!(order_after_busy(Policy::Aging, [30, 30, 5]), vec![4, 2, 3]);
    // Each second of waiting is worth a second of timeout: T 12 at 1 s, 11 at 2 s and 10 at
    // 3 s rank equal (−13), so they go by submission; SJF takes the shortest first.
    assert_eq!(order_after_busy(Policy::Aging, [12, 11, 10]), vec![2, 3, 4]);
    assert_eq!(order_after_busy(Policy::Sjf, [12, 11, 10]), vec![4, 3, 2]);
}

#[test]
fn aging_priority_dominates() {
    let mut c = core(Policy::Aging, 1);
    c.submit(timed(100), 0).unwrap();
    c.tick(0);
    started(&mut c);
    c.submit(timed(10), S).unwrap();
    c.submit(
        Demand {
            priority: 1,
            ..timed(5000)
        },
        2 * S,
    )
    .unwrap();
    c.job_exited(1, Exit::Code(0), 3 * S).unwrap();
    c.tick(3 * S);
    assert_eq!(started(&mut c), vec![3], "α·p outweighs a long timeout");
}

#[test]
fn wait_modes_with_a_preferred_gpu() {
    let mut c = core(Policy::Fifo, 2);
    c.submit(
        Demand {
            prefer: vec![0],
            ..Demand::default()
        },
        0,
    )
    .unwrap();
    c.tick(0);
    assert_eq!(starts(&mut c), vec![(1, vec![0])]);
    let q = c
        .submit(
            Demand {
                prefer: vec![0],
                wait_mode: WaitMode::Queue,
                ..Demand::default()
            },
            S,
        )
        .unwrap();
    let s = c
        .submit(
            Demand {
                prefer: vec![0],
                wait_mode: WaitMode::Schedule,
                ..Demand::default()
            },
            2 * S,
        )
        .unwrap();
    c.tick(2 * S);
    assert_eq!(starts(&mut c), vec![(s, vec![1])], "schedule takes GPU 1");
    c.job_exited(1, Exit::Code(0), 3 * S).unwrap();
    c.tick(3 * S);
    assert_eq!(starts(&mut c), vec![(q, vec![0])], "queue waited for GPU 0");
}

#[test]
fn memory_threshold_makes_a_gpu_unavailable() {
    let mut c = core(Policy::Fifo, 2);
    // Someone else holds 75 GiB of GPU 0's 80: over the 0.9 threshold? 75/80 = 0.94.
    c.gpu_state(
        vec![
            GpuLoad {
                foreign_memory: 75 * GIB,
                ..GpuLoad::default()
            },
            GpuLoad::default(),
        ],
        0,
    );
    let d = |mode| Demand {
        prefer: vec![0],
        wait_mode: mode,
        share: 0.5,
        ..Demand::default()
    };
    let q = c.submit(d(WaitMode::Queue), 0).unwrap();
    let s = c.submit(d(WaitMode::Schedule), 0).unwrap();
    c.tick(0);
    assert_eq!(starts(&mut c), vec![(s, vec![1])]);
    // The memory is freed: the waiting job takes its GPU.
    c.gpu_state(vec![GpuLoad::default(), GpuLoad::default()], S);
    c.tick(S);
    assert_eq!(starts(&mut c), vec![(q, vec![0])]);
}

#[test]
fn memory_caps_must_fit() {
    let mut c = core(Policy::Fifo, 1);
    let d = |gib| Demand {
        share: 0.3,
        memory: Some(gib * GIB),
        ..Demand::default()
    };
    c.submit(d(50), 0).unwrap();
    c.submit(d(40), 0).unwrap();
    c.submit(d(20), 0).unwrap();
    c.tick(0);
    assert_eq!(
        started(&mut c),
        vec![1, 3],
        "50 + 20 fit in 80, 40 does not"
    );
    assert!(matches!(c.submit(d(81), 0), Err(SubmitError::Invalid(_))));
}

#[test]
fn with_memory_overcommit_the_caps_may_sum_past_the_gpu() {
    let mut c = Core::new(
        QueueConfig {
            policy: Policy::Fifo,
            memory_overcommit: 2.0,
            ..QueueConfig::default()
        },
        vec![Gpu { memory: 80 * GIB }],
    );
    let d = |gib| Demand {
        share: 0.2,
        memory: Some(gib * GIB),
        ..Demand::default()
    };
    for _ in 0..5 {
        c.submit(d(40), 0).unwrap();
    }
    c.tick(0);
    assert_eq!(
        started(&mut c),
        vec![1, 2, 3, 4],
        "4 × 40 GiB caps in 2 × 80 GiB"
    );
    c.cancel(4, S).unwrap();
    c.job_exited(4, Exit::Signal(libc::SIGKILL), S).unwrap();
    c.submit(d(10), S).unwrap();
    // The memory threshold counts the promise too: 145 GiB in use of 160 is past 0.9 of it.
    let load = |foreign| GpuLoad {
        foreign_memory: foreign * GIB,
        job_memory: (1..=3).map(|j| (j, 40 * GIB)).collect(),
        ..GpuLoad::default()
    };
    c.gpu_state(vec![load(25)], S);
    c.tick(S);
    assert!(started(&mut c).is_empty());
    c.gpu_state(vec![load(20)], 2 * S);
    c.tick(2 * S);
    assert_eq!(started(&mut c), vec![6]);
    assert!(
        QueueConfig {
            memory_overcommit: 0.5,
            ..QueueConfig::default()
        }
        .validate()
        .is_err()
    );
}

/// Under `gpu-time` admission a job whose cap fits only past the GPU's memory starts only while
/// the GPU time measured in use there (a job not measured yet at its limit) leaves room for its
/// limit; within the GPU's memory, caps alone decide.
#[test]
fn gpu_time_admission_starts_past_the_memory_only_where_the_gpu_has_time() {
    let mk = |admission| {
        Core::new(
            QueueConfig {
                policy: Policy::Fifo,
                memory_overcommit: 2.0,
                overcommit_admission: admission,
                ..QueueConfig::default()
            },
            vec![Gpu { memory: 80 * GIB }],
        )
    };
    let d = |limit| Demand {
        share: 0.0,
        limit,
        memory: Some(40 * GIB),
        ..Demand::default()
    };
    let mut caps = mk(OvercommitAdmission::Caps);
    let mut time = mk(OvercommitAdmission::GpuTime);
    for c in [&mut caps, &mut time] {
        for _ in 0..3 {
            c.submit(d(0.4), 0).unwrap();
        }
        c.tick(0);
    }
    assert_eq!(
        started(&mut caps),
        vec![1, 2, 3],
        "4 × 40 GiB caps fit in 2 × 80 GiB"
    );
    assert_eq!(
        started(&mut time),
        vec![1, 2],
        "past the memory, not measured yet: 0.4 + 0.4 counted, + 0.4 is more than the GPU"
    );
    let load = |busy: &[f64], foreign| GpuLoad {
        job_busy: (1..).zip(busy.iter().copied()).collect(),
        foreign_busy: foreign,
        ..GpuLoad::default()
    };
    time.gpu_state(vec![load(&[0.3, 0.35], 0.0)], S);
    time.tick(S);
    assert!(started(&mut time).is_empty(), "0.65 measured + 0.4 > 1");
    time.gpu_state(vec![load(&[0.3, 0.3], 0.1)], 2 * S);
    time.tick(2 * S);
    assert!(
        started(&mut time).is_empty(),
        "other tenants' time counts: 0.7 + 0.4 > 1"
    );
    time.gpu_state(vec![load(&[0.3, 0.3], 0.0)], 3 * S);
    time.tick(3 * S);
    assert_eq!(started(&mut time), vec![3], "0.6 measured + 0.4 fits");
    // Within the GPU's memory the GPU's time does not matter.
    time.job_exited(1, Exit::Code(0), 4 * S).unwrap();
    time.job_exited(2, Exit::Code(0), 4 * S).unwrap();
    time.gpu_state(vec![load(&[0.0, 0.0, 1.0], 0.0)], 4 * S);
    time.submit(d(1.0), 4 * S).unwrap();
    time.tick(4 * S);
    assert_eq!(
        started(&mut time),
        vec![4],
        "40 + 40 GiB fit in 80: caps decide"
    );
    assert_eq!(
        "gpu-time".parse::<OvercommitAdmission>(),
        Ok(OvercommitAdmission::GpuTime)
    );
    assert!("time".parse::<OvercommitAdmission>().is_err());
}

#[test]
fn max_jobs_per_gpu() {
    let mut c = Core::new(
        QueueConfig {
            policy: Policy::Fifo,
            max_jobs_per_gpu: Some(2),
            ..QueueConfig::default()
        },
        vec![Gpu { memory: 80 * GIB }],
    );
    for _ in 0..3 {
        c.submit(
            Demand {
                share: 0.1,
                ..Demand::default()
            },
            0,
        )
        .unwrap();
    }
    c.tick(0);
    assert_eq!(started(&mut c), vec![1, 2]);
}

#[test]
fn shares_pack_and_whole_gpus_wait() {
    let mut c = core(Policy::Fifo, 2);
    let d = |share| Demand {
        share,
        ..Demand::default()
    };
    c.submit(d(0.5), 0).unwrap();
    c.submit(d(0.5), 0).unwrap();
    c.submit(d(1.0), 0).unwrap();
    c.tick(0);
    assert_eq!(
        starts(&mut c),
        vec![(1, vec![0]), (2, vec![0]), (3, vec![1])],
        "best fit: the two halves share GPU 0, the whole job gets GPU 1"
    );
}

#[test]
fn a_multi_gpu_job_starts_only_with_all_its_gpus() {
    let mut c = core(Policy::Fifo, 2);
    c.submit(Demand::default(), 0).unwrap();
    c.tick(0);
    started(&mut c);
    let big = c
        .submit(
            Demand {
                gpus: 2,
                ..Demand::default()
            },
            S,
        )
        .unwrap();
    c.tick(S);
    assert!(started(&mut c).is_empty(), "one GPU is busy");
    c.job_exited(1, Exit::Code(0), 2 * S).unwrap();
    c.tick(2 * S);
    assert_eq!(starts(&mut c), vec![(big, vec![0, 1])]);
}

#[test]
fn timeout_kills_and_reports_timed_out() {
    let mut c = core(Policy::Fifo, 1);
    c.submit(timed(10), 0).unwrap();
    c.tick(0);
    started(&mut c);
    assert_eq!(c.next_wakeup(), Some(10 * S));
    c.tick(10 * S - 1);
    assert!(c.take_actions().is_empty());
    c.tick(10 * S);
    assert_eq!(
        c.take_actions(),
        vec![Action::Kill {
            job: 1,
            reason: KillReason::Timeout
        }]
    );
    c.job_exited(1, Exit::Signal(15), 11 * S).unwrap();
    assert!(matches!(
        c.job(1).unwrap().state,
        JobState::Finished {
            outcome: Outcome::TimedOut,
            ..
        }
    ));
}

#[test]
fn shares_starts_a_short_job_beside_a_long_one_and_stretches_both_timeouts() {
    let mut c = core(Policy::Shares, 1);
    c.submit(timed(1000), 0).unwrap();
    c.tick(0);
    assert_eq!(started(&mut c), vec![1]);
    c.submit(timed(100), 10 * S).unwrap();
    c.tick(10 * S);
    assert_eq!(
        started(&mut c),
        vec![2],
        "100 s < 990 s left: starts beside"
    );
    // A job longer than what job 2 has left waits.
    c.submit(timed(950), 11 * S).unwrap();
    c.tick(11 * S);
    assert!(started(&mut c).is_empty());
    // Both are guaranteed half a GPU: job 2's 100 s timeout takes 200 s of wall time.
    assert_eq!(c.next_wakeup(), Some(210 * S));
    c.job_exited(2, Exit::Code(0), 150 * S).unwrap();
    c.tick(150 * S);
    assert!(
        started(&mut c).is_empty(),
        "job 3 is not shorter than job 1's time left"
    );
    // Job 1: 10 s alone + 140 s at half = 80 s, 920 s left alone.
    assert_eq!(c.next_wakeup(), Some(1070 * S));
}

#[test]
fn other_policies_never_overcommit() {
    for policy in [Policy::Fifo, Policy::Sjf, Policy::Aging] {
        let mut c = core(policy, 1);
        c.submit(timed(1000), 0).unwrap();
        c.tick(0);
        c.submit(timed(1), S).unwrap();
        c.tick(S);
        assert_eq!(started(&mut c), vec![1], "{policy}");
    }
}

#[test]
fn cancel_queued_and_running() {
    let mut c = core(Policy::Fifo, 1);
    c.submit(Demand::default(), 0).unwrap();
    c.submit(Demand::default(), 0).unwrap();
    c.tick(0);
    started(&mut c);
    c.cancel(2, S).unwrap();
    assert!(matches!(
        c.job(2).unwrap().state,
        JobState::Finished {
            outcome: Outcome::Cancelled,
            run: None,
            ..
        }
    ));
    c.cancel(1, S).unwrap();
    assert_eq!(
        c.take_actions(),
        vec![Action::Kill {
            job: 1,
            reason: KillReason::Cancel
        }]
    );
    c.job_exited(1, Exit::Signal(15), 2 * S).unwrap();
    assert_eq!(c.cancel(1, 3 * S), Err(JobError::Finished(1)));
    assert_eq!(c.cancel(9, 3 * S), Err(JobError::Unknown(9)));
}

#[test]
fn failures_are_retried_as_often_as_asked() {
    let mut c = core(Policy::Fifo, 1);
    c.submit(
        Demand {
            retries: 1,
            ..Demand::default()
        },
        0,
    )
    .unwrap();
    c.tick(0);
    assert_eq!(started(&mut c), vec![1]);
    c.job_exited(1, Exit::Lost, S).unwrap();
    c.tick(S);
    assert_eq!(started(&mut c), vec![1], "retried");
    c.job_exited(1, Exit::Code(3), 2 * S).unwrap();
    c.tick(2 * S);
    assert!(started(&mut c).is_empty());
    let j = c.job(1).unwrap();
    assert_eq!(j.runs, 2);
    assert!(matches!(
        j.state,
        JobState::Finished {
            outcome: Outcome::Failed {
                code: Some(3),
                signal: None
            },
            ..
        }
    ));
}

#[test]
fn bad_demands_are_refused_and_change_nothing() {
    let mut c = core(Policy::Fifo, 2);
    let bad = [
        Demand {
            gpus: 3,
            ..Demand::default()
        },
        Demand {
            gpus: 0,
            ..Demand::default()
        },
        Demand {
            share: 1.5,
            ..Demand::default()
        },
        Demand {
            share: 0.5,
            limit: 0.4,
            ..Demand::default()
        },
        Demand {
            prefer: vec![2],
            ..Demand::default()
        },
        Demand {
            prefer: vec![1, 1],
            ..Demand::default()
        },
        Demand {
            gpus: 2,
            prefer: vec![1],
            wait_mode: WaitMode::Queue,
            ..Demand::default()
        },
        Demand {
            timeout_ns: Some(0),
            ..Demand::default()
        },
    ];
    for d in bad {
        let e = c.submit(d.clone(), 0).unwrap_err();
        assert!(!e.to_string().is_empty(), "{d:?}");
    }
    assert_eq!(c.jobs().count(), 0);
    assert!(c.take_dirty().is_empty());
    assert_eq!(
        c.submit(Demand::default(), 0),
        Ok(1),
        "ids were not used up"
    );
}

#[test]
fn restore_keeps_clocks_and_kills_again() {
    let mut c = core(Policy::Fifo, 1);
    c.submit(timed(10), 0).unwrap();
    c.submit(timed(10), 0).unwrap();
    c.tick(0);
    started(&mut c);
    c.tick(4 * S);
    c.cancel(1, 4 * S).unwrap();
    let jobs: Vec<Job> = c.jobs().cloned().collect();
    let mut again = Core::restore(c.config().clone(), c.gpus().to_vec(), jobs);
    assert_eq!(
        again.take_actions(),
        vec![Action::Kill {
            job: 1,
            reason: KillReason::Cancel
        }]
    );
    again.job_exited(1, Exit::Signal(15), 5 * S).unwrap();
    again.tick(5 * S);
    assert_eq!(started(&mut again), vec![2]);
    assert_eq!(again.submit(Demand::default(), 6 * S), Ok(3));
}

// --- properties over random job mixes ---------------------------------------------------

#[derive(Debug, Clone)]
enum Ev {
    Submit(Demand),
    /// Exit the running job with this index among the running ones (modulo).
    Exit(usize, i32),
    Cancel(usize),
    Load(usize, f64, u64),
    Advance(u64),
}

fn demand(gpus: u32) -> impl Strategy<Value = Demand> {
    (
        1..=gpus,
        prop_oneof![Just(1.0), 0.05f64..1.0],
        proptest::option::of(1u64..60),
        proptest::collection::vec(0..gpus, 0..3),
        any::<bool>(),
        -2i32..3,
        proptest::option::of(1u64..300),
        0u32..2,
    )
        .prop_map(
            move |(k, share, mem, prefer, queue, priority, timeout, retries)| {
                let mut prefer: Vec<u32> = prefer;
                prefer.dedup();
                let mut seen = BTreeSet::new();
                prefer.retain(|g| seen.insert(*g));
                let wait_mode = if queue && prefer.len() >= k as usize {
                    WaitMode::Queue
                } else {
                    WaitMode::Schedule
                };
                Demand {
                    gpus: k,
                    share,
                    limit: 1.0,
                    memory: mem.map(|g| g * GIB),
                    latency: false,
                    prefer,
                    wait_mode,
                    priority,
                    timeout_ns: timeout.map(|t| t * S),
                    retries,
                }
            },
        )
}

fn events(gpus: u32) -> impl Strategy<Value = Vec<Ev>> {
    proptest::collection::vec(
        prop_oneof![
            4 => demand(gpus).prop_map(Ev::Submit),
            3 => (any::<usize>(), 0i32..3).prop_map(|(i, c)| Ev::Exit(i, c)),
            1 => any::<usize>().prop_map(Ev::Cancel),
            1 => (0..gpus as usize, 0.0f64..0.6, 0u64..70).prop_map(|(g, r, m)| Ev::Load(g, r, m * GIB)),
            3 => (1u64..120).prop_map(|s| Ev::Advance(s * S)),
        ],
        1..60,
    )
}

fn policy() -> impl Strategy<Value = Policy> {
    prop_oneof![
        Just(Policy::Fifo),
        Just(Policy::Sjf),
        Just(Policy::Aging),
        Just(Policy::Shares)
    ]
}

fn check_invariants(c: &Core) -> Result<(), TestCaseError> {
    let n = c.gpus().len() as u32;
    for j in c.jobs() {
        if let Some(r) = j.running() {
            let distinct: BTreeSet<u32> = r.gpus.iter().copied().collect();
            prop_assert_eq!(distinct.len(), j.demand.gpus as usize, "K distinct GPUs");
            prop_assert!(r.gpus.iter().all(|&g| g < n));
            if j.demand.wait_mode == WaitMode::Queue && !j.demand.prefer.is_empty() {
                prop_assert!(r.gpus.iter().all(|g| j.demand.prefer.contains(g)));
            }
            if let Some(t) = j.demand.timeout_ns {
                prop_assert!(r.kill.is_some() || r.credited_ns < t, "timeouts enforced");
            }
        }
    }
    for g in 0..n {
        let jobs = c.on_gpu(g).count() as u32;
        if let Some(m) = c.config().max_jobs_per_gpu {
            prop_assert!(jobs <= m, "GPU {} runs {} jobs, max {}", g, jobs, m);
        }
        let mine: f64 = c.on_gpu(g).map(|j| j.demand.share).sum();
        if c.config().policy == Policy::Shares && mine > 1.0 + 1e-6 {
            let m = c
                .config()
                .max_jobs_per_gpu
                .unwrap_or(SHARES_DEFAULT_MAX_JOBS);
            prop_assert!(jobs <= m, "GPU {} overcommitted with {} jobs", g, jobs);
        } else {
            prop_assert!(
                mine <= 1.0 + 1e-6,
                "GPU {} overcommitted by the queue: {}",
                g,
                mine
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Whatever arrives, placements respect K, preferences, shares and job limits, timeouts
    /// are enforced, and once every job is let run to the end the queue drains.
    #[test]
    fn placements_stay_valid_and_the_queue_drains(
        policy in policy(),
        gpus in 1u32..4,
        max_jobs in proptest::option::of(1u32..4),
        evs in events(3),
    ) {
        let mut c = Core::new(
            QueueConfig { policy, max_jobs_per_gpu: max_jobs, ..QueueConfig::default() },
            vec![Gpu { memory: 80 * GIB }; gpus as usize],
        );
        let mut now = 0;
        let mut loads = vec![GpuLoad::default(); gpus as usize];
        for ev in evs {
            match ev {
                Ev::Submit(d) => {
                    let ok = c.check(&d).is_ok();
                    prop_assert_eq!(c.submit(d, now).is_ok(), ok);
                }
                Ev::Exit(i, code) => {
                    let running: Vec<JobId> = c.jobs().filter(|j| j.running().is_some()).map(|j| j.id).collect();
                    if !running.is_empty() {
                        c.job_exited(running[i % running.len()], Exit::Code(code), now).unwrap();
                    }
                }
                Ev::Cancel(i) => {
                    let ids: Vec<JobId> = c.jobs().map(|j| j.id).collect();
                    if !ids.is_empty() {
                        let _ = c.cancel(ids[i % ids.len()], now);
                    }
                }
                Ev::Load(g, r, m) => {
                    if (g as u32) < gpus {
                        loads[g] = GpuLoad { foreign_request: r, foreign_memory: m, ..GpuLoad::default() };
                        c.gpu_state(loads.clone(), now);
                    }
                }
                Ev::Advance(d) => {
                    // Never past a timeout unseen: tick at every wake-up on the way.
                    let target = now + d;
                    while let Some(w) = c.next_wakeup().filter(|&w| w <= target && w > now) {
                        now = w;
                        c.tick(now);
                        check_invariants(&c)?;
                    }
                    now = target;
                }
            }
            c.tick(now);
            check_invariants(&c)?;
            // Killed jobs die at once.
            for a in c.take_actions() {
                if let Action::Kill { job, .. } = a {
                    c.job_exited(job, Exit::Signal(9), now).unwrap();
                }
            }
        }
        // Foreign tenants leave; every job runs to completion.
        c.gpu_state(vec![GpuLoad::default(); gpus as usize], now);
        for _ in 0..1000 {
            c.tick(now);
            let _ = c.take_actions();
            let running: Vec<JobId> = c.jobs().filter(|j| j.running().is_some()).map(|j| j.id).collect();
            if running.is_empty() && c.queue_order().is_empty() {
                break;
            }
            now += S;
            for id in running {
                c.job_exited(id, Exit::Code(0), now).unwrap();
            }
        }
        prop_assert!(c.jobs().all(|j| matches!(j.state, JobState::Finished { .. })), "queue drained");
    }

    /// Under `gpu-time` admission, in any sequence of submissions, measurements and exits,
    /// every job started on caps past its GPU's memory found the GPU time measured in use there
    /// plus its limit within the whole GPU; and the queue drains.
    #[test]
    fn gpu_time_admission_starts_past_the_memory_only_into_idle_time(
        subs in proptest::collection::vec((10u64..60, 1u32..=10), 1..20),
        busy in proptest::collection::vec(0u32..=10, 1..40),
        exits in proptest::collection::vec(any::<bool>(), 1..40),
    ) {
        let cap = 80 * GIB;
        let mut c = Core::new(
            QueueConfig {
                policy: Policy::Fifo,
                memory_overcommit: 2.0,
                overcommit_admission: OvercommitAdmission::GpuTime,
                ..QueueConfig::default()
            },
            vec![Gpu { memory: cap }],
        );
        for &(gib, tenths) in &subs {
            c.submit(Demand { share: 0.0, limit: f64::from(tenths) / 10.0, memory: Some(gib * GIB), ..Demand::default() }, 0).unwrap();
        }
        let mut load = GpuLoad::default();
        let mut now = 0;
        for step in 0..200usize {
            // What the placement sees: caps promised (nothing held yet) and time measured.
            let running: Vec<&Job> = c.jobs().filter(|j| j.running().is_some()).collect();
            let mut promised: u64 = running.iter().map(|j| j.demand.memory.unwrap()).sum();
            let mut used: f64 = load.foreign_busy + running.iter()
                .map(|j| load.job_busy.get(&j.id).copied().unwrap_or(j.demand.limit)).sum::<f64>();
            c.tick(now);
            for job in started(&mut c) {
                let d = &c.job(job).unwrap().demand;
                let m = d.memory.unwrap();
                if promised + m > cap {
                    prop_assert!(used + d.limit <= 1.0 + 1e-9, "job {} started past the memory into {} of the GPU's time", job, used);
                }
                promised += m;
                used += d.limit;
            }
            if c.jobs().all(|j| matches!(j.state, JobState::Finished { .. })) {
                break;
            }
            now += S;
            // The scheduler measures the running jobs; some of them end.
            let running: Vec<JobId> = c.jobs().filter(|j| j.running().is_some()).map(|j| j.id).collect();
            load = GpuLoad::default();
            for (k, &id) in running.iter().enumerate() {
                let limit = c.job(id).unwrap().demand.limit;
                let b = f64::from(busy[(step + k) % busy.len()]) / 10.0;
                load.job_busy.insert(id, b.min(limit));
                if exits[(step + k) % exits.len()] || step > 100 {
                    c.job_exited(id, Exit::Code(0), now).unwrap();
                    load.job_busy.remove(&id);
                }
            }
            c.gpu_state(vec![load.clone()], now);
        }
        prop_assert!(c.jobs().all(|j| matches!(j.state, JobState::Finished { .. })), "queue drained");
    }

}

// ---- the daemon's admission of submissions, fed hostile requests ----

use gpushare_frame::fuzz;
use gpushare_queue_protocol::{QUEUE_PROTOCOL_VERSION, Request, Submission};

/// The queue's scheduling core as the daemon feeds it submissions: each is checked, queued
/// and placed; a fresh core every few hundred so that the queue stays short.
pub(crate) struct Admit {
    core: Core,
    now: u64,
    pub(crate) queued: usize,
}

impl Admit {
    pub(crate) fn new() -> Admit {
        Admit {
            core: Core::new(QueueConfig::default(), vec![Gpu { memory: 80 << 30 }; 2]),
            now: 0,
            queued: 0,
        }
    }

    pub(crate) fn submit(&mut self, d: Demand) {
        if self.core.jobs().count() >= 64 {
            *self = Admit {
                queued: self.queued,
                ..Admit::new()
            };
        }
        self.now += 1_000_000;
        if self.core.submit(d, self.now).is_ok() {
            self.queued += 1;
            self.core.tick(self.now);
            self.core.take_actions();
        }
    }
}

fn submission() -> Submission {
    Submission {
        name: Some("train".into()),
        demand: Demand {
            gpus: 1,
            share: 0.5,
            limit: 0.8,
            memory: Some(4 << 30),
            latency: true,
            prefer: vec![1, 0],
            wait_mode: WaitMode::Queue,
            priority: -2,
            timeout_ns: Some(600_000_000_000),
            retries: 1,
        },
        cmd: vec!["python".into(), "train.py".into()],
        env: vec![("SEED".into(), "1".into())],
        cwd: Some("/home/u".into()),
    }
}

/// Requests as a CLI peer sends them; each submission goes on to the core.
#[test]
fn requests_round_trip_and_hostile_ones_are_rejected() {
    let samples = [
        Request::Hello {
            version: QUEUE_PROTOCOL_VERSION,
        },
        Request::Submit(submission()),
        Request::Submit(Submission {
            demand: Demand::default(),
            ..submission()
        }),
        Request::Jobs,
        Request::Cancel { id: 1 },
        Request::Logs {
            id: 1,
            follow: true,
        },
        Request::Token { renew: false },
    ];
    let mut admit = Admit::new();
    let n = 100_000;
    fuzz::frames(71, &samples, n, |r| {
        if let Request::Submit(s) = r {
            admit.submit(s.demand);
        }
    })
    .assert_exercised(n);
    assert!(admit.queued > 0);
}
