/* spin_procaddr.c: a spin workload that reaches the driver only through cuGetProcAddress_v2 (the
 * route of the CUDA runtime and of NVIDIA's cuda-bindings): it dlopens libcuda.so.1, looks up
 * cuGetProcAddress_v2 with dlsym, and resolves every other entry point through it.
 *
 *   spin_procaddr MS_PER_KERNEL KERNELS SYNC_EVERY [legacy|ptsz]
 *
 * Launches KERNELS `gpushare_spin` kernels of MS_PER_KERNEL milliseconds each, synchronising
 * after every SYNC_EVERY kernels (0: only at the end). `legacy` (default): cuLaunchKernel
 * resolved at version 4000, on a created stream. `ptsz`: cuLaunchKernel and cuStreamSynchronize
 * resolved with CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM (the `_ptsz` variants), launching
 * on stream 0 = the per-thread default stream. Prints one JSON line {"pid":…,"kernels":…};
 * on a failed call prints "FAIL: …" on stderr and exits 1.
 *
 * Build: gcc spin_procaddr.c -ldl (no link against libcuda). */
#define _GNU_SOURCE
#include "cuda_min.h"

#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "gpushare_spin_ptx.h"

typedef CUresult (*PFN_getProcAddress_v2)(const char *symbol, void **pfn, int cudaVersion,
                                          unsigned long long flags, int *symbolStatus);
static PFN_getProcAddress_v2 get_proc;

static void *resolve(const char *name, int version, unsigned long long flags) {
    void *p = NULL;
    int status = -1;
    CUresult r = get_proc(name, &p, version, flags, &status);
    if (r != CUDA_SUCCESS || p == NULL || status != CU_GET_PROC_ADDRESS_SUCCESS)
        fail("cuGetProcAddress_v2(\"%s\", %d, flags %llu) = %d, pfn %p, status %d", name,
             version, flags, r, p, status);
    return p;
}

int main(int argc, char **argv) {
    if (argc < 4 || argc > 5) {
        fprintf(stderr, "usage: %s MS_PER_KERNEL KERNELS SYNC_EVERY [legacy|ptsz]\n", argv[0]);
        return 2;
    }
    double ms = atof(argv[1]);
    long kernels = atol(argv[2]);
    long sync_every = atol(argv[3]);
    const char *mode = argc == 5 ? argv[4] : "legacy";
    if (ms < 0 || kernels < 0 || sync_every < 0)
        fail("arguments must be non-negative");
    int ptsz = strcmp(mode, "ptsz") == 0;
    if (!ptsz && strcmp(mode, "legacy") != 0)
        fail("unknown mode %s (legacy or ptsz)", mode);

    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib)
        fail("dlopen(libcuda.so.1): %s", dlerror());
    get_proc = (PFN_getProcAddress_v2)dlsym(lib, "cuGetProcAddress_v2");
    if (!get_proc)
        fail("dlsym(cuGetProcAddress_v2): %s", dlerror());

    check_error_name = (CUresult(*)(CUresult, const char **))resolve("cuGetErrorName", 6000, 0);
    CUresult (*init)(unsigned) = resolve("cuInit", 2000, 0);
    CUresult (*device_get)(CUdevice *, int) = resolve("cuDeviceGet", 2000, 0);
    CUresult (*ctx_create)(CUcontext *, unsigned, CUdevice) = resolve("cuCtxCreate", 3020, 0);
    CUresult (*ctx_destroy)(CUcontext) = resolve("cuCtxDestroy", 4000, 0);
    CUresult (*module_load_data)(CUmodule *, const void *) = resolve("cuModuleLoadData", 2000, 0);
    CUresult (*module_get_function)(CUfunction *, CUmodule, const char *) =
        resolve("cuModuleGetFunction", 2000, 0);
    CUresult (*stream_create)(CUstream *, unsigned) = resolve("cuStreamCreate", 2000, 0);
    unsigned long long flags = ptsz ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : 0;
    int version = ptsz ? 12000 : 4000;
    CUresult (*stream_sync)(CUstream) = resolve("cuStreamSynchronize", ptsz ? 12000 : 2000, flags);
    CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                       unsigned, CUstream, void **, void **) =
        resolve("cuLaunchKernel", version, flags);

    CK(init(0));
    CUdevice dev;
    CK(device_get(&dev, 0));
    CUcontext ctx;
    CK(ctx_create(&ctx, 0, dev));
    CUmodule mod;
    CUfunction spin;
    CK(module_load_data(&mod, GPUSHARE_SPIN_PTX));
    CK(module_get_function(&spin, mod, "gpushare_spin"));
    CUstream s = NULL; /* ptsz: stream 0 is this thread's default stream */
    if (!ptsz)
        CK(stream_create(&s, CU_STREAM_NON_BLOCKING));

    unsigned long long ns = (unsigned long long)(ms * 1e6 + 0.5);
    void *args[] = {&ns};
    unsigned long long t0 = now_ns();
    for (long i = 1; i <= kernels; i++) {
        CK(launch(spin, 1, 1, 1, 1, 1, 1, 0, s, args, NULL));
        if (sync_every > 0 && i % sync_every == 0)
            CK(stream_sync(s));
    }
    CK(stream_sync(s));
    unsigned long long t1 = now_ns();
    CK(ctx_destroy(ctx));
    printf("{\"pid\":%d,\"kernels\":%ld,\"mode\":\"%s\",\"start_ns\":%llu,\"end_ns\":%llu,"
           "\"wall_ms\":%.3f}\n",
           (int)getpid(), kernels, mode, t0, t1, (t1 - t0) / 1e6);
    return 0;
}
