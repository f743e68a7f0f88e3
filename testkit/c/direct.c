/* direct.c: a C program linked directly against libcuda (gcc direct.c -L<dir> -lcuda), using the
 * driver API through the real exported symbol names. It checks results, prints PASS, or prints
 * "FAIL: <which check>" on stderr and exits 1.
 *
 * Runs unchanged on a real GPU; on the simulator it needs `gpushare-sim run -- ./direct`. */
#define _GNU_SOURCE
#include "cuda_min.h"
#include "cuda_api.h"

#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "gpushare_spin_ptx.h"

/* Driver API prototypes (CUDA 12.x ABI of each exported symbol). */

#define MS 1000000ull
#define TOL 0.03

static CUfunction spin_fn;

static void launch_spin(CUstream s, unsigned long long ns) {
    void *args[] = {&ns};
    CK(cuLaunchKernel(spin_fn, 1, 1, 1, 1, 1, 1, 0, s, args, NULL));
}

/* Device time (ms) between events recorded on `s` before and after whatever `s` gets next.
 * timer_start first queues a 5 ms pad kernel, so the start event completes when the pad does and
 * the timed work follows at once: host launch latency is not part of the measurement. */
#define PAD_NS (5 * MS)
struct timer {
    CUevent start, end;
    CUstream s;
};
static void timer_start(struct timer *t, CUstream s) {
    t->s = s;
    CK(cuEventCreate(&t->start, CU_EVENT_DEFAULT));
    CK(cuEventCreate(&t->end, CU_EVENT_DEFAULT));
    launch_spin(s, PAD_NS);
    CK(cuEventRecord(t->start, s));
}
static float timer_stop(struct timer *t) {
    float ms = -1;
    CK(cuEventRecord(t->end, t->s));
    CK(cuEventSynchronize(t->end));
    CK(cuEventElapsedTime(&ms, t->start, t->end));
    return ms;
}

static unsigned long long host_fn_ran_at;
static void host_fn(void *user) {
    (void)user;
    __atomic_store_n(&host_fn_ran_at, now_ns(), __ATOMIC_SEQ_CST);
}

static void on_segv(int sig) {
    (void)sig;
    static const char msg[] =
        "FAIL: host access to cuMemAllocManaged memory crashed (SIGSEGV): managed memory must be "
        "host-accessible\n";
    ssize_t w = write(2, msg, sizeof msg - 1);
    (void)w;
    _exit(1);
}

