//! The job queue's Unix-socket protocol (`gpushare submit / jobs / cancel / logs / token` ↔
//! `gpushare-queue serve`) and the client the CLI uses, apart from the queue daemon so that the
//! CLI builds without it. Frames from [`gpushare_frame`]; the first request is
//! [`Request::Hello`]. Who is asking is taken from the socket (`SO_PEERCRED`), never from a
//! message.

use gpushare_frame::WireError;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

pub const QUEUE_PROTOCOL_VERSION: u32 = 2;
/// Environment variable naming the queue's socket.
pub const QUEUE_SOCKET_ENV: &str = "GPUSHARE_QUEUE_SOCKET";
/// Where the queue listens when `GPUSHARE_QUEUE_SOCKET` is not set.
pub const DEFAULT_QUEUE_SOCKET: &str = "/run/gpushare/queue.sock";

/// `$GPUSHARE_QUEUE_SOCKET`, or the default.
pub fn queue_socket() -> PathBuf {
    std::env::var_os(QUEUE_SOCKET_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| DEFAULT_QUEUE_SOCKET.into())
}

/// What a job with preferred GPUs does while they cannot take it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum WaitMode {
    /// Wait for the preferred GPUs.
    Queue,
    /// Take any GPU that can take the job.
    #[default]
    Schedule,
}

impl WaitMode {
    pub fn name(self) -> &'static str {
        match self {
            WaitMode::Queue => "queue",
            WaitMode::Schedule => "schedule",
        }
    }
}

impl fmt::Display for WaitMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for WaitMode {
    type Err = String;
    fn from_str(s: &str) -> Result<WaitMode, String> {
        match s {
            "queue" => Ok(WaitMode::Queue),
            "schedule" => Ok(WaitMode::Schedule),
            _ => Err(format!("unknown wait mode {s:?}; use queue or schedule")),
        }
    }
}

/// What a job asks for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Demand {
    /// Number of GPUs, all started at once.
    pub gpus: u32,
    /// Guaranteed share of each GPU (0..=1; 1 is a whole GPU).
    pub share: f64,
    /// Cap on the share of each GPU (share..=1).
    pub limit: f64,
    /// GPU memory cap on each GPU, bytes.
    pub memory: Option<u64>,
    /// The latency class (`gpushare run --latency`): a request server whose tail latency
    /// matters. (Absent from job records written before the class existed: standard.)
    #[serde(default)]
    pub latency: bool,
    /// Preferred GPUs (indices), most preferred first.
    pub prefer: Vec<u32>,
    pub wait_mode: WaitMode,
    /// The submitter's priority p (higher first under `aging` and `shares`).
    pub priority: i32,
    /// Killed after this much entitled running time.
    pub timeout_ns: Option<u64>,
    /// Runs again after a failure (or a lost process) up to this many times.
    pub retries: u32,
}

impl Default for Demand {
    /// One whole GPU, anywhere, no memory cap, the standard class, priority 0, no timeout, no
    /// retry.
    fn default() -> Self {
        Demand {
            gpus: 1,
            share: 1.0,
            limit: 1.0,
            memory: None,
            latency: false,
            prefer: Vec::new(),
            wait_mode: WaitMode::Schedule,
            priority: 0,
            timeout_ns: None,
            retries: 0,
        }
    }
}

