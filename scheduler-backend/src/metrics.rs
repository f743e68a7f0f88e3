//! The Prometheus endpoint (`--metrics ADDR`): a minimal HTTP/1.0 server with an event loop of
//! its own thread. Every request gets the metrics page. Scrapers are served side by side, each
//! given [`REQUEST_WITHIN`] to send its request and [`PAGE_WITHIN`] in all, at most
//! [`MAX_SCRAPERS`] at once: a newcomer beyond that displaces the oldest one still silent, so
//! connections that never ask cannot keep a scraper out.

use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token};
use std::collections::BTreeMap;
use std::io::{self, ErrorKind, Read, Write};
use std::time::{Duration, Instant};

/// Connections served at once.
pub const MAX_SCRAPERS: usize = 64;
/// From its connection, how long a scraper has to send its request.
pub const REQUEST_WITHIN: Duration = Duration::from_millis(500);
/// From its connection, how long a scraper has to take the whole page.
pub const PAGE_WITHIN: Duration = Duration::from_secs(2);
/// A request is read up to its blank line, or this much of it.
const MAX_REQUEST: usize = 8192;
const LISTENER: Token = Token(usize::MAX);

struct Scraper {
    stream: TcpStream,
    opened: Instant,
    /// The request read so far.
    request: Vec<u8>,
    /// Once the request is in: the response, and how much of it is written.
    response: Option<(Vec<u8>, usize)>,
}

impl Scraper {
    fn deadline(&self) -> Instant {
        let within = if self.response.is_some() {
            PAGE_WITHIN
        } else {
            REQUEST_WITHIN
        };
        self.opened + within
    }

    /// Read what the scraper sent; once its request is in, answer with `page()` and write what
    /// the socket takes. `false` when it is done with (answered, gone, or failed).
    fn progress(&mut self, page: &mut impl FnMut() -> String) -> bool {
        if self.response.is_none() {
            let mut buf = [0u8; 1024];
            let complete = loop {
                match self.stream.read(&mut buf) {
                    // The peer closed its side: answer what it asked.
                    Ok(0) => break true,
                    Ok(n) => {
                        self.request.extend_from_slice(&buf[..n]);
                        if self.request.len() >= MAX_REQUEST || ends_headers(&self.request) {
                            break true;
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break false,
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(_) => return false,
                }
            };
            if !complete {
                return true;
            }
        }
        let (out, sent) = self.response.get_or_insert_with(|| (response(&page()), 0));
        while *sent < out.len() {
            match self.stream.write(&out[*sent..]) {
                Ok(0) => return false,
                Ok(n) => *sent += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return true,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return false,
            }
        }
        false
    }
}

/// Whether `request` holds a whole request head (its blank line).
fn ends_headers(request: &[u8]) -> bool {
    request.windows(4).any(|w| w == b"\r\n\r\n") || request.windows(2).any(|w| w == b"\n\n")
}

fn response(body: &str) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.0 200 OK\r\nContent-Type: {}\r\nContent-Length: {}\r\n\r\n",
        crate::prometheus::CONTENT_TYPE,
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body.as_bytes());
    out
}

/// Serve `page()` to every scraper that connects to `listener`, for ever (errors are only the
/// event loop's own).
pub fn serve(listener: std::net::TcpListener, mut page: impl FnMut() -> String) -> io::Result<()> {
    listener.set_nonblocking(true)?;
    let mut listener = TcpListener::from_std(listener);
    let mut poll = Poll::new()?;
    poll.registry()
        .register(&mut listener, LISTENER, Interest::READABLE)?;
    let mut events = Events::with_capacity(256);
    let mut scrapers: BTreeMap<usize, Scraper> = BTreeMap::new();
    let mut next = 0usize;
    loop {
        let timeout = (scrapers.values().map(Scraper::deadline).min())
            .map(|d| d.saturating_duration_since(Instant::now()));
        match poll.poll(&mut events, timeout) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
        for event in events.iter() {
            if event.token() == LISTENER {
                accept(&listener, &poll, &mut scrapers, &mut next);
                continue;
            }
            let t = event.token().0;
            if let Some(s) = scrapers.get_mut(&t)
                && !s.progress(&mut page)
            {
                close(&poll, &mut scrapers, t);
            }
        }
        let now = Instant::now();
        let expired: Vec<usize> = (scrapers.iter())
            .filter(|(_, s)| s.deadline() <= now)
            .map(|(&t, _)| t)
            .collect();
        for t in expired {
            close(&poll, &mut scrapers, t);
        }
    }
}