int main(void) {
    check_error_name = cuGetErrorName;

    /* Error names. */
    const char *name = NULL;
    CK(cuGetErrorName(CUDA_ERROR_NOT_FOUND, &name));
    EXPECT(name && strcmp(name, "CUDA_ERROR_NOT_FOUND") == 0, "cuGetErrorName(500) = %s",
           name ? name : "NULL");
    CK(cuGetErrorName(CUDA_ERROR_OUT_OF_MEMORY, &name));
    EXPECT(name && strcmp(name, "CUDA_ERROR_OUT_OF_MEMORY") == 0, "cuGetErrorName(2) = %s",
           name ? name : "NULL");
    CK_EQ(cuGetErrorName(987654, &name), CUDA_ERROR_INVALID_VALUE);

    /* Device. */
    CK(cuInit(0));
    CUdevice dev;
    CK(cuDeviceGet(&dev, 0));
    CUdevice bad_dev;
    CK_EQ(cuDeviceGet(&bad_dev, 1000), 101 /* CUDA_ERROR_INVALID_DEVICE */);
    char dev_name[256] = {0};
    CK(cuDeviceGetName(dev_name, sizeof dev_name, dev));
    EXPECT(strlen(dev_name) > 0, "empty device name");
    CUuuid uuid;
    memset(&uuid, 0, sizeof uuid);
    CK(cuDeviceGetUuid(&uuid, dev));
    int nonzero = 0;
    for (int i = 0; i < 16; i++)
        nonzero |= uuid.bytes[i];
    EXPECT(nonzero, "cuDeviceGetUuid returned an all-zero UUID");
    int major = -1, minor = -1, sms = -1, warp = -1, coop = -1, pools = -1, v = 0;
    CK(cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev));
    CK(cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev));
    EXPECT(major == 9 && minor == 0, "compute capability %d.%d, expected 9.0 (H100)", major, minor);
    CK(cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev));
    EXPECT(sms > 0, "multiprocessor count %d", sms);
    CK(cuDeviceGetAttribute(&warp, CU_DEVICE_ATTRIBUTE_WARP_SIZE, dev));
    EXPECT(warp == 32, "warp size %d", warp);
    CK(cuDeviceGetAttribute(&coop, CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH, dev));
    EXPECT(coop == 1, "cooperative launch attribute %d", coop);
    CK(cuDeviceGetAttribute(&pools, CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, dev));
    EXPECT(pools == 0, "memory pools attribute %d, expected 0", pools);
    CK_EQ(cuDeviceGetAttribute(&v, 100000, dev), CUDA_ERROR_INVALID_VALUE);

    /* Context and memory. */
    CUcontext ctx;
    CK(cuCtxCreate_v2(&ctx, 0, dev));
    size_t free0 = 0, total = 0;
    CK(cuMemGetInfo_v2(&free0, &total));
    EXPECT(total > 0 && free0 <= total, "cuMemGetInfo: free %zu total %zu", free0, total);

    CUdeviceptr huge = 0;
    CK_EQ(cuMemAlloc_v2(&huge, total + 1), CUDA_ERROR_OUT_OF_MEMORY);

    enum { N = 1 << 20 };
    unsigned *host = malloc(N * sizeof *host), *back = malloc(N * sizeof *back);
    for (unsigned i = 0; i < N; i++)
        host[i] = i * 2654435761u ^ 0xa5a5a5a5u;
    CUdeviceptr buf;
    CK(cuMemAlloc_v2(&buf, N * sizeof *host));
    size_t free1 = 0;
    CK(cuMemGetInfo_v2(&free1, &total));
    EXPECT(free1 + N * sizeof *host <= free0, "free memory %zu -> %zu after a 4 MiB allocation",
           free0, free1);
    CK(cuMemcpyHtoD_v2(buf, host, N * sizeof *host));
    memset(back, 0, N * sizeof *back);
    CK(cuMemcpyDtoH_v2(back, buf, N * sizeof *back));
    EXPECT(memcmp(host, back, N * sizeof *host) == 0, "HtoD/DtoH round trip differs");

    /* Pitched allocation: rows are at least as wide as asked; row 3 round-trips. */
    CUdeviceptr pitched;
    size_t pitch = 0;
    CK(cuMemAllocPitch_v2(&pitched, &pitch, 1000, 16, 4));
    EXPECT(pitch >= 1000 && pitch % 4 == 0, "pitch %zu for 1000-byte rows", pitch);
    CK(cuMemcpyHtoD_v2(pitched + 3 * pitch, host, 1000));
    memset(back, 0, 1000);
    CK(cuMemcpyDtoH_v2(back, pitched + 3 * pitch, 1000));
    EXPECT(memcmp(host, back, 1000) == 0, "pitched row round trip differs");

    /* Managed memory is visible to the host and the driver alike. */
    CUdeviceptr managed;
    CK(cuMemAllocManaged(&managed, 4096, CU_MEM_ATTACH_GLOBAL));
    signal(SIGSEGV, on_segv);
    signal(SIGBUS, on_segv);
    volatile unsigned *mp = (volatile unsigned *)(uintptr_t)managed;
    for (unsigned i = 0; i < 1024; i++)
        mp[i] = host[i];
    signal(SIGSEGV, SIG_DFL);
    signal(SIGBUS, SIG_DFL);
    memset(back, 0, 4096);
    CK(cuMemcpyDtoH_v2(back, managed, 4096));
    EXPECT(memcmp(host, back, 4096) == 0, "host writes to managed memory not seen by cuMemcpyDtoH");
    CK(cuMemcpyHtoD_v2(managed, host + 1024, 4096));
    EXPECT(mp[0] == host[1024] && mp[1023] == host[2047],
           "cuMemcpyHtoD into managed memory not seen by the host");

    /* Module and functions. */
    CUmodule mod;
    CK(cuModuleLoadData(&mod, GPUSHARE_SPIN_PTX));
    CK(cuModuleGetFunction(&spin_fn, mod, "gpushare_spin"));
    CUfunction touch_fn, missing_fn;
    CK(cuModuleGetFunction(&touch_fn, mod, "touch"));
    CK_EQ(cuModuleGetFunction(&missing_fn, mod, "no_such_kernel"), CUDA_ERROR_NOT_FOUND);

    CUstream s;
    CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));

    /* A 1 ms spin timed with events. */
    struct timer t;
    timer_start(&t, s);
    launch_spin(s, 1 * MS);
    float ms = timer_stop(&t);
    EXPECT_NEAR(ms, 1.0, TOL, "cuEventElapsedTime around a 1 ms spin (ms)");

    /* Events without timing cannot be timed. */
    CUevent nt0, nt1;
    CK(cuEventCreate(&nt0, CU_EVENT_DISABLE_TIMING));
    CK(cuEventCreate(&nt1, CU_EVENT_DISABLE_TIMING));
    CK(cuEventRecord(nt0, s));
    CK(cuEventRecord(nt1, s));
    CK(cuEventSynchronize(nt1));
    CK_EQ(cuEventElapsedTime(&ms, nt0, nt1), 400 /* CUDA_ERROR_INVALID_HANDLE */);

    /* The two-parameter kernel on the legacy default stream. */
    unsigned n = N;
    void *touch_args[] = {&buf, &n};
    CK(cuLaunchKernel(touch_fn, N / 256, 1, 1, 256, 1, 1, 0, NULL, touch_args, NULL));
    CK(cuStreamSynchronize(NULL));

    /* A host function runs after the kernel before it in the stream. */
    unsigned long long t0 = now_ns();
    launch_spin(s, 3 * MS);
    CK(cuLaunchHostFunc(s, host_fn, NULL));
    unsigned long long enqueued = now_ns();
    if (enqueued - t0 < 2 * MS) /* otherwise this thread was descheduled: nothing to conclude */
        EXPECT(__atomic_load_n(&host_fn_ran_at, __ATOMIC_SEQ_CST) == 0,
               "host function ran before the 3 ms kernel ahead of it finished");
    CK(cuStreamSynchronize(s));
    unsigned long long ran = __atomic_load_n(&host_fn_ran_at, __ATOMIC_SEQ_CST);
    EXPECT(ran != 0, "host function did not run by cuStreamSynchronize");
    EXPECT(ran - t0 >= (unsigned long long)(3 * MS * (1 - TOL)),
           "host function ran %.3f ms after the launch of a 3 ms kernel ahead of it",
           (ran - t0) / 1e6);

    /* cuLaunchKernelEx and cuLaunchCooperativeKernel. */
    unsigned long long ns = 1 * MS;
    void *spin_args[] = {&ns};
    CUlaunchConfig cfg = {1, 1, 1, 1, 1, 1, 0, s, NULL, 0};
    timer_start(&t, s);
    CK(cuLaunchKernelEx(&cfg, spin_fn, spin_args, NULL));
    ms = timer_stop(&t);
    EXPECT_NEAR(ms, 1.0, TOL, "cuLaunchKernelEx 1 ms spin (ms)");
    timer_start(&t, s);
    CK(cuLaunchCooperativeKernel(spin_fn, 1, 1, 1, 1, 1, 1, 0, s, spin_args));
    ms = timer_stop(&t);
    EXPECT_NEAR(ms, 1.0, TOL, "cuLaunchCooperativeKernel 1 ms spin (ms)");

    /* A captured graph of three 1 ms spins, launched twice: 6 ms of device time. */
    CUstream cs;
    CK(cuStreamCreate(&cs, CU_STREAM_NON_BLOCKING));
    CK(cuStreamBeginCapture_v2(cs, CU_STREAM_CAPTURE_MODE_GLOBAL));
    for (int i = 0; i < 3; i++)
        launch_spin(cs, 1 * MS);
    CUgraph graph;
    CK(cuStreamEndCapture(cs, &graph));
    unsigned long long before_sync = now_ns();
    CK(cuStreamSynchronize(cs));
    EXPECT(now_ns() - before_sync < 1 * MS,
           "cuStreamSynchronize after capture took %.3f ms: captured kernels were executed",
           (now_ns() - before_sync) / 1e6);
    CUgraphExec exec;
    CK(cuGraphInstantiateWithFlags(&exec, graph, 0));
    timer_start(&t, cs);
    CK(cuGraphLaunch(exec, cs));
    CK(cuGraphLaunch(exec, cs));
    ms = timer_stop(&t);
    EXPECT_NEAR(ms, 6.0, TOL, "two launches of a graph of three 1 ms spins (ms)");
    CK(cuGraphExecDestroy(exec));
    CK(cuGraphDestroy(graph));

    CK(cuMemFree_v2(buf));
    CK(cuMemFree_v2(pitched));
    CK(cuMemFree_v2(managed));
    size_t free2 = 0;
    CK(cuMemGetInfo_v2(&free2, &total));
    EXPECT(free2 >= free1 + N * sizeof *host,
           "free memory %zu after freeing everything, %zu while 4 MiB were held", free2, free1);
    CK(cuCtxDestroy_v2(ctx));

    free(host);
    free(back);
    printf("PASS device=\"%s\" cc=%d.%d sms=%d total=%zu\n", dev_name, major, minor, sms, total);
    return 0;
}
