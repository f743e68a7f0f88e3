/* mem_tool.c: small memory-cap probes, linked directly against libcuda (gcc mem_tool.c
 * -L<dir> -lcuda). Each command prints JSON lines on stdout (flushed at once); a failed driver
 * call prints "FAIL: …" on stderr and exits 1.
 *
 *   mem_tool info               {"free":…,"total":…,"device_total":…} (cuMemGetInfo_v2,
 *                               cuDeviceTotalMem_v2)
 *   mem_tool hold BYTES         cuMemAlloc_v2(BYTES), print {"held":BYTES,"t_ns":…}, then wait:
 *                               SIGUSR1 frees it, prints {"freed":…} and exits 0
 *   mem_tool hold-later BYTES   set up, print {"ready":true,"free":…,…} (cuMemGetInfo_v2: the
 *                               hook has connected); SIGUSR1:
 *                               cuMemAlloc_v2(BYTES), print {"held":BYTES,"t_start_ns":…,
 *                               "t_ns":…}; SIGUSR1 again frees it, prints {"freed":BYTES} and
 *                               exits 0
 *   mem_tool try BYTES RETRY_MS cuMemAlloc_v2(BYTES), retried every 1 ms while it returns
 *                               CUDA_ERROR_OUT_OF_MEMORY, for at most RETRY_MS; prints
 *                               {"result":…,"attempts":…,"t_start_ns":…,"t_done_ns":…}; frees
 *   mem_tool bench N BYTES      N × (cuMemAlloc_v2(BYTES); cuMemFree_v2), after a warm-up;
 *                               prints {"ns_per_alloc":…,"ns_per_free":…} (means),
 *                               "median_alloc_ns", "median_free_ns", "p99_alloc_ns"
 *   mem_tool vmm BYTES          the lifetime of physical allocations of BYTES on the device, one
 *                               stage per SIGUSR1, each printing {"stage":…,"free":…}
 *                               (cuMemGetInfo_v2) once done: "released_mapped": created, mapped,
 *                               its handle released; "unmapped": then unmapped (freed);
 *                               "retained_unmapped": a second one created and mapped, its handle
 *                               retained again from an address inside the mapping, the first
 *                               reference released, unmapped; "released": the retained
 *                               reference released (freed)
 *   mem_tool vmm-host BYTES DEV cuMemCreate(BYTES) in host memory (HOST, then HOST_NUMA node 0),
 *                               both mapped, then cuMemAlloc_v2(DEV) while they live; prints
 *                               {"host":…,"host_numa":…,"host_numa_current":…(its result),
 *                               "free_before":…,"free_after":…,"device_alloc":…}
 *   mem_tool many N BYTES RETRY_MS KEEP
 *                               N × cuMemAlloc_v2(BYTES), each retried every 1 ms while it
 *                               returns CUDA_ERROR_OUT_OF_MEMORY for at most RETRY_MS, stopping
 *                               at the first that still fails; prints {"many":K,"wanted":N,
 *                               "longest_wait_ns":…,"t_done_ns":…}; SIGUSR1 frees all but the
 *                               first KEEP and prints {"kept":KEEP,"t_ns":…}; SIGUSR1 again
 *                               frees the rest, prints {"done":K} and exits
 *   mem_tool pool BYTES THRESHOLD
 *                               the default memory pool with release threshold THRESHOLD:
 *                               cuMemAllocAsync(BYTES) on a stream, synchronised; then one stage
 *                               per SIGUSR1: cuMemFreeAsync, cuStreamSynchronize,
 *                               cuMemPoolTrimTo(pool, 0), exit. Each stage prints
 *                               {"stage":…,"reserved":…,"used":…} (the pool's
 *                               RESERVED_MEM_CURRENT and USED_MEM_CURRENT), with "free"
 *                               (cuMemGetInfo_v2) at the first two only: later stages leave the
 *                               hook to notice what the pool released by itself
 *   mem_tool pool-api           the memory pool API as the driver documents it (reserving in
 *                               2 MiB granules, reuse of freed bytes, release at a
 *                               synchronisation down to the threshold, trims, maxSize, current
 *                               pools, destruction with live allocations, high watermarks,
 *                               each allocation's pool); prints {"pool_api":"PASS"}
 *   mem_tool keep BYTES SEED [MANAGED [ipc]]
 *                               with MANAGED > 0: first cuMemAllocManaged(MANAGED), filled with
 *                               a pattern of SEED + 1; then cuMemAlloc_v2(BYTES) (however long
 *                               it blocks), printing {"alloc":RESULT,"wait_ns":…,"pid":…}; on
 *                               success fills it with a pattern of SEED (with "ipc": exports it,
 *                               cuIpcGetMemHandle) and prints {"filled":BYTES}, then waits:
 *                               SIGUSR1 checks every byte (of both), prints
 *                               {"intact":true|false}, frees and exits
 *   mem_tool fork-hold BYTES    cuMemAlloc_v2(BYTES), then fork a child that never uses CUDA
 *                               (stdio on /dev/null; exits on SIGUSR1, or after 120 s); prints
 *                               {"held":BYTES,"child":PID} and exits without freeing */
