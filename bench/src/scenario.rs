//! Scenario files: `bench/scenarios/*.toml`.
//!
//! ```toml
//! name = "three-requests"
//! duration = "6s"
//! gpus = 1            # simulated GPUs (default 1)
//! full_only = false   # true: only in the full suite, not with --quick
//!
//! [[tenant]]
//! name = "a"
//! workload = "train"  # train | async | threads | bursty | latency
//! kernel_ms = 1.0     # device time of each kernel
//! sync_every = 20     # train/threads/bursty: kernels between synchronisations
//! request = 0.5
//! limit = 1.0
//! weight = 1.0
//! class = "standard"  # or "latency": the group's scheduling class (docs/latency.md)
//! gpu = 0
//! count = 1           # replicate: tenants NAME-0 … NAME-(count-1)
//! expect = 0.5        # optional: the target share worked out by hand (nominal demand);
//!                     # loading fails if the bench's water-filling disagrees
//!
//! [flood]             # optional: a connection flood against the scheduler's socket for the
//!                     # whole of each run with gpushare (not the native or alone runs);
//!                     # every key optional, the defaults those of the flood test:
//! idle = 2000                 # connections that said Hello, then nothing more
//! junk = 300                  # connections sending junk…
//! junk_renew_ms = 100         # …each opened again this often
//! stalled_after_hello = 100   # connections with half a frame after their Hello
//! mid_hello = 100             # connections with half a Hello
//!
//! [fault]             # optional: a fault of the scheduler in each run with gpushare
//! kind = "stop"       # stop (SIGSTOP … SIGCONT) | kill (kill -9, then a new scheduler) |
//!                     # starve-request (the whole run in a cpu cgroup with a 50m request's
//!                     # weight beside a CPU hog per core) | starve-quota (the same, under a
//!                     # hard 50m quota) | replace-socket (its socket's path removed) |
//!                     # journal-full (its memory journal's file system full while a third
//!                     # process allocates)
//! at_ms = 1500        # stop, kill, replace-socket, journal-full: when, after the tenants start
//! for_ms = 3000       # stop, kill, journal-full: for how long
//! ```

use crate::expected;
use crate::fault::{FaultKind, FaultSpec};
use anyhow::{Context, bail};
use gpushare_policy::GroupClass;
use gpushare_testkit::flood::FloodSpec;
use gpushare_testkit::trace::Window;
use serde::Deserialize;
use std::path::Path;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Workload {
    /// Loops of `sync_every` kernels of `kernel_ms`, then a synchronisation.
    Train,
    /// Launches without synchronising (a synchronisation every `async_depth` kernels only, so
    /// that the run can end on time): a deep queue.
    Async,
    /// `threads` threads, each launching on its own stream.
    Threads,
    /// On/off: `sync_every` kernels, then idle so that the tenant alone is busy `duty` of the time.
    Bursty,
    /// Poisson requests (`rate_hz`), each `kernels` kernels + a synchronisation.
    Latency,
}

