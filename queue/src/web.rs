//! The queue's web page, rendered on the server from a [`Snapshot`]: the GPUs with their shares
//! and memory, the working queue (queued and running jobs) and the finished queue, each job with
//! a link to its output. The page replaces its live part with each server-sent event from
//! `/events`, and plots each GPU's use by group (inline SVG, from `/api/usage` every two
//! seconds). No build step, no framework, nothing fetched from elsewhere.

use crate::daemon::JOB_GROUP_PREFIX;
use gpushare_queue_protocol::JobView;
use html_escape::encode_safe as esc;
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

/// `YYYY-MM-DD HH:MM:SS` (UTC) of seconds since the epoch.
pub fn utc(unix_s: f64) -> String {
    jiff::Timestamp::from_second(unix_s.max(0.0) as i64).map_or_else(
        |_| "-".into(),
        |t| t.strftime("%Y-%m-%d %H:%M:%S").to_string(),
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
        (None, None, Some(e)) => esc(e).into_owned(),
        _ => "-".into(),
    }
}

/// A link to the job's output once it has run (the server gives it to its owner and root only).
fn output(j: &JobView) -> String {
    if j.runs == 0 {
        "-".into()
    } else {
        format!(
            "<a class=\"output\" href=\"api/jobs/{}/logs\" target=\"_blank\">output</a>",
            j.id
        )
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
        "<h2>Working queue</h2>\n<table id=\"working\"><tr><th>#</th><th>status</th><th>ID</th><th>name</th><th>user</th><th>mode</th><th>GPU scope</th><th>GPUs asked</th><th>GPUs in use</th><th>share</th><th>timeout</th><th>registered</th><th>last update</th><th>output</th></tr>"
    );
    for j in working {
        let scope = if j.demand.prefer.is_empty() {
            "any".into()
        } else {
            gpu_list(&j.demand.prefer)
        };
        let _ = writeln!(
            o,
            "<tr id=\"job-{id}\" data-state=\"{st}\"><td>{pos}</td><td>{st}</td><td>{id}</td><td>{name}</td><td>{user}</td><td>{mode}</td><td>{scope}</td><td>{k}</td><td>{inuse}</td><td>{share:.2}</td><td>{timeout}</td><td>{reg}</td><td>{upd}</td><td>{out}</td></tr>",
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
            out = output(j),
        );
    }
    o.push_str("</table>\n");

    let mut finished: Vec<&JobView> = s.jobs.iter().filter(|j| j.finished()).collect();
    finished.sort_by_key(|j| std::cmp::Reverse(j.id));
    let _ = writeln!(
        o,
        "<h2>Finished queue</h2>\n<table id=\"finished\"><tr><th>ID</th><th>name</th><th>user</th><th>status</th><th>exit</th><th>mode</th><th>GPUs asked</th><th>GPUs used</th><th>share</th><th>timeout</th><th>registered</th><th>started</th><th>ended</th><th>output</th></tr>"
    );
    for j in finished.iter().take(200) {
        let _ = writeln!(
            o,
            "<tr id=\"job-{id}\" data-state=\"{st}\"><td>{id}</td><td>{name}</td><td>{user}</td><td>{st}</td><td>{exit}</td><td>{mode}</td><td>{k}</td><td>{used}</td><td>{share:.2}</td><td>{timeout}</td><td>{reg}</td><td>{start}</td><td>{end}</td><td>{out}</td></tr>",
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
            out = output(j),
        );
    }
    o.push_str("</table>\n");
    o
}

