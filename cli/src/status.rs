//! The table `gpushare status` prints (and `gpushare top` refreshes) from the scheduler's
//! report.

use gpushare_protocol::status::{Durations, MemorySwaps, PodReport, Report, Unhooked};
use std::fmt::Write;

/// The human-readable table of `gpushare status`.
pub fn render(r: &Report) -> String {
    let mut out = String::new();
    if r.gpus.is_empty() {
        out.push_str("no GPU has been used through gpushare yet\n");
    }
    for g in &r.gpus {
        let holder = g
            .holder
            .as_ref()
            .map_or("-".to_string(), |c| format!("pid {} ({})", c.pid, c.group));
        let waiting: Vec<String> = g
            .waiting
            .iter()
            .map(|c| format!("{} ({})", c.pid, c.group))
            .collect();
        let _ = writeln!(
            out,
            "{}  holder: {holder}  waiting: {}",
            g.uuid,
            if waiting.is_empty() {
                "-".into()
            } else {
                waiting.join(", ")
            }
        );
        let _ = writeln!(
            out,
            "  {:<16} {:>7} {:>6} {:>6} {:>7} {:>8} {:>9} {:>7} {:>6} {:>8} {:>9} {:>17}  pids",
            "GROUP",
            "REQUEST",
            "LIMIT",
            "WEIGHT",
            "TARGET",
            "ACHIEVED",
            "BUSY(s)",
            "TOKENS",
            "WAITS",
            "OVERRUNS",
            "PREEMPTED",
            "MEMORY(MiB)"
        );
        if let Some(m) = &g.physical {
            let _ = writeln!(
                out,
                "  memory: {:.0} MiB used, {:.0} free of {:.0}; {:.0} swapped to host memory (caps may sum to {}x); {} allocation(s) waiting",
                mib(m.used),
                mib(m.free),
                mib(m.total),
                mib(m.swapped),
                m.overcommit,
                m.waiting
            );
        }
        for x in &g.groups {
            let pids: Vec<String> = x.pids.iter().map(u32::to_string).collect();
            let memory = match x.memory_cap {
                Some(cap) => format!("{:.0}/{:.0}", mib(x.memory_used), mib(cap)),
                None => format!("{:.0}", mib(x.memory_used)),
            };
            // The latency class is marked after the name.
            let name = if x.latency {
                format!("{} (latency)", x.name)
            } else {
                x.name.clone()
            };
            let _ = writeln!(
                out,
                "  {:<16} {:>7.2} {:>6.2} {:>6.2} {:>7.3} {:>8.3} {:>9.3} {:>7} {:>6} {:>8} {:>9} {:>17}  {}",
                name,
                x.effective_request,
                x.limit,
                x.weight,
                x.target_share,
                x.achieved_share,
                x.busy_seconds,
                x.tokens,
                x.waits,
                x.overruns,
                x.preempted,
                memory,
                pids.join(",")
            );
        }
        for x in &g.groups {
            // Under overcommit, where each group's memory is.
            if g.physical.is_some() || x.memory_swapped > 0 {
                let _ = write!(out, "  {}: memory {}", x.name, x.memory_state.as_str());
                if x.memory_swapped > 0 {
                    let _ = write!(out, ", {:.0} MiB in host memory", mib(x.memory_swapped));
                }
                out.push('\n');
            }
            if let (Some(asked), Some(cap)) = (x.memory_clamped, x.memory_cap) {
                let _ = writeln!(
                    out,
                    "  {}: memory cap clamped to {:.0} MiB of the {:.0} asked (the caps before it promise the rest that memory_overcommit allows)",
                    x.name,
                    mib(cap),
                    mib(asked)
                );
            }
            if let Some(why) = &x.memory_refused {
                let _ = writeln!(out, "  {}: last allocation refused: {why}", x.name);
            }
        }
    }
    if !r.pods.is_empty() {
        render_pods(&mut out, &r.pods);
    }
    render_unhooked(&mut out, &r.unhooked);
    if r.gpus.iter().any(|g| g.physical.is_some()) || r.memory_swaps != MemorySwaps::default() {
        render_swaps(&mut out, &r.memory_swaps);
    }
    render_event_loop(&mut out, &r.event_loop);
    out
}

