//! A daemon's heartbeat, published once for all its clients: a page of shared memory (a memfd)
//! holding one `u64`, the `CLOCK_MONOTONIC` time (ns) the daemon's event loop last ran. The
//! daemon writes it through its own mapping ([`Publisher`]) and passes a read-only descriptor of
//! the page to each client with the first message on its connection ([`send_with_fd`]); a
//! client reads that descriptor ([`FdReader`]) and maps the page read-only ([`Beats`]).
//!
//! The page is sealed before it is passed: it cannot shrink (a read past its end would kill the
//! reader with `SIGBUS`), grow, or be written through any other descriptor or any new mapping
//! (a client cannot forge the daemon's heartbeat for the others), and the seals cannot change.
//! A client maps only a page that carries those seals. The descriptor a client gets is opened
//! read-only besides, so that no client can write the page, map it writable or punch a hole in
//! it whatever the seals allow.

use std::io::{self, Read};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

/// The bytes of the page that are read: one `u64` at its start.
const LEN: usize = std::mem::size_of::<u64>();
/// The seals a page must carry to be mapped.
const SEALS: libc::c_int =
    libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_FUTURE_WRITE | libc::F_SEAL_SEAL;

/// The daemon's side: the page, mapped writable, and a read-only descriptor of it for the
/// clients.
#[derive(Debug)]
pub struct Publisher {
    fd: OwnedFd,
    /// The page opened again read-only: what is passed to clients.
    shared: OwnedFd,
    beat: NonNull<AtomicU64>,
}

// SAFETY: the mapping is shared memory accessed only through the atomic it holds.
unsafe impl Send for Publisher {}

impl Publisher {
    /// A new page, sealed, its heartbeat 0 (never ran). Fails on kernels without memfd seals
    /// for future writes (before Linux 5.1).
    pub fn new() -> io::Result<Publisher> {
        let name = c"gpushare-heartbeat";
        // SAFETY: memfd_create with a NUL-terminated name; the descriptor is owned from here.
        let fd = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a new descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let size = page_size();
        // SAFETY: ftruncate on our own memfd.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let shared = reopen_read_only(&fd)?;
        // Our memfd is `size` bytes long; unmapped on drop.
        let beat = map_shared(&fd, size, libc::PROT_READ | libc::PROT_WRITE)?;
        let publisher = Publisher { fd, shared, beat };
        // After the writable mapping: the future-write seal keeps it, and forbids any other.
        // SAFETY: fcntl(F_ADD_SEALS) on our own memfd, no pointers.
        if unsafe { libc::fcntl(publisher.fd.as_raw_fd(), libc::F_ADD_SEALS, SEALS) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(publisher)
    }

    /// The event loop runs at `now_ns`.
    pub fn beat(&self, now_ns: u64) {
        // SAFETY: the mapping lives as long as `self` and is page-aligned.
        unsafe { self.beat.as_ref() }.store(now_ns, Ordering::Release);
    }

    /// The page's read-only descriptor, to pass to clients.
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.shared.as_fd()
    }
}

/// A new shared mapping of the first `len` bytes of `fd`, which the caller has made sure the
/// file holds for as long as the mapping lives; the caller unmaps it.
fn map_shared(fd: &OwnedFd, len: usize, prot: libc::c_int) -> io::Result<NonNull<AtomicU64>> {
    // SAFETY: a new mapping at an address the kernel chooses, of a descriptor we hold; checked
    // for failure below.
    let at = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            prot,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if at == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    NonNull::new(at.cast::<AtomicU64>()).ok_or_else(|| io::Error::other("mapped at null"))
}

/// `fd` opened again, read-only (a new open file description of the same memfd, through
/// `/proc/self/fd`).
fn reopen_read_only(fd: &OwnedFd) -> io::Result<OwnedFd> {
    let path = format!("/proc/self/fd/{}\0", fd.as_raw_fd());
    // SAFETY: open with a NUL-terminated path; the descriptor is owned from here.
    let ro = unsafe { libc::open(path.as_ptr().cast(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if ro < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `ro` is a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(ro) })
}

impl Drop for Publisher {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, of that size, used by nothing after this.
        unsafe { libc::munmap(self.beat.as_ptr().cast(), page_size()) };
    }
}

/// A client's side: the page mapped read-only.
#[derive(Debug)]
pub struct Beats {
    beat: NonNull<AtomicU64>,
}

// SAFETY: as for `Publisher`: shared memory read only through its atomic.
unsafe impl Send for Beats {}
// SAFETY: as above.
unsafe impl Sync for Beats {}

