//! The queue's HTTP side (`serve --listen ADDR`): the web page, its live updates
//! (server-sent events at `/events`) and a JSON API.
//!
//! | method and path | what | token |
//! |---|---|---|
//! | `GET /` | the web page | off loopback |
//! | `GET /events` | the page's live part, re-rendered at every change (SSE, event `live`) | off loopback |
//! | `GET /api/jobs`, `GET /api/jobs/ID` | jobs as JSON | off loopback |
//! | `GET /api/gpus` | GPUs as JSON | off loopback |
//! | `GET /api/usage` | each GPU's use by group over the last minutes (the page's plots) | off loopback |
//! | `GET /api/me` | who the token belongs to | yes |
//! | `GET /api/jobs/ID/logs` | the job's output | the owner's (or root's) |
//! | `POST /api/jobs` | submit (JSON body, below); `201 {"id": N}` | yes: the job runs as the token's user |
//! | `POST /api/jobs/ID/cancel` | cancel | the owner's (or root's) |
//!
//! A token (`gpushare token` prints the caller's) goes in `Authorization: Bearer TOKEN`, or, for
//! a `GET` only, in the cookie [`TOKEN_COOKIE`] that the web page sets: a browser following a
//! link sends no header. Errors are `{"error": "..."}` with a 4xx status; a refused request
//! changes nothing.

use crate::daemon::{self, Shared};
use crate::web;
use cookie::Cookie;
use gpushare_queue_protocol::{Demand, Submission, WaitMode};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tiny_http::{Header, Method, Request, Response, Server};

/// The cookie that carries a token from the web page (`SameSite=Strict`, honoured for `GET`
/// only: it can read, never act).
pub const TOKEN_COOKIE: &str = "gpushare_token";

/// Largest request body accepted.
const MAX_BODY: u64 = 1 << 20;

/// The body of `POST /api/jobs`. Only `cmd` is required; the rest default as in
/// `gpushare submit`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpSubmission {
    pub cmd: Vec<String>,
    pub name: Option<String>,
    pub gpus: Option<u32>,
    pub share: Option<f64>,
    pub limit: Option<f64>,
    /// A size, e.g. `"4GiB"`.
    pub memory: Option<String>,
    /// The latency class (`true`: a request server whose tail latency matters).
    #[serde(default)]
    pub latency: bool,
    #[serde(default)]
    pub prefer: Vec<u32>,
    /// `"queue"` or `"schedule"`.
    pub wait_mode: Option<String>,
    pub priority: Option<i32>,
    /// A duration, e.g. `"600s"`.
    pub timeout: Option<String>,
    pub retries: Option<u32>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    pub cwd: Option<String>,
}

impl HttpSubmission {
    pub fn into_submission(self) -> Result<Submission, String> {
        let d = Demand::default();
        let demand = Demand {
            gpus: self.gpus.unwrap_or(d.gpus),
            share: self.share.unwrap_or(d.share),
            limit: self.limit.unwrap_or(d.limit),
            memory: self
                .memory
                .as_deref()
                .map(gpushare_units::parse_size)
                .transpose()
                .map_err(|e| format!("memory: {e}"))?,
            latency: self.latency,
            prefer: self.prefer,
            wait_mode: self
                .wait_mode
                .as_deref()
                .map(str::parse::<WaitMode>)
                .transpose()?
                .unwrap_or(d.wait_mode),
            priority: self.priority.unwrap_or(d.priority),
            timeout_ns: self
                .timeout
                .as_deref()
                .map(gpushare_units::parse_duration_ns)
                .transpose()
                .map_err(|e| format!("timeout: {e}"))?,
            retries: self.retries.unwrap_or(d.retries),
        };
        Ok(Submission {
            name: self.name,
            demand,
            cmd: self.cmd,
            env: self.env.into_iter().collect(),
            cwd: self.cwd,
        })
    }
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: &'a str,
}

fn header(name: &str, value: &str) -> Header {
    Header::from_bytes(name.as_bytes(), value.as_bytes()).expect("valid header")
}

fn json<T: Serialize>(status: u16, v: &T) -> Response<std::io::Cursor<Vec<u8>>> {
    Response::from_data(serde_json::to_vec(v).expect("serialisable"))
        .with_status_code(status)
        .with_header(header("Content-Type", "application/json"))
}

fn error(status: u16, message: &str) -> Response<std::io::Cursor<Vec<u8>>> {
    json(status, &ErrorBody { error: message })
}

pub(crate) fn serve_http(sh: Arc<Shared>, server: Server) {
    for req in server.incoming_requests() {
        let s = sh.clone();
        let _ = std::thread::Builder::new()
            .name("http-request".into())
            .spawn(move || handle(&s, req));
    }
}