/// Bytes in MiB.
fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

/// Memory overcommit's swaps and waits since the daemon started, in one line.
fn render_swaps(out: &mut String, c: &MemorySwaps) {
    let s = |d: &Durations, q: f64| d.quantile(q).map_or("-".into(), |s| format!("{s:.2} s"));
    let _ = writeln!(
        out,
        "\nmemory swaps: {} out ({} failed; median {}), {} in ({} failed; median {}); {} allocation(s) waited (median {}, worst {:.2} s), {} refused; {:.0} MiB moved out, {:.0} MiB back",
        c.swap_outs,
        c.swap_out_failures,
        s(&c.swap_out_seconds, 0.5),
        c.swap_ins,
        c.swap_in_failures,
        s(&c.swap_in_seconds, 0.5),
        c.allocation_waits,
        s(&c.allocation_wait_seconds, 0.5),
        c.allocation_wait_seconds.max_s,
        c.allocations_refused,
        mib(c.swap_out_bytes),
        mib(c.swap_in_bytes)
    );
}

/// The warning about GPU processes without the hook's connection.
fn render_unhooked(out: &mut String, unhooked: &[Unhooked]) {
    let (loaded, missing): (Vec<_>, Vec<_>) = unhooked.iter().partition(|u| u.hook_loaded);
    let list = |v: &[&Unhooked]| {
        v.iter()
            .map(|u| format!("{} ({})", u.pid, u.command))
            .collect::<Vec<_>>()
            .join(", ")
    };
    if !missing.is_empty() {
        let _ = writeln!(
            out,
            "\nWARNING: these processes use the GPU driver WITHOUT gpushare's hook (ungated, uncapped): {}\n  Run them with `gpushare run`, or check that LD_PRELOAD names libgpushare.so and that their glibc is 2.34 or newer.",
            list(&missing)
        );
    }
    if !loaded.is_empty() {
        let _ = writeln!(
            out,
            "\nNot connected yet (the hook connects at the first launch or allocation; refused processes stay here): {}",
            list(&loaded)
        );
    }
}

/// The Kubernetes section of `gpushare status`: every container the node agent registered.
fn render_pods(out: &mut String, pods: &[PodReport]) {
    let _ = writeln!(
        out,
        "\nKubernetes containers:\n  {:<20} {:<28} {:<16} {:>7} {:>6} {:>6} {:>11}  {:<8}  GPU",
        "NAMESPACE", "POD", "CONTAINER", "REQUEST", "LIMIT", "WEIGHT", "MEMORY(MiB)", "STATE"
    );
    for p in pods {
        let memory = p.memory.map_or("-".to_string(), |m| {
            format!("{:.0}", m as f64 / (1u64 << 20) as f64)
        });
        let state = if p.removed {
            "removed"
        } else if p.container_id.is_some() {
            "running"
        } else {
            "starting"
        };
        let _ = writeln!(
            out,
            "  {:<20} {:<28} {:<16} {:>7.2} {:>6.2} {:>6.2} {:>11}  {:<8}  {}",
            p.namespace,
            p.pod,
            p.container,
            p.request,
            p.limit,
            p.weight,
            memory,
            state,
            p.gpus.join(",")
        );
    }
}

