//! CPU cgroups for tests that give a process the CPU a kubelet would: a CPU request as a
//! relative weight (cgroup v2 `cpu.weight`, v1 `cpu.shares`), a CPU limit as a hard quota per
//! 100 ms period (v2 `cpu.max`, v1 `cpu.cfs_quota_us`), converted as the kubelet converts
//! millicores. Either version of the cpu controller will do; creating groups needs root.
//!
//! A [`CpuCgroup`] is made at the root of the cpu hierarchy (or inside another one) and removed
//! when dropped, its remaining processes moved back to the root first.

use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

/// The kubelet's CFS period.
const PERIOD_US: u64 = 100_000;

/// Where the cpu controller is mounted, and which version it is.
#[derive(Debug, Clone)]
struct Hierarchy {
    root: PathBuf,
    v2: bool,
}

/// The cpu controller's hierarchy: cgroup v2 if its root offers `cpu`, else a v1 hierarchy
/// with the `cpu` controller. An error says what is missing and how to get it.
fn hierarchy() -> Result<Hierarchy, String> {
    let info = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| format!("cannot read /proc/self/mountinfo: {e}"))?;
    let mut v1 = None;
    for line in info.lines() {
        let Some((mount, fs)) = line.split_once(" - ") else {
            continue;
        };
        let Some(point) = mount.split(' ').nth(4) else {
            continue;
        };
        let mut fs = fs.split(' ');
        let (kind, options) = (fs.next(), fs.nth(1).unwrap_or(""));
        let root = PathBuf::from(point);
        match kind {
            Some("cgroup2") => {
                let controllers =
                    std::fs::read_to_string(root.join("cgroup.controllers")).unwrap_or_default();
                if controllers.split_whitespace().any(|c| c == "cpu") {
                    return Ok(Hierarchy { root, v2: true });
                }
            }
            Some("cgroup") if options.split(',').any(|o| o == "cpu") => v1 = Some(root),
            _ => {}
        }
    }
    v1.map(|root| Hierarchy { root, v2: false }).ok_or_else(|| {
        "no cpu cgroup controller is available (neither cgroup v2 with `cpu` in cgroup.controllers \
         nor a v1 hierarchy mounted with `cpu`): run the test on a host or in a privileged \
         container whose cgroup file system offers the cpu controller"
            .to_string()
    })
}

/// A cgroup of the cpu controller, removed when dropped.
pub struct CpuCgroup {
    dir: PathBuf,
    /// Its path as `/proc/<pid>/cgroup` shows it (from the hierarchy's root).
    path: String,
    hierarchy: Hierarchy,
    /// Its `cgroup.procs`, open for [`enter`](CpuCgroup::enter)'s children to write to.
    procs: File,
}

impl CpuCgroup {
    /// A new cgroup at the root of the cpu hierarchy, named after `name`, this process and a
    /// counter (so that tests side by side, and leftovers of a killed run, never collide).
    pub fn create(name: &str) -> Result<CpuCgroup, String> {
        let h = hierarchy()?;
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let unique = format!(
            "{name}-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        CpuCgroup::make(h, Path::new(""), &unique)
    }

    /// A cgroup inside this one (a pod inside `kubepods`).
    pub fn child(&self, name: &str) -> Result<CpuCgroup, String> {
        if self.hierarchy.v2 {
            write(&self.dir.join("cgroup.subtree_control"), "+cpu")?;
        }
        CpuCgroup::make(self.hierarchy.clone(), Path::new(&self.path), name)
    }

    fn make(h: Hierarchy, parent: &Path, name: &str) -> Result<CpuCgroup, String> {
        if h.v2 && parent.as_os_str().is_empty() {
            write(&h.root.join("cgroup.subtree_control"), "+cpu")?;
        }
        let path = Path::new("/").join(parent).join(name);
        let dir = h.root.join(path.strip_prefix("/").expect("absolute"));
        std::fs::create_dir(&dir).map_err(|e| {
            format!(
                "cannot create the cgroup {}: {e} (creating cgroups needs root)",
                dir.display()
            )
        })?;
        let procs = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.join("cgroup.procs"))
            .map_err(|e| format!("cannot open {}/cgroup.procs: {e}", dir.display()))?;
        Ok(CpuCgroup {
            path: path.to_string_lossy().into_owned(),
            dir,
            hierarchy: h,
            procs,
        })
    }

