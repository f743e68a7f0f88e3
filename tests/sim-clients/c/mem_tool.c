/* mem_tool.c: small memory-cap probes, linked directly against libcuda (gcc mem_tool.c
 * -L<dir> -lcuda). Each command prints JSON lines on stdout (flushed at once); a failed driver
 * call prints "FAIL: …" on stderr and exits 1.
 *
 *   mem_tool info               {"free":…,"total":…,"device_total":…} (cuMemGetInfo_v2,
 *                               cuDeviceTotalMem_v2)
 *   mem_tool hold BYTES         cuMemAlloc_v2(BYTES), print {"held":BYTES,"t_ns":…}, then wait:
 *                               SIGUSR1 frees it, prints {"freed":…} and exits 0
 *   mem_tool try BYTES RETRY_MS cuMemAlloc_v2(BYTES), retried every 1 ms while it returns
 *                               CUDA_ERROR_OUT_OF_MEMORY, for at most RETRY_MS; prints
 *                               {"result":…,"attempts":…,"t_start_ns":…,"t_done_ns":…}; frees
 *   mem_tool bench N BYTES      N × (cuMemAlloc_v2(BYTES); cuMemFree_v2), after a warm-up;
 *                               prints {"ns_per_alloc":…,"ns_per_free":…} */
#define _GNU_SOURCE
#include "cuda_min.h"

#include "cuda_mem.h"

#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "check.h"

static CUdevice dev;
static volatile sig_atomic_t release_now;

static void on_usr1(int sig) {
    (void)sig;
    release_now = 1;
}

static void setup(void) {
    CK(cuInit(0));
    CK(cuDeviceGet(&dev, 0));
    CUcontext ctx;
    CK(cuCtxCreate_v2(&ctx, 0, dev));
}

static void print_info(const char *key) {
    size_t free = 0, total = 0, dtotal = 0;
    CK(cuMemGetInfo_v2(&free, &total));
    CK(cuDeviceTotalMem_v2(&dtotal, dev));
    printf("{\"%s\":true,\"free\":%zu,\"total\":%zu,\"device_total\":%zu}\n", key, free, total,
           dtotal);
    fflush(stdout);
}

int main(int argc, char **argv) {
    check_error_name = cuGetErrorName;
    if (argc < 2) {
        fprintf(stderr, "usage: %s info | hold BYTES | try BYTES RETRY_MS | bench N BYTES\n",
                argv[0]);
        return 2;
    }
    const char *cmd = argv[1];
    if (strcmp(cmd, "info") == 0 && argc == 2) {
        setup();
        print_info("info");
    } else if (strcmp(cmd, "hold") == 0 && argc == 3) {
        size_t bytes = strtoull(argv[2], NULL, 10);
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_usr1;
        sigaction(SIGUSR1, &sa, NULL);
        setup();
        CUdeviceptr p;
        CK(cuMemAlloc_v2(&p, bytes));
        printf("{\"held\":%zu,\"t_ns\":%llu,\"pid\":%d}\n", bytes, now_ns(), (int)getpid());
        fflush(stdout);
        while (!release_now)
            usleep(1000);
        unsigned long long t0 = now_ns();
        CK(cuMemFree_v2(p));
        unsigned long long t1 = now_ns();
        printf("{\"freed\":%zu,\"free_ns\":%llu}\n", bytes, t1 - t0);
        print_info("after_free");
    } else if (strcmp(cmd, "try") == 0 && argc == 4) {
        size_t bytes = strtoull(argv[2], NULL, 10);
        unsigned long long retry_ns = strtoull(argv[3], NULL, 10) * 1000000ull;
        setup();
        print_info("before");
        CUdeviceptr p = 0;
        unsigned long long t0 = now_ns();
        int attempts = 0;
        CUresult r;
        for (;;) {
            attempts++;
            r = cuMemAlloc_v2(&p, bytes);
            if (r != CUDA_ERROR_OUT_OF_MEMORY || now_ns() - t0 >= retry_ns)
                break;
            usleep(1000);
        }
        unsigned long long t1 = now_ns();
        printf("{\"result\":%d,\"attempts\":%d,\"t_start_ns\":%llu,\"t_done_ns\":%llu}\n", r,
               attempts, t0, t1);
        fflush(stdout);
        if (r == CUDA_SUCCESS) {
            print_info("holding");
            CK(cuMemFree_v2(p));
        }
    } else if (strcmp(cmd, "bench") == 0 && argc == 4) {
        long n = atol(argv[2]);
        size_t bytes = strtoull(argv[3], NULL, 10);
        EXPECT(n > 0, "N must be positive");
        setup();
        CUdeviceptr p;
        for (int i = 0; i < 100; i++) {
            CK(cuMemAlloc_v2(&p, bytes));
            CK(cuMemFree_v2(p));
        }
        unsigned long long alloc_ns = 0, free_ns = 0;
        for (long i = 0; i < n; i++) {
            unsigned long long t0 = now_ns();
            CK(cuMemAlloc_v2(&p, bytes));
            unsigned long long t1 = now_ns();
            CK(cuMemFree_v2(p));
            unsigned long long t2 = now_ns();
            alloc_ns += t1 - t0;
            free_ns += t2 - t1;
        }
        printf("{\"n\":%ld,\"bytes\":%zu,\"ns_per_alloc\":%.0f,\"ns_per_free\":%.0f}\n", n, bytes,
               (double)alloc_ns / n, (double)free_ns / n);
    } else {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }
    return 0;
}
