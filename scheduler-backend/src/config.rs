//! The daemon's TOML configuration (see README "Configuration reference"): token timing and
//! the groups with their shares and the processes that belong to them.
//!
//! ```toml
//! [scheduler]
//! quota = "20ms"      # token length
//! min_quota = "2ms"   # shortest turn, and how long a turn cut short still lasts (an eighth
//!                     # of it when the group that yielded the turn takes it back)
//! grace = "20ms"      # a turn unreported by its end + grace is revoked
//! window = "5s"       # window of the achieved shares in `gpushare status`
//! grant_ahead = "5ms" # the next turn is granted this long before the current one ends
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
//! memory = "4GiB"                # GPU memory cap (optional)
//! ```

use crate::identity::Peer;
use gpushare_policy::{GroupParams, PolicyConfig};
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
    memory: Option<String>,
}

fn one() -> f64 {
    1.0
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    scheduler: RawScheduler,
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
/// exhaust the daemon (see `[connections]` in README "Configuration reference").
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

#[derive(Debug, Clone, PartialEq, Default)]
pub struct Config {
    pub policy: PolicyConfig,
    pub connections: ConnectionLimits,
    pub groups: Vec<GroupConfig>,
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
        let mut groups = Vec::new();
        for g in raw.group {
            if groups.iter().any(|x: &GroupConfig| x.name == g.name) {
                return Err(format!("group {:?} is defined twice", g.name));
            }
            let params = GroupParams {
                request: g.request,
                limit: g.limit,
                weight: g.weight,
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
        })
    }

    /// The first group whose uids, gids or cgroups match the peer.
    pub fn group_for(&self, peer: &Peer) -> Option<&GroupConfig> {
        self.groups.iter().find(|g| g.matches(peer))
    }
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
                weight: 1.0
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
    }
}
