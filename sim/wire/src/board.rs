//! The event board: memory shared by the device process and one client, where the device posts
//! each event record's completion time as soon as it is decided. A real GPU writes event
//! completion into host-visible memory that `cuEventQuery` reads, without waking any host
//! thread; a message per record would cost the client's receive thread a wake-up per event.
//!
//! The board is a file mapped by both sides: one 16-byte slot per live event object, holding the
//! generation of its latest decided record (0: none) and that record's completion time. The
//! driver gives each record of an event a new generation, so it never mistakes an earlier
//! record's time for the current one's.

use std::fs::OpenOptions;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering, fence};

const SLOT_BYTES: usize = 16;

/// A mapped event board.
pub struct EventBoard {
    base: *mut AtomicU64,
    slots: u32,
}

// SAFETY: the mapping lives as long as the board, and every access is atomic.
unsafe impl Send for EventBoard {}
// SAFETY: as above.
unsafe impl Sync for EventBoard {}

impl EventBoard {
    /// Create (or truncate) the board file at `path` with `slots` slots and map it. The file
    /// is readable and writable by its owner only; `for_uid` makes it usable by that user (the
    /// client's, which may differ from the device's, as any user may use a GPU): the file is
    /// given to that user, or, where the device may not give files away (it does not run as
    /// root), opened to all users, as `/dev/nvidia*` are.
    pub fn create(path: &Path, slots: u32, for_uid: Option<u32>) -> std::io::Result<EventBoard> {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        let _ = std::fs::remove_file(path);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)?;
        file.set_len(slots as u64 * SLOT_BYTES as u64)?;
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        if let Some(uid) = for_uid.filter(|&u| u != me) {
            // SAFETY: fchown on a file descriptor this function owns; -1 keeps the group.
            let given = unsafe { libc::fchown(file.as_raw_fd(), uid, u32::MAX) } == 0;
            if !given {
                file.set_permissions(std::fs::Permissions::from_mode(0o666))?;
            }
        }
        Self::map(&file, slots)
    }

    /// Map the board another process created at `path`.
    pub fn open(path: &Path, slots: u32) -> std::io::Result<EventBoard> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        if file.metadata()?.len() < slots as u64 * SLOT_BYTES as u64 {
            return Err(std::io::Error::other("event board shorter than announced"));
        }
        Self::map(&file, slots)
    }

    fn map(file: &std::fs::File, slots: u32) -> std::io::Result<EventBoard> {
        use std::os::fd::AsRawFd;
        let len = slots as usize * SLOT_BYTES;
        // SAFETY: a fresh shared mapping of `len` bytes of an open file; checked for failure.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len.max(1),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(EventBoard {
            base: p as *mut AtomicU64,
            slots,
        })
    }

    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// The slot's two words (generation, completion time); `None` out of range.
    fn slot(&self, slot: u32) -> Option<(&AtomicU64, &AtomicU64)> {
        if slot >= self.slots {
            return None;
        }
        // SAFETY: in range of the mapping, 8-byte aligned (page-aligned base, 16-byte slots).
        unsafe {
            let s = self.base.add(2 * slot as usize);
            Some((&*s, &*s.add(1)))
        }
    }

    /// Device side: record generation `generation` of `slot` completes at `end_ns`.
    pub fn post(&self, slot: u32, generation: u64, end_ns: u64) {
        if let Some((g, end)) = self.slot(slot) {
            // Invalidate, write the time, then publish: a reader never pairs a generation with
            // another record's time.
            g.store(0, Ordering::Relaxed);
            fence(Ordering::Release);
            end.store(end_ns, Ordering::Relaxed);
            g.store(generation, Ordering::Release);
        }
    }

    /// Client side: when record generation `generation` of `slot` completes, once decided.
    pub fn read(&self, slot: u32, generation: u64) -> Option<u64> {
        let (g, end) = self.slot(slot)?;
        if g.load(Ordering::Acquire) != generation {
            return None;
        }
        let t = end.load(Ordering::Relaxed);
        fence(Ordering::Acquire);
        (g.load(Ordering::Relaxed) == generation).then_some(t)
    }
}

impl Drop for EventBoard {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `map`.
        unsafe {
            libc::munmap(
                self.base as *mut libc::c_void,
                self.slots as usize * SLOT_BYTES,
            )
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_posted_time_is_read_for_its_generation_only() {
        let dir = std::env::temp_dir().join(format!("board-test-{}", std::process::id()));
        let device = EventBoard::create(&dir, 8, None).unwrap();
        let client = EventBoard::open(&dir, 8).unwrap();
        assert_eq!(client.read(3, 1), None, "nothing posted yet");
        device.post(3, 1, 1234);
        assert_eq!(client.read(3, 1), Some(1234));
        assert_eq!(client.read(3, 2), None, "a later record is not done yet");
        device.post(3, 2, 5678);
        assert_eq!(client.read(3, 2), Some(5678));
        assert_eq!(
            client.read(3, 1),
            None,
            "an earlier record's generation is gone"
        );
        assert_eq!(client.read(8, 1), None, "out of range");
        device.post(8, 1, 1);
        assert!(EventBoard::open(&dir, 9).is_err(), "shorter than announced");
        std::fs::remove_file(&dir).unwrap();
    }
}
