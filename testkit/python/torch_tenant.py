"""A PyTorch tenant for sharing measurements.

    torch_tenant.py train [options]   train an MLP with AdamW (each step dozens of kernels)

Each tenant warms up (its first steps initialise cuBLAS and the caching allocator), then, with
--ready FILE --go FILE, creates FILE and waits for GO to exist, so that tenants started together
measure together; it then runs for --seconds and prints one JSON line: the steps
done and when each ended on the GPU, read from CUDA timing events placed on CLOCK_MONOTONIC
(the measurement on a GPU that writes no trace), and the median time between the ends of
steps queued back to back (a step's GPU time when the tenant is alone on the GPU), and the
floating-point operations of a step's matmuls.

The simulated GPU times kernels without executing them: nothing here depends on a value a kernel
computed.
"""

import argparse
import json
import os
import statistics
import sys
import time


# Features of each input.
INPUTS = 64


def anchor(torch):
    """A timing event and the CLOCK_MONOTONIC ns at which it completed on the GPU: the earliest
    of many polls, each corrected by the event time since the anchor (as the bench's timelines)."""
    stream = torch.cuda.current_stream()
    torch.cuda.synchronize()
    first = torch.cuda.Event(enable_timing=True)
    first.record(stream)
    first.synchronize()
    best = time.monotonic_ns()
    probe = torch.cuda.Event(enable_timing=True)
    for _ in range(32):
        time.sleep(0.0003)
        probe.record(stream)
        while not probe.query():
            pass
        seen = time.monotonic_ns()
        best = min(best, seen - int(first.elapsed_time(probe) * 1e6))
    return first, best


def model(torch, width, depth, inputs):
    import torch.nn as nn

    layers = []
    for i in range(depth):
        layers += [nn.Linear(width if i else inputs, width), nn.GELU()]
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers).cuda()


def matmul_flops(args):
    """The floating-point operations of a step's matmuls: 2·batch·in·out a linear layer forward;
    training, as much again for its weights' gradient and for its input's (but the first's)."""
    dims = [INPUTS] + [args.width] * args.depth + [10]
    forward = sum(2 * args.batch * a * b for a, b in zip(dims, dims[1:]))
    return 3 * forward - 2 * args.batch * INPUTS * args.width


def barrier(args):
    if args.ready:
        open(args.ready, "w").close()
    if args.go:
        while not os.path.exists(args.go):
            time.sleep(0.005)


def run(args):
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    net = model(torch, args.width, args.depth, INPUTS)
    x = torch.randn(args.batch, INPUTS, device="cuda")
    y = torch.randint(0, 10, (args.batch,), device="cuda")
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)

    def train_step():
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()

    for _ in range(3):
        train_step()
    torch.cuda.synchronize()
    barrier(args)
    start_event, start_ns = anchor(torch)
    ends = []
    t_end = time.monotonic() + args.seconds
    while time.monotonic() < t_end:
        train_step()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        ends.append(e)
        if len(ends) > args.in_flight:
            # At most --in-flight steps queued, as a loop reading its loss each step keeps.
            ends[-1 - args.in_flight].synchronize()
    torch.cuda.synchronize()
    ends_ns = [start_ns + int(start_event.elapsed_time(e) * 1e6) for e in ends]
    gaps = [b - a for a, b in zip(ends_ns, ends_ns[1:])]
    out = {
        "pid": os.getpid(),
        "steps": len(ends_ns),
        "start_ns": start_ns,
        "ends_ns": ends_ns,
        "median_gap_ns": int(statistics.median(gaps)) if gaps else None,
        "flops_per_step": matmul_flops(args),
    }
    print(json.dumps(out), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    m = sub.add_parser("train")
    m.add_argument("--seconds", type=float, default=5.0)
    m.add_argument("--width", type=int, default=256)
    m.add_argument("--depth", type=int, default=4)
    m.add_argument("--batch", type=int, default=128)
    m.add_argument("--in-flight", type=int, default=2)
    m.add_argument("--ready")
    m.add_argument("--go")
    run(p.parse_args())


if __name__ == "__main__":
    main()
