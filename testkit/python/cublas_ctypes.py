"""cuBLAS alone, through ctypes, from NVIDIA's PyPI wheels (nvidia-cublas-cu12 and
nvidia-cuda-runtime-cu12): create a handle, run a float32 GEMM and a cuBLASLt-backed batched
GEMM on the simulated GPU, copy the operands back. Prints one JSON line."""

import ctypes
import json
import os

import nvidia.cublas
import nvidia.cuda_runtime


def lib(pkg, name):
    return ctypes.CDLL(os.path.join(list(pkg.__path__)[0], "lib", name), mode=ctypes.RTLD_GLOBAL)


cudart = lib(nvidia.cuda_runtime, "libcudart.so.12")
cublas = lib(nvidia.cublas, "libcublas.so.12")


def check(what, status):
    if status != 0:
        raise SystemExit(f"{what} returned {status}")


n = 128
size = n * n * 4
a, b, c = (ctypes.c_void_p() for _ in range(3))
for p in (a, b, c):
    check("cudaMalloc", cudart.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(size)))
host = (ctypes.c_float * (n * n))(*[float(i % 7) for i in range(n * n)])
check("cudaMemcpy", cudart.cudaMemcpy(a, host, ctypes.c_size_t(size), 1))
handle = ctypes.c_void_p()
check("cublasCreate_v2", cublas.cublasCreate_v2(ctypes.byref(handle)))
one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
check("cublasSgemm_v2", cublas.cublasSgemm_v2(handle, 0, 0, n, n, n, ctypes.byref(one), a, n, b, n,
                                              ctypes.byref(zero), c, n))
check("cublasSgemmStridedBatched", cublas.cublasSgemmStridedBatched(
    handle, 0, 0, 32, 32, 32, ctypes.byref(one), a, 32, ctypes.c_longlong(1024), b, 32,
    ctypes.c_longlong(1024), ctypes.byref(zero), c, 32, ctypes.c_longlong(1024), 4))
check("cudaDeviceSynchronize", cudart.cudaDeviceSynchronize())
back = (ctypes.c_float * (n * n))()
check("cudaMemcpy", cudart.cudaMemcpy(back, a, ctypes.c_size_t(size), 2))
check("cublasDestroy_v2", cublas.cublasDestroy_v2(handle))
print(json.dumps({"gemms": 2, "round_trip": list(back) == list(host)}))
