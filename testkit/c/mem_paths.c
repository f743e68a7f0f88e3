/* mem_paths.c: every allocation path of the driver API against a group's memory cap, linked
 * directly against libcuda (gcc mem_paths.c -L<dir> -lcuda), run under `gpushare run --group G
 * --memory CAP` so that libgpushare.so enforces the cap.
 *
 *   mem_paths paths CAP_BYTES      every path: within the cap succeeds, over it is
 *                                  CUDA_ERROR_OUT_OF_MEMORY, the process keeps working, the
 *                                  matching free makes the memory available again; after each
 *                                  step cuMemGetInfo_v2 says total == CAP, free == CAP - held.
 *   mem_paths oom-kernel CAP_BYTES an over-cap allocation fails with OOM, then a spin kernel is
 *                                  launched and synchronised, and a copy round-trips.
 *
 * Prints one JSON line per path (or one for oom-kernel) and then PASS; on a failed check prints
 * "FAIL: …" on stderr and exits 1. The process must be the group's only one. */
#define _GNU_SOURCE
#include "cuda_min.h"

#include "cuda_mem.h"

#include <dlfcn.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "context.h"
#include "gpushare_spin_ptx.h"

#define MIB (1ull << 20)

static size_t cap;
static CUdevice dev;
static CUstream stream;
static CUmemoryPool pool;
static size_t vmm_gran;