fn one() -> f64 {
    1.0
}
fn default_kernel_ms() -> f64 {
    1.0
}
fn default_sync_every() -> u64 {
    20
}
fn default_threads() -> u32 {
    4
}
fn default_duty() -> f64 {
    0.3
}
fn default_rate() -> f64 {
    50.0
}
fn default_kernels() -> u64 {
    4
}
fn default_async_depth() -> u64 {
    1000
}
fn default_count() -> u32 {
    1
}
fn default_gpus() -> u32 {
    1
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantSpec {
    pub name: String,
    pub workload: Workload,
    #[serde(default = "default_kernel_ms")]
    pub kernel_ms: f64,
    #[serde(default = "default_sync_every")]
    pub sync_every: u64,
    #[serde(default = "default_threads")]
    pub threads: u32,
    #[serde(default = "default_duty")]
    pub duty: f64,
    #[serde(default = "default_rate")]
    pub rate_hz: f64,
    /// Kernels per request (latency).
    #[serde(default = "default_kernels")]
    pub kernels: u64,
    #[serde(default = "default_async_depth")]
    pub async_depth: u64,
    #[serde(default)]
    pub request: f64,
    #[serde(default = "one")]
    pub limit: f64,
    #[serde(default = "one")]
    pub weight: f64,
    /// The group's scheduling class (`gpushare run --latency` for `"latency"`).
    #[serde(default)]
    pub class: GroupClass,
    #[serde(default)]
    pub gpu: u32,
    #[serde(default = "default_count")]
    pub count: u32,
    /// Target share worked out by hand for the tenant's nominal demand (each replica's).
    #[serde(default)]
    pub expect: Option<f64>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct ScenarioFile {
    name: String,
    duration: String,
    #[serde(default = "default_gpus")]
    gpus: u32,
    #[serde(default)]
    full_only: bool,
    #[serde(default)]
    description: String,
    #[serde(default)]
    flood: Option<FloodSpec>,
    #[serde(default)]
    fault: Option<FaultSpec>,
    tenant: Vec<TenantSpec>,
}

/// A parsed scenario, tenants replicated (`count`).
#[derive(Debug, Clone)]
pub struct Scenario {
    pub name: String,
    pub description: String,
    pub duration_ns: u64,
    pub gpus: u32,
    pub full_only: bool,
    /// A connection flood during the runs with gpushare.
    pub flood: Option<FloodSpec>,
    /// A fault of the scheduler in the runs with gpushare.
    pub fault: Option<FaultSpec>,
    pub tenants: Vec<TenantSpec>,
}

impl Scenario {
    pub fn load(path: &Path) -> anyhow::Result<Scenario> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
        Scenario::parse(&text).with_context(|| format!("scenario {}", path.display()))
    }

    pub fn parse(text: &str) -> anyhow::Result<Scenario> {
        let f: ScenarioFile = toml::from_str(text)?;
        let duration_ns = gpushare_units::parse_duration_ns(&f.duration)
            .map_err(|e| anyhow::anyhow!("duration {:?}: {e}", f.duration))?;
        if f.tenant.is_empty() {
            bail!("no [[tenant]]");
        }
        if let Some(fault) = &f.fault
            && !fault.starves()
            && ((fault.for_ms == 0 && fault.kind != FaultKind::ReplaceSocket)
                || (fault.at_ms + fault.for_ms) * 1_000_000 >= duration_ns)
        {
            bail!("[fault]: {fault:?} must last (for_ms > 0) and end within the duration");
        }
        let mut tenants = Vec::new();
        for t in f.tenant {
            if t.gpu >= f.gpus {
                bail!(
                    "tenant {}: gpu {} but the scenario has {} GPUs",
                    t.name,
                    t.gpu,
                    f.gpus
                );
            }
            check_params(&t).map_err(|e| anyhow::anyhow!("tenant {}: {e}", t.name))?;
            if t.count > 1 {
                for i in 0..t.count {
                    tenants.push(TenantSpec {
                        name: format!("{}-{i}", t.name),
                        count: 1,
                        ..t.clone()
                    });
                }
            } else {
                tenants.push(t);
            }
        }
        let sc = Scenario {
            name: f.name,
            description: f.description,
            duration_ns,
            gpus: f.gpus,
            full_only: f.full_only,
            flood: f.flood,
            fault: f.fault,
            tenants,
        };
        sc.check_expectations()?;
        Ok(sc)
    }

    /// The hand-written `expect` of each tenant against the bench's water-filling
    /// ([`expected::targets`]) at nominal demand: two independent readings of the share rules.
    fn check_expectations(&self) -> anyhow::Result<()> {
        let targets = expected::targets(self, |i| self.tenants[i].demand());
        for (t, target) in self.tenants.iter().zip(targets) {
            if let Some(e) = t.expect
                && (e - target).abs() > EXPECT_TOLERANCE
            {
                bail!(
                    "tenant {}: expect = {e} but the bench's water-filling gives {target:.4}; \
                     correct the expectation (or the tenant's request/limit/weight)",
                    t.name
                );
            }
        }
        Ok(())
    }
}

/// How far a hand-written `expect` may differ from the computed target (rounding).
const EXPECT_TOLERANCE: f64 = 5e-4;

/// The tenant's shares as the scheduler validates a group's, and its `expect` a share.
fn check_params(t: &TenantSpec) -> Result<(), String> {
    let params = gpushare_policy::GroupParams {
        request: t.request,
        limit: t.limit,
        weight: t.weight,
        class: t.class,
    };
    params.validate()?;
    if let Some(e) = t.expect
        && !(0.0..=1.0).contains(&e)
    {
        return Err(format!("expect = {e} is not a share between 0 and 1"));
    }
    Ok(())
}

impl TenantSpec {
    /// Share of a GPU this tenant would use alone (1 for the always-busy workloads; the mean
    /// for a latency tenant, see [`TenantSpec::demand_in`]).
    pub fn demand(&self) -> f64 {
        match self.workload {
            Workload::Train | Workload::Async | Workload::Threads => 1.0,
            Workload::Bursty => self.duty.clamp(0.0, 1.0),
            Workload::Latency => {
                (self.rate_hz * self.kernels as f64 * self.kernel_ms / 1e3).min(1.0)
            }
        }
    }

    /// Share of `w` this tenant would use alone, given when its latency requests arrived
    /// (CLOCK_MONOTONIC ns, in order, as `cudarc-client latency` reports them): a Poisson
    /// tenant's demand in a one-second window varies by a few hundredths around its mean. Alone,
    /// each request's work runs from its arrival, or from the end of the one before it if that
    /// is later (the server takes them in turn), and what of it falls inside `w` counts: a
    /// request that arrived shortly before the window still has work in it, one that arrived
    /// shortly before its end has some after it.
    pub fn demand_in(&self, arrivals_ns: &[u64], w: Window) -> f64 {
        let work = (self.kernels as f64 * self.kernel_ms * 1e6).round() as u64;
        let (mut free, mut used) = (0u64, 0u64);
        for &a in arrivals_ns {
            let start = a.max(free);
            if start >= w.end_ns {
                break;
            }
            free = start + work;
            used += free.min(w.end_ns).saturating_sub(start.max(w.start_ns));
        }
        (used as f64 / w.len_ns().max(1) as f64).min(1.0)
    }

    /// `cudarc-client` arguments running this workload for `duration_ms`.
    pub fn client_args(&self, duration_ms: f64, seed: u64) -> Vec<String> {
        let mut a: Vec<String> = vec!["--device".into(), self.gpu.to_string()];
        let ms = self.kernel_ms.to_string();
        let dur = format!("{duration_ms}");
        let mut spin = |sync_every: u64, extra: &[String]| {
            a.extend(
                [
                    "spin",
                    "--ms-per-kernel",
                    &ms,
                    "--duration-ms",
                    &dur,
                    "--sync-every",
                    &sync_every.to_string(),
                ]
                .map(String::from),
            );
            a.extend_from_slice(extra);
        };
        match self.workload {
            Workload::Train => spin(self.sync_every, &[]),
            Workload::Async => spin(self.async_depth, &[]),
            Workload::Threads => spin(
                self.sync_every,
                &["--threads".into(), self.threads.to_string()],
            ),
            Workload::Bursty => {
                let duty = self.duty.clamp(0.01, 1.0);
                let on_ms = self.sync_every as f64 * self.kernel_ms;
                let idle = on_ms * (1.0 - duty) / duty;
                spin(self.sync_every, &["--idle-ms".into(), format!("{idle:.3}")])
            }
            Workload::Latency => a.extend([
                "latency".into(),
                "--rate-hz".into(),
                self.rate_hz.to_string(),
                "--kernels".into(),
                self.kernels.to_string(),
                "--ms-per-kernel".into(),
                ms.clone(),
                "--duration-ms".into(),
                dur.clone(),
                "--seed".into(),
                seed.to_string(),
            ]),
        }
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every shipped scenario loads, so its hand-written expectations agree with the
    /// water-filling; and every tenant carries one.
    #[test]
    fn shipped_scenarios_agree_with_their_hand_written_expectations() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios");
        let mut n = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|x| x == "toml") {
                let sc = Scenario::load(&path).unwrap_or_else(|e| panic!("{e:#}"));
                for t in &sc.tenants {
                    assert!(t.expect.is_some(), "{}: {} has no expect", sc.name, t.name);
                }
                n += 1;
            }
        }
        assert!(n >= 10, "{n} scenarios in {}", dir.display());
    }

    #[test]
    fn a_wrong_expectation_or_bad_parameters_are_refused() {
        let sc = |tenant: &str| {
            Scenario::parse(&format!(
                "name = \"x\"\nduration = \"1s\"\n[[tenant]]\nname = \"a\"\nworkload = \"train\"\n{tenant}\n"
            ))
        };
        assert!(sc("request = 0.2\nlimit = 0.3\nexpect = 0.3").is_ok());
        let e = sc("request = 0.2\nlimit = 0.3\nexpect = 0.2").unwrap_err();
        assert!(format!("{e:#}").contains("gives 0.3000"), "{e:#}");
        assert!(sc("request = 0.5\nlimit = 0.3").is_err());
        assert!(sc("weight = 0").is_err());
        assert!(sc("limit = 1.5").is_err());
    }

    /// A latency tenant's demand in a window is the work it would run in that window alone:
    /// a request's work straddling an edge counts for its part inside, and a request that
    /// arrives while the one before runs waits for it.
    #[test]
    fn a_latency_tenant_demands_the_work_it_would_run_in_the_window_alone() {
        let sc = Scenario::parse(
            "name = \"x\"\nduration = \"1s\"\n[[tenant]]\nname = \"a\"\nworkload = \"latency\"\n\
             rate_hz = 40.0\nkernels = 4\nkernel_ms = 1.0\nexpect = 0.16\n",
        )
        .unwrap();
        let t = &sc.tenants[0];
        let ms = 1_000_000u64;
        let w = Window::new(100 * ms, 200 * ms);
        let demand = |arrivals: &[u64]| t.demand_in(arrivals, w);
        // Inside, whole: 4 ms of 100.
        assert!((demand(&[150 * ms]) - 0.04).abs() < 1e-9);
        // Arrived 1 ms before the window: 3 ms of it inside; 1 ms before its end: 1 ms inside.
        assert!((demand(&[99 * ms]) - 0.03).abs() < 1e-9);
        assert!((demand(&[199 * ms]) - 0.01).abs() < 1e-9);
        // Queued behind one that arrived 3 ms before the window: it runs 1–5 ms into it.
        assert!((demand(&[97 * ms, 98 * ms]) - 0.05).abs() < 1e-9);
        // Queued behind one near the end: it starts past the end.
        assert!((demand(&[196 * ms, 198 * ms]) - 0.04).abs() < 1e-9);
        assert!((demand(&[10 * ms, 300 * ms]) - 0.0).abs() < 1e-9);
    }

    #[test]
    fn a_flood_table_takes_the_flood_tests_defaults() {
        let sc = |flood: &str| {
            Scenario::parse(&format!(
                "name = \"x\"\nduration = \"1s\"\n{flood}\n[[tenant]]\nname = \"a\"\nworkload = \"train\"\n"
            ))
        };
        assert_eq!(sc("").unwrap().flood, None);
        assert_eq!(sc("[flood]").unwrap().flood, Some(FloodSpec::default()));
        let f = sc("[flood]\nidle = 10\njunk_renew_ms = 50")
            .unwrap()
            .flood
            .unwrap();
        assert_eq!((f.idle, f.junk, f.junk_renew_ms), (10, 300, 50));
        assert!(sc("[flood]\nidel = 10").is_err());
    }
}
