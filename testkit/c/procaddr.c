/* procaddr.c: loads libcuda.so.1 with dlopen, looks up only cuGetProcAddress_v2 with dlsym and
 * obtains every other driver entry point through it, as the CUDA runtime and frameworks do.
 * Prints PASS, or "FAIL: <which check>" on stderr and exits 1.
 *
 * Build: gcc procaddr.c -o procaddr -ldl (no link against libcuda). */
#define _GNU_SOURCE
#include "cuda_min.h"

#include <dlfcn.h>
#include <string.h>

#include "check.h"
#include "gpushare_spin_ptx.h"

typedef CUresult (*PFN_getProcAddress_v2)(const char *symbol, void **pfn, int cudaVersion,
                                          unsigned long long flags, int *symbolStatus);

static PFN_getProcAddress_v2 get_proc;

/* The exported symbol `p` points at (dladdr), or "?" if it is not at a dynamic symbol. */
static const char *symbol_at(void *p) {
    Dl_info info;
    if (p && dladdr(p, &info) && info.dli_sname && info.dli_saddr == p)
        return info.dli_sname;
    return "?";
}

/* cuGetProcAddress_v2(name, version, flags), which must find the exported symbol `want`. */
static void *resolve(const char *name, int version, unsigned long long flags, const char *want) {
    void *p = NULL;
    int status = -1;
    CUresult r = get_proc(name, &p, version, flags, &status);
    if (r != CUDA_SUCCESS || p == NULL || status != CU_GET_PROC_ADDRESS_SUCCESS)
        fail("cuGetProcAddress_v2(\"%s\", %d, flags %llu) = %d (%s), pfn %p, status %d", name,
             version, flags, r, err_name(r), p, status);
    const char *got = symbol_at(p);
    if (strcmp(got, want) != 0)
        fail("cuGetProcAddress_v2(\"%s\", %d, flags %llu) returned %p = %s, expected %s", name,
             version, flags, p, got, want);
    return p;
}

#define RESOLVE(var, name, version, flags, want) *(void **)&(var) = resolve(name, version, flags, want)

#define MS 1000000ull
#define TOL 0.03