    /// Its path as `/proc/<pid>/cgroup` shows it, for a scheduler configuration's `cgroups`.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Whether it is a cgroup v2 group (`cpu.weight`, `cpu.max`) or a v1 one (`cpu.shares`,
    /// `cpu.cfs_quota_us`).
    pub fn version(&self) -> &'static str {
        if self.hierarchy.v2 { "v2" } else { "v1" }
    }

    /// The weight a kubelet gives a CPU request of `millicores`: `cpu.shares` =
    /// millicores × 1024 / 1000 (at least 2), and on v2 `cpu.weight` from those shares.
    pub fn request_millicores(&self, millicores: u64) -> Result<(), String> {
        let shares = (millicores * 1024 / 1000).max(2);
        if self.hierarchy.v2 {
            let weight = 1 + (shares - 2) * 9999 / 262_142;
            write(&self.dir.join("cpu.weight"), &weight.to_string())
        } else {
            write(&self.dir.join("cpu.shares"), &shares.to_string())
        }
    }

    /// The quota a kubelet gives a CPU limit of `millicores`: millicores × 100 µs of CPU in
    /// each 100 ms period.
    pub fn limit_millicores(&self, millicores: u64) -> Result<(), String> {
        let quota = millicores * PERIOD_US / 1000;
        if self.hierarchy.v2 {
            write(&self.dir.join("cpu.max"), &format!("{quota} {PERIOD_US}"))
        } else {
            write(&self.dir.join("cpu.cfs_period_us"), &PERIOD_US.to_string())?;
            write(&self.dir.join("cpu.cfs_quota_us"), &quota.to_string())
        }
    }

    /// Move process `pid` (all its threads) into the group.
    pub fn add(&self, pid: u32) -> Result<(), String> {
        write(&self.dir.join("cgroup.procs"), &pid.to_string())
    }

    /// Start `cmd`'s process in the group: the child moves itself in before it runs the
    /// program (writing 0 to `cgroup.procs` moves the writer). The group must outlive the spawn.
    pub fn enter(&self, cmd: &mut Command) {
        let fd = self.procs.as_raw_fd();
        // SAFETY: between fork and exec the child only calls write(2), async-signal-safe, on a
        // descriptor the parent holds open while it spawns.
        unsafe {
            cmd.pre_exec(move || {
                if libc::write(fd, b"0".as_ptr().cast(), 1) == 1 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
    }

    /// How many of its 100 ms periods it was throttled in, of how many it ran in (`cpu.stat`:
    /// `nr_throttled`, `nr_periods`); zeros without a quota.
    pub fn throttled_periods(&self) -> (u64, u64) {
        let stat = std::fs::read_to_string(self.dir.join("cpu.stat")).unwrap_or_default();
        let field = |k: &str| {
            stat.lines()
                .find_map(|l| l.strip_prefix(k)?.trim().parse().ok())
                .unwrap_or(0)
        };
        (field("nr_throttled "), field("nr_periods "))
    }
}

impl Drop for CpuCgroup {
    fn drop(&mut self) {
        // Processes still inside (one killed but not yet reaped leaves in a moment) go back to
        // the root, so that the group can be removed.
        let root_procs = self.hierarchy.root.join("cgroup.procs");
        for _ in 0..100 {
            let procs = std::fs::read_to_string(self.dir.join("cgroup.procs")).unwrap_or_default();
            for pid in procs.lines() {
                let _ = write(&root_procs, pid);
            }
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        eprintln!("cannot remove the cgroup {}", self.dir.display());
    }
}

/// Write `value` to the control file `path` in one write(2), as the kernel wants it.
fn write(path: &Path, value: &str) -> Result<(), String> {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .and_then(|mut f| f.write_all(value.as_bytes()))
        .map_err(|e| format!("cannot write {value:?} to {}: {e}", path.display()))
}
