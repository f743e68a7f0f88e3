//! The Kubernetes containers the node agent told us about (admin protocol,
//! [`gpushare_protocol::admin`]): one scheduler group per container, named
//! `namespace/pod/container`, scoped to the container's GPUs. Pure bookkeeping, no I/O: the
//! admin shell ([`crate::admin`]) feeds it requests and applies the [`GroupChange`]s it returns.
//!
//! A removed container whose processes are still connected keeps its group until the last of
//! them disconnects ([`PodTable::client_left`]); new processes of it are refused.

use crate::identity::PodIdentity;
use gpushare_policy::{GroupClass, GroupParams};
use gpushare_protocol::GpuUuid;
use gpushare_protocol::admin::{AdminRequest, ContainerKey, PodGroup, parse_gpu_uuid};
use gpushare_protocol::status::{PodReport, uuid_string};
use std::collections::{BTreeMap, HashMap};

/// What the daemon must do to its policies and memory books.
#[derive(Debug, Clone, PartialEq)]
pub enum GroupChange {
    /// Create or update the group `name` on the GPUs of [`PodTable::gpus_of`].
    Set {
        name: String,
        params: GroupParams,
        memory: Option<u64>,
    },
    /// The group is gone.
    Remove { name: String },
}

/// Which group a connecting process belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// Its container's group.
    Group(String),
    /// Its pod or container was removed: refuse it.
    Removed(String),
    /// Nothing known (yet) about this container.
    Unknown,
}

#[derive(Debug, Clone)]
struct Entry {
    spec: PodGroup,
    name: String,
    gpus: Vec<GpuUuid>,
    removed: bool,
}

#[derive(Debug, Default)]
pub struct PodTable {
    entries: BTreeMap<ContainerKey, Entry>,
    by_name: HashMap<String, ContainerKey>,
    /// An agent has synced at least once: processes in pods may wait for their policy.
    active: bool,
}

impl PodTable {
    /// Whether a node agent manages pods here (it has sent a [`AdminRequest::Sync`]).
    pub fn active(&self) -> bool {
        self.active
    }

    /// Apply one admin request. `has_clients(name)`: whether processes of that group are
    /// connected. On error nothing changed; the message says what to fix.
    pub fn apply(
        &mut self,
        req: AdminRequest,
        has_clients: impl Fn(&str) -> bool,
    ) -> Result<Vec<GroupChange>, String> {
        let mut out = Vec::new();
        match req {
            AdminRequest::Hello { .. } => return Err("Hello sent twice".into()),
            AdminRequest::Usage => return Err("Usage changes nothing in the pod table".into()),
            AdminRequest::Sync { groups } => {
                let mut checked = Vec::with_capacity(groups.len());
                for g in groups {
                    checked.push(check(g)?);
                }
                let keep: Vec<ContainerKey> = checked.iter().map(|(g, _)| g.key()).collect();
                let gone: Vec<ContainerKey> = self
                    .entries
                    .keys()
                    .filter(|k| !keep.contains(k))
                    .cloned()
                    .collect();
                for k in gone {
                    self.remove(&k, &has_clients, &mut out);
                }
                for (g, gpus) in checked {
                    self.upsert(g, gpus, &mut out);
                }
                self.active = true;
            }
            AdminRequest::Upsert { group } => {
                let (g, gpus) = check(group)?;
                self.upsert(g, gpus, &mut out);
            }
            AdminRequest::Remove { key } => self.remove(&key, &has_clients, &mut out),
        }
        Ok(out)
    }

    fn upsert(&mut self, spec: PodGroup, gpus: Vec<GpuUuid>, out: &mut Vec<GroupChange>) {
        let key = spec.key();
        let name = match self.entries.get(&key) {
            Some(e) => e.name.clone(),
            None => self.fresh_name(&spec),
        };
        out.push(GroupChange::Set {
            name: name.clone(),
            params: params(&spec),
            memory: spec.memory,
        });
        self.by_name.insert(name.clone(), key.clone());
        self.entries.insert(
            key,
            Entry {
                spec,
                name,
                gpus,
                removed: false,
            },
        );
    }

