/* A CUDA runtime (libcudart 12.x) program, built with gcc alone: no nvcc, so its kernels come
 * from PTX text or a ptxas cubin loaded with cudaLibraryLoadData, as a JIT-ing framework does.
 *
 *   runtime_client check IMAGE...        device query, memory round trips (device, pinned,
 *                                        mapped), a 10 ms gpushare_spin kernel timed with events
 *                                        from each IMAGE (PTX or cubin), a captured graph;
 *                                        prints one JSON line per part
 *   runtime_client spin IMAGE MS SECONDS launch MS-millisecond spin kernels for SECONDS of wall
 *                                        time, synchronising every 40, half of them through a
 *                                        captured graph (5 kernels); prints {"kernels":N}
 *
 * Every failing call prints what failed and exits 1.
 */
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static void fail_at(const char *file, int line, const char *what, cudaError_t e) {
    fprintf(stderr, "FAIL: %s:%d: %s returned %d (%s: %s)\n", file, line, what, (int)e,
            cudaGetErrorName(e), cudaGetErrorString(e));
    exit(1);
}

#define CK(call)                                                                              \
    do {                                                                                      \
        cudaError_t ck_e_ = (call);                                                           \
        if (ck_e_ != cudaSuccess)                                                             \
            fail_at(__FILE__, __LINE__, #call, ck_e_);                                        \
    } while (0)

#define EXPECT(cond, ...)                                                                     \
    do {                                                                                      \
        if (!(cond)) {                                                                        \
            fprintf(stderr, "FAIL: %s:%d: `%s`: ", __FILE__, __LINE__, #cond);                \
            fprintf(stderr, __VA_ARGS__);                                                     \
            fprintf(stderr, "\n");                                                            \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

/* The whole file, NUL-terminated (PTX must be; a cubin does not mind). */
static char *read_file(const char *path) {
    FILE *f = fopen(path, "rb");
    EXPECT(f, "cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc(n + 1);
    EXPECT(fread(buf, 1, n, f) == (size_t)n, "cannot read %s", path);
    buf[n] = 0;
    fclose(f);
    return buf;
}

static cudaKernel_t load_spin(const char *path) {
    cudaLibrary_t lib;
    CK(cudaLibraryLoadData(&lib, read_file(path), NULL, NULL, 0, NULL, NULL, 0));
    cudaKernel_t k;
    CK(cudaLibraryGetKernel(&k, lib, "gpushare_spin"));
    return k;
}

static void launch_spin(cudaKernel_t k, uint64_t ns, cudaStream_t s) {
    void *args[] = {&ns};
    dim3 grid = {1, 1, 1}, block = {32, 1, 1};
    CK(cudaLaunchKernel((const void *)k, grid, block, args, 0, s));
}

static void query(void) {
    int n = 0, driver = 0, runtime = 0;
    CK(cudaGetDeviceCount(&n));
    EXPECT(n >= 1, "no device");
    CK(cudaDriverGetVersion(&driver));
    CK(cudaRuntimeGetVersion(&runtime));
    struct cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    EXPECT(sms == p.multiProcessorCount, "%d vs %d", sms, p.multiProcessorCount);
    size_t free_b = 0, total_b = 0;
    CK(cudaMemGetInfo(&free_b, &total_b));
    printf("{\"part\":\"query\",\"devices\":%d,\"name\":\"%s\",\"cc\":\"%d.%d\",\"sms\":%d,"
           "\"total\":%zu,\"driver\":%d,\"runtime\":%d}\n",
           n, p.name, p.major, p.minor, p.multiProcessorCount, total_b, driver, runtime);
}

static void round_trip(void) {
    enum { N = 1 << 20 };
    unsigned char *host = malloc(N), *back = malloc(N);
    for (int i = 0; i < N; i++)
        host[i] = (unsigned char)(i * 7 + 3);
    void *dev = NULL, *dev2 = NULL;
    CK(cudaMalloc(&dev, N));
    CK(cudaMalloc(&dev2, N));
    CK(cudaMemcpy(dev, host, N, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dev2, dev, N, cudaMemcpyDeviceToDevice));
    CK(cudaMemcpy(back, dev2, N, cudaMemcpyDeviceToHost));
    EXPECT(memcmp(host, back, N) == 0, "device round trip differs");
    CK(cudaMemset(dev, 0xab, N));
    CK(cudaMemcpy(back, dev, N, cudaMemcpyDefault));
    EXPECT(back[0] == 0xab && back[N - 1] == 0xab, "memset not seen");

    /* Pinned host memory as a copy source and destination, asynchronous on a stream. */
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    unsigned char *pinned = NULL;
    CK(cudaMallocHost((void **)&pinned, N));
    memcpy(pinned, host, N);
    CK(cudaMemcpyAsync(dev, pinned, N, cudaMemcpyHostToDevice, s));
    memset(pinned, 0, N);
    CK(cudaMemcpyAsync(pinned, dev, N, cudaMemcpyDeviceToHost, s));
    CK(cudaStreamSynchronize(s));
    EXPECT(memcmp(host, pinned, N) == 0, "pinned round trip differs");

    /* Mapped pinned memory: the device pointer is usable by copies and memsets. */
    unsigned char *mapped = NULL;
    void *mapped_dev = NULL;
    CK(cudaHostAlloc((void **)&mapped, N, cudaHostAllocMapped));
    CK(cudaHostGetDevicePointer(&mapped_dev, mapped, 0));
    CK(cudaMemsetAsync(mapped_dev, 0x5a, N, s));
    CK(cudaStreamSynchronize(s));
    EXPECT(mapped[17] == 0x5a, "memset through the mapped pointer not seen");
    CK(cudaMemcpy(dev2, mapped_dev, N, cudaMemcpyDeviceToDevice));
    CK(cudaMemcpy(back, dev2, N, cudaMemcpyDeviceToHost));
    EXPECT(back[N / 2] == 0x5a, "copy from the mapped pointer not seen");

    CK(cudaFreeHost(mapped));
    CK(cudaFreeHost(pinned));
    CK(cudaStreamDestroy(s));
    CK(cudaFree(dev));
    CK(cudaFree(dev2));
    free(host);
    free(back);
    printf("{\"part\":\"round_trip\",\"bytes\":%d,\"ok\":true}\n", N);
}

/* Time one 10 ms spin kernel from `path` with events. A pad kernel runs first, so the events
 * time device work only, not the host's launch latency. */
static void timed_spin(const char *path) {
    cudaKernel_t k = load_spin(path);
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    launch_spin(k, 2000000, 0);
    CK(cudaEventRecord(a, 0));
    launch_spin(k, 10000000, 0);
    CK(cudaEventRecord(b, 0));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    CK(cudaGetLastError());
    printf("{\"part\":\"events\",\"image\":\"%s\",\"elapsed_ms\":%.4f}\n", path, ms);
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
}

/* Capture `kernels` spin kernels of `ns` each into an executable graph. */
static cudaGraphExec_t capture(cudaKernel_t k, cudaStream_t s, int kernels, uint64_t ns) {
    cudaGraph_t g;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    enum cudaStreamCaptureStatus st;
    CK(cudaStreamIsCapturing(s, &st));
    EXPECT(st == cudaStreamCaptureStatusActive, "status %d", (int)st);
    for (int i = 0; i < kernels; i++)
        launch_spin(k, ns, s);
    CK(cudaStreamEndCapture(s, &g));
    size_t nodes = 0;
    CK(cudaGraphGetNodes(g, NULL, &nodes));
    EXPECT(nodes == (size_t)kernels, "%zu nodes captured, expected %d", nodes, kernels);
    cudaGraphExec_t exec;
    CK(cudaGraphInstantiate(&exec, g, 0));
    CK(cudaGraphDestroy(g));
    return exec;
}

static void graph(const char *path) {
    cudaKernel_t k = load_spin(path);
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaGraphExec_t exec = capture(k, s, 3, 2000000);
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    launch_spin(k, 2000000, s);
    CK(cudaEventRecord(a, s));
    CK(cudaGraphLaunch(exec, s));
    CK(cudaEventRecord(b, s));
    CK(cudaStreamSynchronize(s));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    printf("{\"part\":\"graph\",\"nodes\":3,\"elapsed_ms\":%.4f}\n", ms);
    CK(cudaGraphExecDestroy(exec));
    CK(cudaStreamDestroy(s));
}

static int spin_loop(const char *path, double ms, double seconds) {
    cudaKernel_t k = load_spin(path);
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    uint64_t ns = (uint64_t)(ms * 1e6);
    cudaGraphExec_t exec = capture(k, s, 5, ns);
    double end = now_s() + seconds;
    long kernels = 0;
    while (now_s() < end) {
        for (int round = 0; round < 4; round++) {
            for (int i = 0; i < 5; i++)
                launch_spin(k, ns, s);
            CK(cudaGraphLaunch(exec, s));
            kernels += 10;
        }
        CK(cudaStreamSynchronize(s));
    }
    CK(cudaGraphExecDestroy(exec));
    CK(cudaStreamDestroy(s));
    printf("{\"kernels\":%ld}\n", kernels);
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 3 && strcmp(argv[1], "check") == 0) {
        query();
        round_trip();
        for (int i = 2; i < argc; i++)
            timed_spin(argv[i]);
        graph(argv[2]);
        return 0;
    }
    if (argc == 5 && strcmp(argv[1], "spin") == 0)
        return spin_loop(argv[2], atof(argv[3]), atof(argv[4]));
    fprintf(stderr, "usage: %s check IMAGE... | spin IMAGE MS SECONDS\n", argv[0]);
    return 2;
}
