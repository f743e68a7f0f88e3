//! The queue's state in SQLite: every job (queued, running, finished) and the users' HTTP
//! tokens. Each change is one committed transaction (WAL, synchronous=FULL), so a daemon killed
//! at any moment restarts with every job it had acknowledged.

use crate::core::Job;
use rusqlite::{Connection, OptionalExtension, params};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// What the daemon knows about a job besides its scheduling state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobMeta {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub user: String,
    pub cmd: Vec<String>,
    pub env: Vec<(String, String)>,
    pub cwd: Option<String>,
    /// The supervisor (`gpushare-queue shim`) of the current run, with its start time.
    pub shim_pid: Option<u32>,
    pub shim_start: Option<u64>,
    /// The job's process (and process group).
    pub pid: Option<u32>,
    /// Last change of state, ns since the epoch.
    pub updated_ns: u64,
    /// Why the last run could not start.
    pub error: Option<String>,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredJob {
    pub job: Job,
    pub meta: JobMeta,
}

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("database {path}: {error}; check the --db path and its permissions")]
    Open {
        path: String,
        error: rusqlite::Error,
    },
    #[error("database: {0}")]
    Sql(#[from] rusqlite::Error),
    #[error("database holds a job record this version cannot read (job {id}): {error}")]
    Decode { id: i64, error: serde_json::Error },
}

pub struct Db {
    conn: Connection,
}

impl Db {
    pub fn open(path: &Path) -> Result<Db, DbError> {
        let open = |error| DbError::Open {
            path: path.display().to_string(),
            error,
        };
        let conn = Connection::open(path).map_err(open)?;
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(open)?;
        conn.pragma_update(None, "synchronous", "FULL")
            .map_err(open)?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS jobs (
                 id INTEGER PRIMARY KEY,
                 finished INTEGER NOT NULL,
                 body TEXT NOT NULL
             );
             CREATE TABLE IF NOT EXISTS tokens (
                 uid INTEGER PRIMARY KEY,
                 token TEXT NOT NULL UNIQUE
             );",
        )
        .map_err(open)?;
        Ok(Db { conn })
    }

    /// Every job, oldest first.
    pub fn jobs(&self) -> Result<Vec<StoredJob>, DbError> {
        let mut stmt = self.conn.prepare("SELECT id, body FROM jobs ORDER BY id")?;
        let rows = stmt.query_map([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?)))?;
        let mut out = Vec::new();
        for row in rows {
            let (id, body) = row?;
            out.push(serde_json::from_str(&body).map_err(|error| DbError::Decode { id, error })?);
        }
        Ok(out)
    }

    /// Write these jobs in one transaction.
    pub fn save(&mut self, jobs: &[&StoredJob]) -> Result<(), DbError> {
        let tx = self.conn.transaction()?;
        for s in jobs {
            let body = serde_json::to_string(s).expect("a job record serialises");
            let finished = matches!(s.job.state, crate::core::JobState::Finished { .. });
            tx.execute(
                "INSERT INTO jobs (id, finished, body) VALUES (?1, ?2, ?3)
                 ON CONFLICT(id) DO UPDATE SET finished = ?2, body = ?3",
                params![s.job.id as i64, finished, body],
            )?;
        }
        tx.commit()?;
        Ok(())
    }

    /// The user whose token this is.
    pub fn token_user(&self, token: &str) -> Result<Option<u32>, DbError> {
        Ok(self
            .conn
            .query_row("SELECT uid FROM tokens WHERE token = ?1", [token], |r| {
                r.get::<_, u32>(0)
            })
            .optional()?)
    }

    /// `uid`'s token: the one it has, or `fresh` (stored) if it has none or `renew`.
    pub fn token(&self, uid: u32, renew: bool, fresh: &str) -> Result<String, DbError> {
        if !renew
            && let Some(t) = self
                .conn
                .query_row("SELECT token FROM tokens WHERE uid = ?1", [uid], |r| {
                    r.get::<_, String>(0)
                })
                .optional()?
        {
            return Ok(t);
        }
        self.conn.execute(
            "INSERT INTO tokens (uid, token) VALUES (?1, ?2)
             ON CONFLICT(uid) DO UPDATE SET token = ?2",
            params![uid, fresh],
        )?;
        Ok(fresh.to_string())
    }
}
