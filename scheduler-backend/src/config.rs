//! The daemon's TOML configuration (docs/configuration.md#configuration-file): turn timing and
//! the groups with their shares and the processes that belong to them.
//!
//! ```toml
//! memory_overcommit = 1.5 # memory caps on a GPU may sum to 1.5x its memory (default 1)
//!
//! [scheduler]
//! quota = "20ms"      # token length
//! min_quota = "2ms"   # shortest turn, and how long a turn cut short still lasts (an eighth
//!                     # of it when the group that yielded the turn takes it back)
//! grace = "20ms"      # a turn unreported by its end + grace is revoked
//! window = "5s"       # window of the achieved shares in `gpushare status`
//! grant_ahead = "5ms" # the next turn is granted this long before the current one ends
//!
//! [overcommit]        # GPU memory beyond the card (memory_overcommit > 1, a top-level key)
//! wait = "1s"         # an allocation that does not fit waits this long (or as long as a swap
//!                     # would take) for memory others free, then a group is swapped out
//! max_wait = "120s"   # the longest an allocation waits at all; then it fails (at most 600s)
//! window = "60s"      # a swapped-out group with work is back at least once per window
//! memory_turn = "10s" # a group back in (or made room for) is not swapped out for this long
//! retry_after = "10s" # a group whose checkpoint timed out is not chosen again for this long
//! lock_timeout = "5s" # a checkpoint's lock waits this long for the group's submitted work
//! exit_release = "1s" # an exited process's memory counts as used this long (the driver
//!                     # releases it some time after the exit)
//! checkpoint_bandwidth = "1.5GB/s" # what a swap is first taken to cost (then learned from
//! restore_bandwidth = "4.4GB/s"    # the swaps seen): the latency, then the bytes at the
//! checkpoint_latency = "100ms"     # bandwidth of the direction
//!
//! [connections]       # the tenant socket's bounds (a flood costs memory, never fairness)
//! max = 4096          # connections in total; more are closed at once
//! max_per_uid = 256   # connections of one user (SO_PEERCRED uid) in one pid namespace
//! hello_timeout = "2s" # a connection that has not said Hello by then is closed
//!
//! [[group]]
//! name = "training"
//! uids = [1000]                  # processes of these users…
//! gids = []                      # …or of these groups…
//! cgroups = ["kubepods/pod1234"] # …or whose cgroup path contains one of these
//! request = 0.3                  # guaranteed share of GPU time
//! limit = 0.6                    # hard cap (default 1.0)
//! weight = 1.0                   # share of spare time (default 1)
//! class = "standard"             # "latency" for a request server (see docs/latency.md)
//! memory = "4GiB"                # GPU memory cap (optional)
//! ```

use crate::identity::Peer;
use gpushare_policy::overcommit;
use gpushare_policy::{GroupClass, GroupParams, PolicyConfig};
use serde::Deserialize;
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Invalid { path: String, message: String },
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawScheduler {
    quota: Option<String>,
    min_quota: Option<String>,
    grace: Option<String>,
    window: Option<String>,
    grant_ahead: Option<String>,
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawConnections {
    max: Option<usize>,
    max_per_uid: Option<usize>,
    hello_timeout: Option<String>,
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawOvercommit {
    wait: Option<String>,
    max_wait: Option<String>,
    window: Option<String>,
    memory_turn: Option<String>,
    retry_after: Option<String>,
    lock_timeout: Option<String>,
    exit_release: Option<String>,
    checkpoint_bandwidth: Option<String>,
    restore_bandwidth: Option<String>,
    checkpoint_latency: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGroup {
    name: String,
    #[serde(default)]
    uids: Vec<u32>,
    #[serde(default)]
    gids: Vec<u32>,
    #[serde(default)]
    cgroups: Vec<String>,
    #[serde(default)]
    request: f64,
    #[serde(default = "one")]
    limit: f64,
    #[serde(default = "one")]
    weight: f64,
    class: Option<String>,
    memory: Option<String>,
}

fn one() -> f64 {
    1.0
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    memory_overcommit: Option<f64>,
    #[serde(default)]
    scheduler: RawScheduler,
    #[serde(default)]
    overcommit: RawOvercommit,
    #[serde(default)]
    connections: RawConnections,
    #[serde(default)]
    group: Vec<RawGroup>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct GroupConfig {
    pub name: String,
    pub uids: Vec<u32>,
    pub gids: Vec<u32>,
    pub cgroups: Vec<String>,
    pub params: GroupParams,
    pub memory: Option<u64>,
}

impl GroupConfig {
    fn matches(&self, peer: &Peer) -> bool {
        self.uids.contains(&peer.uid)
            || self.gids.contains(&peer.gid)
            || self
                .cgroups
                .iter()
                .any(|c| !c.is_empty() && peer.cgroup.contains(c.as_str()))
    }
}

/// Bounds on the tenant socket, so that no number of idle, slow or hostile connections can
/// exhaust the daemon (docs/robustness.md#a-flood-of-connections).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ConnectionLimits {
    /// Connections in total.
    pub max: usize,
    /// Connections of one user (`SO_PEERCRED` uid) in one pid namespace (a container).
    pub max_per_uid: usize,
    /// How long a new connection may take to say Hello.
    pub hello_timeout_ns: u64,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            max: 4096,
            max_per_uid: 256,
            hello_timeout_ns: 2_000_000_000,
        }
    }
}

/// How memory beyond the card is handled (`[overcommit]`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OvercommitConfig {
    /// The overcommit core's waits, windows and memory turns.
    pub params: overcommit::Params,
    /// How long a checkpoint's lock waits for the victim's submitted work.
    pub lock_timeout_ms: u32,
}