int main(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib)
        fail("dlopen(libcuda.so.1): %s", dlerror());
    *(void **)&get_proc = dlsym(lib, "cuGetProcAddress_v2");
    if (!get_proc)
        fail("dlsym(cuGetProcAddress_v2): %s", dlerror());

    RESOLVE(check_error_name, "cuGetErrorName", 6000, 0, "cuGetErrorName");

    /* cuGetProcAddress returns itself; the CUDA 11.3 ABI is the other symbol. */
    void *self = NULL, *self_v1 = NULL;
    RESOLVE(self, "cuGetProcAddress", 12000, 0, "cuGetProcAddress_v2");
    EXPECT(self == (void *)get_proc, "cuGetProcAddress@12000 %p is not cuGetProcAddress_v2 %p",
           self, (void *)get_proc);
    RESOLVE(self_v1, "cuGetProcAddress", 11030, 0, "cuGetProcAddress");
    EXPECT(self_v1 != self, "cuGetProcAddress@11030 should be the v1 ABI, not the v2 one");

    /* An unknown name, and a known one asked for with a version older than any of its ABIs. */
    void *p = (void *)1;
    int status = -1;
    CK_EQ(get_proc("cuDoesNotExist", &p, 12090, 0, &status), CUDA_ERROR_NOT_FOUND);
    EXPECT(status == CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND, "status %d for an unknown name", status);
    EXPECT(p == NULL, "pfn %p for an unknown name", p);
    p = (void *)1;
    status = -1;
    CUresult r = get_proc("cuLaunchKernelEx", &p, 11000, 0, &status);
    EXPECT(r == CUDA_SUCCESS || r == CUDA_ERROR_NOT_FOUND,
           "cuGetProcAddress_v2(cuLaunchKernelEx, 11000) returned %d (%s)", r, err_name(r));
    EXPECT(status == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT,
           "status %d for cuLaunchKernelEx at CUDA 11.0 (introduced in 11.8)", status);
    EXPECT(p == NULL, "pfn %p for cuLaunchKernelEx at CUDA 11.0", p);
    /* The status pointer is optional. */
    CK_EQ(get_proc("cuDoesNotExist", &p, 12090, 0, NULL), CUDA_ERROR_NOT_FOUND);

    CUresult (*init)(unsigned int);
    CUresult (*device_get)(CUdevice *, int);
    CUresult (*ctx_create)(CUcontext *, unsigned int, CUdevice); /* the _v2 ABI */
    void *ctx_create_v3;
    CUresult (*ctx_destroy)(CUcontext);
    CUresult (*mem_get_info)(size_t *, size_t *);
    CUresult (*mem_alloc)(CUdeviceptr *, size_t);
    CUresult (*mem_free)(CUdeviceptr);
    CUresult (*memcpy_htod)(CUdeviceptr, const void *, size_t);
    CUresult (*memcpy_dtoh)(void *, CUdeviceptr, size_t);
    CUresult (*module_load_data)(CUmodule *, const void *);
    CUresult (*module_get_function)(CUfunction *, CUmodule, const char *);
    CUresult (*stream_create)(CUstream *, unsigned int);
    CUresult (*stream_sync)(CUstream);
    CUresult (*stream_sync_ptsz)(CUstream);
    CUresult (*event_create)(CUevent *, unsigned int);
    CUresult (*event_record)(CUevent, CUstream);
    CUresult (*event_sync)(CUevent);
    CUresult (*event_elapsed)(float *, CUevent, CUevent);
    typedef CUresult (*launch_t)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                                 unsigned, unsigned, CUstream, void **, void **);
    launch_t launch, launch_legacy_flag, launch_ptsz;

    RESOLVE(init, "cuInit", 2000, 0, "cuInit");
    RESOLVE(device_get, "cuDeviceGet", 2000, 0, "cuDeviceGet");
    RESOLVE(ctx_create, "cuCtxCreate", 3020, 0, "cuCtxCreate_v2");
    RESOLVE(ctx_create_v3, "cuCtxCreate", 11040, 0, "cuCtxCreate_v3");
    EXPECT((void *)ctx_create != ctx_create_v3, "cuCtxCreate@3020 and @11040 are the same");
    RESOLVE(ctx_destroy, "cuCtxDestroy", 4000, 0, "cuCtxDestroy_v2");
    RESOLVE(mem_get_info, "cuMemGetInfo", 3020, 0, "cuMemGetInfo_v2");
    RESOLVE(mem_alloc, "cuMemAlloc", 3020, 0, "cuMemAlloc_v2");
    RESOLVE(mem_free, "cuMemFree", 3020, 0, "cuMemFree_v2");
    RESOLVE(memcpy_htod, "cuMemcpyHtoD", 3020, 0, "cuMemcpyHtoD_v2");
    RESOLVE(memcpy_dtoh, "cuMemcpyDtoH", 3020, 0, "cuMemcpyDtoH_v2");
    RESOLVE(module_load_data, "cuModuleLoadData", 2000, 0, "cuModuleLoadData");
    RESOLVE(module_get_function, "cuModuleGetFunction", 2000, 0, "cuModuleGetFunction");
    RESOLVE(stream_create, "cuStreamCreate", 2000, 0, "cuStreamCreate");
    RESOLVE(stream_sync, "cuStreamSynchronize", 2000, 0, "cuStreamSynchronize");
    RESOLVE(stream_sync_ptsz, "cuStreamSynchronize", 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM,
            "cuStreamSynchronize_ptsz");
    RESOLVE(event_create, "cuEventCreate", 2000, 0, "cuEventCreate");
    RESOLVE(event_record, "cuEventRecord", 2000, 0, "cuEventRecord");
    RESOLVE(event_sync, "cuEventSynchronize", 2000, 0, "cuEventSynchronize");
    RESOLVE(event_elapsed, "cuEventElapsedTime", 2000, 0, "cuEventElapsedTime");
    RESOLVE(launch, "cuLaunchKernel", 4000, 0, "cuLaunchKernel");
    RESOLVE(launch_legacy_flag, "cuLaunchKernel", 12000, CU_GET_PROC_ADDRESS_LEGACY_STREAM,
            "cuLaunchKernel");
    RESOLVE(launch_ptsz, "cuLaunchKernel", 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM,
            "cuLaunchKernel_ptsz");
    EXPECT((void *)launch == (void *)launch_legacy_flag, "legacy-stream flag changed cuLaunchKernel");
    EXPECT((void *)launch != (void *)launch_ptsz, "per-thread flag did not change cuLaunchKernel");

    /* Use them. */
    CK(init(0));
    CUdevice dev;
    CK(device_get(&dev, 0));
    CUcontext ctx = NULL;
    CK(ctx_create(&ctx, 0, dev));
    EXPECT(ctx != NULL, "cuCtxCreate_v2 returned a NULL context");
    size_t free0 = 0, total = 0;
    CK(mem_get_info(&free0, &total));
    EXPECT(total > 0 && free0 <= total, "cuMemGetInfo_v2: free %zu total %zu", free0, total);

    enum { N = 16384 };
    static unsigned host[N], back[N];
    for (unsigned i = 0; i < N; i++)
        host[i] = i * 40503u + 7;
    CUdeviceptr d;
    CK(mem_alloc(&d, sizeof host));
    CK(memcpy_htod(d, host, sizeof host));
    CK(memcpy_dtoh(back, d, sizeof back));
    EXPECT(memcmp(host, back, sizeof host) == 0, "HtoD/DtoH round trip differs");

    CUmodule mod;
    CUfunction spin, missing;
    CK(module_load_data(&mod, GPUSHARE_SPIN_PTX));
    CK(module_get_function(&spin, mod, "gpushare_spin"));
    CK_EQ(module_get_function(&missing, mod, "no_such_kernel"), CUDA_ERROR_NOT_FOUND);

    /* 1 ms spin on a created stream, legacy launch, timed with events. */
    CUstream s;
    CK(stream_create(&s, CU_STREAM_NON_BLOCKING));
    CUevent e0, e1;
    CK(event_create(&e0, CU_EVENT_DEFAULT));
    CK(event_create(&e1, CU_EVENT_DEFAULT));
    /* Each timed kernel is queued behind a 5 ms pad kernel, so the start event completes when the
     * pad does and the timed kernel follows at once: host launch latency is not measured. */
    unsigned long long pad = 5 * MS;
    void *pad_args[] = {&pad};
    unsigned long long ns = 1 * MS;
    void *args[] = {&ns};
    CK(launch(spin, 1, 1, 1, 1, 1, 1, 0, s, pad_args, NULL));
    CK(event_record(e0, s));
    CK(launch(spin, 1, 1, 1, 1, 1, 1, 0, s, args, NULL));
    CK(event_record(e1, s));
    CK(event_sync(e1));
    float ms = -1;
    CK(event_elapsed(&ms, e0, e1));
    EXPECT_NEAR(ms, 1.0, TOL, "1 ms spin via cuLaunchKernel@4000 (ms)");
    CK(stream_sync(s));

    /* 2 ms spin through the per-thread entry point on stream 0 (= this thread's default stream):
     * events on CU_STREAM_PER_THREAD bracket it, and the per-thread synchronize waits for it. */
    ns = 2 * MS;
    unsigned long long t0 = now_ns();
    CK(launch_ptsz(spin, 1, 1, 1, 1, 1, 1, 0, NULL, pad_args, NULL));
    CK(event_record(e0, CU_STREAM_PER_THREAD));
    CK(launch_ptsz(spin, 1, 1, 1, 1, 1, 1, 0, NULL, args, NULL));
    CK(event_record(e1, CU_STREAM_PER_THREAD));
    CK(stream_sync_ptsz(NULL));
    unsigned long long waited = now_ns() - t0;
    EXPECT(waited >= (unsigned long long)(7 * MS * (1 - TOL)),
           "cuStreamSynchronize_ptsz(0) returned %.3f ms after 5 + 2 ms of kernels were launched "
           "on the per-thread stream", waited / 1e6);
    CK(event_sync(e1));
    CK(event_elapsed(&ms, e0, e1));
    EXPECT_NEAR(ms, 2.0, TOL, "2 ms spin via cuLaunchKernel_ptsz on the per-thread stream (ms)");

    CK(mem_free(d));
    CK(ctx_destroy(ctx));
    printf("PASS\n");
    return 0;
}