/// How promptly the daemon's event loop served, in one line.
fn render_event_loop(out: &mut String, l: &Durations) {
    let ms = |q: f64| {
        l.quantile(q)
            .map_or("-".into(), |s| format!("{:.3}", s * 1e3))
    };
    let _ = writeln!(
        out,
        "\nevent loop: {} events handled, late by at most {} ms (median), {} ms (99%), {:.3} ms (worst)",
        l.count,
        ms(0.5),
        ms(0.99),
        l.max_s * 1e3
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warns_of_processes_without_the_hook_and_says_how_late_the_loop_ran() {
        let r = Report {
            dev_mode: true,
            gpus: vec![],
            pods: vec![],
            unhooked: vec![
                Unhooked {
                    pid: 42,
                    command: "python3".into(),
                    hook_loaded: false,
                },
                Unhooked {
                    pid: 43,
                    command: "trainer".into(),
                    hook_loaded: true,
                },
            ],
            event_loop: Durations {
                bounds_s: vec![0.0001, 0.001],
                counts: vec![98, 1, 1],
                count: 100,
                sum_s: 0.01,
                max_s: 0.004,
            },
            memory_swaps: Default::default(),
        };
        let table = render(&r);
        assert!(
            table.contains("WITHOUT gpushare's hook (ungated, uncapped): 42 (python3)"),
            "{table}"
        );
        assert!(table.contains("Not connected yet"), "{table}");
        assert!(
            table.contains(
                "event loop: 100 events handled, late by at most 0.100 ms (median), 1.000 ms (99%), 4.000 ms (worst)"
            ),
            "{table}"
        );
    }

    #[test]
    fn under_overcommit_shows_the_gpus_books_each_groups_memory_and_the_swaps() {
        use gpushare_protocol::status::{GpuReport, GroupReport, MemoryState, PhysicalMemory};
        const MIB: u64 = 1 << 20;
        let group = |name: &str, state: MemoryState, swapped: u64| GroupReport {
            memory_clamped: (name == "second").then_some(2000 * MIB),
            name: name.into(),
            request: 0.0,
            limit: 1.0,
            weight: 1.0,
            latency: false,
            effective_request: 0.0,
            target_share: 0.5,
            achieved_share: 0.0,
            busy_seconds: 0.0,
            tokens: 0,
            waits: 0,
            overruns: 0,
            revocations: 0,
            preempted: 0,
            pids: vec![],
            active: true,
            memory_used: 1200 * MIB,
            memory_cap: Some(1500 * MIB),
            memory_reservations: 1,
            memory_swapped: swapped,
            memory_state: state,
            memory_refused: None,
            pod: None,
        };
        let r = Report {
            dev_mode: true,
            gpus: vec![GpuReport {
                uuid: "GPU-x".into(),
                holder: None,
                waiting: vec![],
                groups: vec![
                    group("first", MemoryState::SwappedOut, 1200 * MIB),
                    group("second", MemoryState::Resident, 0),
                ],
                physical: Some(PhysicalMemory {
                    total: 2048 * MIB,
                    used: 1200 * MIB,
                    free: 848 * MIB,
                    swapped: 1200 * MIB,
                    overcommit: 2.0,
                    waiting: 0,
                }),
            }],
            pods: vec![],
            unhooked: vec![],
            event_loop: Durations::default(),
            memory_swaps: MemorySwaps {
                swap_outs: 1,
                swap_out_bytes: 1200 << 20,
                allocation_waits: 1,
                swap_out_seconds: Durations {
                    bounds_s: vec![0.1, 1.0],
                    counts: vec![0, 1, 0],
                    count: 1,
                    sum_s: 0.9,
                    max_s: 0.9,
                },
                allocation_wait_seconds: Durations {
                    bounds_s: vec![0.1, 1.0, 10.0],
                    counts: vec![0, 0, 1, 0],
                    count: 1,
                    sum_s: 1.25,
                    max_s: 1.25,
                },
                ..MemorySwaps::default()
            },
        };
        let table = render(&r);
        for line in [
            "  memory: 1200 MiB used, 848 free of 2048; 1200 swapped to host memory (caps may sum to 2x); 0 allocation(s) waiting\n",
            "  first: memory swapped out, 1200 MiB in host memory\n",
            "  second: memory resident\n",
            "  second: memory cap clamped to 1500 MiB of the 2000 asked (the caps before it promise the rest that memory_overcommit allows)\n",
            "memory swaps: 1 out (0 failed; median 0.90 s), 0 in (0 failed; median -); 1 allocation(s) waited (median 1.25 s, worst 1.25 s), 0 refused; 1200 MiB moved out, 0 MiB back\n",
        ] {
            assert!(table.contains(line), "{line:?} in\n{table}");
        }
    }
}
