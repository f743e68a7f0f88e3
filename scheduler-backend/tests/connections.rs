//! The tenant socket's bounds (`[connections]`, docs/robustness.md#a-flood-of-connections), against the
//! real daemon binary: connections over the per-user limit are closed at once, a connection
//! must say Hello in time, a frame may not be oversized, and a peer that leaves its replies
//! unread is dropped while the others are served.

use gpushare_protocol::{ClientMsg, PROTOCOL_VERSION, ServerMsg};
use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

struct Daemon {
    child: Child,
    socket: PathBuf,
    _dir: tempfile::TempDir,
}

impl Daemon {
    fn start(config: &str) -> Daemon {
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("config.toml");
        std::fs::write(&cfg, config).unwrap();
        let socket = dir.path().join("s.sock");
        let child = Command::new(env!("CARGO_BIN_EXE_gpushare-scheduler"))
            .arg("--dev")
            .arg("--config")
            .arg(&cfg)
            .arg("--socket")
            .arg(&socket)
            .env("GPUSHARE_LOG", "warn")
            .spawn()
            .unwrap();
        let start = Instant::now();
        while !socket.exists() {
            assert!(start.elapsed() < Duration::from_secs(10), "no socket");
            std::thread::sleep(Duration::from_millis(10));
        }
        Daemon {
            child,
            socket,
            _dir: dir,
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn send(s: &mut UnixStream, msg: &ClientMsg) -> std::io::Result<()> {
    let mut frame = Vec::new();
    gpushare_protocol::encode(msg, &mut frame).unwrap();
    s.write_all(&frame)
}

/// A connection that said Hello and was welcomed.
fn client(socket: &Path) -> UnixStream {
    let mut s = UnixStream::connect(socket).unwrap();
    let hello = ClientMsg::Hello {
        version: PROTOCOL_VERSION,
        declared: None,
    };
    send(&mut s, &hello).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let reply = gpushare_protocol::recv::<ServerMsg>(&mut s, &mut Vec::new());
    assert!(
        matches!(reply, Ok(Some(ServerMsg::Welcome { .. }))),
        "{reply:?}"
    );
    s
}

/// Whether the daemon closes `s` within `timeout` (whatever it sent before is skipped).
fn closed_within(s: &mut UnixStream, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    let mut buf = [0u8; 64 << 10];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        s.set_read_timeout(Some(left)).unwrap();
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return false;
            }
            Err(_) => return true,
        }
    }
}

fn still_open(s: &mut UnixStream) -> bool {
    !closed_within(s, Duration::from_millis(100))
}

#[test]
fn connections_over_the_users_limit_are_closed_at_once() {
    let d = Daemon::start("[connections]\nmax_per_uid = 3\n");
    let mut held: Vec<UnixStream> = (0..3).map(|_| client(&d.socket)).collect();
    let mut extra = UnixStream::connect(&d.socket).unwrap();
    assert!(closed_within(&mut extra, Duration::from_secs(5)));
    assert!(held.iter_mut().all(still_open));
    drop(held.pop());
    // The closed connection's place is free again once the daemon has seen it go.
    let start = Instant::now();
    loop {
        let mut s = UnixStream::connect(&d.socket).unwrap();
        if still_open(&mut s) {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(5), "no place freed");
    }
}

#[test]
fn connections_over_the_total_limit_are_closed_at_once() {
    let d = Daemon::start("[connections]\nmax = 2\n");
    let mut held: Vec<UnixStream> = (0..2).map(|_| client(&d.socket)).collect();
    let mut extra = UnixStream::connect(&d.socket).unwrap();
    assert!(closed_within(&mut extra, Duration::from_secs(5)));
    assert!(held.iter_mut().all(still_open));
}

#[test]
fn a_connection_that_does_not_say_hello_in_time_is_closed() {
    let d = Daemon::start("[connections]\nhello_timeout = \"200ms\"\n");
    let mut silent = UnixStream::connect(&d.socket).unwrap();
    let mut half = UnixStream::connect(&d.socket).unwrap();
    half.write_all(&[3, 0]).unwrap();
    let mut greeted = client(&d.socket);
    assert!(closed_within(&mut silent, Duration::from_secs(5)));
    assert!(closed_within(&mut half, Duration::from_secs(5)));
    assert!(still_open(&mut greeted));
}

