//! Who is on the other end of a socket, from the kernel rather than from the client:
//! `SO_PEERCRED` for pid/uid/gid ([`Credentials`]), `/proc/<pid>/cgroup` for the container,
//! and from its cgroup path the Kubernetes pod and container ([`pod_identity`]).

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    pub pid: u32,
    /// When the process started (clock ticks since boot; 0 if unknown), so that a later
    /// process reusing the pid is not taken for it.
    pub start: u64,
    pub uid: u32,
    pub gid: u32,
    /// The process's cgroup path(s) from `/proc/<pid>/cgroup`, comma-separated.
    pub cgroup: String,
    /// The Kubernetes container the process runs in, if its cgroup is a kubelet's.
    pub pod: Option<PodIdentity>,
}

/// A connected peer's credentials as the kernel gave them (`SO_PEERCRED`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Credentials {
    pub pid: u32,
    pub uid: u32,
    pub gid: u32,
}

impl From<libc::ucred> for Credentials {
    fn from(c: libc::ucred) -> Credentials {
        Credentials {
            pid: c.pid as u32,
            uid: c.uid,
            gid: c.gid,
        }
    }
}

/// Who the peer with these credentials is, read from `/proc` (its cgroup and start time),
/// and its pid namespace (`None` if unreadable). Reads files: the daemon calls it off its event
/// loop.
pub fn resolve(cred: Credentials) -> (Peer, Option<u64>) {
    let text = std::fs::read_to_string(format!("/proc/{}/cgroup", cred.pid)).unwrap_or_default();
    let peer = peer_from(cred, &text, start_time(cred.pid).unwrap_or(0));
    (peer, pid_namespace(cred.pid))
}

/// The peer with these credentials, whose `/proc/<pid>/cgroup` reads `proc_cgroup` and which
/// started at `start`.
fn peer_from(cred: Credentials, proc_cgroup: &str, start: u64) -> Peer {
    let mut paths: Vec<String> = proc_cgroup
        .lines()
        .filter_map(|l| l.splitn(3, ':').nth(2).map(str::to_string))
        .collect();
    paths.dedup();
    Peer {
        pid: cred.pid,
        start,
        uid: cred.uid,
        gid: cred.gid,
        cgroup: paths.join(","),
        pod: pod_identity(proc_cgroup),
    }
}

/// The pid namespace of process `pid` (the inode `/proc/<pid>/ns/pid` names), if readable:
/// every container has its own, so it tells apart peers of one uid (root) in two containers.
pub fn pid_namespace(pid: u32) -> Option<u64> {
    let link = std::fs::read_link(format!("/proc/{pid}/ns/pid")).ok()?;
    let text = link.to_str()?;
    text.strip_prefix("pid:[")?.strip_suffix(']')?.parse().ok()
}

/// When process `pid` started, in clock ticks since boot (`/proc/<pid>/stat` field 22), or
/// `None` if there is no such process (or `pid` is 0: a peer in another pid namespace).
pub fn start_time(pid: u32) -> Option<u64> {
    if pid == 0 {
        return None;
    }
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may contain anything: count from after it.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_ascii_whitespace().nth(19)?.parse().ok()
}

impl Peer {
    /// The process, as the memory books and their journal know it.
    pub fn process(&self) -> crate::memory::ProcessId {
        crate::memory::ProcessId {
            pid: self.pid,
            start: self.start,
        }
    }
}

/// A Kubernetes container, as its cgroup names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PodIdentity {
    /// The pod's `metadata.uid`, with dashes (`0b1c8e3a-6f0e-4a57-9a39-8f2d3c1b7e11`), or the
    /// 32-hex-digit hash a static pod has.
    pub pod_uid: String,
    /// The container's 64-hex-digit ID, without runtime prefix.
    pub container_id: String,
}

/// The pod and container of a process from the text of its `/proc/<pid>/cgroup`: the line(s)
/// whose path has the kubelet's layout (cgroup v1 and v2 alike). `None` if no line does, or if
/// two lines name different containers.
pub fn pod_identity(proc_cgroup: &str) -> Option<PodIdentity> {
    let mut found: Option<PodIdentity> = None;
    for line in proc_cgroup.lines() {
        let Some(path) = line.splitn(3, ':').nth(2) else {
            continue;
        };
        if let Some(id) = pod_identity_of_path(path) {
            match &found {
                Some(f) if *f != id => return None,
                _ => found = Some(id),
            }
        }
    }
    found
}

