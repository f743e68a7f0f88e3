//! Which processes on this node use the GPU driver without the hook talking to this scheduler:
//! an image whose glibc is older than the hook's baseline (the loader skips the preload), one
//! that clears `LD_PRELOAD`, a statically linked program — each runs ungated and uncapped, and
//! nothing else would say so. Read from `/proc`: a process that maps the CUDA driver
//! (`libcuda.so…`) and has no connection here. A process that maps the hook too but has not
//! connected yet (it connects at its first launch or allocation) is listed as such.
//!
//! Seen only where the daemon sees processes: every process of the node from the host's pid
//! namespace (the DaemonSet runs with `hostPID`), and only maps it may read (as root: all).
//! Reading `/proc` takes time on a busy node: the daemon takes the census on a thread of its own.

use gpushare_protocol::status::Unhooked;
use std::collections::HashSet;
use std::path::Path;

/// How often the daemon takes the census.
pub const EVERY: std::time::Duration = std::time::Duration::from_secs(2);

/// What the maps of one process say: (maps the driver, maps the hook).
fn libraries(maps: &str) -> (bool, bool) {
    let mut driver = false;
    let mut hook = false;
    for line in maps.lines() {
        let Some(path) = line.split_whitespace().nth(5) else {
            continue;
        };
        let name = path.rsplit('/').next().unwrap_or(path);
        driver |= name.starts_with("libcuda.so");
        hook |= name.starts_with("libgpushare.so");
    }
    (driver, hook)
}

/// The processes under `proc_root` (normally `/proc`) that map the driver, except those in
/// `connected` and `own` (this daemon), by pid.
pub fn take(proc_root: &Path, connected: &HashSet<u32>, own: u32) -> Vec<Unhooked> {
    let Ok(dir) = std::fs::read_dir(proc_root) else {
        return Vec::new();
    };
    let mut found: Vec<Unhooked> = dir
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| *pid != own && !connected.contains(pid))
        .filter_map(|pid| {
            let maps = std::fs::read_to_string(proc_root.join(format!("{pid}/maps"))).ok()?;
            let (driver, hook_loaded) = libraries(&maps);
            driver.then(|| Unhooked {
                pid,
                command: std::fs::read_to_string(proc_root.join(format!("{pid}/comm")))
                    .map(|c| c.trim_end().to_string())
                    .unwrap_or_default(),
                hook_loaded,
            })
        })
        .collect();
    found.sort_by_key(|u| u.pid);
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn process(root: &Path, pid: u32, comm: &str, libs: &[&str]) {
        let dir = root.join(pid.to_string());
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("comm"), format!("{comm}\n")).unwrap();
        let maps: String = libs
            .iter()
            .map(|l| format!("7f0000000000-7f0000001000 r-xp 00000000 08:01 1234 {l}\n"))
            .collect();
        std::fs::write(
            dir.join("maps"),
            format!("{maps}7ffd0000-7ffd1000 rw-p 00000000 00:00 0 [stack]\n"),
        )
        .unwrap();
    }

    #[test]
    fn lists_driver_users_without_a_connection() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        process(
            r,
            10,
            "python3",
            &["/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.14"],
        );
        process(
            r,
            11,
            "trainer",
            &["/opt/gpushare/libgpushare.so", "/usr/lib/libcuda.so.1"],
        );
        process(
            r,
            12,
            "served",
            &["/opt/gpushare/libgpushare.so", "/usr/lib/libcuda.so.1"],
        );
        process(r, 13, "bash", &["/usr/lib/x86_64-linux-gnu/libc.so.6"]);
        process(r, 14, "gpushare-sched", &["/usr/lib/libcuda.so.1"]);
        std::fs::create_dir_all(r.join("self")).unwrap();
        let found = take(r, &HashSet::from([12]), 14);
        assert_eq!(
            found,
            vec![
                Unhooked {
                    pid: 10,
                    command: "python3".into(),
                    hook_loaded: false
                },
                Unhooked {
                    pid: 11,
                    command: "trainer".into(),
                    hook_loaded: true
                },
            ]
        );
    }
}