    /// `namespace/pod/container`, or with the pod UID's first 8 digits appended when an older
    /// pod of the same name still holds that name (a StatefulSet pod recreated while the old
    /// one's processes exit).
    fn fresh_name(&self, g: &PodGroup) -> String {
        let base = format!("{}/{}/{}", g.namespace, g.pod, g.container);
        if self.by_name.contains_key(&base) {
            let short: String = g.pod_uid.chars().take(8).collect();
            format!("{base}@{short}")
        } else {
            base
        }
    }

    fn remove(
        &mut self,
        key: &ContainerKey,
        has_clients: &impl Fn(&str) -> bool,
        out: &mut Vec<GroupChange>,
    ) {
        let Some(e) = self.entries.get_mut(key) else {
            return;
        };
        if has_clients(&e.name) {
            e.removed = true;
        } else {
            let name = e.name.clone();
            self.entries.remove(key);
            self.by_name.remove(&name);
            out.push(GroupChange::Remove { name });
        }
    }

    /// A process of group `name` disconnected: a removed container's group goes with its last
    /// process.
    pub fn client_left(&mut self, name: &str, has_clients: bool) -> Option<GroupChange> {
        let key = self.by_name.get(name)?.clone();
        if has_clients || !self.entries.get(&key)?.removed {
            return None;
        }
        self.entries.remove(&key);
        self.by_name.remove(name);
        Some(GroupChange::Remove {
            name: name.to_string(),
        })
    }

    /// The group of a process in container `who`: its container ID when the agent reported
    /// it, else the pod's only container with a group whose ID is not known yet.
    pub fn lookup(&self, who: &PodIdentity) -> Lookup {
        let of_pod: Vec<&Entry> = self
            .entries
            .values()
            .filter(|e| e.spec.pod_uid == who.pod_uid)
            .collect();
        let by_id = of_pod
            .iter()
            .find(|e| e.spec.container_id.as_deref() == Some(who.container_id.as_str()));
        let unambiguous = match of_pod.as_slice() {
            [only] if only.spec.container_id.is_none() => Some(only),
            _ => None,
        };
        match by_id.or(unambiguous) {
            Some(e) if e.removed => Lookup::Removed(e.name.clone()),
            Some(e) => Lookup::Group(e.name.clone()),
            None => Lookup::Unknown,
        }
    }

    /// Whether group `name` may be used on `gpu`: a container's group only on its own GPUs,
    /// any other group everywhere.
    pub fn on_gpu(&self, name: &str, gpu: &GpuUuid) -> bool {
        self.gpus_of(name).is_none_or(|g| g.contains(gpu))
    }

    /// The GPUs of a container's group (`None`: not a container's group).
    pub fn gpus_of(&self, name: &str) -> Option<&[GpuUuid]> {
        let key = self.by_name.get(name)?;
        self.entries.get(key).map(|e| e.gpus.as_slice())
    }

    /// `(namespace, pod, container)` of a container's group.
    pub fn labels(&self, name: &str) -> Option<(&str, &str, &str)> {
        let e = self.entries.get(self.by_name.get(name)?)?;
        Some((&e.spec.namespace, &e.spec.pod, &e.spec.container))
    }

    /// Every known container, for `gpushare status`.
    pub fn report(&self) -> Vec<PodReport> {
        self.entries
            .values()
            .map(|e| PodReport {
                namespace: e.spec.namespace.clone(),
                pod: e.spec.pod.clone(),
                container: e.spec.container.clone(),
                pod_uid: e.spec.pod_uid.clone(),
                container_id: e.spec.container_id.clone(),
                group: e.name.clone(),
                gpus: e.gpus.iter().map(uuid_string).collect(),
                request: e.spec.request,
                limit: e.spec.limit,
                weight: e.spec.weight,
                memory: e.spec.memory,
                removed: e.removed,
            })
            .collect()
    }
}

