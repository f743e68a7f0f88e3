/* mem_race.c: allocate and free random sizes as fast as possible, for a race between processes
 * of one group against its memory cap. Linked directly against libcuda.
 *
 *   mem_race SEED GO_FILE DURATION_MS MAX_MIB TIMELINE_FILE
 *
 * After initialising (context, one warm-up allocation so the hook is connected) it creates
 * TIMELINE_FILE.ready and waits until GO_FILE exists (the test creates it once every racer is
 * ready, however long a busy machine took to start them), then for DURATION_MS: either frees one of the buffers it holds
 * (cuMemFree_v2) or allocates 1 MiB..MAX_MIB MiB bytes (cuMemAlloc_v2; CUDA_ERROR_OUT_OF_MEMORY
 * counts as refused). At the end it frees everything.
 *
 * TIMELINE_FILE gets one line "T_NS BYTES_HELD" per change of what it holds, conservatively
 * timed: an allocation counts from just after cuMemAlloc_v2 returned, a free until just before
 * cuMemFree_v2 was called. So the recorded holding lies inside the time the memory was really
 * reserved, and the sum over processes must never exceed the cap.
 *
 * Prints {"pid":…,"allocs":…,"refused":…,"frees":…,"peak":…,"events":…}. */
#define _GNU_SOURCE
#include "cuda_min.h"

#include "cuda_mem.h"

#include <string.h>
#include <unistd.h>

#include "check.h"
#include "context.h"

#define MAX_HELD 4096
#define MAX_EVENTS (1 << 20)

static unsigned long long rng;
static unsigned long long next_rand(void) {
    /* xorshift64* */
    rng ^= rng >> 12;
    rng ^= rng << 25;
    rng ^= rng >> 27;
    return rng * 2685821657736338717ull;
}

static unsigned long long ev_t[MAX_EVENTS];
static unsigned long long ev_held[MAX_EVENTS];
static long nev;

static void record(unsigned long long t, unsigned long long held) {
    if (nev < MAX_EVENTS) {
        ev_t[nev] = t;
        ev_held[nev] = held;
        nev++;
    }
}

int main(int argc, char **argv) {
    check_error_name = cuGetErrorName;
    if (argc != 6) {
        fprintf(stderr, "usage: %s SEED GO_FILE DURATION_MS MAX_MIB TIMELINE_FILE\n", argv[0]);
        return 2;
    }
    rng = strtoull(argv[1], NULL, 10) * 0x9E3779B97F4A7C15ull + 1;
    const char *go = argv[2];
    unsigned long long duration = strtoull(argv[3], NULL, 10) * 1000000ull;
    size_t max_bytes = strtoull(argv[4], NULL, 10) << 20;
    FILE *out = fopen(argv[5], "w");
    EXPECT(out != NULL, "cannot open %s", argv[5]);

    context_create(NULL);
    CUdeviceptr warm;
    CK(cuMemAlloc_v2(&warm, 4096));
    CK(cuMemFree_v2(warm));

    static CUdeviceptr ptr[MAX_HELD];
    static size_t size[MAX_HELD];
    int n = 0;
    unsigned long long held = 0, peak = 0;
    long allocs = 0, refused = 0, frees = 0;

    char ready[4096];
    snprintf(ready, sizeof ready, "%s.ready", argv[5]);
    FILE *r = fopen(ready, "w");
    EXPECT(r != NULL && fclose(r) == 0, "cannot create %s", ready);
    while (access(go, F_OK) != 0)
        usleep(200);
    unsigned long long end = now_ns() + duration;
    record(now_ns(), 0);
    while (now_ns() < end) {
        unsigned long long r = next_rand();
        /* Free with probability 2/5 (always when the table is full). */
        if (n > 0 && (r % 5 < 2 || n == MAX_HELD)) {
            int i = (int)((r >> 8) % (unsigned)n);
            unsigned long long t = now_ns();
            held -= size[i];
            record(t, held);
            CK(cuMemFree_v2(ptr[i]));
            ptr[i] = ptr[n - 1];
            size[i] = size[n - 1];
            n--;
            frees++;
        } else {
            size_t bytes = (1u << 20) + (size_t)((r >> 8) % (max_bytes - (1u << 20) + 1));
            CUdeviceptr p;
            CUresult res = cuMemAlloc_v2(&p, bytes);
            unsigned long long t = now_ns();
            if (res == CUDA_SUCCESS) {
                ptr[n] = p;
                size[n] = bytes;
                n++;
                held += bytes;
                if (held > peak)
                    peak = held;
                record(t, held);
                allocs++;
            } else if (res == CUDA_ERROR_OUT_OF_MEMORY) {
                refused++;
            } else {
                fail("cuMemAlloc_v2(%zu) returned %d (%s)", bytes, res, err_name(res));
            }
        }
    }
    while (n > 0) {
        n--;
        held -= size[n];
        record(now_ns(), held);
        CK(cuMemFree_v2(ptr[n]));
        frees++;
    }
    for (long i = 0; i < nev; i++)
        fprintf(out, "%llu %llu\n", ev_t[i], ev_held[i]);
    EXPECT(fclose(out) == 0, "writing %s", argv[5]);
    printf("{\"pid\":%d,\"allocs\":%ld,\"refused\":%ld,\"frees\":%ld,\"peak\":%llu,\"events\":%ld}\n",
           (int)getpid(), allocs, refused, frees, peak, nev);
    return 0;
}
