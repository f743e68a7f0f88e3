//! The daemon over its socket: config groups, hot reload, refusal of unknown clients, and
//! surviving malformed input.

use gpushare_protocol::status::Report;
use gpushare_protocol::{ClientMsg, PROTOCOL_VERSION, ServerMsg};
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A loopback port nobody listens on (for `--metrics`).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn start_with(
    dir: &Path,
    config: &str,
    dev: bool,
    extra: &[String],
) -> (Daemon, std::path::PathBuf) {
    let cfg = dir.join("config.toml");
    std::fs::write(&cfg, config).unwrap();
    let sock = dir.join("s.sock");
    let mut c = Command::new(env!("CARGO_BIN_EXE_gpushare-scheduler"));
    c.arg("--config")
        .arg(&cfg)
        .arg("--socket")
        .arg(&sock)
        .args(extra)
        .env("GPUSHARE_LOG", "error");
    if dev {
        c.arg("--dev");
    }
    let d = Daemon(c.spawn().unwrap());
    let t = Instant::now();
    while !sock.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "daemon did not start"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    (d, sock)
}

fn start(dir: &Path, config: &str, dev: bool) -> (Daemon, std::path::PathBuf) {
    start_with(dir, config, dev, &[])
}

fn connect(sock: &Path) -> UnixStream {
    let mut s = UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    gpushare_protocol::send(
        &mut s,
        &ClientMsg::Hello {
            version: PROTOCOL_VERSION,
            declared: None,
        },
    )
    .unwrap();
    s
}

fn next(s: &mut UnixStream) -> ServerMsg {
    gpushare_protocol::recv::<ServerMsg>(s, &mut Vec::new())
        .unwrap()
        .expect("a message")
}

fn status(sock: &Path) -> Report {
    let mut s = connect(sock);
    assert!(matches!(next(&mut s), ServerMsg::Welcome { .. }));
    gpushare_protocol::send(&mut s, &ClientMsg::Status).unwrap();
    match next(&mut s) {
        ServerMsg::Status { report } => *report,
        other => panic!("unexpected {other:?}"),
    }
}

fn uid() -> u32 {
    // SAFETY: getuid has no preconditions.
    unsafe { libc::getuid() }
}

