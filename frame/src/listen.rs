//! The Unix socket every gpushare daemon serves on, published only once it accepts.
//!
//! `bind` creates the socket file before `listen` marks it ready, so a client that polls for the
//! file can connect in between and be refused. The socket is therefore bound and made to listen
//! under a temporary name, given its mode, and renamed into place: whoever sees `path` can
//! connect, and never sees it with a looser mode than asked.

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::path::Path;

/// Listen on `path` with permissions `mode`, creating its directory and replacing a stale
/// socket. Errors name the path that failed.
pub fn listen_at(path: &Path, mode: u32) -> io::Result<UnixListener> {
    let context = |what: &str, p: &Path, e: io::Error| {
        io::Error::new(e.kind(), format!("cannot {what} {}: {e}", p.display()))
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    std::fs::create_dir_all(dir).map_err(|e| context("create", dir, e))?;
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let staging = dir.join(format!(".{name}.{}.new", std::process::id()));
    let _ = std::fs::remove_file(&staging);
    let publish = || -> io::Result<UnixListener> {
        let listener = UnixListener::bind(&staging)?;
        std::fs::set_permissions(&staging, std::fs::Permissions::from_mode(mode))?;
        std::fs::rename(&staging, path)?;
        Ok(listener)
    };
    publish().map_err(|e| {
        let _ = std::fs::remove_file(&staging);
        context("listen on", path, e)
    })
}

/// The kernel's credentials of a connected Unix socket's peer (`SO_PEERCRED`): who is asking,
/// as the daemons take it (never from a message). One system call, so that a daemon can check
/// its connection limits before any other work.
pub fn peer_credentials(socket: &impl AsRawFd) -> io::Result<libc::ucred> {
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
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    #[test]
    fn the_socket_appears_listening_with_its_mode_over_a_stale_one() {
        let dir = tempfile_dir();
        let path = dir.join("sub").join("d.sock");
        let first = listen_at(&path, 0o600).unwrap();
        drop(first);
        // The first socket is stale now (nobody listens); a new daemon replaces it.
        let _listener = listen_at(&path, 0o666).unwrap();
        UnixStream::connect(&path).expect("connectable as soon as it exists");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o666);
        let left: Vec<_> = std::fs::read_dir(path.parent().unwrap()).unwrap().collect();
        assert_eq!(left.len(), 1, "no staging file is left behind");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn an_unusable_directory_is_named_in_the_error() {
        let e = listen_at(Path::new("/proc/self/no/such/d.sock"), 0o600).unwrap_err();
        assert!(e.to_string().contains("/proc/self/no/such"), "{e}");
    }

    fn tempfile_dir() -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("gpushare-frame-listen-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }
}