/// The token of a request: its `Authorization` header, else (for a `GET`) its token cookie.
fn token_of(req: &Request) -> Result<Option<String>, String> {
    let field = |name: &'static str| {
        req.headers()
            .iter()
            .filter(move |h| h.field.equiv(name))
            .map(|h| h.value.as_str())
    };
    if let Some(value) = field("Authorization").next() {
        let token = value
            .trim()
            .strip_prefix("Bearer ")
            .ok_or("Authorization must be `Bearer TOKEN`")?;
        return Ok(Some(token.trim().to_string()));
    }
    if *req.method() != Method::Get {
        return Ok(None);
    }
    Ok(field("Cookie")
        .flat_map(Cookie::split_parse)
        .filter_map(Result::ok)
        .find(|c| c.name() == TOKEN_COOKIE)
        .map(|c| c.value().trim().to_string()))
}

/// Who the request is from: `Ok(None)` without a token, `Err` with a bad one.
fn caller(sh: &Shared, req: &Request) -> Result<Option<u32>, String> {
    match token_of(req)? {
        None => Ok(None),
        Some(token) => daemon::token_user(sh, &token)
            .map(Some)
            .ok_or_else(|| "unknown token; `gpushare token` prints yours".to_string()),
    }
}

fn handle(sh: &Arc<Shared>, mut req: Request) {
    let url = req.url().to_string();
    let path: Vec<&str> = url
        .split('?')
        .next()
        .unwrap_or("")
        .split('/')
        .filter(|s| !s.is_empty())
        .collect();
    let method = req.method().clone();
    let loopback = req.remote_addr().is_some_and(|a| a.ip().is_loopback());
    let user = match caller(sh, &req) {
        Ok(u) => u,
        // The page itself says what is wrong with the token it saved.
        Err(_) if method == Method::Get && path.is_empty() => None,
        Err(e) => {
            let _ = req.respond(error(401, &e));
            return;
        }
    };
    let need_token = "this needs a token: `gpushare token` prints yours; send it as `Authorization: Bearer TOKEN`, or save it on the web page";
    // Read-only views are open on loopback; from elsewhere they need a token too.
    let view = method == Method::Get
        && matches!(
            path.as_slice(),
            [] | ["events"] | ["api", "jobs" | "gpus" | "usage"] | ["api", "jobs", _]
        );
    if view && !loopback && user.is_none() {
        let refusal = if path.is_empty() {
            // A browser: a page that asks for the token.
            Response::from_data(web::token_page().into_bytes())
                .with_status_code(401)
                .with_header(header("Content-Type", "text/html; charset=utf-8"))
        } else {
            error(401, need_token)
        };
        let _ = req.respond(refusal);
        return;
    }
    let job_id = |s: &str| s.parse::<u64>().ok();
    let response = match (&method, path.as_slice()) {
        (Method::Get, []) => {
            let page = web::page(&daemon::snapshot(&sh.lock()));
            Response::from_data(page.into_bytes())
                .with_header(header("Content-Type", "text/html; charset=utf-8"))
        }
        (Method::Get, ["events"]) => {
            events(sh, req);
            return;
        }
        (Method::Get, ["api", "jobs"]) => json(200, &daemon::views(&sh.lock())),
        (Method::Get, ["api", "gpus"]) => json(200, &daemon::snapshot(&sh.lock()).gpus),
        (Method::Get, ["api", "usage"]) => json(200, &daemon::usage(&sh.lock())),
        (Method::Get, ["api", "me"]) => match user {
            None => error(401, need_token),
            Some(uid) => json(
                200,
                &serde_json::json!({ "uid": uid, "user": crate::sys::user_by_uid(uid).map(|u| u.name) }),
            ),
        },
        (Method::Get, ["api", "jobs", id]) => {
            match job_id(id).and_then(|id| daemon::view(&sh.lock(), id)) {
                Some(v) => json(200, &v),
                None => error(404, &format!("no job {id}")),
            }
        }
        (Method::Get, ["api", "jobs", id, "logs"]) => match (user, job_id(id)) {
            (None, _) => error(401, need_token),
            (_, None) => error(404, &format!("no job {id}")),
            (Some(uid), Some(id)) => match daemon::may_read_logs(sh, uid, id) {
                Err(e) => error(403, &e),
                Ok(()) => {
                    let mut out = Vec::new();
                    loop {
                        let chunk = daemon::read_log(sh, id, out.len() as u64, 64 << 10);
                        if chunk.is_empty() {
                            break;
                        }
                        out.extend(chunk);
                    }
                    Response::from_data(out)
                        .with_header(header("Content-Type", "text/plain; charset=utf-8"))
                }
            },
        },
        (Method::Post, ["api", "jobs"]) => match user {
            None => error(401, need_token),
            Some(uid) => {
                let mut body = Vec::new();
                let read = req.as_reader().take(MAX_BODY + 1).read_to_end(&mut body);
                if read.is_err() || body.len() as u64 > MAX_BODY {
                    error(413, "the body must be a JSON object of at most 1 MiB")
                } else {
                    match serde_json::from_slice::<HttpSubmission>(&body)
                        .map_err(|e| format!("malformed job: {e}"))
                        .and_then(HttpSubmission::into_submission)
                        .and_then(|s| daemon::submit(sh, uid, s))
                    {
                        Ok(id) => json(201, &serde_json::json!({ "id": id })),
                        Err(e) => error(400, &e),
                    }
                }
            }
        },
        (Method::Post, ["api", "jobs", id, "cancel"]) => match (user, job_id(id)) {
            (None, _) => error(401, need_token),
            (_, None) => error(404, &format!("no job {id}")),
            (Some(uid), Some(id)) => match daemon::cancel(sh, uid, id) {
                Ok(v) => json(200, &v),
                Err(e) if e.starts_with("no job") => error(404, &e),
                Err(e) if e.contains("not yours") => error(403, &e),
                Err(e) => error(409, &e),
            },
        },
        (_, [] | ["events"] | ["api", "jobs" | "gpus" | "usage" | "me"] | ["api", "jobs", _]) => {
            error(
                405,
                &format!("{method} is not served at {url}; see the API table in docs/queue.md"),
            )
        }
        (_, ["api", "jobs", _, "logs" | "cancel"]) => error(
            405,
            &format!("{method} is not served at {url}; see the API table in docs/queue.md"),
        ),
        _ => error(404, &format!("nothing at {url}")),
    };
    let _ = req.respond(response);
}

