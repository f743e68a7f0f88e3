"""NVIDIA's cuda-bindings (the official Python driver API, which resolves every entry point
through cuGetProcAddress) on the simulated GPU: device query, memory info, PTX module, a timed
spin kernel, a copy round trip. Prints one JSON line; exits non-zero on any failed call."""

import json
import sys

import numpy as np
from cuda.bindings import driver as cu


def ok(result):
    err, *values = result
    if err != cu.CUresult.CUDA_SUCCESS:
        sys.exit(f"driver call failed: {err}")
    return values[0] if len(values) == 1 else values


ptx_path, spin_ns = sys.argv[1], int(sys.argv[2])
ok(cu.cuInit(0))
dev = ok(cu.cuDeviceGet(0))
name = ok(cu.cuDeviceGetName(64, dev)).split(b"\0")[0].decode()
ctx = ok(cu.cuDevicePrimaryCtxRetain(dev))
ok(cu.cuCtxSetCurrent(ctx))
free, total = ok(cu.cuMemGetInfo())
module = ok(cu.cuModuleLoadData(open(ptx_path, "rb").read() + b"\0"))
spin = ok(cu.cuModuleGetFunction(module, b"gpushare_spin"))
stream = ok(cu.cuStreamCreate(0))
start, end = ok(cu.cuEventCreate(0)), ok(cu.cuEventCreate(0))
# A pad kernel first, so the events time device work only, not host launch latency.
pad = np.array([5_000_000], dtype=np.uint64)
ok(cu.cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, stream, np.array([pad.ctypes.data], dtype=np.uint64).ctypes.data, 0))
ok(cu.cuEventRecord(start, stream))
ns = np.array([spin_ns], dtype=np.uint64)
ok(cu.cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, stream, np.array([ns.ctypes.data], dtype=np.uint64).ctypes.data, 0))
ok(cu.cuEventRecord(end, stream))
ok(cu.cuStreamSynchronize(stream))
elapsed_ms = ok(cu.cuEventElapsedTime(start, end))
buf = ok(cu.cuMemAlloc(4096))
host = np.arange(1024, dtype=np.uint32)
back = np.zeros(1024, dtype=np.uint32)
ok(cu.cuMemcpyHtoD(buf, host.ctypes.data, 4096))
ok(cu.cuMemcpyDtoH(back.ctypes.data, buf, 4096))
ok(cu.cuMemFree(buf))
print(json.dumps({"name": name, "free": free, "total": total, "elapsed_ms": elapsed_ms,
                  "round_trip": bool((host == back).all())}))
