/* peer_tenant.c: one process driving two GPUs whose kernels wait for each other, as NCCL's do
 * (linked directly against libcuda: the exported-symbol route).
 *
 *   peer_tenant ring ITERS SPIN0_US SPIN1_US SYNC_EVERY
 *       Two threads, one per GPU (primary contexts of devices 0 and 1, a created stream each),
 *       ITERS iterations of a ring of two:
 *         GPU 1: gpushare_spin(SPIN1_US); gpushare_set_flag(A[i]); record event E[i];
 *                gpushare_wait_flag(B[i])
 *         GPU 0: gpushare_wait_flag(A[i]); gpushare_spin(SPIN0_US); cuStreamWaitEvent(E[i])
 *                (an event of GPU 1's stream); gpushare_set_flag(B[i])
 *       so each GPU's work waits on the other's, through peer-waiting kernels (spinning on the
 *       device until the other GPU sets their flag) and a cross-device event dependency. Each
 *       thread synchronises its stream every SYNC_EVERY iterations (0: only at the end).
 *       Prints {"pid":…,"mode":"ring","iters":…,"start_ns":…,"end_ns":…,"wall_ms":…}.
 *
 *   peer_tenant hold DELAY_MS
 *       Launches one gpushare_wait_flag(F) on GPU 0, sleeps DELAY_MS on the host, then launches
 *       gpushare_set_flag(F) on GPU 1 and synchronises both GPUs: a kernel that holds GPU 0
 *       waiting for its peer for DELAY_MS. Prints {"pid":…,"mode":"hold","wait_launched_ns":…,
 *       "set_launched_ns":…,"end_ns":…}.
 *
 * On a failed call prints "FAIL: …" on stderr and exits 1.
 * Build: gcc peer_tenant.c -L<dir of libcuda.so> -lcuda -lpthread */
#define _GNU_SOURCE
#include "cuda_min.h"
#include "cuda_api.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "gpushare_peer_ptx.h"
#include "gpushare_spin_ptx.h"

/* One GPU's context, stream and kernels. */
struct gpu {
    CUcontext ctx;
    CUstream stream;
    CUfunction spin, wait_flag, set_flag;
};

static void gpu_open(struct gpu *g, int ordinal) {
    CUdevice dev;
    CK(cuDeviceGet(&dev, ordinal));
    CK(cuDevicePrimaryCtxRetain(&g->ctx, dev));
    CK(cuCtxSetCurrent(g->ctx));
    CUmodule spin_mod, peer_mod;
    CK(cuModuleLoadData(&spin_mod, GPUSHARE_SPIN_PTX));
    CK(cuModuleLoadData(&peer_mod, GPUSHARE_PEER_PTX));
    CK(cuModuleGetFunction(&g->spin, spin_mod, "gpushare_spin"));
    CK(cuModuleGetFunction(&g->wait_flag, peer_mod, "gpushare_wait_flag"));
    CK(cuModuleGetFunction(&g->set_flag, peer_mod, "gpushare_set_flag"));
    CK(cuStreamCreate(&g->stream, CU_STREAM_NON_BLOCKING));
}

/* Launch `f` with one u64 argument on the GPU's stream (its context current on this thread). */
static void launch1(struct gpu *g, CUfunction f, unsigned long long arg) {
    void *args[] = {&arg};
    CK(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, g->stream, args, NULL));
}

/* `n` zeroed u64 flags in the current context's device memory. */
static CUdeviceptr flags_alloc(long n) {
    CUdeviceptr p;
    CK(cuMemAlloc_v2(&p, (size_t)n * 8));
    CK(cuMemsetD8_v2(p, 0, (size_t)n * 8));
    return p;
}

static struct gpu gpus[2];
static long iters, sync_every;
static unsigned long long spin_ns[2];
static CUdeviceptr flags_a, flags_b;
static CUevent *events;
/* Events GPU 1's thread has recorded so far (GPU 0's thread may wait for those). */
static long recorded;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;

static void *gpu1_loop(void *arg) {
    (void)arg;
    struct gpu *g = &gpus[1];
    CK(cuCtxSetCurrent(g->ctx));
    for (long i = 0; i < iters; i++) {
        launch1(g, g->spin, spin_ns[1]);
        launch1(g, g->set_flag, flags_a + 8 * (unsigned long long)i);
        CK(cuEventRecord(events[i], g->stream));
        pthread_mutex_lock(&mu);
        recorded = i + 1;
        pthread_cond_broadcast(&cv);
        pthread_mutex_unlock(&mu);
        launch1(g, g->wait_flag, flags_b + 8 * (unsigned long long)i);
        if (sync_every > 0 && (i + 1) % sync_every == 0)
            CK(cuStreamSynchronize(g->stream));
    }
    CK(cuStreamSynchronize(g->stream));
    return NULL;
}