#define _GNU_SOURCE
#include "cuda_min.h"

#include "cuda_mem.h"

#include <fcntl.h>
#include <stdint.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "context.h"
#include "pattern.h"

typedef struct {
    char reserved[64];
} CUipcMemHandle;
CUresult cuIpcGetMemHandle(CUipcMemHandle *handle, CUdeviceptr dptr);

static CUdevice dev;
static volatile sig_atomic_t release_now;

static void on_usr1(int sig) {
    (void)sig;
    release_now = 1;
}

/* SIGUSR1 from the test: go on to the next stage (release what is held). */
static void release_on_usr1(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_usr1;
    sigaction(SIGUSR1, &sa, NULL);
}

static void setup(void) {
    context_create(&dev);
}

static int cmp_ull(const void *a, const void *b) {
    unsigned long long x = *(const unsigned long long *)a, y = *(const unsigned long long *)b;
    return (x > y) - (x < y);
}

static void wait_usr1(void) {
    while (!release_now)
        usleep(1000);
    release_now = 0;
}

static size_t mem_free(void) {
    size_t free = 0, total = 0;
    CK(cuMemGetInfo_v2(&free, &total));
    return free;
}

static void print_stage(const char *stage) {
    printf("{\"stage\":\"%s\",\"free\":%zu}\n", stage, mem_free());
    fflush(stdout);
}

static void print_pool_stage(const char *stage, CUmemoryPool pool, int with_info) {
    unsigned long long reserved = 0, used = 0;
    CK(cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved));
    CK(cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &used));
    printf("{\"stage\":\"%s\",\"reserved\":%llu,\"used\":%llu", stage, reserved, used);
    if (with_info)
        printf(",\"free\":%zu", mem_free());
    printf(",\"t_ns\":%llu}\n", now_ns());
    fflush(stdout);
}

static unsigned long long pool_attr(CUmemoryPool pool, CUmemPool_attribute attr) {
    unsigned long long v = 0;
    CK(cuMemPoolGetAttribute(pool, attr, &v));
    return v;
}

#define POOL_MIB (1ull << 20)

/* Expect pool `pool` to reserve `reserved` MiB, of which `used` MiB are used. */
#define EXPECT_POOL(pool, reserved, used, when)                                               \
    EXPECT(pool_attr(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) == (reserved) * POOL_MIB &&  \
               pool_attr(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT) == (used) * POOL_MIB,        \
           "%s: reserved %llu used %llu, expected %llu MiB, %llu MiB", when,                  \
           pool_attr(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT),                             \
           pool_attr(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT), (unsigned long long)(reserved), \
           (unsigned long long)(used))

static CUmemoryPool pool_of(CUdeviceptr p) {
    CUmemoryPool pool = NULL;
    CK(cuPointerGetAttribute(&pool, CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, p));
    return pool;
}

