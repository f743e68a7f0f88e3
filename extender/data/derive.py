#!/usr/bin/env python3
"""Derive the replay's data files from their public sources (standard library only).

    python3 derive.py ECE_DIPLOMA_CHECKOUT CLUSTERDATA_CHECKOUT

writes, next to this script:

- seed-engines.csv: one row per run of constant memory of each MLPerf ssd-mobilenet engine that
  ran alone on the V100 (the whole-GPU runs, WORKLOAD_DEFAULT, of all six experiments of
  ECE-Diploma's monitoring-files/): engine, seconds, MiB in use, the engine's mean GPU
  utilisation (percent) over its run.
- openb-nodes.csv: the GPU nodes of cluster-trace-gpu-v2023 (openb_node_list_gpu_node.csv):
  CPU (milli), memory (MiB), GPUs, model.
- openb-{default,gpushare40,gpushare80}.csv: the pods of openb_pod_list_*.csv in the file's
  order: CPU (milli), memory (MiB), GPUs, GPU milli, seconds held in the trace
  (deletion - scheduled; deletion - creation for pods the trace never scheduled).
"""

import csv
import glob
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def series(path):
    """(second, value) rows of a combined_*.csv (a BOM may open the file)."""
    out = []
    with open(path, encoding="utf-8-sig") as f:
        for row in csv.reader(f):
            if len(row) >= 2 and row[0].strip():
                out.append((int(float(row[0])), float(row[1])))
    out.sort()
    return out


def engines(seed_root):
    """Each engine's per-second memory (MiB) and mean utilisation, from the solo runs: the GPU's
    memory is one engine's from the first non-zero sample to the last before it drops to 0."""
    found = []
    pattern = os.path.join(seed_root, "monitoring-files", "EXPERIMENT_*", "OVERALL")
    for overall in sorted(glob.glob(pattern)):
        mem = series(os.path.join(overall, "dcgm_fb_used", "combined_DEFAULT.csv"))
        util = dict(series(os.path.join(overall, "dcgm_gpu_utilization", "combined_DEFAULT.csv")))
        run = []
        for t, v in mem + [(None, 0.0)]:
            if v > 0:
                run.append((t, v))
            elif run:
                # A whole run: at least a minute of samples, one second apart.
                secs = [s for s, _ in run]
                if len(run) >= 60 and secs[-1] - secs[0] == len(run) - 1:
                    u = [util.get(s, 0.0) for s in secs]
                    found.append(([int(round(x)) for _, x in run], sum(u) / len(u)))
                run = []
    return found


def write_engines(seed_root):
    rows = []
    for i, (mib, util) in enumerate(engines(seed_root)):
        start = 0
        for j in range(1, len(mib) + 1):
            if j == len(mib) or mib[j] != mib[start]:
                rows.append((i, j - start, mib[start], f"{util:.2f}"))
                start = j
    with open(os.path.join(HERE, "seed-engines.csv"), "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["engine", "seconds", "mib", "util_pct"])
        w.writerows(rows)
    return len({r[0] for r in rows})


def write_openb(trace_root):
    csvs = os.path.join(trace_root, "cluster-trace-gpu-v2023", "csv")
    with open(os.path.join(csvs, "openb_node_list_gpu_node.csv")) as f, open(
        os.path.join(HERE, "openb-nodes.csv"), "w", newline=""
    ) as out:
        w = csv.writer(out, lineterminator="\n")
        w.writerow(["cpu_milli", "memory_mib", "gpus", "model"])
        for r in csv.DictReader(f):
            w.writerow([r["cpu_milli"], r["memory_mib"], r["gpu"], r["model"]])
    for name in ["default", "gpushare40", "gpushare80"]:
        with open(os.path.join(csvs, f"openb_pod_list_{name}.csv")) as f, open(
            os.path.join(HERE, f"openb-{name}.csv"), "w", newline=""
        ) as out:
            w = csv.writer(out, lineterminator="\n")
            w.writerow(["cpu_milli", "memory_mib", "gpus", "gpu_milli", "held_s"])
            for r in csv.DictReader(f):
                start = r["scheduled_time"] or r["creation_time"]
                held = int(r["deletion_time"]) - int(start)
                w.writerow([r["cpu_milli"], r["memory_mib"], r["num_gpu"], r["gpu_milli"], held])


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    n = write_engines(sys.argv[1])
    write_openb(sys.argv[2])
    print(f"{n} engine profiles; openb nodes and pods written to {HERE}")