/// Take every waiting connection; beyond [`MAX_SCRAPERS`], each displaces the oldest scraper
/// that has not sent its request yet (or is refused, if all have).
fn accept(
    listener: &TcpListener,
    poll: &Poll,
    scrapers: &mut BTreeMap<usize, Scraper>,
    next: &mut usize,
) {
    loop {
        let mut stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            // WouldBlock, or out of file descriptors: the rest wait in the backlog.
            Err(_) => return,
        };
        if scrapers.len() >= MAX_SCRAPERS {
            let silent = (scrapers.iter())
                .filter(|(_, s)| s.response.is_none())
                .min_by_key(|(_, s)| s.opened)
                .map(|(&t, _)| t);
            match silent {
                Some(t) => close(poll, scrapers, t),
                None => continue,
            }
        }
        let t = *next;
        *next = (*next + 1) % LISTENER.0;
        let interest = Interest::READABLE | Interest::WRITABLE;
        if poll
            .registry()
            .register(&mut stream, Token(t), interest)
            .is_ok()
        {
            let opened = Instant::now();
            let (request, response) = (Vec::new(), None);
            scrapers.insert(
                t,
                Scraper {
                    stream,
                    opened,
                    request,
                    response,
                },
            );
        }
    }
}

fn close(poll: &Poll, scrapers: &mut BTreeMap<usize, Scraper>, t: usize) {
    if let Some(mut s) = scrapers.remove(&t) {
        let _ = poll.registry().deregister(&mut s.stream);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpStream as Std;

    /// A metrics server on a free loopback port serving `page`.
    fn server(page: String) -> std::net::SocketAddr {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || serve(l, move || page.clone()));
        addr
    }

    /// One scrape, as Prometheus makes it: the whole response, and how long it took.
    fn scrape(addr: std::net::SocketAddr) -> (String, Duration) {
        let t = Instant::now();
        let mut s = Std::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut body = String::new();
        s.read_to_string(&mut body).unwrap();
        (body, t.elapsed())
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
        unread.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        held.push(unread);
        let (body, took) = scrape(addr);
        assert!(
            body.starts_with("HTTP/1.0 200 OK\r\n") && body.ends_with(&page),
            "{body:?}"
        );
        assert!(took < Duration::from_secs(1), "the scrape took {took:?}");
        // A connection that never asks is closed once its time to ask is over.
        let mut late = Std::connect(addr).unwrap();
        late.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let t = Instant::now();
        let mut rest = Vec::new();
        let _ = late.read_to_end(&mut rest);
        let waited = t.elapsed();
        assert!(rest.is_empty(), "{rest:?}");
        assert!(
            waited >= REQUEST_WITHIN / 2 && waited < REQUEST_WITHIN + Duration::from_secs(1),
            "closed after {waited:?}"
        );
        drop(held);
    }

    #[test]
    fn a_scraper_that_stops_reading_is_cut_off_and_others_are_served_meanwhile() {
        // Larger than what the loopback socket buffers hold.
        let page = "x".repeat(32 << 20);
        let addr = server(page.clone());
        let mut stuck = Std::connect(addr).unwrap();
        stuck.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        let (body, took) = scrape(addr);
        assert_eq!(body.len() - body.find("\r\n\r\n").unwrap() - 4, page.len());
        assert!(took < Duration::from_secs(2), "the scrape took {took:?}");
        // The stuck scraper gets part of the page, then its connection is closed.
        std::thread::sleep(PAGE_WITHIN + Duration::from_millis(500));
        stuck
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut got = Vec::new();
        let _ = stuck.read_to_end(&mut got);
        assert!(got.len() < page.len(), "{} bytes", got.len());
    }

    #[test]
    fn a_request_head_ends_at_its_blank_line() {
        assert!(ends_headers(b"GET / HTTP/1.0\r\nHost: a\r\n\r\n"));
        assert!(ends_headers(b"GET / HTTP/1.0\n\n"));
        assert!(!ends_headers(b"GET / HTTP/1.0\r\nHost: a\r\n"));
    }
}