static void pool_api(void) {
    CUstream s;
    CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CUmemoryPool def, cur, pool;
    CK(cuDeviceGetDefaultMemPool(&def, dev));
    CK(cuDeviceGetMemPool(&cur, dev));
    EXPECT(cur == def, "the current pool is the default one at first");
    EXPECT(pool_attr(def, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD) == 0, "default threshold 0");
    int reuse = 0;
    CK(cuMemPoolGetAttribute(def, CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC, &reuse));
    EXPECT(reuse == 1, "reuse policies enabled by default");
    size_t free0 = mem_free();

    CUmemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = 0;
    props.maxSize = 64 * POOL_MIB;
    CK(cuMemPoolCreate(&pool, &props));
    CUdeviceptr a, b, c, big;
    CK(cuMemAllocFromPoolAsync(&a, 3 * POOL_MIB, pool, s));
    EXPECT_POOL(pool, 4, 3, "3 MiB: two granules");
    EXPECT(pool_of(a) == pool, "the allocation's pool");
    CK(cuMemAllocFromPoolAsync(&b, POOL_MIB, pool, s));
    EXPECT_POOL(pool, 4, 4, "1 MiB more fits in the pool's free bytes");
    EXPECT(mem_free() == free0 - 4 * POOL_MIB, "the device lost what the pool reserves");
    CK(cuMemFreeAsync(a, s));
    EXPECT_POOL(pool, 4, 1, "freed: kept in the pool");
    EXPECT(mem_free() == free0 - 4 * POOL_MIB, "freed bytes stay reserved");
    CK(cuStreamSynchronize(s));
    EXPECT_POOL(pool, 2, 1, "synchronised: released down to threshold 0, but not a used granule");
    EXPECT(mem_free() == free0 - 2 * POOL_MIB, "released to the device");
    CK_EQ(cuMemAllocFromPoolAsync(&big, 70 * POOL_MIB, pool, s), CUDA_ERROR_OUT_OF_MEMORY);

    CK(cuDeviceSetMemPool(dev, pool));
    CK(cuDeviceGetMemPool(&cur, dev));
    EXPECT(cur == pool, "cuDeviceSetMemPool");
    CK(cuMemAllocAsync(&c, POOL_MIB, s));
    EXPECT(pool_of(c) == pool, "cuMemAllocAsync allocates from the current pool");
    EXPECT_POOL(pool, 2, 2, "the current pool");
    CK_EQ(cuMemPoolDestroy(def), CUDA_ERROR_INVALID_VALUE);
    CK(cuMemPoolDestroy(pool));
    CK(cuDeviceGetMemPool(&cur, dev));
    EXPECT(cur == def, "destroying the current pool makes the default one current");
    EXPECT(mem_free() == free0 - 2 * POOL_MIB, "a destroyed pool keeps its live allocations");
    CK(cuMemFreeAsync(b, s));
    CK(cuMemFreeAsync(c, s));
    EXPECT(mem_free() == free0, "and releases everything with the last of them");

    unsigned long long zero = 0, one = 1, threshold = 100 * POOL_MIB;
    CK(cuMemAllocAsync(&a, 6 * POOL_MIB, s));
    CK(cuMemFreeAsync(a, s));
    CK(cuMemPoolSetAttribute(def, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &threshold));
    CK(cuStreamSynchronize(s));
    EXPECT_POOL(def, 6, 0, "under its threshold the pool keeps what it reserved");
    CK(cuMemAllocAsync(&a, 5 * POOL_MIB, s));
    EXPECT_POOL(def, 6, 5, "and reuses it");
    CK(cuMemFreeAsync(a, s));
    CK(cuMemPoolTrimTo(def, 3 * POOL_MIB));
    EXPECT_POOL(def, 4, 0, "trimmed to at least 3 MiB, in granules");
    CK(cuMemPoolTrimTo(def, 0));
    EXPECT_POOL(def, 0, 0, "trimmed to nothing");
    EXPECT(pool_attr(def, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH) == 6 * POOL_MIB, "high watermark");
    CK_EQ(cuMemPoolSetAttribute(def, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, &one),
          CUDA_ERROR_INVALID_VALUE);
    CK(cuMemPoolSetAttribute(def, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, &zero));
    EXPECT(pool_attr(def, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH) == 0, "high watermark reset");
    CK_EQ(cuMemPoolSetAttribute(def, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &zero),
          CUDA_ERROR_INVALID_VALUE);
    EXPECT(mem_free() == free0, "everything back");
    printf("{\"pool_api\":\"PASS\"}\n");
}