typedef CUresult (*PFN_alloc_async)(CUdeviceptr *, size_t, CUstream);
typedef CUresult (*PFN_alloc_pool)(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
typedef CUresult (*PFN_free_async)(CUdeviceptr, CUstream);
typedef CUresult (*PFN_alloc)(CUdeviceptr *, size_t);
static PFN_alloc_async alloc_async_ptsz;
static PFN_free_async free_async_ptsz;
static PFN_alloc_pool alloc_pool_ptsz;
static PFN_free_async free_async_ptsz_dlsym;
static PFN_alloc alloc_procaddr;

/* The exported symbol `p` points at and the file it is in, for the report. */
static const char *where(void *p) {
    static char buf[512];
    Dl_info info;
    if (p && dladdr(p, &info) && info.dli_sname) {
        const char *f = info.dli_fname ? strrchr(info.dli_fname, '/') : NULL;
        snprintf(buf, sizeof buf, "%s@%s", info.dli_sname, f ? f + 1 : "?");
    } else {
        snprintf(buf, sizeof buf, "?");
    }
    return buf;
}

/* What one allocation holds. */
struct obj {
    CUdeviceptr p;
    CUmemGenericAllocationHandle h;
    CUdeviceptr va;
    CUarray arr;
    CUmipmappedArray mip;
    size_t bytes;
};

struct path {
    const char *name;
    /* Footprint of the largest allocation of this kind that is at most `want` bytes. */
    size_t (*fit)(size_t want);
    /* Allocate fit(want) bytes; on success fills `o`. */
    CUresult (*alloc)(size_t want, struct obj *o);
    void (*release)(struct obj *o);
};

static size_t fit_bytes(size_t want) { return want; }

/* --- plain device pointers ----------------------------------------------------------------- */

static CUresult a_alloc(size_t want, struct obj *o) { return cuMemAlloc_v2(&o->p, want); }
static void f_free(struct obj *o) { CK(cuMemFree_v2(o->p)); }

/* Pitched: rows of 4096 bytes (a multiple of every pitch alignment), 4-byte elements. */
#define PITCH_ROW 4096
static size_t fit_pitch(size_t want) { return want / PITCH_ROW * PITCH_ROW; }
static CUresult a_pitch(size_t want, struct obj *o) {
    size_t pitch = 0;
    CUresult r = cuMemAllocPitch_v2(&o->p, &pitch, PITCH_ROW, want / PITCH_ROW, 4);
    if (r == CUDA_SUCCESS)
        EXPECT(pitch == PITCH_ROW, "pitch %zu for %d-byte rows", pitch, PITCH_ROW);
    return r;
}

static CUresult a_managed(size_t want, struct obj *o) {
    return cuMemAllocManaged(&o->p, want, CU_MEM_ATTACH_GLOBAL);
}

/* Stream-ordered: the stream is synchronised after each call so the memory is really there. */
static CUresult a_async(size_t want, struct obj *o) {
    CUresult r = cuMemAllocAsync(&o->p, want, stream);
    if (r == CUDA_SUCCESS)
        CK(cuStreamSynchronize(stream));
    return r;
}
static void f_async(struct obj *o) {
    CK(cuMemFreeAsync(o->p, stream));
    CK(cuStreamSynchronize(stream));
}

/* Per-thread default stream variants, obtained through cuGetProcAddress_v2 (flag 2). */
static CUresult a_async_ptsz(size_t want, struct obj *o) {
    CUresult r = alloc_async_ptsz(&o->p, want, NULL);
    if (r == CUDA_SUCCESS)
        CK(cuStreamSynchronize(CU_STREAM_PER_THREAD));
    return r;
}
static void f_async_ptsz(struct obj *o) {
    CK(free_async_ptsz(o->p, NULL));
    CK(cuStreamSynchronize(CU_STREAM_PER_THREAD));
}

static CUresult a_pool(size_t want, struct obj *o) {
    CUresult r = cuMemAllocFromPoolAsync(&o->p, want, pool, stream);
    if (r == CUDA_SUCCESS)
        CK(cuStreamSynchronize(stream));
    return r;
}

/* cuMemAllocFromPoolAsync_ptsz / cuMemFreeAsync_ptsz looked up with dlsym on libcuda.so.1. */
static CUresult a_pool_ptsz(size_t want, struct obj *o) {
    CUresult r = alloc_pool_ptsz(&o->p, want, pool, NULL);
    if (r == CUDA_SUCCESS)
        CK(cuStreamSynchronize(CU_STREAM_PER_THREAD));
    return r;
}
static void f_pool_ptsz(struct obj *o) {
    CK(free_async_ptsz_dlsym(o->p, NULL));
    CK(cuStreamSynchronize(CU_STREAM_PER_THREAD));
}

/* cuMemAlloc resolved the way the CUDA runtime does: cuGetProcAddress_v2("cuMemAlloc", 3020). */
static CUresult a_procaddr(size_t want, struct obj *o) { return alloc_procaddr(&o->p, want); }

/* --- virtual memory management ------------------------------------------------------------- */

static CUmemAllocationProp vmm_prop(void) {
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    return prop;
}

static size_t fit_vmm(size_t want) { return want / vmm_gran * vmm_gran; }

/* cuMemCreate, then reserve an address range, map it, give access and write to it. */
static CUresult a_vmm(size_t want, struct obj *o) {
    CUmemAllocationProp prop = vmm_prop();
    size_t n = fit_vmm(want);
    CUresult r = cuMemCreate(&o->h, n, &prop, 0);
    if (r != CUDA_SUCCESS)
        return r;
    CK(cuMemAddressReserve(&o->va, n, 0, 0, 0));
    CK(cuMemMap(o->va, n, 0, o->h, 0));
    CUmemAccessDesc access = {{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    CK(cuMemSetAccess(o->va, n, &access, 1));
    CK(cuMemsetD8_v2(o->va, 0x5a, n));
    return CUDA_SUCCESS;
}
static void f_vmm(struct obj *o) {
    CK(cuMemUnmap(o->va, o->bytes));
    CK(cuMemRelease(o->h));
    CK(cuMemAddressFree(o->va, o->bytes));
}

/* --- arrays -------------------------------------------------------------------------------- */

/* 2D float4 arrays (16 bytes per element), 1024 elements per row. */
#define ROW2D (1024 * 16)
static size_t fit_array(size_t want) { return want / ROW2D * ROW2D; }
static CUresult a_array(size_t want, struct obj *o) {
    CUDA_ARRAY_DESCRIPTOR d = {1024, want / ROW2D, CU_AD_FORMAT_FLOAT, 4};
    return cuArrayCreate_v2(&o->arr, &d);
}
static void f_array(struct obj *o) { CK(cuArrayDestroy(o->arr)); }

/* 3D uchar arrays, 256 x 64 slices of 1 byte per element. */
#define SLICE3D (256 * 64)
static size_t fit_array3d(size_t want) { return want / SLICE3D * SLICE3D; }
static CUresult a_array3d(size_t want, struct obj *o) {
    CUDA_ARRAY3D_DESCRIPTOR d = {256, 64, want / SLICE3D, CU_AD_FORMAT_UNSIGNED_INT8, 1, 0};
    return cuArray3DCreate_v2(&o->arr, &d);
}

/* Mipmapped 2D float4 arrays of 3 levels, 1024 wide: level k is max(1, dim >> k). */
#define MIP_LEVELS 3
static size_t mip_bytes(size_t w, size_t h) {
    size_t total = 0;
    for (int k = 0; k < MIP_LEVELS; k++) {
        total += w * h * 16;
        w = w / 2 ? w / 2 : 1;
        h = h / 2 ? h / 2 : 1;
    }
    return total;
}
static size_t mip_height(size_t want) {
    size_t h = want / (1024 * 16);
    while (h > 0 && mip_bytes(1024, h) > want)
        h--;
    return h;
}
static size_t fit_mip(size_t want) { return mip_bytes(1024, mip_height(want)); }
static CUresult a_mip(size_t want, struct obj *o) {
    CUDA_ARRAY3D_DESCRIPTOR d = {1024, mip_height(want), 0, CU_AD_FORMAT_FLOAT, 4, 0};
    return cuMipmappedArrayCreate(&o->mip, &d, MIP_LEVELS);
}
static void f_mip(struct obj *o) { CK(cuMipmappedArrayDestroy(o->mip)); }

static const struct path PATHS[] = {
    {"cuMemAlloc_v2", fit_bytes, a_alloc, f_free},
    {"cuMemAllocPitch_v2", fit_pitch, a_pitch, f_free},
    {"cuMemAllocManaged", fit_bytes, a_managed, f_free},
    {"cuMemAllocAsync", fit_bytes, a_async, f_async},
    {"cuMemAllocAsync_ptsz", fit_bytes, a_async_ptsz, f_async_ptsz},
    {"cuMemAllocFromPoolAsync", fit_bytes, a_pool, f_async},
    {"cuMemAllocFromPoolAsync_ptsz", fit_bytes, a_pool_ptsz, f_pool_ptsz},
    {"cuMemAlloc(procaddr 3020)", fit_bytes, a_procaddr, f_free},
    {"cuMemCreate", fit_vmm, a_vmm, f_vmm},
    {"cuArrayCreate_v2", fit_array, a_array, f_array},
    {"cuArray3DCreate_v2", fit_array3d, a_array3d, f_array},
    {"cuMipmappedArrayCreate", fit_mip, a_mip, f_mip},
};
#define NPATHS (sizeof PATHS / sizeof PATHS[0])

/* cuMemGetInfo_v2 must say total == cap and free == cap - held; cuDeviceTotalMem_v2 == cap. */
static void expect_info(const char *path, const char *step, size_t held) {
    size_t free = 0, total = 0, dtotal = 0;
    CK(cuMemGetInfo_v2(&free, &total));
    CK(cuDeviceTotalMem_v2(&dtotal, dev));
    EXPECT(total == cap && free == cap - held && dtotal == cap,
           "%s, %s: cuMemGetInfo_v2 free %zu total %zu, cuDeviceTotalMem_v2 %zu; expected free "
           "%zu (cap %zu - held %zu), total %zu",
           path, step, free, total, dtotal, cap - held, cap, held, cap);
}

static int try_alloc(const struct path *pa, size_t want, struct obj *o) {
    memset(o, 0, sizeof *o);
    o->bytes = pa->fit(want);
    return pa->alloc(want, o);
}

static void run_path(const struct path *pa) {
    const char *n = pa->name;
    struct obj a, b, c, d;
    expect_info(n, "before", 0);

    /* Within the cap. */
    CK_EQ(try_alloc(pa, cap / 4 * 3, &a), CUDA_SUCCESS);
    EXPECT(a.bytes > cap / 2, "%s: fit(3/4 cap) = %zu is too small for the test", n, a.bytes);
    expect_info(n, "after allocating 3/4 of the cap", a.bytes);

    /* Over the cap: refused by the hook, and nothing held for it. */
    CUresult over = try_alloc(pa, cap / 2, &b);
    EXPECT(over == CUDA_ERROR_OUT_OF_MEMORY,
           "%s: allocating %zu more while holding %zu of %zu returned %d (%s), expected "
           "CUDA_ERROR_OUT_OF_MEMORY",
           n, b.bytes, a.bytes, cap, over, err_name(over));
    expect_info(n, "after the refused allocation", a.bytes);

    /* The process keeps working: a smaller allocation of the same kind still fits. */
    CK_EQ(try_alloc(pa, cap / 8, &c), CUDA_SUCCESS);
    expect_info(n, "after a small allocation next to the big one", a.bytes + c.bytes);
    pa->release(&c);
    expect_info(n, "after freeing the small one", a.bytes);

    /* Freed memory is available again, up to the whole cap. */
    pa->release(&a);
    expect_info(n, "after freeing", 0);
    CK_EQ(try_alloc(pa, cap, &d), CUDA_SUCCESS);
    expect_info(n, "after allocating the whole cap", d.bytes);
    CUresult again = try_alloc(pa, cap, &b);
    EXPECT(again == CUDA_ERROR_OUT_OF_MEMORY, "%s: a second whole cap returned %d (%s)", n, again,
           err_name(again));
    pa->release(&d);
    expect_info(n, "after freeing the whole cap", 0);

    printf("{\"path\":\"%s\",\"held\":%zu,\"refused_result\":%d,\"full\":%zu}\n", n, a.bytes,
           over, d.bytes);
    fflush(stdout);
}

/* Exact boundaries with cuMemAlloc_v2, and paths sharing one cap. */
static void boundaries(void) {
    CUdeviceptr p = 0, q = 0;
    CK_EQ(cuMemAlloc_v2(&p, cap + 1), CUDA_ERROR_OUT_OF_MEMORY);
    expect_info("boundary", "after cap + 1 refused", 0);
    CK_EQ(cuMemAlloc_v2(&p, cap), CUDA_SUCCESS);
    CK_EQ(cuMemAlloc_v2(&q, 1), CUDA_ERROR_OUT_OF_MEMORY);
    expect_info("boundary", "exactly the cap", cap);
    CK(cuMemFree_v2(p));
    CK_EQ(cuMemAlloc_v2(&p, cap - 4096), CUDA_SUCCESS);
    CK_EQ(cuMemAlloc_v2(&q, 4097), CUDA_ERROR_OUT_OF_MEMORY);
    CK_EQ(cuMemAlloc_v2(&q, 4096), CUDA_SUCCESS);
    expect_info("boundary", "cap - 4096 + 4096", cap);
    CK(cuMemFree_v2(q));
    CK(cuMemFree_v2(p));
    expect_info("boundary", "all freed", 0);

    /* One cap for every path: a quarter each as pitched memory, an array and VMM; then a
     * managed allocation of half the cap does not fit, one of a quarter does. */
    struct obj o1, o2, o3, o4;
    CK_EQ(try_alloc(&PATHS[1], cap / 4, &o1), CUDA_SUCCESS);
    CK_EQ(try_alloc(&PATHS[9], cap / 4, &o2), CUDA_SUCCESS);
    CK_EQ(try_alloc(&PATHS[8], cap / 4, &o3), CUDA_SUCCESS);
    size_t held = o1.bytes + o2.bytes + o3.bytes;
    expect_info("mixed", "three paths", held);
    CK_EQ(try_alloc(&PATHS[2], cap / 2, &o4), CUDA_ERROR_OUT_OF_MEMORY);
    CK_EQ(try_alloc(&PATHS[2], cap - held, &o4), CUDA_SUCCESS);
    expect_info("mixed", "four paths, the whole cap", cap);
    PATHS[2].release(&o4);
    PATHS[8].release(&o3);
    PATHS[9].release(&o2);
    PATHS[1].release(&o1);
    expect_info("mixed", "all freed", 0);
    printf("{\"path\":\"boundaries\"}\n");
}

static void setup(void) {
    context_create(&dev);
    CK(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
}

static void paths_cmd(void) {
    setup();
    CK(cuDeviceGetDefaultMemPool(&pool, dev));
    CUmemAllocationProp prop = vmm_prop();
    CK(cuMemGetAllocationGranularity(&vmm_gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    EXPECT(vmm_gran > 0 && cap % vmm_gran == 0, "granularity %zu, cap %zu", vmm_gran, cap);

    int st = -1;
    CK(cuGetProcAddress_v2("cuMemAllocAsync", (void **)&alloc_async_ptsz, 12000,
                           CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &st));
    EXPECT(alloc_async_ptsz && st == 0, "cuMemAllocAsync (per-thread) status %d", st);
    CK(cuGetProcAddress_v2("cuMemFreeAsync", (void **)&free_async_ptsz, 12000,
                           CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &st));
    EXPECT(free_async_ptsz && st == 0, "cuMemFreeAsync (per-thread) status %d", st);
    CK(cuGetProcAddress_v2("cuMemAlloc", (void **)&alloc_procaddr, 3020, 0, &st));
    EXPECT(alloc_procaddr && st == 0, "cuMemAlloc at 3020: status %d", st);

    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    EXPECT(lib != NULL, "dlopen(libcuda.so.1): %s", dlerror());
    *(void **)&alloc_pool_ptsz = dlsym(lib, "cuMemAllocFromPoolAsync_ptsz");
    *(void **)&free_async_ptsz_dlsym = dlsym(lib, "cuMemFreeAsync_ptsz");
    EXPECT(alloc_pool_ptsz && free_async_ptsz_dlsym, "dlsym of the _ptsz pool functions");
    printf("{\"resolved\":{\"cuMemAllocAsync/2\":\"%s\",", where((void *)alloc_async_ptsz));
    printf("\"cuMemFreeAsync/2\":\"%s\",", where((void *)free_async_ptsz));
    printf("\"cuMemAlloc/3020\":\"%s\",", where((void *)alloc_procaddr));
    printf("\"dlsym cuMemAllocFromPoolAsync_ptsz\":\"%s\"}}\n", where((void *)alloc_pool_ptsz));

    for (size_t i = 0; i < NPATHS; i++)
        run_path(&PATHS[i]);
    boundaries();
    printf("PASS\n");
}

static void oom_kernel_cmd(void) {
    setup();
    CUmodule mod;
    CUfunction spin;
    CK(cuModuleLoadData(&mod, GPUSHARE_SPIN_PTX));
    CK(cuModuleGetFunction(&spin, mod, "gpushare_spin"));
    CUdeviceptr p = 0, q = 0;
    CK(cuMemAlloc_v2(&p, cap / 2));
    CUresult r = cuMemAlloc_v2(&q, cap);
    EXPECT(r == CUDA_ERROR_OUT_OF_MEMORY, "over-cap cuMemAlloc_v2 returned %d (%s)", r,
           err_name(r));
    /* After the refusal: kernels launch and complete, copies round-trip. */
    unsigned long long ns = 2000000, t0 = now_ns();
    void *args[] = {&ns};
    CK(cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, stream, args, NULL));
    CK(cuStreamSynchronize(stream));
    unsigned long long t1 = now_ns();
    EXPECT(t1 - t0 >= ns, "a 2 ms kernel completed after %llu ns", t1 - t0);
    unsigned char host[4096], back[4096];
    for (int i = 0; i < 4096; i++)
        host[i] = (unsigned char)(i * 7 + 3);
    CK(cuMemcpyHtoD_v2(p, host, sizeof host));
    CK(cuMemcpyDtoH_v2(back, p, sizeof back));
    EXPECT(memcmp(host, back, sizeof host) == 0, "copy round trip after the OOM");
    CK(cuMemFree_v2(p));
    CK(cuMemAlloc_v2(&q, cap));
    CK(cuMemFree_v2(q));
    CK(cuCtxSynchronize());
    printf("{\"oom\":%d,\"kernel_ms\":%.3f}\n", r, (t1 - t0) / 1e6);
    printf("PASS\n");
}

int main(int argc, char **argv) {
    check_error_name = cuGetErrorName;
    if (argc != 3) {
        fprintf(stderr, "usage: %s paths|oom-kernel CAP_BYTES\n", argv[0]);
        return 2;
    }
    cap = strtoull(argv[2], NULL, 10);
    EXPECT(cap >= 16 * MIB, "cap %zu: at least 16 MiB", cap);
    if (strcmp(argv[1], "paths") == 0)
        paths_cmd();
    else if (strcmp(argv[1], "oom-kernel") == 0)
        oom_kernel_cmd();
    else
        fail("unknown command %s", argv[1]);
    return 0;
}
