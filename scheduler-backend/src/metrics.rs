//! The Prometheus endpoint (`--metrics ADDR`): hyper's HTTP/1 server on a single-threaded
//! runtime of the metrics thread; `GET /metrics` gets the page. Scrapers are served side by
//! side, one request per connection, each given [`REQUEST_WITHIN`] to send its request head and
//! [`PAGE_WITHIN`] in all, at most [`MAX_SCRAPERS`] at once: a newcomer beyond that displaces
//! the oldest connection that has not asked yet (or is refused, if all have), so connections
//! that never ask cannot keep a scraper out.

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::CONTENT_TYPE;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;

/// Connections served at once.
pub const MAX_SCRAPERS: usize = 64;
/// From its connection, how long a scraper has to send its request head.
pub const REQUEST_WITHIN: Duration = Duration::from_millis(500);
/// From its connection, how long a scraper has to take the whole page.
pub const PAGE_WITHIN: Duration = Duration::from_secs(2);

/// How many scrapers are served at once, and for how long each.
#[derive(Clone, Copy, Debug)]
struct Limits {
    scrapers: usize,
    request_within: Duration,
    page_within: Duration,
}

/// The endpoint's limits: [`MAX_SCRAPERS`], [`REQUEST_WITHIN`], [`PAGE_WITHIN`].
const LIMITS: Limits = Limits {
    scrapers: MAX_SCRAPERS,
    request_within: REQUEST_WITHIN,
    page_within: PAGE_WITHIN,
};

type Page = Arc<dyn Fn() -> String + Send + Sync>;

/// One connection being served.
struct Scraper {
    /// Its request head is in.
    asked: Arc<AtomicBool>,
    /// Told to end it, when displaced.
    cancel: Arc<Notify>,
}

/// The connections being served, by arrival.
#[derive(Default)]
struct Scrapers {
    next: u64,
    open: BTreeMap<u64, Scraper>,
}

fn locked(s: &Mutex<Scrapers>) -> std::sync::MutexGuard<'_, Scrapers> {
    s.lock().unwrap_or_else(|e| e.into_inner())
}

/// Serve `page()` at `/metrics` to every scraper that connects to `listener`, for ever (errors
/// are only the runtime's own).
pub fn serve(
    listener: std::net::TcpListener,
    page: impl Fn() -> String + Send + Sync + 'static,
) -> io::Result<()> {
    serve_within(listener, LIMITS, page)
}

/// [`serve`], with `limits`.
fn serve_within(
    listener: std::net::TcpListener,
    limits: Limits,
    page: impl Fn() -> String + Send + Sync + 'static,
) -> io::Result<()> {
    listener.set_nonblocking(true)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        accept(listener, limits, Arc::new(page)).await
    })
}

async fn accept(listener: tokio::net::TcpListener, limits: Limits, page: Page) -> io::Result<()> {
    let scrapers = Arc::new(Mutex::new(Scrapers::default()));
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            // Out of file descriptors, say: the rest wait in the backlog a moment.
            Err(e) => {
                tracing::debug!("metrics endpoint cannot accept: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let (id, asked, cancel) = {
            let mut s = locked(&scrapers);
            if s.open.len() >= limits.scrapers {
                let silent = (s.open.iter())
                    .find(|(_, c)| !c.asked.load(Ordering::Relaxed))
                    .map(|(&id, _)| id);
                match silent.and_then(|id| s.open.remove(&id)) {
                    Some(oldest) => oldest.cancel.notify_one(),
                    None => continue,
                }
            }
            let id = s.next;
            s.next += 1;
            let c = Scraper {
                asked: Arc::default(),
                cancel: Arc::default(),
            };
            let out = (id, c.asked.clone(), c.cancel.clone());
            s.open.insert(id, c);
            out
        };
        let (page, scrapers) = (page.clone(), scrapers.clone());
        tokio::spawn(async move {
            scrape(stream, limits, page, asked, cancel).await;
            locked(&scrapers).open.remove(&id);
        });
    }
}

