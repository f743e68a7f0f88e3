/* reset_tenant.c: a spin workload on the device's primary context, reset halfway (as
 * cudaDeviceReset does), linked directly against libcuda.
 *
 *   reset_tenant MS_PER_KERNEL KERNELS_BEFORE KERNELS_AFTER SYNC_EVERY
 *
 * Retains the primary context of device 0, launches KERNELS_BEFORE `gpushare_spin` kernels of
 * MS_PER_KERNEL ms on a created stream (synchronising every SYNC_EVERY), then resets the
 * primary context with cuDevicePrimaryCtxReset_v2: its modules, streams and events are gone,
 * the retained handle stays (the driver documents that a reset does not release it). Loads the
 * module again on the same handle and launches KERNELS_AFTER more the same way. Prints one JSON
 * line {"pid":…,"reset_ns":…,"end_ns":…,"same_handle":0|1}; a failed call prints "FAIL: …" on
 * stderr and exits 1.
 *
 * Build: gcc reset_tenant.c -L<dir of libcuda.so> -lcuda */
#define _GNU_SOURCE
#include "cuda_min.h"
#include "cuda_api.h"

#include <stdlib.h>
#include <unistd.h>

#include "check.h"
#include "spin.h"

/* Load the spin kernel and launch `kernels` of `ns` each on a new stream of the current
 * context, synchronising every `sync_every`. */
static void spin_run(unsigned long long ns, long kernels, long sync_every) {
    CUfunction spin;
    CUstream s;
    spin_load(&spin, &s);
    void *args[] = {&ns};
    for (long i = 1; i <= kernels; i++) {
        CK(cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, s, args, NULL));
        if (sync_every > 0 && i % sync_every == 0)
            CK(cuStreamSynchronize(s));
    }
    CK(cuStreamSynchronize(s));
}

int main(int argc, char **argv) {
    check_error_name = cuGetErrorName;
    if (argc != 5) {
        fprintf(stderr, "usage: %s MS_PER_KERNEL KERNELS_BEFORE KERNELS_AFTER SYNC_EVERY\n",
                argv[0]);
        return 2;
    }
    unsigned long long ns = (unsigned long long)(atof(argv[1]) * 1e6 + 0.5);
    long before = atol(argv[2]), after = atol(argv[3]), sync_every = atol(argv[4]);

    CK(cuInit(0));
    CUdevice dev;
    CK(cuDeviceGet(&dev, 0));
    CUcontext ctx;
    CK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CK(cuCtxSetCurrent(ctx));
    spin_run(ns, before, sync_every);

    CK(cuDevicePrimaryCtxReset_v2(dev));
    unsigned long long reset_ns = now_ns();
    CUcontext again;
    CK(cuDevicePrimaryCtxRetain(&again, dev));
    CK(cuCtxSetCurrent(ctx));
    spin_run(ns, after, sync_every);
    printf("{\"pid\":%d,\"reset_ns\":%llu,\"end_ns\":%llu,\"same_handle\":%d}\n", (int)getpid(),
           reset_ns, now_ns(), again == ctx);
    return 0;
}