static CUmemAllocationProp located(int type, int id) {
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = type;
    prop.location.id = id;
    return prop;
}

/* Reserve an address range for `bytes` and map `h` there with read-write access from device 0. */
static CUdeviceptr map_rw(CUmemGenericAllocationHandle h, size_t bytes) {
    CUdeviceptr va;
    CK(cuMemAddressReserve(&va, bytes, 0, 0, 0));
    CK(cuMemMap(va, bytes, 0, h, 0));
    CUmemAccessDesc access = {{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    CK(cuMemSetAccess(va, bytes, &access, 1));
    return va;
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
        fprintf(stderr,
                "usage: %s info | hold BYTES | hold-later BYTES | try BYTES RETRY_MS | bench N BYTES | vmm BYTES | "
                "vmm-host BYTES DEV | many N BYTES RETRY_MS KEEP | pool BYTES THRESHOLD | pool-api | "
                "keep BYTES SEED | "
                "fork-hold BYTES\n",
                argv[0]);
        return 2;
    }
    const char *cmd = argv[1];
    if (strcmp(cmd, "info") == 0 && argc == 2) {
        setup();
        print_info("info");
    } else if (strcmp(cmd, "hold") == 0 && argc == 3) {
        size_t bytes = strtoull(argv[2], NULL, 10);
        release_on_usr1();
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
    } else if (strcmp(cmd, "keep") == 0 && argc >= 4 && argc <= 6) {
        size_t bytes = strtoull(argv[2], NULL, 10);
        uint64_t seed = strtoull(argv[3], NULL, 10);
        size_t managed = argc >= 5 ? strtoull(argv[4], NULL, 10) : 0;
        int ipc = argc == 6 && strcmp(argv[5], "ipc") == 0;
        release_on_usr1();
        setup();
        CUdeviceptr m = 0;
        if (managed > 0) {
            CK(cuMemAllocManaged(&m, managed, CU_MEM_ATTACH_GLOBAL));
            fill(m, managed, seed + 1);
        }
        CUdeviceptr p = 0;
        unsigned long long t0 = now_ns();
        CUresult r = cuMemAlloc_v2(&p, bytes);
        printf("{\"alloc\":%d,\"wait_ns\":%llu,\"pid\":%d}\n", r, now_ns() - t0, (int)getpid());
        fflush(stdout);
        if (r != CUDA_SUCCESS)
            return 1;
        fill(p, bytes, seed);
        if (ipc) {
            CUipcMemHandle h;
            CK(cuIpcGetMemHandle(&h, p));
        }
        printf("{\"filled\":%zu}\n", bytes);
        fflush(stdout);
        while (!release_now)
            usleep(1000);
        int ok = intact(p, bytes, seed) && (managed == 0 || intact(m, managed, seed + 1));
        printf("{\"intact\":%s}\n", ok ? "true" : "false");
        fflush(stdout);
        CK(cuMemFree_v2(p));
        if (managed > 0)
            CK(cuMemFree_v2(m));
    } else if (strcmp(cmd, "hold-later") == 0 && argc == 3) {
        size_t bytes = strtoull(argv[2], NULL, 10);
        release_on_usr1();
        setup();
        print_info("ready");
        wait_usr1();
        CUdeviceptr p;
        unsigned long long t0 = now_ns();
        CK(cuMemAlloc_v2(&p, bytes));
        printf("{\"held\":%zu,\"t_start_ns\":%llu,\"t_ns\":%llu}\n", bytes, t0, now_ns());
        fflush(stdout);
        wait_usr1();
        CK(cuMemFree_v2(p));
        printf("{\"freed\":%zu}\n", bytes);
        fflush(stdout);
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
        unsigned long long *alloc_ns = calloc((size_t)n, sizeof *alloc_ns);
        unsigned long long *free_ns = calloc((size_t)n, sizeof *free_ns);
        EXPECT(alloc_ns && free_ns, "out of host memory for %ld samples", n);
        unsigned long long alloc_sum = 0, free_sum = 0;
        for (long i = 0; i < n; i++) {
            unsigned long long t0 = now_ns();
            CK(cuMemAlloc_v2(&p, bytes));
            unsigned long long t1 = now_ns();
            CK(cuMemFree_v2(p));
            unsigned long long t2 = now_ns();
            alloc_ns[i] = t1 - t0;
            free_ns[i] = t2 - t1;
            alloc_sum += t1 - t0;
            free_sum += t2 - t1;
        }
        qsort(alloc_ns, (size_t)n, sizeof *alloc_ns, cmp_ull);
        qsort(free_ns, (size_t)n, sizeof *free_ns, cmp_ull);
        printf("{\"n\":%ld,\"bytes\":%zu,\"ns_per_alloc\":%.0f,\"ns_per_free\":%.0f,"
               "\"median_alloc_ns\":%llu,\"median_free_ns\":%llu,\"p99_alloc_ns\":%llu}\n",
               n, bytes, (double)alloc_sum / n, (double)free_sum / n, alloc_ns[n / 2],
               free_ns[n / 2], alloc_ns[n - 1 - n / 100]);
        free(alloc_ns);
        free(free_ns);
    } else if (strcmp(cmd, "vmm") == 0 && argc == 3) {
        size_t bytes = strtoull(argv[2], NULL, 10);
        release_on_usr1();
        setup();
        CUmemAllocationProp prop = located(CU_MEM_LOCATION_TYPE_DEVICE, 0);
        CUmemGenericAllocationHandle h, again;
        CK(cuMemCreate(&h, bytes, &prop, 0));
        CUdeviceptr va = map_rw(h, bytes);
        CK(cuMemsetD8_v2(va, 0x5a, 2u << 20)); /* usable (touching all of it would cost RAM) */
        CK(cuMemRelease(h));
        print_stage("released_mapped");
        wait_usr1();
        CK(cuMemUnmap(va, bytes));
        print_stage("unmapped");
        wait_usr1();
        CK(cuMemCreate(&h, bytes, &prop, 0));
        CK(cuMemMap(va, bytes, 0, h, 0));
        CK(cuMemRetainAllocationHandle(&again, (void *)(uintptr_t)(va + bytes / 2)));
        EXPECT(again == h, "cuMemRetainAllocationHandle returned another handle");
        CK(cuMemRelease(h));
        CK(cuMemUnmap(va, bytes));
        print_stage("retained_unmapped");
        wait_usr1();
        CK(cuMemRelease(again));
        CK(cuMemAddressFree(va, bytes));
        print_stage("released");
    } else if (strcmp(cmd, "vmm-host") == 0 && argc == 4) {
        size_t bytes = strtoull(argv[2], NULL, 10);
        size_t dev_bytes = strtoull(argv[3], NULL, 10);
        setup();
        size_t before = mem_free();
        CUmemAllocationProp host = located(CU_MEM_LOCATION_TYPE_HOST, 0);
        CUmemAllocationProp numa = located(CU_MEM_LOCATION_TYPE_HOST_NUMA, 0);
        CUmemAllocationProp current = located(CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT, 0);
        CUmemGenericAllocationHandle hh, hn, hc;
        CUresult rh = cuMemCreate(&hh, bytes, &host, 0);
        CUresult rn = cuMemCreate(&hn, bytes, &numa, 0);
        CUresult rc = cuMemCreate(&hc, bytes, &current, 0);
        CUdeviceptr vh = 0, vn = 0;
        if (rh == CUDA_SUCCESS)
            vh = map_rw(hh, bytes);
        if (rn == CUDA_SUCCESS)
            vn = map_rw(hn, bytes);
        size_t after = mem_free();
        CUdeviceptr p = 0;
        CUresult ra = cuMemAlloc_v2(&p, dev_bytes);
        printf("{\"host\":%d,\"host_numa\":%d,\"host_numa_current\":%d,\"free_before\":%zu,"
               "\"free_after\":%zu,\"device_alloc\":%d}\n",
               rh, rn, rc, before, after, ra);
        fflush(stdout);
        if (ra == CUDA_SUCCESS)
            CK(cuMemFree_v2(p));
        if (rh == CUDA_SUCCESS) {
            CK(cuMemUnmap(vh, bytes));
            CK(cuMemRelease(hh));
        }
        if (rn == CUDA_SUCCESS) {
            CK(cuMemUnmap(vn, bytes));
            CK(cuMemRelease(hn));
        }
    } else if (strcmp(cmd, "many") == 0 && argc == 6) {
        long n = atol(argv[2]);
        size_t bytes = strtoull(argv[3], NULL, 10);
        unsigned long long retry_ns = strtoull(argv[4], NULL, 10) * 1000000ull;
        long keep = atol(argv[5]);
        EXPECT(n > 0 && keep >= 0, "N must be positive, KEEP not negative");
        release_on_usr1();
        setup();
        CUdeviceptr *p = calloc((size_t)n, sizeof *p);
        EXPECT(p != NULL, "out of host memory for %ld pointers", n);
        long k = 0;
        unsigned long long longest = 0;
        for (; k < n; k++) {
            unsigned long long t0 = now_ns();
            CUresult r;
            while ((r = cuMemAlloc_v2(&p[k], bytes)) == CUDA_ERROR_OUT_OF_MEMORY &&
                   now_ns() - t0 < retry_ns)
                usleep(1000);
            if (r == CUDA_ERROR_OUT_OF_MEMORY)
                break;
            CK(r);
            if (now_ns() - t0 > longest)
                longest = now_ns() - t0;
        }
        printf("{\"many\":%ld,\"wanted\":%ld,\"longest_wait_ns\":%llu,\"t_done_ns\":%llu}\n", k,
               n, longest, now_ns());
        fflush(stdout);
        wait_usr1();
        long kept = keep < k ? keep : k;
        for (long i = kept; i < k; i++)
            CK(cuMemFree_v2(p[i]));
        printf("{\"kept\":%ld,\"t_ns\":%llu}\n", kept, now_ns());
        fflush(stdout);
        wait_usr1();
        for (long i = 0; i < kept; i++)
            CK(cuMemFree_v2(p[i]));
        printf("{\"done\":%ld}\n", k);
        free(p);
    } else if (strcmp(cmd, "pool") == 0 && argc == 4) {
        size_t bytes = strtoull(argv[2], NULL, 10);
        unsigned long long threshold = strtoull(argv[3], NULL, 10);
        release_on_usr1();
        setup();
        CUstream s;
        CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
        CUmemoryPool pool;
        CK(cuDeviceGetDefaultMemPool(&pool, dev));
        CK(cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &threshold));
        CUdeviceptr p;
        CK(cuMemAllocAsync(&p, bytes, s));
        CK(cuStreamSynchronize(s));
        print_pool_stage("allocated", pool, 1);
        wait_usr1();
        CK(cuMemFreeAsync(p, s));
        print_pool_stage("freed", pool, 1);
        wait_usr1();
        CK(cuStreamSynchronize(s));
        print_pool_stage("synced", pool, 0);
        wait_usr1();
        CK(cuMemPoolTrimTo(pool, 0));
        print_pool_stage("trimmed", pool, 0);
        wait_usr1();
    } else if (strcmp(cmd, "pool-api") == 0 && argc == 2) {
        setup();
        pool_api();
    } else if (strcmp(cmd, "fork-hold") == 0 && argc == 3) {
        size_t bytes = strtoull(argv[2], NULL, 10);
        release_on_usr1();
        setup();
        CUdeviceptr p;
        CK(cuMemAlloc_v2(&p, bytes));
        fflush(stdout);
        pid_t child = fork();
        if (child < 0)
            fail("fork");
        if (child == 0) {
            /* A data-loader worker: no CUDA, and not the test's pipes (the test waits for them). */
            int null = open("/dev/null", O_RDWR);
            for (int fd = 0; fd <= 2; fd++)
                dup2(null, fd);
            unsigned long long t0 = now_ns();
            while (!release_now && now_ns() - t0 < 120000000000ull)
                usleep(1000);
            _exit(0);
        }
        printf("{\"held\":%zu,\"child\":%d}\n", bytes, (int)child);
    } else {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }
    return 0;
}
