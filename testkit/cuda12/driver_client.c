/* CUDA 12 driver-API features, built with gcc against NVIDIA's own cuda.h (from the
 * nvidia-cuda-runtime-cu12 wheel) and linked with the simulated libcuda:
 *
 *   driver_client library IMAGE...  cuLibraryLoadData of each image (PTX, cubin, fat binary):
 *                                   a CUkernel launched by every launch path, in a graph node,
 *                                   its attributes and parameter layout; one JSON line each
 *   driver_client link PTX CUBIN    cuLink* of a PTX and a cubin (with other kernels); the
 *                                   linked cubin loads with all four; a second copy of the PTX
 *                                   does not link
 *   driver_client capture PTX       the stream-capture rules (invalidation, modes, threads)
 *   driver_client long-capture PTX SECONDS
 *                                   a global-mode capture kept open for SECONDS while this
 *                                   process also runs 1 ms kernels on another stream (so, under
 *                                   gpushare, tokens come and go during the capture); the
 *                                   captured graph then runs
 *
 * Every failing check prints what failed and exits 1.
 */
#include <cuda.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static const char *name_of(CUresult r) {
    const char *s = "?";
    cuGetErrorName(r, &s);
    return s;
}

#define CK_EQ(call, want)                                                                     \
    do {                                                                                      \
        CUresult ck_r_ = (call);                                                              \
        if (ck_r_ != (want)) {                                                                \
            fprintf(stderr, "FAIL: %s:%d: %s returned %s, expected %s\n", __FILE__, __LINE__, \
                    #call, name_of(ck_r_), name_of(want));                                    \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)
#define CK(call) CK_EQ(call, CUDA_SUCCESS)
#define EXPECT(cond, ...)                                                                     \
    do {                                                                                      \
        if (!(cond)) {                                                                        \
            fprintf(stderr, "FAIL: %s:%d: `%s`: ", __FILE__, __LINE__, #cond);                \
            fprintf(stderr, __VA_ARGS__);                                                     \
            fprintf(stderr, "\n");                                                            \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

static void *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    EXPECT(f, "cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc(n + 1);
    EXPECT(fread(buf, 1, n, f) == (size_t)n, "cannot read %s", path);
    buf[n] = 0;
    fclose(f);
    if (len)
        *len = n;
    return buf;
}

static CUcontext setup(void) {
    CK(cuInit(0));
    CUdevice dev;
    CK(cuDeviceGet(&dev, 0));
    CUcontext ctx;
    CK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CK(cuCtxSetCurrent(ctx));
    return ctx;
}

static void by_launch_kernel(CUkernel k, CUstream s, uint64_t *ns) {
    void *args[] = {ns};
    CK(cuLaunchKernel((CUfunction)k, 1, 1, 1, 32, 1, 1, 0, s, args, NULL));
}

/* Device time between two events around `launch`, in ms. A 10 ms pad kernel runs first, so the
 * events time the device work `launch` queues, not the host's time to queue it. */
static double timed(CUstream s, void (*launch)(CUkernel, CUstream, uint64_t *), CUkernel k,
                    uint64_t *ns) {
    CUevent a, b;
    CK(cuEventCreate(&a, 0));
    CK(cuEventCreate(&b, 0));
    uint64_t pad = 10000000;
    by_launch_kernel(k, s, &pad);
    CK(cuEventRecord(a, s));
    launch(k, s, ns);
    CK(cuEventRecord(b, s));
    CK(cuEventSynchronize(b));
    float ms = 0;
    CK(cuEventElapsedTime(&ms, a, b));
    CK(cuEventDestroy(a));
    CK(cuEventDestroy(b));
    return ms;
}

static void by_launch_kernel_ex(CUkernel k, CUstream s, uint64_t *ns) {
    CUlaunchConfig cfg = {0};
    cfg.gridDimX = cfg.gridDimY = cfg.gridDimZ = 1;
    cfg.blockDimX = 32;
    cfg.blockDimY = cfg.blockDimZ = 1;
    cfg.hStream = s;
    void *args[] = {ns};
    CK(cuLaunchKernelEx(&cfg, (CUfunction)k, args, NULL));
}

static void by_cooperative(CUkernel k, CUstream s, uint64_t *ns) {
    void *args[] = {ns};
    CK(cuLaunchCooperativeKernel((CUfunction)k, 1, 1, 1, 32, 1, 1, 0, s, args));
}

static void by_graph_node(CUkernel k, CUstream s, uint64_t *ns) {
    CUgraph g;
    CK(cuGraphCreate(&g, 0));
    CUDA_KERNEL_NODE_PARAMS p = {0};
    p.func = (CUfunction)k;
    p.gridDimX = p.gridDimY = p.gridDimZ = 1;
    p.blockDimX = 32;
    p.blockDimY = p.blockDimZ = 1;
    void *args[] = {ns};
    p.kernelParams = args;
    CUgraphNode node;
    CK(cuGraphAddKernelNode(&node, g, NULL, 0, &p));
    CUgraphExec exec;
    CK(cuGraphInstantiate(&exec, g, 0));
    CK(cuGraphLaunch(exec, s));
    CK(cuGraphExecDestroy(exec));
    CK(cuGraphDestroy(g));
}

static void library(const char *path) {
    CUlibrary lib;
    CK(cuLibraryLoadData(&lib, read_file(path, NULL), NULL, NULL, 0, NULL, NULL, 0));
    unsigned count = 0;
    CK(cuLibraryGetKernelCount(&count, lib));
    EXPECT(count == 2, "%u kernels in %s", count, path);
    CUkernel k, touch;
    CK(cuLibraryGetKernel(&k, lib, "gpushare_spin"));
    CK(cuLibraryGetKernel(&touch, lib, "touch"));
    CK_EQ(cuLibraryGetKernel(&k, lib, "nope"), CUDA_ERROR_NOT_FOUND);
    CK(cuLibraryGetKernel(&k, lib, "gpushare_spin"));
    const char *name = NULL;
    CK(cuKernelGetName(&name, k));
    EXPECT(strcmp(name, "gpushare_spin") == 0, "%s", name);
    size_t off = 0, size = 0;
    CK(cuKernelGetParamInfo(touch, 1, &off, &size));
    EXPECT(off == 8 && size == 4, "touch's 2nd parameter at %zu, %zu bytes", off, size);
    CK_EQ(cuKernelGetParamInfo(touch, 2, &off, &size), CUDA_ERROR_INVALID_VALUE);
    CK(cuKernelSetAttribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 100000, k, 0));
    int v = 0;
    CK(cuKernelGetAttribute(&v, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, k, 0));
    EXPECT(v == 100000, "attribute reads back %d", v);
    /* The CUkernel is accepted where a CUfunction is; cuKernelGetFunction gives one too. */
    CK(cuFuncGetAttribute(&v, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, (CUfunction)k));
    CUfunction f;
    CK(cuKernelGetFunction(&f, k));
    CUmodule mod;
    CK(cuLibraryGetModule(&mod, lib));
    CUfunction by_name;
    CK(cuModuleGetFunction(&by_name, mod, "gpushare_spin"));
    EXPECT(by_name == f, "the library's module has the kernel's function");
    CUstream s;
    CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    uint64_t ns = 2000000;
    printf("{\"image\":\"%s\",\"launch\":%.4f,\"launch_ex\":%.4f,\"cooperative\":%.4f,"
           "\"graph\":%.4f}\n",
           path, timed(s, by_launch_kernel, k, &ns), timed(s, by_launch_kernel_ex, k, &ns),
           timed(s, by_cooperative, k, &ns), timed(s, by_graph_node, k, &ns));
    CK(cuStreamDestroy(s));
    CK(cuLibraryUnload(lib));
    CK_EQ(cuLibraryGetKernelCount(&count, lib), CUDA_ERROR_INVALID_HANDLE);
}

static void link_images(const char *ptx, const char *cubin) {
    CUlinkState link;
    CK(cuLinkCreate(0, NULL, NULL, &link));
    size_t n = 0;
    void *text = read_file(ptx, &n);
    CK(cuLinkAddData(link, CU_JIT_INPUT_PTX, text, n, "spin.ptx", 0, NULL, NULL));
    CK(cuLinkAddFile(link, CU_JIT_INPUT_CUBIN, cubin, 0, NULL, NULL));
    CK_EQ(cuLinkAddData(link, CU_JIT_INPUT_PTX, text, n, "again.ptx", 0, NULL, NULL),
          CUDA_ERROR_INVALID_IMAGE);
    void *out = NULL;
    size_t out_len = 0;
    CK(cuLinkComplete(link, &out, &out_len));
    EXPECT(out_len > 64 && memcmp(out, "\177ELF", 4) == 0, "the output is a cubin");
    CUmodule mod;
    CK(cuModuleLoadData(&mod, out));
    unsigned count = 0;
    CK(cuModuleGetFunctionCount(&count, mod));
    EXPECT(count == 4, "%u functions linked", count);
    CK(cuLinkDestroy(link));
    CK(cuModuleUnload(mod));
    printf("{\"linked_functions\":%u,\"bytes\":%zu}\n", count, out_len);
}

/* --- stream capture ----------------------------------------------------------------------- */

static CUstream capture_stream;
static volatile int step;

static void *other_thread_alloc(void *relaxed) {
    CUcontext ctx;
    CK(cuDevicePrimaryCtxRetain(&ctx, 0));
    CK(cuCtxSetCurrent(ctx));
    if (relaxed) {
        CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
        CK(cuThreadExchangeStreamCaptureMode(&mode));
        EXPECT(mode == CU_STREAM_CAPTURE_MODE_GLOBAL, "previous mode %d", mode);
    }
    CUdeviceptr p;
    CUresult r = cuMemAlloc(&p, 4096);
    if (r == CUDA_SUCCESS)
        CK(cuMemFree(p));
    return (void *)(intptr_t)r;
}

static CUresult alloc_from_other_thread(int relaxed) {
    pthread_t t;
    void *r;
    pthread_create(&t, NULL, other_thread_alloc, relaxed ? (void *)1 : NULL);
    pthread_join(t, &r);
    return (CUresult)(intptr_t)r;
}

static void launch_touch(CUfunction f, CUstream s) {
    CUdeviceptr p = 0;
    unsigned n = 0;
    void *args[] = {&p, &n};
    CK(cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, s, args, NULL));
}

/* Begin a capture in `mode`, run `misuse`, and expect the capture to end as `want`. */
#define CASE(mode, misuse, want_misuse, want_end)                                             \
    do {                                                                                      \
        CK(cuStreamBeginCapture(capture_stream, mode));                                       \
        launch_touch(touch, capture_stream);                                                  \
        CK_EQ(misuse, want_misuse);                                                           \
        CUgraph g = NULL;                                                                     \
        CK_EQ(cuStreamEndCapture(capture_stream, &g), want_end);                              \
        if (g)                                                                                \
            CK(cuGraphDestroy(g));                                                            \
        cases++;                                                                              \
    } while (0)

static void capture(const char *ptx) {
    CUmodule mod;
    CK(cuModuleLoadData(&mod, read_file(ptx, NULL)));
    CUfunction touch;
    CK(cuModuleGetFunction(&touch, mod, "touch"));
    CK(cuStreamCreate(&capture_stream, 0));
    CUstream other;
    CK(cuStreamCreate(&other, CU_STREAM_NON_BLOCKING));
    CUevent ev;
    CK(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
    CUdeviceptr p;
    int cases = 0;
    const CUresult unsupported = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    const CUresult invalidated = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;

    /* Synchronising or querying the capturing stream, or its context. */
    CASE(CU_STREAM_CAPTURE_MODE_RELAXED, cuStreamSynchronize(capture_stream), unsupported,
         invalidated);
    CASE(CU_STREAM_CAPTURE_MODE_RELAXED, cuStreamQuery(capture_stream), unsupported, invalidated);
    CASE(CU_STREAM_CAPTURE_MODE_RELAXED, cuCtxSynchronize(), unsupported, invalidated);
    /* An event recorded in the capture, queried or waited for while it goes on. */
    CASE(CU_STREAM_CAPTURE_MODE_RELAXED,
         (cuEventRecord(ev, capture_stream), cuEventQuery(ev)), unsupported, invalidated);
    CASE(CU_STREAM_CAPTURE_MODE_RELAXED,
         (cuEventRecord(ev, capture_stream), cuEventSynchronize(ev)), unsupported, invalidated);
    /* The legacy stream waits for blocking streams: it cannot be used while one captures. */
    CASE(CU_STREAM_CAPTURE_MODE_RELAXED, cuLaunchKernel(touch, 1, 1, 1, 1, 1, 1, 0, NULL,
                                                         (void *[]){&p, &(unsigned){0}}, NULL),
         CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, invalidated);
    /* Unsafe calls (here a plain allocation): prohibited in this thread unless the capture is
     * relaxed, and in other threads while a global-mode capture goes on, unless they chose the
     * relaxed interaction mode. */
    CASE(CU_STREAM_CAPTURE_MODE_GLOBAL, cuMemAlloc(&p, 64), unsupported, invalidated);
    CASE(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, cuMemAlloc(&p, 64), unsupported, invalidated);
    CASE(CU_STREAM_CAPTURE_MODE_RELAXED, (cuMemAlloc(&p, 64), cuMemFree(p)), CUDA_SUCCESS,
         CUDA_SUCCESS);
    CASE(CU_STREAM_CAPTURE_MODE_GLOBAL, alloc_from_other_thread(0), unsupported, invalidated);
    CASE(CU_STREAM_CAPTURE_MODE_GLOBAL, alloc_from_other_thread(1), CUDA_SUCCESS, CUDA_SUCCESS);
    CASE(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, alloc_from_other_thread(0), CUDA_SUCCESS,
         CUDA_SUCCESS);
    /* Work on another, non-blocking stream is unaffected. */
    CASE(CU_STREAM_CAPTURE_MODE_GLOBAL, (launch_touch(touch, other), cuStreamSynchronize(other)),
         CUDA_SUCCESS, CUDA_SUCCESS);

    /* A valid capture afterwards still works, and its graph runs. */
    CUgraph g;
    CK(cuStreamBeginCapture(capture_stream, CU_STREAM_CAPTURE_MODE_GLOBAL));
    launch_touch(touch, capture_stream);
    CUstreamCaptureStatus status;
    CK(cuStreamIsCapturing(capture_stream, &status));
    EXPECT(status == CU_STREAM_CAPTURE_STATUS_ACTIVE, "status %d", status);
    CK(cuStreamEndCapture(capture_stream, &g));
    CUgraphExec exec;
    CK(cuGraphInstantiate(&exec, g, 0));
    CK(cuGraphLaunch(exec, capture_stream));
    CK(cuStreamSynchronize(capture_stream));
    printf("{\"capture_cases\":%d}\n", cases);
}

static void long_capture(const char *ptx, double seconds) {
    CUmodule mod;
    CK(cuModuleLoadData(&mod, read_file(ptx, NULL)));
    CUfunction spin;
    CK(cuModuleGetFunction(&spin, mod, "gpushare_spin"));
    CUstream cap, work;
    CK(cuStreamCreate(&cap, CU_STREAM_NON_BLOCKING));
    CK(cuStreamCreate(&work, CU_STREAM_NON_BLOCKING));
    uint64_t ms = 1000000;
    void *args[] = {&ms};
    CK(cuStreamBeginCapture(cap, CU_STREAM_CAPTURE_MODE_GLOBAL));
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int captured = 0, ran = 0;
    do {
        CK(cuLaunchKernel(spin, 1, 1, 1, 32, 1, 1, 0, cap, args, NULL));
        captured++;
        for (int i = 0; i < 10; i++, ran++)
            CK(cuLaunchKernel(spin, 1, 1, 1, 32, 1, 1, 0, work, args, NULL));
        CK(cuStreamSynchronize(work));
        clock_gettime(CLOCK_MONOTONIC, &t);
    } while ((t.tv_sec - t0.tv_sec) + (t.tv_nsec - t0.tv_nsec) / 1e9 < seconds);
    CUgraph g;
    CK(cuStreamEndCapture(cap, &g));
    size_t nodes = 0;
    CK(cuGraphGetNodes(g, NULL, &nodes));
    EXPECT(nodes == (size_t)captured, "%zu nodes, %d captured", nodes, captured);
    CUgraphExec exec;
    CK(cuGraphInstantiate(&exec, g, 0));
    CK(cuGraphLaunch(exec, cap));
    CK(cuStreamSynchronize(cap));
    printf("{\"captured\":%d,\"ran\":%d}\n", captured, ran);
}

int main(int argc, char **argv) {
    setup();
    if (argc >= 3 && strcmp(argv[1], "library") == 0) {
        for (int i = 2; i < argc; i++)
            library(argv[i]);
        return 0;
    }
    if (argc == 4 && strcmp(argv[1], "link") == 0) {
        link_images(argv[2], argv[3]);
        return 0;
    }
    if (argc == 3 && strcmp(argv[1], "capture") == 0) {
        capture(argv[2]);
        return 0;
    }
    if (argc == 4 && strcmp(argv[1], "long-capture") == 0) {
        long_capture(argv[2], atof(argv[3]));
        return 0;
    }
    fprintf(stderr, "usage: %s library IMAGE... | link PTX CUBIN | capture PTX | long-capture PTX SECONDS\n",
            argv[0]);
    return 2;
}
