//! Who is on the other end of a socket, from the kernel rather than from the client:
//! `SO_PEERCRED` for pid/uid/gid, `/proc/<pid>/cgroup` for the container.

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    pub pid: u32,
    pub uid: u32,
    pub gid: u32,
    /// The process's cgroup path(s) from `/proc/<pid>/cgroup`, comma-separated.
    pub cgroup: String,
}

pub fn peer(stream: &UnixStream) -> std::io::Result<Peer> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt(SO_PEERCRED) on a connected Unix socket, writing into a ucred of the
    // size given.
    let r = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut paths: Vec<String> = std::fs::read_to_string(format!("/proc/{}/cgroup", cred.pid))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.splitn(3, ':').nth(2).map(str::to_string))
        .collect();
    paths.dedup();
    let cgroup = paths.join(",");
    Ok(Peer {
        pid: cred.pid as u32,
        uid: cred.uid,
        gid: cred.gid,
        cgroup,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifies_this_process() {
        let (a, _b) = UnixStream::pair().unwrap();
        let p = peer(&a).unwrap();
        assert_eq!(p.pid, std::process::id());
        // SAFETY: getuid has no preconditions.
        assert_eq!(p.uid, unsafe { libc::getuid() });
    }
}
