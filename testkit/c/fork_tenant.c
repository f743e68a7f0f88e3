/* fork_tenant.c: a process under gpushare that forks in the middle of its GPU work.
 *
 *   fork_tenant KERNELS
 *
 * Launches KERNELS 1 ms spin kernels (synchronising every 10), forking after half of them two
 * children: one that does no CUDA work and exits, and one that calls cuInit and cuDeviceGet and
 * must get an error or success, never hang or crash. The parent then finishes its kernels.
 * Prints {"pid":…,"kernels":…,"child_cuinit":…,"wall_ms":…}; on a failed call prints "FAIL: …" and exits 1. */
#define _GNU_SOURCE
#include "cuda_min.h"
#include "cuda_api.h"

#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "context.h"
#include "gpushare_spin_ptx.h"


static int wait_child(pid_t pid) {
    int status = 0;
    if (waitpid(pid, &status, 0) != pid) fail("waitpid");
    if (!WIFEXITED(status)) fail("a forked child died of a signal");
    return WEXITSTATUS(status);
}

int main(int argc, char **argv) {
    check_error_name = cuGetErrorName;
    if (argc != 2) {
        fprintf(stderr, "usage: %s KERNELS\n", argv[0]);
        return 2;
    }
    long kernels = atol(argv[1]);
    CUmodule mod;
    CUfunction spin;
    context_create(NULL);
    CK(cuModuleLoadData(&mod, GPUSHARE_SPIN_PTX));
    CK(cuModuleGetFunction(&spin, mod, "gpushare_spin"));
    unsigned long long ns = 1000000ULL;
    void *params[] = {&ns};
    int child_cuinit = -1;
    unsigned long long t0 = now_ns();
    for (long i = 0; i < kernels; i++) {
        CK(cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL));
        if ((i + 1) % 10 == 0) CK(cuStreamSynchronize(NULL));
        if (i == kernels / 2) {
            pid_t idle = fork();
            if (idle < 0) fail("fork");
            if (idle == 0) _exit(0);
            pid_t user = fork();
            if (user < 0) fail("fork");
            if (user == 0) {
                /* The real driver refuses CUDA in a child of an initialised parent; the point is
                 * that the hook neither hangs nor crashes it. */
                CUdevice d;
                CUresult r = cuInit(0);
                if (r == 0) r = cuDeviceGet(&d, 0);
                _exit(r == 0 ? 0 : 3);
            }
            if (wait_child(idle) != 0) fail("the idle child failed");
            child_cuinit = wait_child(user);
        }
    }
    CK(cuStreamSynchronize(NULL));
    printf("{\"pid\":%d,\"kernels\":%ld,\"child_cuinit\":%d,\"wall_ms\":%.1f}\n", getpid(),
           kernels, child_cuinit, (now_ns() - t0) / 1e6);
    return 0;
}