static void *gpu0_loop(void *arg) {
    (void)arg;
    struct gpu *g = &gpus[0];
    CK(cuCtxSetCurrent(g->ctx));
    for (long i = 0; i < iters; i++) {
        launch1(g, g->wait_flag, flags_a + 8 * (unsigned long long)i);
        launch1(g, g->spin, spin_ns[0]);
        /* cuStreamWaitEvent takes the event's latest record: wait until GPU 1's thread made it. */
        pthread_mutex_lock(&mu);
        while (recorded <= i)
            pthread_cond_wait(&cv, &mu);
        pthread_mutex_unlock(&mu);
        CK(cuStreamWaitEvent(g->stream, events[i], 0));
        launch1(g, g->set_flag, flags_b + 8 * (unsigned long long)i);
        if (sync_every > 0 && (i + 1) % sync_every == 0)
            CK(cuStreamSynchronize(g->stream));
    }
    CK(cuStreamSynchronize(g->stream));
    return NULL;
}

static int ring(int argc, char **argv) {
    if (argc != 6)
        fail("usage: %s ring ITERS SPIN0_US SPIN1_US SYNC_EVERY", argv[0]);
    iters = atol(argv[2]);
    for (int i = 0; i < 2; i++) {
        double us = atof(argv[3 + i]);
        if (us < 0)
            fail("spin times must be non-negative");
        spin_ns[i] = (unsigned long long)(us * 1e3 + 0.5);
    }
    sync_every = atol(argv[5]);
    if (iters <= 0 || sync_every < 0)
        fail("ITERS must be positive and SYNC_EVERY non-negative");
    CK(cuCtxSetCurrent(gpus[0].ctx));
    flags_b = flags_alloc(iters); /* GPU 0 sets B, GPU 1 waits for it */
    CK(cuCtxSetCurrent(gpus[1].ctx));
    flags_a = flags_alloc(iters); /* GPU 1 sets A, GPU 0 waits for it */
    events = calloc((size_t)iters, sizeof *events);
    EXPECT(events != NULL, "out of memory");
    for (long i = 0; i < iters; i++)
        CK(cuEventCreate(&events[i], CU_EVENT_DISABLE_TIMING));

    unsigned long long t0 = now_ns();
    pthread_t t[2];
    EXPECT(pthread_create(&t[0], NULL, gpu0_loop, NULL) == 0, "pthread_create");
    EXPECT(pthread_create(&t[1], NULL, gpu1_loop, NULL) == 0, "pthread_create");
    for (int i = 0; i < 2; i++)
        EXPECT(pthread_join(t[i], NULL) == 0, "pthread_join");
    for (int i = 0; i < 2; i++) {
        CK(cuCtxSetCurrent(gpus[i].ctx));
        CK(cuCtxSynchronize());
    }
    unsigned long long t1 = now_ns();
    printf("{\"pid\":%d,\"mode\":\"ring\",\"iters\":%ld,\"start_ns\":%llu,\"end_ns\":%llu,"
           "\"wall_ms\":%.3f}\n",
           (int)getpid(), iters, t0, t1, (t1 - t0) / 1e6);
    return 0;
}

static int hold(int argc, char **argv) {
    if (argc != 3)
        fail("usage: %s hold DELAY_MS", argv[0]);
    double delay_ms = atof(argv[2]);
    if (delay_ms < 0)
        fail("DELAY_MS must be non-negative");
    CK(cuCtxSetCurrent(gpus[0].ctx));
    CUdeviceptr flag = flags_alloc(1);
    launch1(&gpus[0], gpus[0].wait_flag, flag);
    unsigned long long waiting = now_ns();
    usleep((useconds_t)(delay_ms * 1e3));
    CK(cuCtxSetCurrent(gpus[1].ctx));
    launch1(&gpus[1], gpus[1].set_flag, flag);
    unsigned long long set = now_ns();
    CK(cuStreamSynchronize(gpus[1].stream));
    CK(cuCtxSetCurrent(gpus[0].ctx));
    CK(cuStreamSynchronize(gpus[0].stream));
    unsigned long long end = now_ns();
    printf("{\"pid\":%d,\"mode\":\"hold\",\"wait_launched_ns\":%llu,\"set_launched_ns\":%llu,"
           "\"end_ns\":%llu}\n",
           (int)getpid(), waiting, set, end);
    return 0;
}

int main(int argc, char **argv) {
    check_error_name = cuGetErrorName;
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc < 2)
        fail("usage: %s ring ITERS SPIN0_US SPIN1_US SYNC_EVERY | hold DELAY_MS", argv[0]);
    CK(cuInit(0));
    int n = 0;
    CK(cuDeviceGetCount(&n));
    EXPECT(n >= 2, "two GPUs needed, %d visible", n);
    gpu_open(&gpus[0], 0);
    gpu_open(&gpus[1], 1);
    if (strcmp(argv[1], "ring") == 0)
        return ring(argc, argv);
    if (strcmp(argv[1], "hold") == 0)
        return hold(argc, argv);
    fail("unknown mode %s (ring or hold)", argv[1]);
    return 2;
}
