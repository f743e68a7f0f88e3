/* exit_queued.c: leaves while the kernels it launched are still queued on the GPU, under its
 * turn, with the hook's threads still running.
 *
 *   exit_queued MS_PER_KERNEL KERNELS LINGER_MS return|exit
 *
 * Launches KERNELS `gpushare_spin` kernels of MS_PER_KERNEL milliseconds each on one created
 * stream, never synchronising, then returns from main (`return`) or calls exit(0) (`exit`).
 * Before cuInit it registers an exit handler that sleeps LINGER_MS: exit handlers run in reverse
 * order of registration, so it runs after the driver's teardown (registered at cuInit), as the
 * teardown of a library initialised before CUDA would, and gives the process's other threads
 * that long with the driver gone. Prints {"pid":…,"kernels":…,"leaving_ns":…} before leaving;
 * on a failed call prints "FAIL: …" on stderr and exits 1.
 *
 * Build: gcc exit_queued.c -L<dir of libcuda.so> -lcuda */
#define _GNU_SOURCE
#include "cuda_min.h"
#include "cuda_api.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "spin.h"

static long linger_ms;

static void linger(void) {
    struct timespec t = {linger_ms / 1000, (linger_ms % 1000) * 1000000L};
    while (nanosleep(&t, &t) != 0)
        ;
}

int main(int argc, char **argv) {
    check_error_name = cuGetErrorName;
    if (argc != 5) {
        fprintf(stderr, "usage: %s MS_PER_KERNEL KERNELS LINGER_MS return|exit\n", argv[0]);
        return 2;
    }
    double ms = atof(argv[1]);
    long kernels = atol(argv[2]);
    linger_ms = atol(argv[3]);
    int by_exit = strcmp(argv[4], "exit") == 0;
    if (ms < 0 || kernels < 0 || linger_ms < 0 || (!by_exit && strcmp(argv[4], "return") != 0))
        fail("usage: MS_PER_KERNEL KERNELS LINGER_MS return|exit");
    if (atexit(linger) != 0)
        fail("atexit");

    CUfunction spin;
    CUstream s;
    spin_setup(&spin, &s);
    unsigned long long ns = (unsigned long long)(ms * 1e6 + 0.5);
    void *args[] = {&ns};
    for (long i = 0; i < kernels; i++)
        CK(cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, s, args, NULL));
    printf("{\"pid\":%d,\"kernels\":%ld,\"leaving_ns\":%llu}\n", (int)getpid(), kernels,
           now_ns());
    fflush(stdout);
    if (by_exit)
        exit(0);
    return 0;
}