#[test]
fn an_oversized_frame_drops_only_its_connection() {
    let d = Daemon::start("");
    let mut good = client(&d.socket);
    let mut bad = client(&d.socket);
    bad.write_all(&(64u32 << 10 | 1).to_le_bytes()).unwrap();
    assert!(closed_within(&mut bad, Duration::from_secs(5)));
    send(&mut good, &ClientMsg::Status).unwrap();
    let reply = gpushare_protocol::recv::<ServerMsg>(&mut good, &mut Vec::new());
    assert!(
        matches!(reply, Ok(Some(ServerMsg::Status { .. }))),
        "{reply:?}"
    );
}

/// A peer that asks and never reads is dropped once its unread replies exceed the bound; the
/// daemon answers everyone else meanwhile.
#[test]
fn a_peer_that_does_not_read_is_dropped_and_blocks_no_one() {
    let d = Daemon::start("");
    let mut hog = client(&d.socket);
    let mut frame = Vec::new();
    gpushare_protocol::encode(&ClientMsg::Status, &mut frame).unwrap();
    let burst = frame.repeat(1000);
    hog.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut other = client(&d.socket);
    let mut dropped = false;
    for _ in 0..200 {
        if hog.write_all(&burst).is_err() {
            dropped = true;
            break;
        }
    }
    let t = Instant::now();
    send(&mut other, &ClientMsg::Status).unwrap();
    let reply = gpushare_protocol::recv::<ServerMsg>(&mut other, &mut Vec::new());
    assert!(
        matches!(reply, Ok(Some(ServerMsg::Status { .. }))),
        "{reply:?}"
    );
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "status took {:?}",
        t.elapsed()
    );
    assert!(dropped || closed_within(&mut hog, Duration::from_secs(5)));
}

/// Replies that the socket cannot take at once wait in the daemon and follow as the peer reads
/// them: a burst whose answers overflow the socket's buffer (but not the bound on unread
/// replies) is answered in full.
#[test]
fn replies_beyond_the_socket_buffer_follow_as_the_peer_reads() {
    let d = Daemon::start("");
    let mut s = client(&d.socket);
    let gpu = *b"gpushare-sim-gpu";
    let mut alive = Vec::new();
    gpushare_protocol::encode(&ServerMsg::Alive { gpu }, &mut alive).unwrap();
    // The socket holds at most its buffer's size of them (less as the daemon writes them in
    // small pieces); the daemon holds the rest, fewer than it lets a peer leave unread.
    let socket_buffer: usize = std::fs::read_to_string("/proc/sys/net/core/wmem_default")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let answers = socket_buffer + (24 << 10);
    assert!(
        answers < gpushare_scheduler::server::MAX_OUTPUT,
        "a socket buffer of {socket_buffer} bytes holds what this test would leave unread"
    );
    let n = answers / alive.len();
    let mut probe = Vec::new();
    gpushare_protocol::encode(&ClientMsg::Probe { gpu }, &mut probe).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(&probe.repeat(n)).unwrap();
    // Read once the daemon has read the whole burst and answered what its socket takes.
    std::thread::sleep(Duration::from_millis(200));
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = Vec::new();
    for i in 0..n {
        let reply = gpushare_protocol::recv::<ServerMsg>(&mut s, &mut buf);
        assert!(
            matches!(reply, Ok(Some(ServerMsg::Alive { .. }))),
            "reply {i} of {n}: {reply:?}"
        );
    }
}

/// The events the daemon's event loop handled so far, from its report.
fn loop_events(s: &mut UnixStream) -> u64 {
    send(s, &ClientMsg::Status).unwrap();
    match gpushare_protocol::recv::<ServerMsg>(s, &mut Vec::new()) {
        Ok(Some(ServerMsg::Status { report })) => report.event_loop.count,
        other => panic!("{other:?}"),
    }
}

/// A question answered costs the event loop one wake-up: the peer reading the answer does not
/// wake it again.
#[test]
fn an_answer_read_does_not_wake_the_event_loop() {
    let d = Daemon::start("");
    let mut s = client(&d.socket);
    let gpu = *b"gpushare-sim-gpu";
    let n = 60;
    let before = loop_events(&mut s);
    let mut buf = Vec::new();
    for _ in 0..n {
        send(&mut s, &ClientMsg::Probe { gpu }).unwrap();
        let reply = gpushare_protocol::recv::<ServerMsg>(&mut s, &mut buf);
        assert!(
            matches!(reply, Ok(Some(ServerMsg::Alive { .. }))),
            "{reply:?}"
        );
        // The next question comes later than the loop's reaction to this answer being read.
        std::thread::sleep(Duration::from_millis(2));
    }
    let events = loop_events(&mut s) - before;
    assert!(
        events < n + n / 2,
        "{events} events for {n} questions and a status"
    );
}
