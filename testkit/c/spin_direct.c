/* spin_direct.c: a spin workload linked directly against libcuda (the exported-symbol route).
 *
 *   spin_direct MS_PER_KERNEL KERNELS SYNC_EVERY [launch|ex|coop|graph]
 *
 * Launches KERNELS `gpushare_spin` kernels of MS_PER_KERNEL milliseconds each on one created
 * stream, synchronising the stream after every SYNC_EVERY kernels (0: only at the end), through
 * cuLaunchKernel (default), cuLaunchKernelEx, cuLaunchCooperativeKernel, or cuGraphLaunch of a
 * captured one-kernel graph. Prints one JSON line {"pid":…,"kernels":…,"mode":…,"wall_ms":…};
 * on a failed call prints "FAIL: …" on stderr and exits 1.
 *
 * Build: gcc spin_direct.c -L<dir of libcuda.so> -lcuda */
#define _GNU_SOURCE
#include "cuda_min.h"
#include "cuda_api.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "spin.h"


int main(int argc, char **argv) {
    check_error_name = cuGetErrorName;
    if (argc < 4 || argc > 5) {
        fprintf(stderr, "usage: %s MS_PER_KERNEL KERNELS SYNC_EVERY [launch|ex|coop|graph]\n",
                argv[0]);
        return 2;
    }
    double ms = atof(argv[1]);
    long kernels = atol(argv[2]);
    long sync_every = atol(argv[3]);
    const char *mode = argc == 5 ? argv[4] : "launch";
    if (ms < 0 || kernels < 0 || sync_every < 0)
        fail("arguments must be non-negative");
    int m = strcmp(mode, "launch") == 0 ? 0
            : strcmp(mode, "ex") == 0   ? 1
            : strcmp(mode, "coop") == 0 ? 2
            : strcmp(mode, "graph") == 0 ? 3
                                         : -1;
    if (m < 0)
        fail("unknown launch mode %s (launch, ex, coop or graph)", mode);

    CUfunction spin;
    CUstream s;
    CUcontext ctx = spin_setup(&spin, &s);

    unsigned long long ns = (unsigned long long)(ms * 1e6 + 0.5);
    void *args[] = {&ns};
    CUlaunchConfig cfg = {1, 1, 1, 1, 1, 1, 0, s, NULL, 0};
    CUgraphExec exec = NULL;
    if (m == 3) {
        CUgraph graph;
        CK(cuStreamBeginCapture_v2(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
        CK(cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, s, args, NULL));
        CK(cuStreamEndCapture(s, &graph));
        CK(cuGraphInstantiateWithFlags(&exec, graph, 0));
    }

    unsigned long long t0 = now_ns();
    for (long i = 1; i <= kernels; i++) {
        switch (m) {
        case 0:
            CK(cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, s, args, NULL));
            break;
        case 1:
            CK(cuLaunchKernelEx(&cfg, spin, args, NULL));
            break;
        case 2:
            CK(cuLaunchCooperativeKernel(spin, 1, 1, 1, 1, 1, 1, 0, s, args));
            break;
        default:
            CK(cuGraphLaunch(exec, s));
        }
        if (sync_every > 0 && i % sync_every == 0)
            CK(cuStreamSynchronize(s));
    }
    CK(cuStreamSynchronize(s));
    unsigned long long t1 = now_ns();
    CK(cuCtxDestroy_v2(ctx));
    printf("{\"pid\":%d,\"kernels\":%ld,\"mode\":\"%s\",\"start_ns\":%llu,\"end_ns\":%llu,"
           "\"wall_ms\":%.3f}\n",
           (int)getpid(), kernels, mode, t0, t1, (t1 - t0) / 1e6);
    return 0;
}