impl Default for OvercommitConfig {
    fn default() -> Self {
        OvercommitConfig {
            params: overcommit::Params::default(),
            lock_timeout_ms: 5_000,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct Config {
    pub policy: PolicyConfig,
    pub connections: ConnectionLimits,
    pub groups: Vec<GroupConfig>,
    /// How far the memory caps on a GPU may sum past its memory (`None`: as
    /// `--memory-overcommit` says, else 1).
    pub memory_overcommit: Option<f64>,
    pub overcommit: OvercommitConfig,
}

/// A `memory_overcommit` ratio: at least 1, finite.
pub fn overcommit_ratio(r: f64) -> Result<f64, String> {
    if r.is_finite() && r >= 1.0 {
        Ok(r)
    } else {
        Err(format!(
            "memory_overcommit must be a ratio of at least 1 (1: caps may not promise more than \
             a GPU holds), not {r}"
        ))
    }
}

impl Config {
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Config::parse(&text).map_err(|message| ConfigError::Invalid {
            path: path.display().to_string(),
            message,
        })
    }

    pub fn parse(text: &str) -> Result<Config, String> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| e.to_string())?;
        let mut policy = PolicyConfig::default();
        let dur = |v: &Option<String>, key: &str, into: &mut u64| -> Result<(), String> {
            if let Some(s) = v {
                *into = gpushare_units::parse_duration_ns(s)
                    .map_err(|e| format!("scheduler.{key}: {e}"))?;
            }
            Ok(())
        };
        dur(&raw.scheduler.quota, "quota", &mut policy.quota_ns)?;
        dur(
            &raw.scheduler.min_quota,
            "min_quota",
            &mut policy.min_quota_ns,
        )?;
        dur(&raw.scheduler.grace, "grace", &mut policy.grace_ns)?;
        dur(&raw.scheduler.window, "window", &mut policy.window_ns)?;
        dur(
            &raw.scheduler.grant_ahead,
            "grant_ahead",
            &mut policy.grant_ahead_ns,
        )?;
        if policy.quota_ns == 0
            || policy.min_quota_ns > policy.quota_ns
            || policy.window_ns < policy.quota_ns
        {
            return Err("scheduler: need 0 < min_quota <= quota <= window".into());
        }
        let mut connections = ConnectionLimits::default();
        let raw_conn = &raw.connections;
        connections.max = raw_conn.max.unwrap_or(connections.max);
        connections.max_per_uid = raw_conn.max_per_uid.unwrap_or(connections.max_per_uid);
        if let Some(s) = &raw_conn.hello_timeout {
            connections.hello_timeout_ns = gpushare_units::parse_duration_ns(s)
                .map_err(|e| format!("connections.hello_timeout: {e}"))?;
        }
        if connections.max == 0 || connections.max_per_uid == 0 {
            return Err("connections: max and max_per_uid must be at least 1".into());
        }
        let memory_overcommit = raw.memory_overcommit.map(overcommit_ratio).transpose()?;
        let overcommit = parse_overcommit(&raw.overcommit)?;
        let mut groups = Vec::new();
        for g in raw.group {
            if groups.iter().any(|x: &GroupConfig| x.name == g.name) {
                return Err(format!("group {:?} is defined twice", g.name));
            }
            let class = match &g.class {
                Some(c) => GroupClass::parse(c).map_err(|e| format!("group {:?}: {e}", g.name))?,
                None => GroupClass::Standard,
            };
            let params = GroupParams {
                request: g.request,
                limit: g.limit,
                weight: g.weight,
                class,
            };
            params
                .validate()
                .map_err(|reason| format!("invalid parameters for group {:?}: {reason}", g.name))?;
            let memory = match &g.memory {
                Some(m) => Some(
                    gpushare_units::parse_size(m)
                        .map_err(|e| format!("group {:?} memory: {e}", g.name))?,
                ),
                None => None,
            };
            groups.push(GroupConfig {
                name: g.name,
                uids: g.uids,
                gids: g.gids,
                cgroups: g.cgroups,
                params,
                memory,
            });
        }
        Ok(Config {
            policy,
            connections,
            groups,
            memory_overcommit,
            overcommit,
        })
    }