/// A job as submitted: what it asks for and what to run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Submission {
    pub name: Option<String>,
    pub demand: Demand,
    pub cmd: Vec<String>,
    /// Extra environment for the job.
    pub env: Vec<(String, String)>,
    /// Working directory (default: the user's home).
    pub cwd: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Request {
    Hello {
        version: u32,
    },
    Submit(Submission),
    Jobs,
    Cancel {
        id: u64,
    },
    /// The job's output; with `follow`, until the job has finished.
    Logs {
        id: u64,
        follow: bool,
    },
    /// The caller's token for the HTTP API (made on first use; `renew` replaces it).
    Token {
        renew: bool,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Response {
    Welcome,
    Submitted {
        id: u64,
    },
    Jobs(Vec<JobView>),
    Cancelled(JobView),
    LogChunk(Vec<u8>),
    /// The end of the output; the job as it is then.
    LogEnd(JobView),
    Token(String),
    Error(String),
}

/// A job as users see it (`gpushare jobs`, the HTTP API, the web page).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobView {
    pub id: u64,
    pub name: String,
    pub user: String,
    pub uid: u32,
    /// `queued`, `running`, `killing`, `succeeded`, `failed`, `timed out`, `cancelled`, `lost`.
    pub state: String,
    /// Place in the queue (1 = next), while queued.
    pub queue_position: Option<u32>,
    pub demand: Demand,
    /// GPUs in use (or used by the last run).
    pub gpus: Vec<u32>,
    pub pid: Option<u32>,
    pub runs: u32,
    pub submitted_unix: f64,
    pub started_unix: Option<f64>,
    pub ended_unix: Option<f64>,
    /// Last change of state.
    pub updated_unix: f64,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    /// Why it could not start, if so.
    pub error: Option<String>,
    pub cmd: Vec<String>,
}

impl JobView {
    pub fn finished(&self) -> bool {
        !matches!(self.state.as_str(), "queued" | "running" | "killing")
    }

    /// What `gpushare submit --attach` exits with: the job's code; 128+N for a signal; 124 for
    /// a timeout (as `timeout(1)`); 125 if it was cancelled, could not start or was lost.
    pub fn exit_status(&self) -> u8 {
        match (self.state.as_str(), self.exit_code, self.signal) {
            ("timed out", _, _) => 124,
            ("succeeded", _, _) => 0,
            ("failed", Some(c), _) => c.clamp(0, 255) as u8,
            ("failed", None, Some(s)) => (128 + s).clamp(0, 255) as u8,
            _ => 125,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(
        "cannot reach gpushare-queue at {path}: {error}; is it running? (set {QUEUE_SOCKET_ENV} if it listens elsewhere)"
    )]
    Connect { path: String, error: std::io::Error },
    #[error("talking to gpushare-queue: {0}")]
    Wire(#[from] WireError),
    #[error("gpushare-queue closed the connection")]
    Closed,
    #[error("{0}")]
    Refused(String),
    #[error("unexpected answer from gpushare-queue: {0:?}")]
    Unexpected(Box<Response>),
}

/// A connection to the queue.
pub struct QueueClient {
    stream: UnixStream,
    buf: Vec<u8>,
}

impl QueueClient {
    pub fn connect(path: &Path) -> Result<QueueClient, ClientError> {
        let stream = UnixStream::connect(path).map_err(|error| ClientError::Connect {
            path: path.display().to_string(),
            error,
        })?;
        let mut c = QueueClient {
            stream,
            buf: Vec::new(),
        };
        match c.call(&Request::Hello {
            version: QUEUE_PROTOCOL_VERSION,
        })? {
            Response::Welcome => Ok(c),
            other => Err(ClientError::Unexpected(Box::new(other))),
        }
    }

    fn send(&mut self, req: &Request) -> Result<(), ClientError> {
        gpushare_frame::send(&mut self.stream, req)?;
        Ok(())
    }

    /// The next response; a [`Response::Error`] becomes [`ClientError::Refused`].
    pub fn recv(&mut self) -> Result<Response, ClientError> {
        match gpushare_frame::recv::<Response>(&mut self.stream, &mut self.buf)? {
            Some(Response::Error(m)) => Err(ClientError::Refused(m)),
            Some(r) => Ok(r),
            None => Err(ClientError::Closed),
        }
    }

    fn call(&mut self, req: &Request) -> Result<Response, ClientError> {
        self.stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .ok();
        self.send(req)?;
        self.recv()
    }

    pub fn submit(&mut self, s: Submission) -> Result<u64, ClientError> {
        match self.call(&Request::Submit(s))? {
            Response::Submitted { id } => Ok(id),
            other => Err(ClientError::Unexpected(Box::new(other))),
        }
    }

    pub fn jobs(&mut self) -> Result<Vec<JobView>, ClientError> {
        match self.call(&Request::Jobs)? {
            Response::Jobs(j) => Ok(j),
            other => Err(ClientError::Unexpected(Box::new(other))),
        }
    }

    pub fn cancel(&mut self, id: u64) -> Result<JobView, ClientError> {
        match self.call(&Request::Cancel { id })? {
            Response::Cancelled(j) => Ok(j),
            other => Err(ClientError::Unexpected(Box::new(other))),
        }
    }

    pub fn token(&mut self, renew: bool) -> Result<String, ClientError> {
        match self.call(&Request::Token { renew })? {
            Response::Token(t) => Ok(t),
            other => Err(ClientError::Unexpected(Box::new(other))),
        }
    }

    /// Write the job's output to `out` as it comes; returns the job once the output ended
    /// (with `follow`: once the job finished).
    pub fn logs(
        &mut self,
        id: u64,
        follow: bool,
        out: &mut impl std::io::Write,
    ) -> Result<JobView, ClientError> {
        self.stream.set_read_timeout(None).ok();
        self.send(&Request::Logs { id, follow })?;
        loop {
            match self.recv()? {
                Response::LogChunk(bytes) => {
                    // The reader may have gone (a closed pipe): keep draining quietly.
                    let _ = out.write_all(&bytes).and_then(|_| out.flush());
                }
                Response::LogEnd(job) => return Ok(job),
                other => return Err(ClientError::Unexpected(Box::new(other))),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_frame::fuzz;

    /// Job records kept from before the latency class read as standard.
    #[test]
    fn a_demand_without_the_class_is_standard() {
        let d: Demand = serde_json::from_str(
            r#"{"gpus": 1, "share": 0.5, "limit": 1.0, "memory": null, "prefer": [],
                "wait_mode": "schedule", "priority": 0, "timeout_ns": null, "retries": 0}"#,
        )
        .unwrap();
        assert_eq!(
            d,
            Demand {
                share: 0.5,
                ..Demand::default()
            }
        );
    }

    #[test]
    fn responses_round_trip_and_hostile_ones_are_rejected() {
        let job = JobView {
            id: 1,
            name: "train".into(),
            user: "u".into(),
            uid: 1000,
            state: "running".into(),
            queue_position: Some(1),
            demand: Demand {
                gpus: 1,
                share: 0.5,
                limit: 0.8,
                memory: Some(4 << 30),
                latency: true,
                prefer: vec![1, 0],
                wait_mode: WaitMode::Queue,
                priority: -2,
                timeout_ns: Some(600_000_000_000),
                retries: 1,
            },
            gpus: vec![0],
            pid: Some(42),
            runs: 1,
            submitted_unix: 1.5,
            started_unix: Some(2.5),
            ended_unix: None,
            updated_unix: 2.5,
            exit_code: Some(1),
            signal: None,
            error: None,
            cmd: vec!["true".into()],
        };
        let samples = [
            Response::Welcome,
            Response::Submitted { id: 1 },
            Response::Jobs(vec![job.clone(), job.clone()]),
            Response::Cancelled(job.clone()),
            Response::LogChunk(b"step 1\n".to_vec()),
            Response::LogEnd(job),
            Response::Token("t0k3n".into()),
            Response::Error("no".into()),
        ];
        let n = 100_000;
        fuzz::frames(72, &samples, n, |_| {}).assert_exercised(n);
    }
}
