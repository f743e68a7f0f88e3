/* phase_tenant.c: a tenant whose working set grows and shrinks in phases, for memory beyond
 * the card (the `memory-overcommit` benchmark and its test).
 *
 *   phase_tenant SEED MS_PER_KERNEL BYTES:KERNELS [BYTES:KERNELS…]
 *
 * Each phase first resizes the working set to BYTES (device buffers of cuMemAlloc_v2: one more
 * buffer of the difference to grow; the newest buffers freed to shrink, then one of the
 * difference if still short), writes a pattern into each new buffer, then launches KERNELS
 * `gpushare_spin` kernels of MS_PER_KERNEL ms on one stream and synchronises, then checks that
 * every buffer it still holds has its bytes. The pattern is written to and checked on sampled
 * pages only (the first and last 4 KiB page of each buffer and one page every 64 MiB): a
 * simulated GPU keeps device memory in host memory and tens of GiB cannot be touched on the
 * host running it; pages never written are left alone by the simulated driver, written ones are
 * moved to host memory and back by a checkpoint like the rest.
 *
 * Prints one JSON line per phase {"phase":I,"bytes":…,"alloc_wait_ns":…,"gpu_from_ns":…,
 * "gpu_to_ns":…,"t_ns":…} (gpu_from_ns just before its first launch, gpu_to_ns when its
 * synchronisation returned, on CLOCK_MONOTONIC as the device trace: in between it wants the
 * GPU all the time) and at the end {"done":true,"intact":true|false,"phases":N,"start_ns":…,
 * "end_ns":…,"pid":…}. An
 * allocation that fails prints {"oom":true,"phase":I,"result":…} and exits 3 (a job that runs
 * out of memory ends). Other failed driver calls print "FAIL: …" on stderr and exit 1.
 *
 * Build: gcc phase_tenant.c -L<dir of libcuda.so> -lcuda */
#define _GNU_SOURCE
#include "cuda_min.h"
#include "cuda_api.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "pattern.h"
#include "spin.h"

#define PAGE 4096ull
#define STRIDE (64ull << 20)
#define MAX_BUFS 256

struct buf {
    CUdeviceptr p;
    size_t bytes;
    uint64_t seed;
};

static struct buf bufs[MAX_BUFS];
static int nbufs;

/* The sampled pages of a buffer of `bytes`: offsets 0, STRIDE, 2·STRIDE, … and its last page. */
static size_t sample(size_t bytes, size_t k, int *last) {
    size_t off = k * STRIDE;
    size_t end = bytes >= PAGE ? bytes - PAGE : 0;
    *last = off >= end;
    return off >= end ? end : off;
}

static void page_pattern(uint64_t *page, size_t len, uint64_t seed, size_t off) {
    for (size_t i = 0; i < len / 8; i++)
        page[i] = word(seed, off / 8 + i);
}

static void write_samples(const struct buf *b) {
    uint64_t page[PAGE / 8];
    size_t len = b->bytes < PAGE ? b->bytes : PAGE;
    int last = 0;
    for (size_t k = 0; !last; k++) {
        size_t off = sample(b->bytes, k, &last);
        page_pattern(page, len, b->seed, off);
        CK(cuMemcpyHtoD_v2(b->p + off, page, len));
    }
}

static int samples_intact(const struct buf *b) {
    uint64_t want[PAGE / 8], got[PAGE / 8];
    size_t len = b->bytes < PAGE ? b->bytes : PAGE;
    int last = 0;
    for (size_t k = 0; !last; k++) {
        size_t off = sample(b->bytes, k, &last);
        page_pattern(want, len, b->seed, off);
        CK(cuMemcpyDtoH_v2(got, b->p + off, len));
        if (memcmp(want, got, len) != 0)
            return 0;
    }
    return 1;
}

static size_t held(void) {
    size_t n = 0;
    for (int i = 0; i < nbufs; i++)
        n += bufs[i].bytes;
    return n;
}

/* Resize the working set to `want` bytes; the time the allocation took (0 if none). */
static unsigned long long resize(size_t want, uint64_t seed, int phase) {
    while (nbufs > 0 && held() > want) {
        nbufs--;
        CK(cuMemFree_v2(bufs[nbufs].p));
    }
    size_t have = held();
    if (have >= want)
        return 0;
    if (nbufs == MAX_BUFS)
        fail("more than %d buffers", MAX_BUFS);
    struct buf *b = &bufs[nbufs];
    b->bytes = want - have;
    b->seed = seed * 1000003ull + (uint64_t)phase;
    unsigned long long t0 = now_ns();
    CUresult r = cuMemAlloc_v2(&b->p, b->bytes);
    unsigned long long waited = now_ns() - t0;
    if (r != CUDA_SUCCESS) {
        printf("{\"oom\":true,\"phase\":%d,\"bytes\":%zu,\"result\":%d,\"pid\":%d}\n", phase,
               b->bytes, (int)r, (int)getpid());
        fflush(stdout);
        exit(3);
    }
    nbufs++;
    write_samples(b);
    return waited;
}

int main(int argc, char **argv) {
    check_error_name = cuGetErrorName;
    if (argc < 4) {
        fprintf(stderr, "usage: %s SEED MS_PER_KERNEL BYTES:KERNELS [BYTES:KERNELS…]\n",
                argv[0]);
        return 2;
    }
    uint64_t seed = strtoull(argv[1], NULL, 10);
    double ms = atof(argv[2]);
    if (!(ms >= 0))
        fail("MS_PER_KERNEL must be non-negative");

    CUfunction spin;
    CUstream s;
    spin_setup(&spin, &s);
    unsigned long long ns = (unsigned long long)(ms * 1e6 + 0.5);
    void *args[] = {&ns};

    unsigned long long start = now_ns();
    int ok = 1;
    for (int i = 3; i < argc; i++) {
        int phase = i - 3;
        char *colon = strchr(argv[i], ':');
        if (!colon)
            fail("phase %s: expected BYTES:KERNELS", argv[i]);
        size_t bytes = strtoull(argv[i], NULL, 10);
        long kernels = atol(colon + 1);
        unsigned long long waited = resize(bytes, seed, phase);
        unsigned long long gpu_from = now_ns();
        for (long k = 0; k < kernels; k++)
            CK(cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, s, args, NULL));
        CK(cuStreamSynchronize(s));
        unsigned long long gpu_to = now_ns();
        for (int b = 0; b < nbufs; b++)
            ok &= samples_intact(&bufs[b]);
        printf("{\"phase\":%d,\"bytes\":%zu,\"alloc_wait_ns\":%llu,\"gpu_from_ns\":%llu,"
               "\"gpu_to_ns\":%llu,\"intact\":%s,\"t_ns\":%llu}\n",
               phase, held(), waited, gpu_from, gpu_to, ok ? "true" : "false", now_ns());
        fflush(stdout);
    }
    while (nbufs > 0)
        CK(cuMemFree_v2(bufs[--nbufs].p));
    printf("{\"done\":true,\"intact\":%s,\"phases\":%d,\"start_ns\":%llu,\"end_ns\":%llu,"
           "\"pid\":%d}\n",
           ok ? "true" : "false", argc - 3, start, now_ns(), (int)getpid());
    fflush(stdout);
    return ok ? 0 : 4;
}
