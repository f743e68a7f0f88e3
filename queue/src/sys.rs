//! The operating-system calls the daemon needs that std does not wrap (the queue's FFI layer):
//! the user database, a child's switch to its user before `exec`, and signals to process
//! groups.

use std::ffi::{CStr, CString};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

/// An account from the user database.
#[derive(Debug, Clone, PartialEq)]
pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: String,
    pub shell: String,
}

/// The account of `uid`, if the user database has one.
pub fn user_by_uid(uid: u32) -> Option<User> {
    let mut size = 1024usize;
    loop {
        let mut buf = vec![0 as libc::c_char; size];
        // SAFETY: all-zero is a valid `passwd` (null pointers, zero ids); it is only read after
        // getpwuid_r filled it in.
        let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
        let mut result: *mut libc::passwd = std::ptr::null_mut();
        // SAFETY: out-pointers to a live passwd and result, a buffer of `size` bytes.
        let rc = unsafe { libc::getpwuid_r(uid, &mut pw, buf.as_mut_ptr(), size, &mut result) };
        if rc == libc::ERANGE && size < 1 << 20 {
            size *= 4;
            continue;
        }
        if rc != 0 || result.is_null() {
            return None;
        }
        let text = |p: *const libc::c_char| {
            if p.is_null() {
                String::new()
            } else {
                // SAFETY: getpwuid_r points these into `buf` (alive here) as NUL-terminated text.
                unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
            }
        };
        return Some(User {
            name: text(pw.pw_name),
            uid: pw.pw_uid,
            gid: pw.pw_gid,
            home: text(pw.pw_dir),
            shell: text(pw.pw_shell),
        });
    }
}

/// The groups `user` belongs to (its primary group first), as a login would set them.
pub fn groups_of(user: &User) -> Vec<u32> {
    let Ok(name) = CString::new(user.name.clone()) else {
        return vec![user.gid];
    };
    let mut n: libc::c_int = 32;
    loop {
        let mut groups = vec![0 as libc::gid_t; n as usize];
        let mut count = n;
        // SAFETY: a NUL-terminated name, a buffer of `count` gids and its length.
        let rc =
            unsafe { libc::getgrouplist(name.as_ptr(), user.gid, groups.as_mut_ptr(), &mut count) };
        if rc >= 0 {
            groups.truncate(count.max(0) as usize);
            return groups;
        }
        if count <= n || n >= 1 << 16 {
            return vec![user.gid];
        }
        n = count;
    }
}

/// This process's effective uid.
pub fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

/// Make `cmd`'s child run as `uid`/`gid` with supplementary `groups`, in `cwd` (or `home`, or
/// `/`, whichever it may enter as that user). Identity changes need root; a daemon that is not
/// root only ever runs its own user's jobs and changes nothing but the directory.
pub fn run_as(cmd: &mut Command, uid: u32, gid: u32, groups: &[u32], cwd: &Path, home: &Path) {
    let switch = euid() == 0;
    let groups: Vec<libc::gid_t> = groups.to_vec();
    let dirs: Vec<CString> = [cwd, home, Path::new("/")]
        .iter()
        .filter_map(|p| CString::new(p.as_os_str().as_bytes()).ok())
        .collect();
    let hook = move || -> std::io::Result<()> {
        if switch {
            // SAFETY: plain syscalls on prepared data (async-signal-safe, as the child of a
            // fork must be): groups first, then gid, then uid, after which root is gone.
            unsafe {
                if libc::setgroups(groups.len(), groups.as_ptr()) != 0
                    || libc::setgid(gid) != 0
                    || libc::setuid(uid) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
            }
        }
        for d in &dirs {
            // SAFETY: chdir on a NUL-terminated path.
            if unsafe { libc::chdir(d.as_ptr()) } == 0 {
                return Ok(());
            }
        }
        Err(std::io::Error::last_os_error())
    };
    // SAFETY: the hook runs between fork and exec and makes only async-signal-safe syscalls on
    // data prepared before the fork; it allocates nothing.
    unsafe { cmd.pre_exec(hook) };
}

/// Send `signal` to process group `pgid`; false if there is no such group.
pub fn signal_group(pgid: u32, signal: i32) -> bool {
    if pgid == 0 || pgid > i32::MAX as u32 {
        return false;
    }
    // SAFETY: kill(2) with a negative pid signals that process group; no memory involved.
    unsafe { libc::kill(-(pgid as i32), signal) == 0 }
}

/// Whether process `pid` exists (and is not a zombie) with start time `start` (clock ticks
/// since boot, as in `/proc/<pid>/stat`): a recycled pid does not count.
pub fn alive_since(pid: u32, start: u64) -> bool {
    proc_stat(pid).is_some_and(|(state, t)| state != 'Z' && t == start)
}

/// Start time of process `pid` (clock ticks since boot).
pub fn start_time(pid: u32) -> Option<u64> {
    proc_stat(pid).map(|(_, t)| t)
}

/// State letter and start time from `/proc/<pid>/stat`.
fn proc_stat(pid: u32) -> Option<(char, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may contain anything: fields follow the last ')'.
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    // `state` is field 3; starttime is field 22.
    let start = fields.nth(18)?.parse().ok()?;
    Some((state, start))
}

/// Whether process group `pgid` still has a member.
pub fn group_alive(pgid: u32) -> bool {
    signal_group(pgid, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_users_account_and_groups() {
        let me = user_by_uid(euid()).expect("the running user has an account");
        assert_eq!(me.uid, euid());
        let groups = groups_of(&me);
        assert!(groups.contains(&me.gid));
    }

    #[test]
    fn this_process_is_alive_since_its_start() {
        let pid = std::process::id();
        let t = start_time(pid).unwrap();
        assert!(alive_since(pid, t));
        assert!(!alive_since(pid, t + 1));
    }
}