    /// The first group whose uids, gids or cgroups match the peer.
    pub fn group_for(&self, peer: &Peer) -> Option<&GroupConfig> {
        self.groups.iter().find(|g| g.matches(peer))
    }
}

fn parse_overcommit(raw: &RawOvercommit) -> Result<OvercommitConfig, String> {
    let mut c = OvercommitConfig::default();
    let dur = |v: &Option<String>, key: &str, into: &mut u64| -> Result<(), String> {
        if let Some(s) = v {
            *into = gpushare_units::parse_duration_ns(s)
                .map_err(|e| format!("overcommit.{key}: {e}"))?;
        }
        Ok(())
    };
    let p = &mut c.params;
    dur(&raw.wait, "wait", &mut p.alloc_wait_ns)?;
    dur(&raw.max_wait, "max_wait", &mut p.max_wait_ns)?;
    dur(&raw.window, "window", &mut p.window_ns)?;
    dur(&raw.memory_turn, "memory_turn", &mut p.memory_turn_ns)?;
    dur(&raw.retry_after, "retry_after", &mut p.retry_after_ns)?;
    dur(&raw.exit_release, "exit_release", &mut p.exit_release_ns)?;
    let cost = &mut p.swap_cost;
    dur(
        &raw.checkpoint_latency,
        "checkpoint_latency",
        &mut cost.latency_ns,
    )?;
    let rate = |v: &Option<String>, key: &str, into: &mut f64| -> Result<(), String> {
        if let Some(s) = v {
            *into =
                gpushare_units::parse_rate(s).map_err(|e| format!("overcommit.{key}: {e}"))? as f64;
        }
        Ok(())
    };
    rate(
        &raw.checkpoint_bandwidth,
        "checkpoint_bandwidth",
        &mut cost.checkpoint_bytes_per_s,
    )?;
    rate(
        &raw.restore_bandwidth,
        "restore_bandwidth",
        &mut cost.restore_bytes_per_s,
    )?;
    let mut lock = u64::from(c.lock_timeout_ms) * 1_000_000;
    dur(&raw.lock_timeout, "lock_timeout", &mut lock)?;
    c.lock_timeout_ms = u32::try_from(lock / 1_000_000)
        .map_err(|_| "overcommit.lock_timeout: too long".to_string())?;
    if c.params.max_wait_ns > gpushare_protocol::MAX_MEMORY_WAIT_NS {
        return Err(format!(
            "overcommit.max_wait: at most {} s (the hook waits no longer for an answer)",
            gpushare_protocol::MAX_MEMORY_WAIT_NS / 1_000_000_000
        ));
    }
    if c.params.window_ns == 0 {
        return Err("overcommit.window must be longer than 0".into());
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = r#"
[scheduler]
quota = "10ms"
grace = "5ms"

[connections]
max_per_uid = 16
hello_timeout = "500ms"

[[group]]
name = "train"
uids = [1000]
request = 0.3
limit = 0.6
memory = "4GiB"

[[group]]
name = "pods"
cgroups = ["kubepods/pod42"]
weight = 2
"#;

    #[test]
    fn parses_the_documented_example() {
        let c = Config::parse(EXAMPLE).unwrap();
        assert_eq!(c.policy.quota_ns, 10_000_000);
        assert_eq!(c.policy.grace_ns, 5_000_000);
        assert_eq!(
            c.connections,
            ConnectionLimits {
                max: 4096,
                max_per_uid: 16,
                hello_timeout_ns: 500_000_000,
            }
        );
        assert_eq!(
            c.groups[0].params,
            GroupParams {
                request: 0.3,
                limit: 0.6,
                weight: 1.0,
                class: GroupClass::Standard,
            }
        );
        assert_eq!(c.groups[0].memory, Some(4 << 30));
        let peer = |uid, cgroup: &str| Peer {
            start: 0,
            pid: 1,
            uid,
            gid: 0,
            cgroup: cgroup.into(),
            pod: None,
        };
        assert_eq!(c.group_for(&peer(1000, "/")).unwrap().name, "train");
        assert_eq!(
            c.group_for(&peer(7, "/kubepods/pod42/ctr")).unwrap().name,
            "pods"
        );
        assert!(c.group_for(&peer(7, "/user.slice")).is_none());
    }

    /// The configuration file as `docs/configuration.md` shows it: the example parses, and it
    /// shows every key each table accepts (the keys come from the parser's own refusal of an
    /// unknown one, so a key added here and not there fails this test).
    #[test]
    fn the_configuration_reference_shows_every_key() {
        let doc = include_str!("../../docs/configuration.md");
        let block = doc
            .split("### Configuration file")
            .nth(1)
            .and_then(|s| s.split("```toml\n").nth(1))
            .and_then(|s| s.split("```").next())
            .expect("docs/configuration.md has a TOML example under \"Configuration file\"");
        Config::parse(block).unwrap_or_else(|e| panic!("the documented example: {e}"));
        for table in ["[scheduler]", "[connections]", "[[group]]\nname = \"g\""] {
            let err = Config::parse(&format!("{table}\nno_such_key = 1")).unwrap_err();
            let expected = err
                .split("expected one of ")
                .nth(1)
                .unwrap_or_else(|| panic!("the parser names the keys of {table}: {err}"));
            let keys: Vec<&str> = expected.split('`').skip(1).step_by(2).collect();
            assert!(!keys.is_empty(), "no keys in {err:?}");
            for key in keys {
                assert!(
                    block
                        .lines()
                        .any(|l| l.trim_start().starts_with(&format!("{key} ="))),
                    "{table} accepts `{key}`, which docs/configuration.md's example does not show"
                );
            }
        }
    }

    #[test]
    fn the_kubernetes_daemonsets_configuration_parses() {
        let yaml = include_str!("../../deploy/kubernetes/scheduler-config.yaml");
        let (_, file) = yaml
            .split_once("scheduler.toml: |\n")
            .expect("the file's key");
        let toml: Vec<&str> = (file.lines())
            .map(|l| l.strip_prefix("    ").unwrap_or(l))
            .collect();
        let c = Config::parse(&toml.join("\n")).unwrap();
        assert_eq!(c.memory_overcommit, Some(1.0));
    }

    #[test]
    fn overcommit_keys_parse_and_bad_ones_are_explained() {
        let c = Config::parse(
            "memory_overcommit = 1.5\n[overcommit]\nwait = \"2s\"\nmax_wait = \"30s\"\nlock_timeout = \"1s\"\nexit_release = \"250ms\"\ncheckpoint_bandwidth = \"15GB/s\"\nrestore_bandwidth = \"44GB/s\"\ncheckpoint_latency = \"20ms\"",
        )
        .unwrap();
        assert_eq!(
            c.overcommit.params.swap_cost,
            gpushare_policy::overcommit::SwapCost {
                latency_ns: 20_000_000,
                checkpoint_bytes_per_s: 15e9,
                restore_bytes_per_s: 44e9,
            }
        );
        assert_eq!(
            Config::parse("").unwrap().overcommit.params.swap_cost,
            gpushare_policy::overcommit::SwapCost::MEASURED
        );
        assert_eq!(c.memory_overcommit, Some(1.5));
        assert_eq!(c.overcommit.params.alloc_wait_ns, 2_000_000_000);
        assert_eq!(c.overcommit.params.max_wait_ns, 30_000_000_000);
        assert_eq!(c.overcommit.lock_timeout_ms, 1_000);
        assert_eq!(c.overcommit.params.exit_release_ns, 250_000_000);
        assert_eq!(Config::parse("").unwrap().memory_overcommit, None);
        let e = Config::parse("memory_overcommit = 0.5").unwrap_err();
        assert!(e.contains("at least 1"), "{e}");
        let e = Config::parse("[overcommit]\nmax_wait = \"1h\"").unwrap_err();
        assert!(e.contains("max_wait"), "{e}");
        let e = Config::parse("[overcommit]\nrestore_bandwidth = \"44GB\"").unwrap_err();
        assert!(e.contains("restore_bandwidth") && e.contains("rate"), "{e}");
    }

    #[test]
    fn bad_input_is_explained() {
        assert!(
            Config::parse("[scheduler]\nquota = \"fast\"")
                .unwrap_err()
                .contains("quota")
        );
        assert!(Config::parse("[[group]]\nname = \"a\"\nrequest = 0.9\nlimit = 0.5").is_err());
        assert!(
            Config::parse("[[group]]\nname = \"a\"\n[[group]]\nname = \"a\"")
                .unwrap_err()
                .contains("twice")
        );
        assert!(
            Config::parse("[scheduler]\nquantum = \"1ms\"")
                .unwrap_err()
                .contains("quantum")
        );
        let e = Config::parse("[[group]]\nname = \"serve\"\nclass = \"fast\"").unwrap_err();
        assert!(e.contains("serve") && e.contains("\"latency\""), "{e}");
    }

    #[test]
    fn a_group_may_declare_the_latency_class() {
        let c = Config::parse("[[group]]\nname = \"serve\"\nclass = \"latency\"").unwrap();
        assert_eq!(c.groups[0].params.class, GroupClass::Latency);
    }
}
