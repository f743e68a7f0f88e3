//! A hand-written SVG line plot: shares over time, one polyline per tenant, dashed targets.

use std::fmt::Write;

const COLORS: [&str; 10] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// `t`: bin starts (s); `series[i]`: tenant i's share per bin; `targets[i]`: its target.
pub fn shares_plot(
    title: &str,
    t: &[f64],
    names: &[String],
    series: &[Vec<f64>],
    targets: &[f64],
) -> String {
    let (w, h) = (760.0, 360.0);
    let (l, r, top, bot) = (50.0, 170.0, 30.0, 40.0);
    let pw = w - l - r;
    let ph = h - top - bot;
    let tmax = t.last().copied().unwrap_or(1.0).max(0.25) + 0.25;
    let x = |s: f64| l + s / tmax * pw;
    let y = |v: f64| top + (1.0 - v.clamp(0.0, 1.0)) * ph;
    let mut o = String::new();
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(o, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(
        o,
        r#"<text x="{l}" y="18" font-size="13">{}</text>"#,
        esc(title)
    );
    for k in 0..=4 {
        let v = k as f64 / 4.0;
        let _ = writeln!(
            o,
            r##"<line x1="{l}" y1="{y0:.1}" x2="{x1:.1}" y2="{y0:.1}" stroke="#ddd"/><text x="{tx}" y="{ty:.1}" text-anchor="end">{v:.2}</text>"##,
            y0 = y(v),
            x1 = l + pw,
            tx = l - 4.0,
            ty = y(v) + 4.0
        );
    }
    let mut s = 0.0;
    while s <= tmax {
        let _ = writeln!(
            o,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{s:.0}s</text>"#,
            x(s),
            top + ph + 15.0
        );
        s += 1.0;
    }
    let _ = writeln!(
        o,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">time (s); share of its GPU per {} ms</text>"#,
        l + pw / 2.0,
        h - 6.0,
        (crate::analysis::PLOT_BIN_NS / 1_000_000)
    );
    for (i, ys) in series.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        let pts: Vec<String> = t
            .iter()
            .zip(ys)
            .map(|(&ti, &v)| format!("{:.1},{:.1}", x(ti + 0.125), y(v)))
            .collect();
        let _ = writeln!(
            o,
            r#"<polyline fill="none" stroke="{c}" stroke-width="1.5" points="{}"/>"#,
            pts.join(" ")
        );
        let _ = writeln!(
            o,
            r#"<line x1="{l}" y1="{ty:.1}" x2="{x1:.1}" y2="{ty:.1}" stroke="{c}" stroke-dasharray="4 3" stroke-width="1"/>"#,
            ty = y(targets[i]),
            x1 = l + pw
        );
        if i < 24 {
            let ly = top + 12.0 * i as f64 + 6.0;
            let _ = writeln!(
                o,
                r#"<line x1="{lx}" y1="{ly:.1}" x2="{lx2}" y2="{ly:.1}" stroke="{c}" stroke-width="2"/><text x="{tx}" y="{ty:.1}">{} (target {:.3})</text>"#,
                esc(&names[i]),
                targets[i],
                lx = w - r + 10.0,
                lx2 = w - r + 24.0,
                tx = w - r + 28.0,
                ty = ly + 4.0
            );
        }
    }
    o.push_str("</svg>\n");
    o
}