const STYLE: &str = r##"
body { font-family: system-ui, sans-serif; margin: 1.5em; }
table { border-collapse: collapse; margin-bottom: 1.5em; }
th, td { border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: left; font-size: 0.9em; }
th { background: #f0f0f0; }
tr[data-state="running"] { background: #e8f5e9; }
tr[data-state="failed"], tr[data-state="timed out"], tr[data-state="lost"] { background: #fdecea; }
.warn { color: #a00; }
.note, #me { color: #555; font-size: 0.85em; }
#conn { color: #666; font-size: 0.8em; }
#plots { display: flex; flex-wrap: wrap; gap: 1em 2em; margin-bottom: 1em; }
.usage h3 { font-size: 1em; margin: 0.3em 0; }
.usage svg { background: #fafafa; border: 1px solid #ddd; margin-right: 0.5em; }
.usage .grid { stroke: #ddd; }
.usage text { font-size: 10px; fill: #555; }
.legend { list-style: none; padding: 0; margin: 0.3em 0; font-size: 0.85em; }
.legend li { display: inline-block; margin-right: 1em; }
.swatch { display: inline-block; width: 0.8em; height: 0.8em; margin-right: 0.3em; vertical-align: middle; }
"##;

/// Saves the token in a cookie of this browser, and says whose it is.
const TOKEN_FORM: &str = r##"<form id="token-form">
<label>Your token (<code>gpushare token</code> prints it): <input id="token" type="password" autocomplete="off" size="34"></label>
<button type="submit">save</button> <button type="button" id="forget">forget</button>
<span id="me"></span>
</form>"##;

const TOKEN_SCRIPT: &str = r##"
const COOKIE = "gpushare_token";
// Answers may come back out of order (the page's first question, then one after "forget"):
// only the latest question's answer is shown.
let asked = 0;
async function whoami() {
  const mine = ++asked;
  const me = document.getElementById("me");
  const r = await fetch("api/me").catch(() => null);
  const v = r && r.ok ? await r.json().catch(() => null) : null;
  if (mine !== asked) return;
  if (v) {
    me.textContent = "saved: output links open as " + (v.user ?? "uid " + v.uid) + ".";
  } else if (document.cookie.split("; ").some((c) => c.startsWith(COOKIE + "="))) {
    me.textContent = "this token is unknown: `gpushare token` prints yours.";
  } else {
    me.textContent = "no token saved: output links are refused.";
  }
}
function saveToken(t) {
  document.cookie = COOKIE + "=" + encodeURIComponent(t) + "; SameSite=Strict; max-age=" + (t ? 2592000 : 0);
  return whoami();
}
document.getElementById("token-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const input = document.getElementById("token");
  saveToken(input.value.trim()).then(() => { input.value = ""; if (window.afterToken) window.afterToken(); });
});
document.getElementById("forget").addEventListener("click", () => saveToken(""));
whoami();
"##;

/// Draws each GPU's use by group over the last minutes as stacked areas, from `/api/usage`: the
/// whole history once, then the samples after the last it has.
const PLOT_SCRIPT: &str = r##"
const PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"];
const NS = "http://www.w3.org/2000/svg";
const W = 440, H = 150, L = 52, R = 8, T = 8, B = 20;
function el(ns, name, attrs, text) {
  const e = ns ? document.createElementNS(ns, name) : document.createElement(name);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  return e;
}
function bytes(b) { return b >= 2 ** 30 ? (b / 2 ** 30).toFixed(1) + " GiB" : Math.round(b / 2 ** 20) + " MiB"; }
// The least of 1, 2 or 5 times a power of two MiB at or above `b`.
function ceiling(b) {
  for (let m = 2 ** 20; ; m *= 2) for (const k of [1, 2, 5]) if (k * m >= b) return k * m;
}
function ago(s) { return s >= 120 ? "−" + Math.round(s / 60) + " min" : "−" + Math.round(s) + " s"; }
function chart(id, title, times, groups, key, max, fmt) {
  const svg = el(NS, "svg", { id, width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: "img" });
  svg.appendChild(el(NS, "title", {}, title));
  const x0 = times[0], span = Math.max(times[times.length - 1] - x0, 1e-9);
  const x = (t) => (L + ((t - x0) / span) * (W - L - R)).toFixed(1);
  const y = (v) => (T + (1 - Math.min(v / max, 1)) * (H - T - B)).toFixed(1);
  for (const f of [0, 0.5, 1]) {
    svg.appendChild(el(NS, "line", { class: "grid", x1: L, x2: W - R, y1: y(f * max), y2: y(f * max) }));
    svg.appendChild(el(NS, "text", { x: L - 4, y: +y(f * max) + 3, "text-anchor": "end" }, fmt(f * max)));
  }
  svg.appendChild(el(NS, "text", { x: L, y: H - 5 }, ago(span)));
  svg.appendChild(el(NS, "text", { x: W - R, y: H - 5, "text-anchor": "end" }, title + ", now"));
  const base = times.map(() => 0);
  groups.forEach((g, k) => {
    const v = g[key], top = v.map((a, i) => base[i] + a);
    const upper = times.map((t, i) => x(t) + "," + y(top[i]));
    const lower = times.map((t, i) => x(t) + "," + y(base[i])).reverse();
    const colour = PALETTE[k % PALETTE.length];
    svg.appendChild(el(NS, "path", {
      d: "M" + upper.concat(lower).join("L") + "Z", fill: colour, "fill-opacity": 0.7, stroke: colour,
      "data-group": g.name, "data-points": v.length, "data-max": Math.max(...v),
    }));
    top.forEach((a, i) => { base[i] = a; });
  });
  return svg;
}
function gpuUsage(g) {
  const box = el(null, "section", { id: "usage-gpu-" + g.index, class: "usage" });
  box.appendChild(el(null, "h3", {}, "GPU " + g.index + " (" + g.name + ")"));
  if (g.times.length < 2) {
    box.appendChild(el(null, "p", { class: "note" }, "collecting samples…"));
    return box;
  }
  const share = chart("share-gpu-" + g.index, "share of GPU time", g.times, g.groups, "share", 1, (v) => v.toFixed(1));
  // Scaled to what was in use, so that a few MiB show on a GPU of many GiB.
  const used = Math.max(0, ...g.times.map((_, i) => g.groups.reduce((s, x) => s + x.memory[i], 0)));
  const memMax = Math.min(ceiling(used * 1.1), g.memory_total || Infinity);
  const memory = chart("memory-gpu-" + g.index, "memory in use (of " + bytes(g.memory_total) + ")", g.times, g.groups, "memory", memMax, bytes);
  box.append(share, memory);
  const legend = el(null, "ul", { class: "legend" });
  g.groups.forEach((x, k) => {
    const li = el(null, "li", { "data-group": x.name });
    li.append(el(null, "span", { class: "swatch", style: "background:" + PALETTE[k % PALETTE.length] }), x.label);
    legend.appendChild(li);
  });
  if (!g.groups.length) legend.appendChild(el(null, "li", {}, "idle"));
  box.appendChild(legend);
  return box;
}
// Each GPU's samples so far (by index): the first answer of /api/usage, then what each later
// one adds (it asks only for the samples after the last it has).
const usageSeen = new Map();
function zeros(n) { return new Array(n).fill(0); }
function merge(have, got) {
  if (!have || !have.times.length) return got;
  // Only the samples after those the page has.
  let s = 0;
  while (s < got.times.length && got.times[s] <= have.times[have.times.length - 1]) s++;
  const n = have.times.length, m = got.times.length - s;
  const groups = have.groups.map((g) => ({ ...g, share: g.share.concat(zeros(m)), memory: g.memory.concat(zeros(m)) }));
  for (const g of got.groups) {
    const [share, memory] = [g.share.slice(s), g.memory.slice(s)];
    const mine = groups.find((x) => x.name === g.name);
    if (!mine) {
      groups.push({ ...g, share: zeros(n).concat(share), memory: zeros(n).concat(memory) });
      continue;
    }
    mine.label = g.label;
    mine.share.splice(n, m, ...share);
    mine.memory.splice(n, m, ...memory);
  }
  // As the daemon keeps them: the samples of the last span, the groups present in one of them
  // in the order they first appear.
  const times = have.times.concat(got.times.slice(s));
  const from = times[times.length - 1] - got.span_seconds;
  let cut = 0;
  while (times[cut] < from) cut++;
  const first = (g) => g.share.findIndex((v, i) => v > 0 || g.memory[i] > 0);
  const kept = groups
    .map((g) => ({ ...g, share: g.share.slice(cut), memory: g.memory.slice(cut) }))
    .filter((g) => first(g) >= 0)
    .map((g, k) => [first(g), k, g])
    .sort((a, b) => a[0] - b[0] || a[1] - b[1])
    .map((x) => x[2]);
  return { ...got, times: times.slice(cut), groups: kept };
}
async function plots() {
  // The samples after the oldest of the GPUs' last ones (all of them while a GPU has none).
  const lasts = Array.from(usageSeen.values(), (g) => g.times[g.times.length - 1]);
  const since = lasts.length && lasts.every((t) => t !== undefined) ? Math.min(...lasts) : null;
  const r = await fetch(since === null ? "api/usage" : "api/usage?since=" + since).catch(() => null);
  if (!r || !r.ok) return;
  for (const g of await r.json()) usageSeen.set(g.index, merge(usageSeen.get(g.index), g));
  document.getElementById("plots").replaceChildren(...Array.from(usageSeen.values(), gpuUsage));
}
plots();
setInterval(plots, 2000);
"##;

/// What the page says about the output links.
const OUTPUT_NOTE: &str = "Each job's <em>output</em> link shows what the job wrote to its owner and to root, \
known by the token saved above. Anyone else gets “not yours” and a browser without a token is asked for one: \
neither sees the output.";

/// The whole page.
pub fn page(s: &Snapshot) -> String {
    format!(
        r#"<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>gpushare queue</title>
<style>{STYLE}</style></head>
<body>
<h1>gpushare queue <span id="conn">policy {policy}</span></h1>
{TOKEN_FORM}
<p class="note">{OUTPUT_NOTE}</p>
<h2>Use of each GPU, last minutes</h2>
<div id="plots"><p class="note">loading…</p></div>
<div id="live">
{live}</div>
<script>
const live = document.getElementById("live");
const conn = document.getElementById("conn");
const events = new EventSource("events");
events.addEventListener("live", (e) => {{ live.innerHTML = e.data; conn.textContent = "policy {policy}, live"; }});
events.onerror = () => {{ conn.textContent = "policy {policy}, reconnecting…"; }};
{TOKEN_SCRIPT}
{PLOT_SCRIPT}
</script>
</body></html>
"#,
        policy = esc(&s.policy),
        live = live(s)
    )
}

/// Served instead of the page to a browser off this machine without a token: it asks for one,
/// then loads the page.
pub fn token_page() -> String {
    format!(
        r#"<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>gpushare queue: token</title>
<style>{STYLE}</style></head>
<body>
<h1>gpushare queue</h1>
<p>From off this machine the queue shows itself to its users only.</p>
{TOKEN_FORM}
<script>
window.afterToken = () => location.reload();
{TOKEN_SCRIPT}
</script>
</body></html>
"#
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
        let row = live(&Snapshot {
            policy: "fifo".into(),
            gpus: vec![],
            jobs: vec![],
            books_error: Some("<script>alert('x')</script> & \"more\"".into()),
        });
        assert!(
            !row.contains("<script>") && !row.contains("alert('x')"),
            "{row}"
        );
        assert!(
            row.contains("&lt;script&gt;") && row.contains("&amp;"),
            "{row}"
        );
    }
}