impl Beats {
    /// Map the page `fd` names, read-only: only one sealed as [`Publisher`] seals it (else an
    /// error), so that reading it can never fault.
    pub fn map(fd: &OwnedFd) -> io::Result<Beats> {
        // SAFETY: fcntl(F_GET_SEALS) and fstat on a descriptor we own, into a local stat.
        let (seals, size) = unsafe {
            let seals = libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS);
            let mut st: libc::stat = std::mem::zeroed();
            let ok = libc::fstat(fd.as_raw_fd(), &mut st) == 0;
            (seals, if ok { st.st_size } else { -1 })
        };
        if seals < 0 || seals & SEALS != SEALS {
            return Err(io::Error::other("not a sealed heartbeat page"));
        }
        if size < LEN as libc::off_t {
            return Err(io::Error::other("a heartbeat page too small"));
        }
        // The first LEN bytes of a file that cannot shrink, read-only; unmapped on drop.
        let beat = map_shared(fd, LEN, libc::PROT_READ)?;
        Ok(Beats { beat })
    }

    /// When the daemon's event loop last ran (`CLOCK_MONOTONIC` ns; 0: not yet).
    pub fn read(&self) -> u64 {
        // SAFETY: the mapping lives as long as `self`, page-aligned, of a file that cannot
        // shrink; an atomic load only reads it.
        unsafe { self.beat.as_ref() }.load(Ordering::Acquire)
    }
}

impl Drop for Beats {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, of that size, used by nothing after this.
        unsafe { libc::munmap(self.beat.as_ptr().cast(), LEN) };
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf takes no pointers.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(n).unwrap_or(4096).max(LEN)
}

/// Room for one control message: 64 bytes, up to twelve descriptors on 64-bit Linux
/// (`CMSG_SPACE(12 · 4)`); a message with more is cut short (`MSG_CTRUNC`).
type Control = [u64; 8];

