//! The queue's web page, rendered on the server: the GPUs with their shares and memory, the
//! working queue (queued and running jobs) and the finished queue. The page replaces its live
//! part with each server-sent event from `/events`; no build step, no framework.

use crate::daemon::{JOB_GROUP_PREFIX, State, views};
use gpushare_queue_protocol::JobView;
use serde::Serialize;
use std::fmt::Write;

/// One GPU for the page and `GET /api/gpus`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuView {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub memory_total: u64,
    /// In use by every tenant, from the scheduler's books.
    pub memory_used: u64,
    /// Shares guaranteed to the queue's jobs running here.
    pub queue_share: f64,
    /// Shares guaranteed to the scheduler's other tenants here.
    pub others_request: f64,
    /// Share of GPU time each group got lately (the scheduler's window), by group.
    pub achieved: Vec<(String, f64)>,
    /// The queue's jobs running here.
    pub jobs: Vec<u64>,
}

/// Everything the page shows, taken at one instant.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Snapshot {
    pub policy: String,
    pub gpus: Vec<GpuView>,
    pub jobs: Vec<JobView>,
    /// Why the scheduler's books could not be read, if so.
    pub books_error: Option<String>,
}

pub(crate) fn snapshot(st: &State) -> Snapshot {
    let books = st.books.as_ref().ok();
    let gpus = st
        .gpus
        .iter()
        .zip(st.core.loads())
        .map(|(g, load)| {
            let report = books.and_then(|r| r.gpus.iter().find(|x| x.uuid == g.uuid));
            GpuView {
                index: g.index,
                uuid: g.uuid.clone(),
                name: g.name.clone(),
                memory_total: g.memory,
                memory_used: load.memory_used(),
                queue_share: st.core.on_gpu(g.index).fold(0.0, |s, j| s + j.demand.share),
                others_request: load.foreign_request,
                achieved: report
                    .map(|r| {
                        r.groups
                            .iter()
                            .filter(|x| x.achieved_share > 0.0005)
                            .map(|x| (x.name.clone(), x.achieved_share))
                            .collect()
                    })
                    .unwrap_or_default(),
                jobs: st.core.on_gpu(g.index).map(|j| j.id).collect(),
            }
        })
        .collect();
    Snapshot {
        policy: st.core.config().policy.to_string(),
        gpus,
        jobs: views(st),
        books_error: st.books.as_ref().err().cloned(),
    }
}

fn esc(s: &str) -> String {
    s.chars()
        .map(|c| match c {
            '&' => "&amp;".into(),
            '<' => "&lt;".into(),
            '>' => "&gt;".into(),
            '"' => "&quot;".into(),
            '\'' => "&#39;".into(),
            c => c.to_string(),
        })
        .collect()
}