/// The pod and container of one cgroup path, parsed exactly in the kubelet's layouts:
///
/// - systemd driver: `…/kubepods[-<qos>]-pod<uid with _>.slice/<runtime>-<id>.scope[/…]` where
///   the slice name is `[<root>-]kubepods[-besteffort|-burstable]-pod<uid>` and `<runtime>` is
///   `cri-containerd`, `crio` or `docker`;
/// - cgroupfs driver: `…/kubepods[/besteffort|/burstable]/pod<uid>/<id>[/…]`, the container
///   component being the bare ID or `cri-containerd-`, `crio-`, `docker-` and the ID.
///
/// Anything may precede the kubelet's part (a `--cgroup-root`, or the `/..` of a path seen from
/// another cgroup namespace); components after the container are cgroups the container made
/// inside its own.
pub fn pod_identity_of_path(path: &str) -> Option<PodIdentity> {
    let parts: Vec<&str> = path.split('/').filter(|c| !c.is_empty()).collect();
    for i in 0..parts.len().saturating_sub(1) {
        if let Some(pod_uid) = systemd_pod_slice(parts[i]) {
            let container_id = parts[i + 1]
                .strip_suffix(".scope")
                .and_then(runtime_prefixed_id)?;
            return Some(PodIdentity {
                pod_uid,
                container_id,
            });
        }
        if let Some(uid) = parts[i].strip_prefix("pod")
            && valid_uid(uid)
            && cgroupfs_parent(&parts[..i])
        {
            let c = parts[i + 1];
            let container_id = if is_container_id(c) {
                c.to_string()
            } else {
                runtime_prefixed_id(c)?
            };
            return Some(PodIdentity {
                pod_uid: uid.to_string(),
                container_id,
            });
        }
    }
    None
}

/// `[<root>-]kubepods[-<qos>]-pod<uid_with_underscores>.slice` → the UID with dashes.
fn systemd_pod_slice(component: &str) -> Option<String> {
    let name = component.strip_suffix(".slice")?;
    let (parent, pod) = name.rsplit_once('-')?;
    let uid = pod.strip_prefix("pod")?.replace('_', "-");
    if !valid_uid(&uid) {
        return None;
    }
    let parent = parent
        .strip_suffix("-besteffort")
        .or_else(|| parent.strip_suffix("-burstable"))
        .unwrap_or(parent);
    let root_ok = match parent.strip_suffix("kubepods")? {
        "" => true,
        root => root.ends_with('-') && root.split('-').filter(|t| !t.is_empty()).count() > 0,
    };
    root_ok.then_some(uid)
}

/// The components before `pod<uid>` end with `kubepods` or `kubepods/<qos>`.
fn cgroupfs_parent(before: &[&str]) -> bool {
    matches!(
        before,
        [.., "kubepods"] | [.., "kubepods", "besteffort" | "burstable"]
    )
}

/// `cri-containerd-<id>`, `crio-<id>` or `docker-<id>` → the ID.
fn runtime_prefixed_id(s: &str) -> Option<String> {
    ["cri-containerd-", "crio-", "docker-"]
        .iter()
        .find_map(|p| s.strip_prefix(p))
        .filter(|id| is_container_id(id))
        .map(str::to_string)
}