/// Server-sent events: the page's live part now and after every change; a comment every 15 s
/// while nothing changes.
fn events(sh: &Shared, req: Request) {
    let mut w = req.into_writer();
    let head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nConnection: close\r\n\r\n";
    if w.write_all(head.as_bytes())
        .and_then(|_| w.flush())
        .is_err()
    {
        return;
    }
    let mut seen = 0u64;
    loop {
        let mut st = sh.lock();
        let until = Instant::now() + Duration::from_secs(15);
        while st.version == seen {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            st = sh
                .changed
                .wait_timeout(st, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        let msg = if st.version == seen {
            drop(st);
            ": still here\n\n".to_string()
        } else {
            seen = st.version;
            let snap = daemon::snapshot(&st);
            drop(st);
            let mut m = String::from("event: live\n");
            for line in web::live(&snap).lines() {
                m.push_str("data: ");
                m.push_str(line);
                m.push('\n');
            }
            m.push('\n');
            m
        };
        if w.write_all(msg.as_bytes()).and_then(|_| w.flush()).is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(body: &str) -> Result<Submission, String> {
        serde_json::from_str::<HttpSubmission>(body)
            .map_err(|e| e.to_string())
            .and_then(HttpSubmission::into_submission)
    }

    #[test]
    fn submissions_default_like_the_cli() {
        let s = parse(r#"{"cmd": ["true"]}"#).unwrap();
        assert_eq!(s.demand, Demand::default());
        let s = parse(
            r#"{"cmd": ["x"], "memory": "4GiB", "timeout": "90s", "wait_mode": "queue", "prefer": [1], "share": 0.5}"#,
        )
        .unwrap();
        assert_eq!(s.demand.memory, Some(4 << 30));
        assert_eq!(s.demand.timeout_ns, Some(90_000_000_000));
        assert_eq!(s.demand.wait_mode, WaitMode::Queue);
        assert!(!s.demand.latency);
        let s = parse(r#"{"cmd": ["serve"], "latency": true}"#).unwrap();
        assert!(s.demand.latency);
    }

    #[test]
    fn bad_bodies_say_what_is_wrong() {
        for (body, says) in [
            (r#"{"cmd": ["x"], "gpu": 2}"#, "unknown field `gpu`"),
            (
                r#"{"cmd": ["x"], "wait_mode": "later"}"#,
                "unknown wait mode",
            ),
            (r#"{"cmd": ["x"], "memory": "lots"}"#, "memory"),
            (r#"{"cmd": ["x"], "timeout": "10"}"#, "needs a unit"),
            (r#"{"name": "x"}"#, "missing field `cmd`"),
            (r#"{"cmd": ["x""#, "EOF"),
        ] {
            let e = parse(body).unwrap_err();
            assert!(e.contains(says), "{body}: {e}");
        }
    }

    /// `POST /api/jobs` bodies as a token holder might send them: a 400 or a job for the core.
    #[test]
    fn hostile_bodies_are_rejected_without_panicking() {
        let samples = [
            r#"{"cmd": ["true"]}"#,
            r#"{"cmd": ["x", "--y"], "name": "n", "gpus": 1, "share": 0.5, "limit": 0.75, "memory": "4GiB", "prefer": [1, 0], "wait_mode": "queue", "priority": -3, "timeout": "90s", "retries": 2, "env": {"A": "1"}, "cwd": "/tmp"}"#,
            r#"{"cmd": ["x"], "wait_mode": "schedule", "memory": "512MiB", "timeout": "1e3s"}"#,
        ];
        let mut admit = crate::core::tests::Admit::new();
        let n = 100_000;
        gpushare_frame::fuzz::texts(73, &samples, n, |body| match parse(body) {
            Ok(s) => {
                admit.submit(s.demand);
                true
            }
            Err(_) => false,
        })
        .assert_exercised(n);
        assert!(admit.queued > 0);
    }
}