/// `YYYY-MM-DD HH:MM:SS` (UTC) of seconds since the epoch.
pub fn utc(unix_s: f64) -> String {
    let secs = unix_s.max(0.0) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

fn gpu_list(g: &[u32]) -> String {
    if g.is_empty() {
        "-".into()
    } else {
        g.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
    }
}

fn timeout(j: &JobView) -> String {
    j.demand
        .timeout_ns
        .map_or("-".into(), |t| format!("{:.0} s", t as f64 / 1e9))
}

fn exit(j: &JobView) -> String {
    match (j.exit_code, j.signal, &j.error) {
        (Some(c), _, _) => format!("exit {c}"),
        (None, Some(s), _) => format!("signal {s}"),
        (None, None, Some(e)) => esc(e),
        _ => "-".into(),
    }
}

/// The part of the page that live updates replace.
pub fn live(s: &Snapshot) -> String {
    let mut o = String::new();
    if let Some(e) = &s.books_error {
        let _ = writeln!(o, "<p class=\"warn\">scheduler: {}</p>", esc(e));
    }
    let _ = writeln!(
        o,
        "<h2>GPUs</h2>\n<table id=\"gpus\"><tr><th>GPU</th><th>name</th><th>queue share</th><th>others' requests</th><th>memory used</th><th>jobs</th><th>GPU time lately</th></tr>"
    );
    for g in &s.gpus {
        let achieved: Vec<String> = g
            .achieved
            .iter()
            .map(|(n, a)| {
                let n = n
                    .strip_prefix(JOB_GROUP_PREFIX)
                    .map_or(n.clone(), |id| format!("job {id}"));
                format!("{} {:.2}", esc(&n), a)
            })
            .collect();
        let jobs: Vec<String> = g.jobs.iter().map(u64::to_string).collect();
        let _ = writeln!(
            o,
            "<tr id=\"gpu-{}\"><td title=\"{}\">{}</td><td>{}</td><td>{:.2}</td><td>{:.2}</td><td>{} / {}</td><td>{}</td><td>{}</td></tr>",
            g.index,
            esc(&g.uuid),
            g.index,
            esc(&g.name),
            g.queue_share,
            g.others_request,
            gib(g.memory_used),
            gib(g.memory_total),
            if jobs.is_empty() {
                "-".into()
            } else {
                jobs.join(", ")
            },
            if achieved.is_empty() {
                "-".into()
            } else {
                achieved.join(", ")
            }
        );
    }
    o.push_str("</table>\n");

    let mut working: Vec<&JobView> = s.jobs.iter().filter(|j| !j.finished()).collect();
    working.sort_by_key(|j| (j.queue_position.unwrap_or(0), j.id));
    let _ = writeln!(
        o,
        "<h2>Working queue</h2>\n<table id=\"working\"><tr><th>#</th><th>status</th><th>ID</th><th>name</th><th>user</th><th>mode</th><th>GPU scope</th><th>GPUs asked</th><th>GPUs in use</th><th>share</th><th>timeout</th><th>registered</th><th>last update</th></tr>"
    );
    for j in working {
        let scope = if j.demand.prefer.is_empty() {
            "any".into()
        } else {
            gpu_list(&j.demand.prefer)
        };
        let _ = writeln!(
            o,
            "<tr id=\"job-{id}\" data-state=\"{st}\"><td>{pos}</td><td>{st}</td><td>{id}</td><td>{name}</td><td>{user}</td><td>{mode}</td><td>{scope}</td><td>{k}</td><td>{inuse}</td><td>{share:.2}</td><td>{timeout}</td><td>{reg}</td><td>{upd}</td></tr>",
            id = j.id,
            st = esc(&j.state),
            pos = j.queue_position.map_or("-".into(), |p| p.to_string()),
            name = esc(&j.name),
            user = esc(&j.user),
            mode = j.demand.wait_mode,
            k = j.demand.gpus,
            inuse = gpu_list(&j.gpus),
            share = j.demand.share,
            timeout = timeout(j),
            reg = utc(j.submitted_unix),
            upd = utc(j.updated_unix),
        );
    }
    o.push_str("</table>\n");

    let mut finished: Vec<&JobView> = s.jobs.iter().filter(|j| j.finished()).collect();
    finished.sort_by_key(|j| std::cmp::Reverse(j.id));
    let _ = writeln!(
        o,
        "<h2>Finished queue</h2>\n<table id=\"finished\"><tr><th>ID</th><th>name</th><th>user</th><th>status</th><th>exit</th><th>mode</th><th>GPUs asked</th><th>GPUs used</th><th>share</th><th>timeout</th><th>registered</th><th>started</th><th>ended</th></tr>"
    );
    for j in finished.iter().take(200) {
        let _ = writeln!(
            o,
            "<tr id=\"job-{id}\" data-state=\"{st}\"><td>{id}</td><td>{name}</td><td>{user}</td><td>{st}</td><td>{exit}</td><td>{mode}</td><td>{k}</td><td>{used}</td><td>{share:.2}</td><td>{timeout}</td><td>{reg}</td><td>{start}</td><td>{end}</td></tr>",
            id = j.id,
            st = esc(&j.state),
            name = esc(&j.name),
            user = esc(&j.user),
            exit = exit(j),
            mode = j.demand.wait_mode,
            k = j.demand.gpus,
            used = gpu_list(&j.gpus),
            share = j.demand.share,
            timeout = timeout(j),
            reg = utc(j.submitted_unix),
            start = j.started_unix.map_or("-".into(), utc),
            end = j.ended_unix.map_or("-".into(), utc),
        );
    }
    o.push_str("</table>\n");
    o
}

/// The whole page.
pub fn page(s: &Snapshot) -> String {
    format!(
        r#"<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>gpushare queue</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; }}
table {{ border-collapse: collapse; margin-bottom: 1.5em; }}
th, td {{ border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: left; font-size: 0.9em; }}
th {{ background: #f0f0f0; }}
tr[data-state="running"] {{ background: #e8f5e9; }}
tr[data-state="failed"], tr[data-state="timed out"], tr[data-state="lost"] {{ background: #fdecea; }}
.warn {{ color: #a00; }}
#conn {{ color: #666; font-size: 0.8em; }}
</style></head>
<body>
<h1>gpushare queue <span id="conn">policy {policy}</span></h1>
<div id="live">
{live}</div>
<script>
const live = document.getElementById("live");
const conn = document.getElementById("conn");
const events = new EventSource("events");
events.addEventListener("live", (e) => {{ live.innerHTML = e.data; conn.textContent = "policy {policy}, live"; }});
events.onerror = () => {{ conn.textContent = "policy {policy}, reconnecting…"; }};
</script>
</body></html>
"#,
        policy = esc(&s.policy),
        live = live(s)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_dates() {
        assert_eq!(utc(0.0), "1970-01-01 00:00:00");
        assert_eq!(utc(951_782_400.0), "2000-02-29 00:00:00");
        assert_eq!(utc(1_700_000_000.5), "2023-11-14 22:13:20");
    }

    #[test]
    fn text_is_escaped() {
        assert_eq!(
            esc("<a href='x'>&\"</a>"),
            "&lt;a href=&#39;x&#39;&gt;&amp;&quot;&lt;/a&gt;"
        );
    }
}