fn is_container_id(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// A pod UID: `8-4-4-4-12` lowercase hex (API pods), or 32 lowercase hex (static pods).
fn valid_uid(s: &str) -> bool {
    let hex = |b: u8| b.is_ascii_digit() || (b'a'..=b'f').contains(&b);
    match s.len() {
        36 => s.bytes().enumerate().all(|(i, b)| {
            if [8, 13, 18, 23].contains(&i) {
                b == b'-'
            } else {
                hex(b)
            }
        }),
        32 => s.bytes().all(hex),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifies_this_process() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let cred = gpushare_frame::peer_credentials(&a).unwrap();
        let (p, ns) = resolve(cred.into());
        assert_eq!(p.pid, std::process::id());
        // SAFETY: getuid has no preconditions.
        assert_eq!(p.uid, unsafe { libc::getuid() });
        assert!(p.start > 0, "start time read from /proc");
        assert_eq!(start_time(p.pid), Some(p.start), "stable for a process");
        let ns = ns.expect("this process's pid namespace");
        assert_eq!(pid_namespace(p.pid), Some(ns));
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        assert_eq!(pid_namespace(child.id()), Some(ns), "a child shares it");
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(pid_namespace(0), None);
        let child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let mut child = child;
        let started = start_time(child.id()).unwrap();
        assert!(started >= p.start, "a later process started later");
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(
            start_time(child.id()),
            None,
            "a reaped process has no start time"
        );
        assert_eq!(start_time(0), None);
    }

    const UID: &str = "0b1c8e3a-6f0e-4a57-9a39-8f2d3c1b7e11";
    const UID_: &str = "0b1c8e3a_6f0e_4a57_9a39_8f2d3c1b7e11";

    fn id() -> String {
        "3f".repeat(32)
    }

    fn expect(path: &str) -> Option<PodIdentity> {
        pod_identity_of_path(path)
    }

    fn ok() -> Option<PodIdentity> {
        Some(PodIdentity {
            pod_uid: UID.into(),
            container_id: id(),
        })
    }

    #[test]
    fn systemd_driver_layouts() {
        let id = id();
        for path in [
            format!(
                "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/cri-containerd-{id}.scope"
            ),
            format!(
                "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/crio-{id}.scope"
            ),
            format!("/kubepods.slice/kubepods-pod{UID_}.slice/docker-{id}.scope"),
            // --cgroup-root=/kubelet (kind), and a path seen from another cgroup namespace.
            format!(
                "/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod{UID_}.slice/cri-containerd-{id}.scope"
            ),
            format!("/../../kubepods-burstable-pod{UID_}.slice/cri-containerd-{id}.scope"),
            // A cgroup the container made inside its own.
            format!(
                "/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{id}.scope/init.scope"
            ),
        ] {
            assert_eq!(expect(&path), ok(), "{path}");
        }
    }

    #[test]
    fn cgroupfs_driver_layouts() {
        let id = id();
        for path in [
            format!("/kubepods/besteffort/pod{UID}/{id}"),
            format!("/kubepods/burstable/pod{UID}/{id}"),
            format!("/kubepods/pod{UID}/{id}"),
            format!("/kubepods/burstable/pod{UID}/crio-{id}"),
            format!("/kubepods/pod{UID}/docker-{id}"),
            format!("/kubelet/kubepods/besteffort/pod{UID}/{id}"),
        ] {
            assert_eq!(expect(&path), ok(), "{path}");
        }
        let static_pod = "7f3b0b8c9d2e4f6a8b1c3d5e7f9a0b2c";
        assert_eq!(
            expect(&format!("/kubepods/burstable/pod{static_pod}/{id}")),
            Some(PodIdentity {
                pod_uid: static_pod.into(),
                container_id: id.clone()
            })
        );
    }

    #[test]
    fn near_misses_are_not_pods() {
        let id = id();
        for path in [
            // the pod's own cgroup (no container), conmon, a short or upper-case ID
            format!("/kubepods.slice/kubepods-pod{UID_}.slice"),
            format!("/kubepods.slice/kubepods-pod{UID_}.slice/crio-conmon-{id}.scope"),
            format!(
                "/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{}.scope",
                &id[..63]
            ),
            format!("/kubepods/pod{UID}/{}", id.to_uppercase()),
            // wrong QoS, not under kubepods, dashes in a systemd UID, a mangled UID
            format!("/kubepods.slice/kubepods-gold-pod{UID_}.slice/cri-containerd-{id}.scope"),
            format!("/notkubepods/pod{UID}/{id}"),
            format!("/system.slice/pod{UID}/{id}"),
            format!("/kubepods.slice/kubepods-pod{UID}.slice/cri-containerd-{id}.scope"),
            format!("/kubepods/pod{}/{id}", &UID[1..]),
            // substrings of a pod path elsewhere in a name
            format!("/user.slice/my-kubepods-pod{UID_}.slice.bak/cri-containerd-{id}.scope"),
            "/".to_string(),
            String::new(),
        ] {
            assert_eq!(expect(&path), None, "{path}");
        }
    }

    #[test]
    fn v1_and_v2_lines_of_proc_cgroup() {
        let id = id();
        let v2 = format!("0::/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{id}.scope\n");
        assert_eq!(pod_identity(&v2), ok());
        let hybrid = format!(
            "9:name=systemd:/kubepods/pod{UID}/{id}\n4:memory:/kubepods/pod{UID}/{id}\n1:cpu:/\n0::/\n"
        );
        assert_eq!(pod_identity(&hybrid), ok());
        let conflicting = format!(
            "4:memory:/kubepods/pod{UID}/{id}\n0::/kubepods/pod{UID}/{}\n",
            "ab".repeat(32)
        );
        assert_eq!(
            pod_identity(&conflicting),
            None,
            "two containers: no answer"
        );
        assert_eq!(pod_identity("0::/user.slice/session-1.scope\n"), None);
    }

    /// A tenant's `/proc/<pid>/cgroup` decides whose policy it gets: mangled ones name a valid
    /// pod and container or none.
    #[test]
    fn hostile_cgroup_files_are_rejected_without_panicking() {
        let id = id();
        let samples = [
            format!(
                "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/crio-{id}.scope\n"
            ),
            format!(
                "9:name=systemd:/kubepods/besteffort/pod{UID}/docker-{id}/inner\n1:cpu:/\n0::/\n"
            ),
            format!("0::/../kubepods/pod{}/{id}\n", "ab".repeat(16)),
        ];
        let samples: Vec<&str> = samples.iter().map(String::as_str).collect();
        let n = 100_000;
        gpushare_frame::fuzz::texts(54, &samples, n, |text| match pod_identity(text) {
            Some(p) => {
                assert!(
                    valid_uid(&p.pod_uid) && is_container_id(&p.container_id),
                    "{text:?}"
                );
                true
            }
            None => false,
        })
        .assert_exercised(n);
    }
}