fn params(g: &PodGroup) -> GroupParams {
    GroupParams {
        request: g.request,
        limit: g.limit,
        weight: g.weight,
        class: GroupClass::latency_if(g.latency),
    }
}

/// Validate a group from the agent; its GPUs parsed.
fn check(g: PodGroup) -> Result<(PodGroup, Vec<GpuUuid>), String> {
    let what = || format!("{}/{}/{}", g.namespace, g.pod, g.container);
    if g.pod_uid.is_empty() || g.container.is_empty() {
        return Err(format!(
            "{}: pod UID and container name are required",
            what()
        ));
    }
    params(&g)
        .validate()
        .map_err(|e| format!("{}: {e}", what()))?;
    if g.gpus.is_empty() {
        return Err(format!("{}: no GPU given", what()));
    }
    let gpus = g
        .gpus
        .iter()
        .map(|s| {
            parse_gpu_uuid(s).ok_or_else(|| {
                format!(
                    "{}: {s:?} is not a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)",
                    what()
                )
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok((g, gpus))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const GPU: &str = "GPU-67707573-6861-7265-2d73-696d2d677075";
    const GPU2: &str = "GPU-67707573-6861-7265-2d73-696d2d677076";

    fn group(uid: &str, container: &str, id: Option<&str>, request: f64) -> PodGroup {
        PodGroup {
            pod_uid: uid.into(),
            namespace: "ns".into(),
            pod: format!("pod-{uid}"),
            container: container.into(),
            container_id: id.map(str::to_string),
            gpus: vec![GPU.into()],
            request,
            limit: 1.0,
            weight: 1.0,
            memory: None,
            latency: false,
        }
    }

    fn who(uid: &str, id: &str) -> PodIdentity {
        PodIdentity {
            pod_uid: uid.into(),
            container_id: id.into(),
        }
    }

    #[test]
    fn a_single_container_pod_is_found_before_its_container_id_is_known() {
        let mut t = PodTable::default();
        let ch = t
            .apply(
                AdminRequest::Sync {
                    groups: vec![group("u1", "main", None, 0.3)],
                },
                |_| false,
            )
            .unwrap();
        assert_eq!(
            ch,
            vec![GroupChange::Set {
                name: "ns/pod-u1/main".into(),
                params: GroupParams {
                    request: 0.3,
                    limit: 1.0,
                    weight: 1.0,
                    class: GroupClass::Standard,
                },
                memory: None
            }]
        );
        assert!(t.active());
        assert_eq!(
            t.lookup(&who("u1", "c1")),
            Lookup::Group("ns/pod-u1/main".into())
        );
        assert_eq!(t.lookup(&who("u2", "c1")), Lookup::Unknown);
        assert!(t.on_gpu("ns/pod-u1/main", &parse_gpu_uuid(GPU).unwrap()));
        assert!(!t.on_gpu("ns/pod-u1/main", &parse_gpu_uuid(GPU2).unwrap()));
        assert!(t.on_gpu("some-config-group", &parse_gpu_uuid(GPU2).unwrap()));
    }

    #[test]
    fn several_containers_of_a_pod_need_their_ids() {
        let mut t = PodTable::default();
        let groups = vec![group("u1", "a", None, 0.3), group("u1", "b", None, 0.2)];
        t.apply(AdminRequest::Sync { groups }, |_| false).unwrap();
        assert_eq!(t.lookup(&who("u1", "c1")), Lookup::Unknown, "which one?");
        t.apply(
            AdminRequest::Upsert {
                group: group("u1", "b", Some("c1"), 0.2),
            },
            |_| false,
        )
        .unwrap();
        assert_eq!(
            t.lookup(&who("u1", "c1")),
            Lookup::Group("ns/pod-u1/b".into())
        );
        assert_eq!(t.lookup(&who("u1", "c2")), Lookup::Unknown);
    }

    #[test]
    fn a_removed_container_keeps_its_group_until_its_last_process_leaves() {
        let mut t = PodTable::default();
        t.apply(
            AdminRequest::Sync {
                groups: vec![group("u1", "main", Some("c1"), 0.3)],
            },
            |_| false,
        )
        .unwrap();
        let ch = t
            .apply(AdminRequest::Sync { groups: vec![] }, |_| true)
            .unwrap();
        assert!(ch.is_empty(), "processes still connected: {ch:?}");
        assert_eq!(
            t.lookup(&who("u1", "c1")),
            Lookup::Removed("ns/pod-u1/main".into())
        );
        // A new pod of the same name while the old one drains gets a distinct group.
        let mut again = group("u2", "main", Some("c9"), 0.5);
        again.pod = "pod-u1".into();
        let ch = t
            .apply(AdminRequest::Upsert { group: again }, |_| false)
            .unwrap();
        assert!(matches!(&ch[0], GroupChange::Set { name, .. } if name == "ns/pod-u1/main@u2"));
        assert_eq!(t.client_left("ns/pod-u1/main", true), None);
        assert_eq!(
            t.client_left("ns/pod-u1/main", false),
            Some(GroupChange::Remove {
                name: "ns/pod-u1/main".into()
            })
        );
        assert_eq!(t.lookup(&who("u1", "c1")), Lookup::Unknown);
        assert_eq!(
            t.client_left("ns/pod-u2/main@u2", false),
            None,
            "not removed"
        );
    }

    #[test]
    fn invalid_groups_are_refused_whole() {
        let mut t = PodTable::default();
        let mut bad = group("u2", "main", None, 0.5);
        bad.limit = 0.2;
        let err = t
            .apply(
                AdminRequest::Sync {
                    groups: vec![group("u1", "main", None, 0.3), bad],
                },
                |_| false,
            )
            .unwrap_err();
        assert!(err.contains("limit"), "{err}");
        assert!(t.report().is_empty(), "nothing applied");
        let mut no_gpu = group("u3", "main", None, 0.5);
        no_gpu.gpus = vec!["GPU-0".into()];
        assert!(
            t.apply(AdminRequest::Upsert { group: no_gpu }, |_| false)
                .unwrap_err()
                .contains("GPU UUID")
        );
    }

    /// Regression (found fuzzing the admin socket): the suffix that tells two pods of one name
    /// apart was cut at byte 8 of the pod UID, inside a multi-byte character.
    #[test]
    fn a_pod_uid_with_multibyte_characters_names_its_group() {
        let mut t = PodTable::default();
        for uid in ["a", "pod-uidé-1"] {
            let req = AdminRequest::Upsert {
                group: PodGroup {
                    pod: "train".into(),
                    ..group(uid, "main", None, 0.1)
                },
            };
            t.apply(req, |_| false).unwrap();
        }
        assert!(
            t.by_name.contains_key("ns/train/main@pod-uidé"),
            "{:?}",
            t.by_name
        );
    }

    proptest! {
        /// Whatever the sequence of syncs, the table ends up holding exactly the last sync's
        /// containers (none connected), and every change names a group it set or removed.
        #[test]
        fn sync_converges(syncs in proptest::collection::vec(proptest::collection::btree_set(0u8..6, 0..6), 1..8)) {
            let mut t = PodTable::default();
            let mut live: std::collections::BTreeSet<String> = Default::default();
            for s in &syncs {
                let groups = s.iter().map(|i| group(&format!("u{i}"), "main", None, 0.1)).collect();
                for c in t.apply(AdminRequest::Sync { groups }, |_| false).unwrap() {
                    match c {
                        GroupChange::Set { name, .. } => { live.insert(name); }
                        GroupChange::Remove { name } => { prop_assert!(live.remove(&name)); }
                    }
                }
            }
            let want: std::collections::BTreeSet<String> =
                syncs.last().unwrap().iter().map(|i| format!("ns/pod-u{i}/main")).collect();
            prop_assert_eq!(&live, &want);
            let reported: std::collections::BTreeSet<String> = t.report().into_iter().map(|r| r.group).collect();
            prop_assert_eq!(reported, want);
        }
    }
}