/// Write what `socket` takes of `bytes` now, without blocking, passing `fd` with them
/// (`SCM_RIGHTS`); the count written. A closed peer is an error, not `SIGPIPE`.
pub fn send_with_fd(
    socket: &impl AsRawFd,
    bytes: &[u8],
    fd: std::os::fd::BorrowedFd<'_>,
) -> io::Result<usize> {
    let mut control: Control = [0; 8];
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // SAFETY: msghdr zeroed, then pointed at live locals: one iovec over `bytes`, and a control
    // buffer with room for one descriptor's message (CMSG_SPACE(4) ≤ 64 bytes), filled through
    // the CMSG macros within it.
    let n = unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = libc::CMSG_SPACE(size_of::<libc::c_int>() as u32) as _;
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(size_of::<libc::c_int>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>(), fd.as_raw_fd());
        libc::sendmsg(
            socket.as_raw_fd(),
            &msg,
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Reads a Unix stream socket, keeping the first descriptor passed with what it reads (others
/// are closed): for the first message on a connection, which may bring the daemon's heartbeat.
/// Descriptors whose control message was cut short (`MSG_CTRUNC`: out of descriptors, or more
/// than [`Control`] holds) are all closed: no page.
#[derive(Debug)]
pub struct FdReader<'a, S: AsRawFd> {
    socket: &'a S,
    /// The descriptor received, if one was.
    pub fd: Option<OwnedFd>,
}

impl<'a, S: AsRawFd> FdReader<'a, S> {
    pub fn new(socket: &'a S) -> FdReader<'a, S> {
        FdReader { socket, fd: None }
    }
}

impl<S: AsRawFd> Read for FdReader<'_, S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let mut control: Control = [0; 8];
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // SAFETY: msghdr zeroed, then pointed at live locals: one iovec over `buf` and the
        // control buffer, of their sizes. Received descriptors are close-on-exec.
        let (n, msg) = unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = size_of::<Control>() as _;
            let n = libc::recvmsg(self.socket.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC);
            (n, msg)
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let truncated = msg.msg_flags & libc::MSG_CTRUNC != 0;
        // SAFETY: walking the control messages the kernel wrote into `control` (msg points at
        // it, msg_controllen says how much) with the CMSG macros; each SCM_RIGHTS message's
        // data holds (cmsg_len - CMSG_LEN(0)) / 4 descriptors, now ours.
        unsafe {
            let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
            while !cmsg.is_null() {
                if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(cmsg).cast::<libc::c_int>();
                    let bytes =
                        ((*cmsg).cmsg_len as usize).saturating_sub(libc::CMSG_LEN(0) as usize);
                    for i in 0..bytes / size_of::<libc::c_int>() {
                        let fd = OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i)));
                        if self.fd.is_none() && !truncated {
                            self.fd = Some(fd);
                        }
                    }
                }
                cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
            }
        }
        Ok(n as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::net::UnixStream;

    /// A page passed over a socket with the bytes it came with is mapped read-only by the
    /// reader, which sees every beat; a plain read of the same bytes loses nothing but the page.
    #[test]
    fn a_page_passed_with_a_message_shows_the_beats() {
        let p = Publisher::new().expect("a heartbeat page");
        let (a, b) = UnixStream::pair().unwrap();
        assert_eq!(send_with_fd(&a, b"welcome", p.fd()).unwrap(), 7);
        (&a).write_all(b"next").unwrap();
        let mut r = FdReader::new(&b);
        let mut got = [0u8; 11];
        r.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"welcomenext");
        let beats = Beats::map(r.fd.as_ref().expect("the page")).expect("mapped");
        assert_eq!(beats.read(), 0);
        p.beat(12_345);
        assert_eq!(beats.read(), 12_345);
        drop(p);
        assert_eq!(beats.read(), 12_345, "the page outlives its publisher");

        let p = Publisher::new().unwrap();
        send_with_fd(&a, b"x", p.fd()).unwrap();
        let mut one = [0u8; 1];
        (&b).read_exact(&mut one).unwrap();
        assert_eq!(&one, b"x");
    }

    /// A client cannot write the page (through its descriptor, by mapping it writable, or by
    /// making a read-only mapping writable), shrink it, punch a hole in it, or lift the seals;
    /// its descriptor is read-only; an unsealed memfd is not mapped.
    #[test]
    fn the_page_is_sealed_against_clients() {
        let p = Publisher::new().unwrap();
        let fd = p.fd().try_clone_to_owned().unwrap();
        let raw = fd.as_raw_fd();
        // SAFETY: system calls on a descriptor we own, with live local buffers; the read-only
        // mapping made here is unmapped before the block ends.
        unsafe {
            assert_eq!(
                libc::fcntl(raw, libc::F_GETFL) & libc::O_ACCMODE,
                libc::O_RDONLY
            );
            assert_eq!(libc::pwrite(raw, [1u8; 8].as_ptr().cast(), 8, 0), -1);
            assert_eq!(libc::ftruncate(raw, 0), -1);
            let hole = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
            assert_eq!(libc::fallocate(raw, hole, 0, 8), -1, "a hole punched");
            let r = libc::mmap(
                std::ptr::null_mut(),
                8,
                libc::PROT_READ,
                libc::MAP_SHARED,
                raw,
                0,
            );
            assert_ne!(r, libc::MAP_FAILED);
            let page = page_size();
            let rw = libc::PROT_READ | libc::PROT_WRITE;
            assert_eq!(libc::mprotect(r, page, rw), -1, "made writable");
            libc::munmap(r, page);
            let w = libc::mmap(
                std::ptr::null_mut(),
                8,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                raw,
                0,
            );
            assert_eq!(w, libc::MAP_FAILED, "mapped writable");
            assert_eq!(libc::fcntl(raw, libc::F_ADD_SEALS, 0), -1);
        }
        assert!(Beats::map(&fd).is_ok());

        // SAFETY: memfd_create with a NUL-terminated name, no pointers kept.
        let raw = unsafe { libc::memfd_create(c"x".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0, "memfd_create: {}", io::Error::last_os_error());
        // SAFETY: a new descriptor nothing else owns.
        let plain = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: ftruncate on our own memfd.
        assert_eq!(unsafe { libc::ftruncate(plain.as_raw_fd(), 4096) }, 0);
        assert!(Beats::map(&plain).is_err(), "an unsealed page");
    }

    /// A control message cut short (more descriptors than [`Control`] holds) brings no page:
    /// the bytes are read, the descriptors that came are closed.
    #[test]
    fn a_control_message_cut_short_brings_no_page() {
        // SAFETY: CMSG_SPACE takes no pointers.
        let space = |n: usize| unsafe { libc::CMSG_SPACE((n * size_of::<libc::c_int>()) as u32) };
        assert!(space(12) as usize <= size_of::<Control>());
        let too_many = (1..)
            .find(|&n| space(n) as usize > size_of::<Control>())
            .unwrap();
        let p = Publisher::new().unwrap();
        let (a, b) = UnixStream::pair().unwrap();
        let fds = vec![p.fd().as_raw_fd(); too_many];
        let mut control = vec![0u64; 64];
        let mut iov = libc::iovec {
            iov_base: b"w".as_ptr() as *mut libc::c_void,
            iov_len: 1,
        };
        // SAFETY: as in `send_with_fd`, with a control buffer of 512 bytes, room for the
        // message of `too_many` descriptors.
        let n = unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = space(too_many) as _;
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN((too_many * size_of::<libc::c_int>()) as u32) as _;
            let data = libc::CMSG_DATA(cmsg).cast::<libc::c_int>();
            for (i, fd) in fds.iter().enumerate() {
                std::ptr::write_unaligned(data.add(i), *fd);
            }
            libc::sendmsg(a.as_raw_fd(), &msg, 0)
        };
        assert_eq!(n, 1, "sendmsg: {}", io::Error::last_os_error());
        let mut r = FdReader::new(&b);
        let mut got = [0u8; 1];
        r.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"w");
        assert!(r.fd.is_none(), "a page from a control message cut short");
    }
}