#[test]
fn config_groups_and_hot_reload() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = |req: f64| {
        format!(
            "[[group]]\nname = \"me\"\nuids = [{}]\nrequest = {req}\nmemory = \"1GiB\"\n",
            uid()
        )
    };
    let port = free_port();
    let (_d, sock) = start_with(
        dir.path(),
        &cfg(0.25),
        false,
        &["--metrics".into(), format!("127.0.0.1:{port}")],
    );
    let mut s = connect(&sock);
    assert_eq!(
        next(&mut s),
        ServerMsg::Welcome {
            group: "me".into(),
            liveness_ns: 40_000_000
        },
        "the default quota plus the default grace"
    );
    let gpu = [9u8; 16];
    gpushare_protocol::send(&mut s, &ClientMsg::Acquire { gpu }).unwrap();
    let ServerMsg::Grant { token, .. } = next(&mut s) else {
        panic!("no grant")
    };
    gpushare_protocol::send(
        &mut s,
        &ClientMsg::MemReserve {
            req: 1,
            gpu,
            bytes: 2 << 30,
        },
    )
    .unwrap();
    assert!(
        matches!(next(&mut s), ServerMsg::Memory { granted: false, cap: Some(c), .. } if c == 1 << 30)
    );
    let request = |r: &Report| r.gpus[0].groups[0].request;
    assert_eq!(request(&status(&sock)), 0.25);
    let mut http = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    http.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut page = String::new();
    std::io::Read::read_to_string(&mut http, &mut page).unwrap();
    assert!(page.contains("200 OK") && page.contains(r#"gpushare_group_memory_cap_bytes{gpu="0",UUID="GPU-09090909-0909-0909-0909-090909090909",group="me"} 1073741824"#), "{page}");

    // Rewrite the config; the daemon picks it up within a few seconds.
    std::fs::write(dir.path().join("config.toml"), cfg(0.5)).unwrap();
    let t = Instant::now();
    while request(&status(&sock)) != 0.5 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "config was not reloaded"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // A broken config is reported and the previous one kept (checked after two reload periods).
    std::fs::write(dir.path().join("config.toml"), "[[group]]\nname = 3\n").unwrap();
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(request(&status(&sock)), 0.5);
    gpushare_protocol::send(
        &mut s,
        &ClientMsg::Yield {
            gpu,
            token,
            drained_ns: 1,
        },
    )
    .unwrap();
}

#[test]
fn unknown_clients_get_a_clear_error_and_garbage_drops_only_its_sender() {
    let dir = tempfile::tempdir().unwrap();
    let (_d, sock) = start(dir.path(), "", false);
    let mut s = connect(&sock);
    assert_eq!(
        next(&mut s),
        ServerMsg::Welcome {
            group: String::new(),
            liveness_ns: 40_000_000
        }
    );
    gpushare_protocol::send(&mut s, &ClientMsg::Acquire { gpu: [1; 16] }).unwrap();
    match next(&mut s) {
        ServerMsg::Error {
            message,
            fatal: true,
        } => {
            assert!(
                message.contains("no group") && message.contains("--dev"),
                "{message}"
            );
        }
        other => panic!("unexpected {other:?}"),
    }
    // Garbage, then a frame claiming 4 GiB: that client is dropped, the daemon lives on.
    for junk in [
        &b"\x05\x00\x00\x00\xff\xff\xff\xff\xff"[..],
        &[0xff, 0xff, 0xff, 0xff, 1, 2, 3][..],
    ] {
        let mut bad = UnixStream::connect(&sock).unwrap();
        bad.write_all(junk).unwrap();
        bad.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let r = gpushare_protocol::recv::<ServerMsg>(&mut bad, &mut Vec::new());
        assert!(
            matches!(
                r,
                Ok(None) | Err(_) | Ok(Some(ServerMsg::Error { fatal: true, .. }))
            ),
            "{r:?}"
        );
    }
    assert!(
        status(&sock).gpus.is_empty(),
        "the refused client created nothing"
    );
}

#[test]
fn declared_groups_need_dev_mode() {
    let dir = tempfile::tempdir().unwrap();
    let (_d, sock) = start(dir.path(), "", false);
    let mut s = UnixStream::connect(&sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let declared = gpushare_protocol::GroupSpec {
        name: "x".into(),
        request: 0.5,
        limit: 1.0,
        weight: 1.0,
        memory: None,
        latency: false,
    };
    gpushare_protocol::send(
        &mut s,
        &ClientMsg::Hello {
            version: PROTOCOL_VERSION,
            declared: Some(declared),
        },
    )
    .unwrap();
    assert!(
        matches!(next(&mut s), ServerMsg::Error { fatal: true, message } if message.contains("--dev"))
    );
}

/// The tenant socket's path removed (its directory replaced, say): the daemon binds it again
/// within a couple of seconds, new processes connect there, and the connections it had live on
/// (a probe is answered).
#[test]
fn a_removed_socket_is_bound_again_and_connections_live_on() {
    let dir = tempfile::tempdir().unwrap();
    let config = format!("[[group]]\nname = \"me\"\nuids = [{}]\n", uid());
    let (_d, sock) = start(dir.path(), &config, false);
    let mut before = connect(&sock);
    assert!(matches!(next(&mut before), ServerMsg::Welcome { .. }));
    std::fs::remove_file(&sock).unwrap();
    let t = Instant::now();
    while !sock.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "the socket was not bound again"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut after = connect(&sock);
    assert!(matches!(next(&mut after), ServerMsg::Welcome { .. }));
    let gpu = [7u8; 16];
    gpushare_protocol::send(&mut before, &ClientMsg::Probe { gpu }).unwrap();
    assert_eq!(next(&mut before), ServerMsg::Alive { gpu });
}

/// Every client gets the daemon's heartbeat page with its `Welcome`: the same sealed page,
/// mapped read-only, whose beat is when the event loop last ran (it ran to answer a probe).
#[test]
fn the_welcome_brings_the_heartbeat_page() {
    use gpushare_protocol::heartbeat::{Beats, FdReader};
    use gpushare_units::monotonic_ns;
    let dir = tempfile::tempdir().unwrap();
    let config = format!("[[group]]\nname = \"me\"\nuids = [{}]\n", uid());
    let (_d, sock) = start(dir.path(), &config, false);
    let welcome = |s: &UnixStream| {
        let mut r = FdReader::new(s);
        let msg = gpushare_protocol::recv::<ServerMsg>(&mut r, &mut Vec::new()).unwrap();
        assert!(matches!(msg, Some(ServerMsg::Welcome { .. })), "{msg:?}");
        Beats::map(&r.fd.expect("the heartbeat page")).expect("a sealed page")
    };
    let mut a = connect(&sock);
    let beats = welcome(&a);
    let b = connect(&sock);
    let also = welcome(&b);
    let asked = monotonic_ns();
    let gpu = [7u8; 16];
    gpushare_protocol::send(&mut a, &ClientMsg::Probe { gpu }).unwrap();
    assert_eq!(next(&mut a), ServerMsg::Alive { gpu });
    let beat = beats.read();
    assert!(
        beat >= asked && beat <= monotonic_ns(),
        "the loop ran to answer: beat {beat}, probe sent at {asked}"
    );
    assert_eq!(also.read(), beat, "one page for all clients");
}
