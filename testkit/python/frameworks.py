"""Python GPU frameworks, unmodified and with default settings, on the simulated GPU
(`frameworks.py CASE...`, the cases in one process):

    frameworks.py numba      a @cuda.jit kernel (compiled by numba, linked and loaded through
                             cuda.core: cuLink*, cuLibraryLoadData, a CUkernel launch)
    frameworks.py cupy       CuPy arrays, an elementwise expression, a reduction, a RawKernel
                             (NVRTC) named gpushare_spin timed with CuPy events
    frameworks.py cuda_core  cuda.core Program (NVRTC to a cubin) + launch of gpushare_spin,
                             timed with events, and a graph built by capture

Each prints one JSON line. The simulated GPU times kernels without executing them, so nothing
here checks a value a kernel computes; copies and memsets are real.
"""

import json
import sys

import numpy as np

SPIN_SRC = r"""
extern "C" __global__ void gpushare_spin(unsigned long long ns) {
    unsigned long long start;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    for (;;) {
        unsigned long long now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (now - start >= ns) break;
    }
}
"""


def numba_case(kernels):
    from numba import cuda

    @cuda.jit
    def scale(a, k):
        i = cuda.grid(1)
        if i < a.size:
            a[i] *= k

    host = np.arange(1024, dtype=np.float32)
    dev = cuda.to_device(host)
    for _ in range(kernels):
        scale[4, 256](dev, 2.0)
    cuda.synchronize()
    back = dev.copy_to_host()
    assert back.shape == host.shape
    return {"framework": "numba", "kernels": kernels, "device": cuda.get_current_device().name.decode()
            if isinstance(cuda.get_current_device().name, bytes) else cuda.get_current_device().name}


def cupy_case(spin_ms):
    import cupy as cp

    host = np.arange(1 << 20, dtype=np.float32)
    a = cp.asarray(host)
    b = a * 2 + 1
    total = b.sum()
    assert total.shape == () and b.shape == a.shape
    assert np.array_equal(cp.asnumpy(a), host), "copy round trip"
    spin = cp.RawKernel(SPIN_SRC, "gpushare_spin")
    pad, start, end = cp.cuda.Event(), cp.cuda.Event(), cp.cuda.Event()
    spin((1,), (32,), (np.uint64(2_000_000),))  # a pad, so the events time device work only
    start.record()
    spin((1,), (32,), (np.uint64(int(spin_ms * 1e6)),))
    end.record()
    end.synchronize()
    return {"framework": "cupy", "elapsed_ms": cp.cuda.get_elapsed_time(start, end)}


def cuda_core_case(spin_ms):
    from cuda.core import Device, EventOptions, LaunchConfig, Program, ProgramOptions, launch

    dev = Device()
    dev.set_current()
    stream = dev.create_stream()
    arch = "sm_" + "".join(str(x) for x in dev.compute_capability)
    prog = Program(SPIN_SRC, code_type="c++", options=ProgramOptions(arch=arch))
    kernel = prog.compile("cubin").get_kernel("gpushare_spin")
    config = LaunchConfig(grid=1, block=32)
    timing = EventOptions(timing_enabled=True)
    launch(stream, config, kernel, np.uint64(2_000_000))  # pad
    start = stream.record(options=timing)
    launch(stream, config, kernel, np.uint64(int(spin_ms * 1e6)))
    end = stream.record(options=timing)
    end.sync()
    elapsed = end - start
    builder = stream.create_graph_builder()
    builder.begin_building()
    launch(builder, config, kernel, np.uint64(1_000_000))
    launch(builder, config, kernel, np.uint64(1_000_000))
    graph = builder.end_building().complete()
    graph.launch(stream)
    stream.sync()
    return {"framework": "cuda_core", "elapsed_ms": elapsed, "arch": arch}


CASES = {"numba": lambda: numba_case(10), "cupy": lambda: cupy_case(10.0),
         "cuda_core": lambda: cuda_core_case(10.0)}
for case in sys.argv[1:]:
    if case not in CASES:
        sys.exit(f"unknown case {case!r}: numba, cupy or cuda_core")
    print(json.dumps(CASES[case]()), flush=True)
