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
    listener.set_nonblocking(true)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        accept(listener, Arc::new(page)).await
    })
}

async fn accept(listener: tokio::net::TcpListener, page: Page) -> io::Result<()> {
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
            if s.open.len() >= MAX_SCRAPERS {
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
            scrape(stream, page, asked, cancel).await;
            locked(&scrapers).open.remove(&id);
        });
    }
}

/// Serve one connection: its one request, within [`PAGE_WITHIN`] unless displaced first.
async fn scrape(
    stream: tokio::net::TcpStream,
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
        .header_read_timeout(REQUEST_WITHIN)
        .keep_alive(false);
    let conn = http.serve_connection(TokioIo::new(stream), service);
    tokio::select! {
        _ = tokio::time::timeout(PAGE_WITHIN, conn) => {}
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
    use std::io::{Read, Write};
    use std::net::TcpStream as Std;
    use std::time::Instant;

    /// A metrics server on a free loopback port serving `page`.
    fn server(page: String) -> std::net::SocketAddr {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || serve(l, move || page.clone()));
        addr
    }

    /// One request for `path`, as Prometheus makes it: the whole response, and how long it
    /// took.
    fn get(addr: std::net::SocketAddr, path: &str) -> (String, Duration) {
        let t = Instant::now();
        let mut s = Std::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").unwrap();
        let mut body = String::new();
        s.read_to_string(&mut body).unwrap();
        (body, t.elapsed())
    }

    #[test]
    fn the_page_is_at_slash_metrics_only() {
        let page = "gpushare_up 1\n".to_string();
        let addr = server(page.clone());
        let (body, _) = get(addr, "/metrics");
        assert!(body.contains(" 200 OK\r\n"), "{body:?}");
        assert!(
            body.to_ascii_lowercase().contains(&format!(
                "content-type: {}",
                crate::prometheus::CONTENT_TYPE
            )),
            "{body:?}"
        );
        assert!(body.ends_with(&page), "{body:?}");
        let (body, _) = get(addr, "/");
        assert!(body.contains(" 404 Not Found\r\n"), "{body:?}");
        assert!(!body.contains("gpushare_up"), "{body:?}");
    }

    #[test]
    fn silent_and_slow_connections_do_not_keep_a_scraper_out() {
        let page = "gpushare_up 1\n".to_string();
        let addr = server(page.clone());
        // More connections than it serves at once, silent or with half a request, and one that
        // asks for the page and never reads it (its socket buffer takes it all). Fewer than the
        // listen backlog (128): beyond it, while the server thread waits for a core, the kernel
        // drops connection attempts and the scrape's own would be retried a second later.
        let mut held: Vec<Std> = (0..MAX_SCRAPERS + 32)
            .map(|i| {
                let mut s = Std::connect(addr).unwrap();
                if i % 2 == 0 {
                    s.write_all(b"GET /metri").unwrap();
                }
                s
            })
            .collect();
        let mut unread = Std::connect(addr).unwrap();
        unread.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
        held.push(unread);
        let (body, took) = get(addr, "/metrics");
        assert!(
            body.contains(" 200 OK\r\n") && body.ends_with(&page),
            "{body:?}"
        );
        assert!(took < REQUEST_WITHIN, "the scrape took {took:?}");
        // A connection that never asks is closed once its time to ask is over.
        let mut late = Std::connect(addr).unwrap();
        late.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let t = Instant::now();
        let mut rest = Vec::new();
        let _ = late.read_to_end(&mut rest);
        let waited = t.elapsed();
        assert!(
            waited >= REQUEST_WITHIN / 2 && waited < REQUEST_WITHIN + Duration::from_secs(1),
            "closed after {waited:?}: {:?}",
            String::from_utf8_lossy(&rest)
        );
        drop(held);
    }

    #[test]
    fn a_scraper_that_stops_reading_is_cut_off_and_others_are_served_meanwhile() {
        // Larger than what the loopback socket buffers hold.
        let page = "x".repeat(32 << 20);
        let addr = server(page.clone());
        let mut stuck = Std::connect(addr).unwrap();
        stuck.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
        let (body, took) = get(addr, "/metrics");
        assert_eq!(body.len() - body.find("\r\n\r\n").unwrap() - 4, page.len());
        assert!(took < PAGE_WITHIN, "the scrape took {took:?}");
        // The stuck scraper gets part of the page, then its connection is closed.
        std::thread::sleep(PAGE_WITHIN + Duration::from_millis(500));
        stuck
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut got = Vec::new();
        let _ = stuck.read_to_end(&mut got);
        assert!(got.len() < page.len(), "{} bytes", got.len());
    }
}