/// Serve one connection: its one request, within the page's time unless displaced first.
async fn scrape(
    stream: tokio::net::TcpStream,
    limits: Limits,
    page: Page,
    asked: Arc<AtomicBool>,
    cancel: Arc<Notify>,
) {
    let service = service_fn(move |req: Request<Incoming>| {
        asked.store(true, Ordering::Relaxed);
        let page = page.clone();
        async move { Ok::<_, Infallible>(respond(&req, &*page)) }
    });
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.request_within)
        .keep_alive(false);
    let conn = http.serve_connection(TokioIo::new(stream), service);
    tokio::select! {
        _ = tokio::time::timeout(limits.page_within, conn) => {}
        _ = cancel.notified() => {}
    }
}

fn respond(req: &Request<Incoming>, page: &dyn Fn() -> String) -> Response<Full<Bytes>> {
    let (status, content_type, body) = if req.uri().path() == "/metrics" {
        (StatusCode::OK, crate::prometheus::CONTENT_TYPE, page())
    } else {
        let text = "not found: the metrics are at /metrics\n";
        (
            StatusCode::NOT_FOUND,
            "text/plain; charset=utf-8",
            text.to_string(),
        )
    };
    Response::builder()
        .status(status)
        .header(CONTENT_TYPE, content_type)
        .body(Full::new(Bytes::from(body)))
        .unwrap_or_else(|_| Response::new(Full::default()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{ErrorKind, Read, Write};
    use std::net::TcpStream as Std;

    /// Longer than any test: a limit that is never reached.
    const NEVER: Duration = Duration::from_secs(3600);
    /// The endpoint's limits with no time limit in reach: a connection is closed only when it is
    /// served or displaced.
    const PATIENT: Limits = Limits {
        request_within: NEVER,
        page_within: NEVER,
        ..LIMITS
    };
    /// How long a test client waits for a reply or a close before the test fails rather than
    /// hangs (a broken server may never send either).
    const HANG: Duration = Duration::from_secs(20);
    /// Larger than what the loopback socket buffers hold, so that a scraper who does not read
    /// keeps its connection busy.
    const BIG: usize = 32 << 20;

    /// A metrics server with `limits` on a free loopback port serving `page`.
    fn server(limits: Limits, page: String) -> std::net::SocketAddr {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || serve_within(l, limits, move || page.clone()));
        addr
    }

    fn connect(addr: std::net::SocketAddr) -> Std {
        let s = Std::connect(addr).unwrap();
        s.set_read_timeout(Some(HANG)).unwrap();
        s
    }

    /// Everything the server sends on `s` until it closes the connection.
    fn rest(mut s: Std) -> Vec<u8> {
        let mut got = Vec::new();
        match s.read_to_end(&mut got) {
            Ok(_) => {}
            // Closed with part of a request unread.
            Err(e) if e.kind() == ErrorKind::ConnectionReset => {}
            Err(e) => panic!("not closed: {e} after {} bytes", got.len()),
        }
        got
    }

    /// Whether the server still holds `s` open, having sent nothing on it.
    fn open_and_silent(s: &Std) -> bool {
        s.set_nonblocking(true).unwrap();
        let r = (&*s).read(&mut [0; 1]);
        s.set_nonblocking(false).unwrap();
        matches!(r, Err(e) if e.kind() == ErrorKind::WouldBlock)
    }

    /// One request for `path`, as Prometheus makes it: the whole response.
    fn get(addr: std::net::SocketAddr, path: &str) -> String {
        let mut s = connect(addr);
        write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").unwrap();
        String::from_utf8(rest(s)).unwrap()
    }

    /// The body of `response`, which must be a 200.
    fn body(response: &str) -> &str {
        let (head, body) = response.split_once("\r\n\r\n").unwrap_or((response, ""));
        assert!(head.starts_with("HTTP/1.0 200 OK\r\n"), "{head:?}");
        body
    }

    #[test]
    fn the_page_is_at_slash_metrics_only() {
        let page = "gpushare_up 1\n".to_string();
        let addr = server(PATIENT, page.clone());
        let response = get(addr, "/metrics");
        assert!(
            response.to_ascii_lowercase().contains(&format!(
                "content-type: {}",
                crate::prometheus::CONTENT_TYPE
            )),
            "{response:?}"
        );
        assert_eq!(body(&response), page);
        let response = get(addr, "/");
        assert!(response.contains(" 404 Not Found\r\n"), "{response:?}");
        assert!(!response.contains("gpushare_up"), "{response:?}");
    }

    #[test]
    fn a_scraper_beyond_the_limit_displaces_the_oldest_connection_that_has_not_asked() {
        // No connection is ever closed for its time here: only displacement makes room.
        let page = "x".repeat(BIG);
        let addr = server(PATIENT, page.clone());
        // First one that asks for the page and does not read it: it keeps its place.
        let mut asked = connect(addr);
        asked.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
        // Its page has begun: the server has its request.
        let mut first = [0; 1];
        asked.read_exact(&mut first).unwrap();
        // Then more than the limit, silent or with half a request. Fewer than the listen
        // backlog (128), which the kernel would otherwise overflow while the server thread
        // waits for a core.
        let silent: Vec<Std> = (0..MAX_SCRAPERS + 32)
            .map(|i| {
                let mut s = connect(addr);
                if i % 2 == 0 {
                    s.write_all(b"GET /metri").unwrap();
                }
                s
            })
            .collect();
        let response = get(addr, "/metrics");
        assert_eq!(body(&response).len(), page.len());
        // Each newcomer beyond the limit, the scrape included, displaced the oldest silent one.
        let displaced = 1 + silent.len() + 1 - MAX_SCRAPERS;
        let mut silent = silent.into_iter();
        for (i, s) in silent.by_ref().take(displaced).enumerate() {
            let got = rest(s);
            assert!(got.is_empty(), "silent connection {i} was sent {got:?}");
        }
        for (i, s) in silent.enumerate() {
            assert!(
                open_and_silent(&s),
                "silent connection {} is closed",
                displaced + i
            );
        }
        // The one that asked first was never displaced: it gets the whole page.
        let response = [&first[..], &rest(asked)].concat();
        assert_eq!(
            body(&String::from_utf8(response).unwrap()).len(),
            page.len()
        );
    }

    #[test]
    fn a_connection_that_does_not_send_its_request_in_time_is_closed() {
        let page = "gpushare_up 1\n".to_string();
        let patient = server(PATIENT, page.clone());
        let strict = server(
            Limits {
                request_within: Duration::from_millis(50),
                page_within: NEVER,
                ..LIMITS
            },
            page.clone(),
        );
        // Silent, and with half a request, on each server; the patient server's first.
        let half = |addr| {
            let mut s = connect(addr);
            s.write_all(b"GET /metri").unwrap();
            s
        };
        let kept = [connect(patient), half(patient)];
        let cut = [connect(strict), half(strict)];
        // The strict server closes both once their time to ask is over (nothing else closes
        // them: the page's time never ends, and no one displaces them) ...
        for s in cut {
            let got = rest(s);
            assert!(got.is_empty(), "{got:?}");
        }
        // ... while the patient one, which took them earlier, still holds its own open.
        for s in &kept {
            assert!(open_and_silent(s));
        }
    }

    #[test]
    fn a_scraper_that_stops_reading_does_not_hold_up_the_others() {
        let page = "x".repeat(BIG);
        let addr = server(PATIENT, page.clone());
        let mut stuck = connect(addr);
        stuck.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
        // The stuck scraper cannot have its page (it does not read, and the page outgrows
        // the socket buffers), and no time runs out: the other is served meanwhile.
        assert_eq!(body(&get(addr, "/metrics")).len(), page.len());
        assert_eq!(
            body(&String::from_utf8(rest(stuck)).unwrap()).len(),
            page.len()
        );
    }

    #[test]
    fn a_scraper_that_stops_reading_is_cut_off_once_the_page_time_is_over() {
        let page = "x".repeat(BIG);
        let limits = Limits {
            request_within: NEVER,
            // Long enough for the stuck scraper to send its request on a busy machine.
            page_within: Duration::from_millis(500),
            ..LIMITS
        };
        let addr = server(limits, page.clone());
        let mut stuck = connect(addr);
        stuck.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
        // Its page has begun: the server has its request.
        stuck.read_exact(&mut [0; 1]).unwrap();
        // Silent connections, each taken once the one before was closed for its time: the
        // first one's time is over no sooner than the stuck scraper's, so the second one's
        // begins after the server has seen that.
        for _ in 0..2 {
            assert!(rest(connect(addr)).is_empty());
        }
        // It gets part of the page, then its connection is closed.
        let got = rest(stuck);
        assert!(got.len() < page.len(), "{} bytes", got.len());
    }
}
