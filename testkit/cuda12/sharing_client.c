/* Green contexts and interprocess (IPC) handles, built with gcc against NVIDIA's own cuda.h
 * (from the nvidia-cuda-runtime-cu12 wheel) and linked with the simulated libcuda. Each check
 * quotes the sentence of cuda.h's documentation it follows.
 *
 *   sharing_client green   green contexts: the device's SM resource, splits, descriptors, the
 *                          green context and its context, streams and events
 *   sharing_client ipc     memory and event handles: this process exports an allocation and an
 *                          event, a child process (this program, `ipc-child …`) opens them; the
 *                          two see the same bytes and each other's event records
 *
 * Prints one JSON line (the checks passed); a failed check prints FAIL and exits 1.
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../c/check.h"
#include "../c/gpushare_spin_ptx.h"

static int checks;
#define CHECK_EQ(call, want)                                                                  \
    do {                                                                                      \
        CK_EQ(call, want);                                                                    \
        checks++;                                                                             \
    } while (0)
#define CHECK(cond, ...)                                                                      \
    do {                                                                                      \
        EXPECT(cond, __VA_ARGS__);                                                            \
        checks++;                                                                             \
    } while (0)

static CUfunction spin;

/* Load the spin kernel into the current context. */
static void load_spin(void) {
    CUmodule mod;
    CK(cuModuleLoadData(&mod, GPUSHARE_SPIN_PTX));
    CK(cuModuleGetFunction(&spin, mod, "gpushare_spin"));
}

static void launch_spin(CUstream s, uint64_t ns) {
    void *args[] = {&ns};
    CK(cuLaunchKernel(spin, 1, 1, 1, 32, 1, 1, 0, s, args, NULL));
}

static float elapsed_ms(CUevent a, CUevent b) {
    float ms = 0;
    CK(cuEventElapsedTime(&ms, a, b));
    return ms;
}

static void green(void) {
    CUdevice dev;
    CK(cuDeviceGet(&dev, 0));
    int sms = 0;
    CK(cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev));

    /* cuDeviceGetDevResource: "Get the type resources available to the device." */
    CUdevResource all;
    CHECK_EQ(cuDeviceGetDevResource(dev, &all, CU_DEV_RESOURCE_TYPE_SM), CUDA_SUCCESS);
    CHECK(all.type == CU_DEV_RESOURCE_TYPE_SM && all.sm.smCount == (unsigned)sms,
          "the device's SM resource: %u SMs, type %d", all.sm.smCount, all.type);
    CUdevResource bad;
    CHECK_EQ(cuDeviceGetDevResource(dev, &bad, CU_DEV_RESOURCE_TYPE_INVALID),
             CUDA_ERROR_INVALID_RESOURCE_TYPE);

    /* cuDevSmResourceSplitByCount: "If result is NULL, the API simulates a split and provides
     * the amount of groups that would be created in nbGroups"; on compute capability 9.0 "the
     * minimum count is 8 SMs and must be a multiple of 8". */
    unsigned n = 0;
    CHECK_EQ(cuDevSmResourceSplitByCount(NULL, &n, &all, NULL, 0, 8), CUDA_SUCCESS);
    CHECK(n == (unsigned)sms / 8, "groups of 8: %u", n);
    CHECK_EQ(cuDevSmResourceSplitByCount(NULL, &n, &all, NULL, 0, 12), CUDA_SUCCESS);
    CHECK(n == (unsigned)sms / 16, "12 SMs rounded up to 16: %u groups", n);
    /* "Value of minCount must be between 0 and the SM count specified in input." */
    CHECK_EQ(cuDevSmResourceSplitByCount(NULL, &n, &all, NULL, 0, sms + 8),
             CUDA_ERROR_INVALID_VALUE);

    /* "nbGroups must point to the amount of elements in result and on return, the API will
     * overwrite nbGroups with the amount actually created"; "If the input resource cannot be
     * cleanly split among nbGroups, the remaining is placed in here." */
    CUdevResource groups[2], rest;
    n = 2;
    CHECK_EQ(cuDevSmResourceSplitByCount(groups, &n, &all, &rest, 0, 16), CUDA_SUCCESS);
    CHECK(n == 2 && groups[0].sm.smCount == 16 && groups[1].sm.smCount == 16 &&
              rest.sm.smCount == (unsigned)sms - 32,
          "2 groups of 16 and the rest: %u groups, %u, %u, rest %u", n, groups[0].sm.smCount,
          groups[1].sm.smCount, rest.sm.smCount);
    /* "The output results cannot be split again without first creating a descriptor and a
     * green context with that descriptor." */
    CHECK_EQ(cuDevSmResourceSplitByCount(NULL, &n, &groups[0], NULL, 0, 8),
             CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION);

    /* cuDevResourceGenerateDesc: resources of type SM "must be outputs (whether result or
     * remaining) from the same split API instance, otherwise
     * CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION is returned." */
    CUdevResource other, pair[2];
    n = 1;
    CK(cuDevSmResourceSplitByCount(&other, &n, &all, NULL, 0, 8));
    pair[0] = groups[0];
    pair[1] = other;
    CUdevResourceDesc desc;
    CHECK_EQ(cuDevResourceGenerateDesc(&desc, pair, 2), CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION);
    pair[1] = rest;
    CHECK_EQ(cuDevResourceGenerateDesc(&desc, pair, 2), CUDA_SUCCESS);
    CHECK_EQ(cuDevResourceGenerateDesc(&desc, groups, 2), CUDA_SUCCESS);

    /* cuGreenCtxCreate: "CU_GREEN_CTX_DEFAULT_STREAM is required"; "This API will retain the
     * primary context on device dev, which is released when the green context is destroyed";
     * "The API does not set the green context current." */
    CUgreenCtx g;
    CHECK_EQ(cuGreenCtxCreate(&g, desc, dev, 0), CUDA_ERROR_INVALID_VALUE);
    unsigned flags;
    int active;
    CK(cuDevicePrimaryCtxGetState(dev, &flags, &active));
    CHECK(!active, "the primary context starts inactive");
    CHECK_EQ(cuGreenCtxCreate(&g, desc, dev, CU_GREEN_CTX_DEFAULT_STREAM), CUDA_SUCCESS);
    CK(cuDevicePrimaryCtxGetState(dev, &flags, &active));
    CHECK(active, "the green context retained the primary context");
    CUcontext current;
    CK(cuCtxGetCurrent(&current));
    CHECK(current == NULL, "the green context is not made current");

    /* cuCtxFromGreenCtx: the context "with the resources of the specified green context";
     * cuCtxGetDevResource / cuGreenCtxGetDevResource: "the type resources available to the
     * context". */
    CUcontext gctx;
    CHECK_EQ(cuCtxFromGreenCtx(&gctx, g), CUDA_SUCCESS);
    CUdevResource r;
    CHECK_EQ(cuCtxGetDevResource(gctx, &r, CU_DEV_RESOURCE_TYPE_SM), CUDA_SUCCESS);
    CHECK(r.sm.smCount == 32, "the green context's SMs: %u", r.sm.smCount);
    CHECK_EQ(cuGreenCtxGetDevResource(g, &r, CU_DEV_RESOURCE_TYPE_SM), CUDA_SUCCESS);
    CHECK(r.sm.smCount == 32, "the green context's SMs: %u", r.sm.smCount);
    /* ... and a green context's resource may be split ("without first creating a descriptor
     * and a green context" it may not). */
    CHECK_EQ(cuDevSmResourceSplitByCount(NULL, &n, &r, NULL, 0, 8), CUDA_SUCCESS);
    CHECK(n == 4, "32 SMs in groups of 8: %u", n);

    /* cuStreamGetGreenCtx: "If during stream creation the context that was active in the
     * calling thread was obtained with cuCtxFromGreenCtx, that green context is returned";
     * cuStreamGetCtx_v2: "the green context in pGreenCtx and the primary context of the
     * associated device in pCtx". */
    CUcontext primary;
    CK(cuDevicePrimaryCtxRetain(&primary, dev));
    CK(cuCtxSetCurrent(gctx));
    load_spin();
    CUstream s;
    CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CUgreenCtx got;
    CHECK_EQ(cuStreamGetGreenCtx(s, &got), CUDA_SUCCESS);
    CHECK(got == g, "a stream created in the green context belongs to it");
    CUcontext pctx;
    CHECK_EQ(cuStreamGetCtx_v2(s, &pctx, &got), CUDA_SUCCESS);
    CHECK(pctx == primary && got == g, "cuStreamGetCtx_v2: the primary context and the green");
    /* cuGreenCtxStreamCreate: "CU_STREAM_NON_BLOCKING must be specified." */
    CUstream gs;
    CHECK_EQ(cuGreenCtxStreamCreate(&gs, g, 0, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_EQ(cuGreenCtxStreamCreate(&gs, g, CU_STREAM_NON_BLOCKING, 0), CUDA_SUCCESS);
    CHECK_EQ(cuStreamGetGreenCtx(gs, &got), CUDA_SUCCESS);
    CHECK(got == g, "cuGreenCtxStreamCreate's stream belongs to the green context");

    /* cuGreenCtxRecordEvent: "Captures in hEvent all the activities of the green context". */
    CUevent start, all_done;
    CK(cuEventCreate(&start, CU_EVENT_DEFAULT));
    CK(cuEventCreate(&all_done, CU_EVENT_DEFAULT));
    CK(cuEventRecord(start, gs));
    launch_spin(s, 20000000);
    launch_spin(gs, 5000000);
    CHECK_EQ(cuGreenCtxRecordEvent(g, all_done), CUDA_SUCCESS);
    CK(cuEventSynchronize(all_done));
    float ms = elapsed_ms(start, all_done);
    CHECK(ms >= 20.0f, "the green context's record follows its 20 ms kernel: %.3f ms", ms);

    /* cuGreenCtxWaitEvent: "Makes all future work submitted to green context hCtx wait for all
     * work captured in hEvent"; "hEvent may be from a different context". */
    CUevent before, in_primary, after;
    CK(cuEventCreate(&before, CU_EVENT_DEFAULT));
    CK(cuEventCreate(&after, CU_EVENT_DEFAULT));
    CK(cuEventRecord(before, gs));
    CK(cuCtxSetCurrent(primary));
    CUfunction green_spin = spin;
    load_spin();
    CUstream ps;
    CK(cuStreamCreate(&ps, CU_STREAM_NON_BLOCKING));
    CK(cuEventCreate(&in_primary, CU_EVENT_DISABLE_TIMING));
    launch_spin(ps, 30000000);
    CK(cuEventRecord(in_primary, ps));
    CHECK_EQ(cuGreenCtxWaitEvent(g, in_primary), CUDA_SUCCESS);
    CUgreenCtx none;
    CHECK_EQ(cuStreamGetGreenCtx(ps, &none), CUDA_SUCCESS);
    CHECK(none == NULL, "a regular context's stream has no green context");
    CK(cuCtxSetCurrent(gctx));
    spin = green_spin;
    CK(cuEventRecord(after, gs));
    CK(cuEventSynchronize(after));
    ms = elapsed_ms(before, after);
    CHECK(ms >= 30.0f, "later green-context work waited for the 30 ms kernel: %.3f ms", ms);

    /* cuGreenCtxDestroy: "Destroys the green context, releasing the primary context". */
    CK(cuCtxSetCurrent(NULL));
    CK(cuDevicePrimaryCtxRelease(dev));
    CHECK_EQ(cuGreenCtxDestroy(g), CUDA_SUCCESS);
    CK(cuDevicePrimaryCtxGetState(dev, &flags, &active));
    CHECK(!active, "destroying the green context released the primary context");
    printf("{\"case\": \"green\", \"checks\": %d, \"sms\": %d}\n", checks, sms);
}

static void to_hex(const void *bytes, size_t n, char *out) {
    for (size_t i = 0; i < n; i++)
        sprintf(out + 2 * i, "%02x", ((const unsigned char *)bytes)[i]);
}

static void from_hex(const char *hex, void *bytes, size_t n) {
    for (size_t i = 0; i < n; i++)
        EXPECT(sscanf(hex + 2 * i, "%2hhx", (unsigned char *)bytes + i) == 1, "bad hex");
}

#define IPC_BYTES (1u << 20)
#define IPC_SPIN_NS 3000000000ull

static void fill(uint32_t *p, uint32_t seed) {
    for (unsigned i = 0; i < IPC_BYTES / 4; i++)
        p[i] = seed * 2654435761u + i;
}

static void ipc(const char *self) {
    CUdevice dev;
    CK(cuDeviceGet(&dev, 0));
    CUcontext ctx;
    CK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CK(cuCtxSetCurrent(ctx));
    load_spin();
    CUstream s;
    CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    static uint32_t host[IPC_BYTES / 4], back[IPC_BYTES / 4];

    /* cuIpcGetMemHandle: "Takes a pointer to the base of an existing device memory allocation
     * created with cuMemAlloc"; "may be called multiple times on an allocation without adverse
     * effects". */
    CUdeviceptr buf;
    CK(cuMemAlloc(&buf, IPC_BYTES));
    fill(host, 1);
    CK(cuMemcpyHtoD(buf, host, IPC_BYTES));
    int capable = 0;
    CK(cuPointerGetAttribute(&capable, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, buf));
    CHECK(capable, "cuMemAlloc memory is legacy-IPC capable");
    CUipcMemHandle h, again;
    CHECK_EQ(cuIpcGetMemHandle(&h, buf), CUDA_SUCCESS);
    CHECK_EQ(cuIpcGetMemHandle(&again, buf), CUDA_SUCCESS);
    CHECK(memcmp(&h, &again, sizeof h) == 0, "the same allocation, the same handle");
    CHECK_EQ(cuIpcGetMemHandle(&again, buf + 4096), CUDA_ERROR_INVALID_VALUE);
    CUdeviceptr pooled;
    CK(cuMemAllocAsync(&pooled, 4096, s));
    CK(cuPointerGetAttribute(&capable, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, pooled));
    CHECK(!capable, "stream-ordered memory is not legacy-IPC capable");
    CHECK_EQ(cuIpcGetMemHandle(&again, pooled), CUDA_ERROR_INVALID_VALUE);
    CK(cuMemFreeAsync(pooled, s));

    /* cuIpcGetEventHandle: "This event must have been created with the CU_EVENT_INTERPROCESS
     * and CU_EVENT_DISABLE_TIMING flags set." */
    CUevent timed, ev;
    CUipcEventHandle eh;
    CK(cuEventCreate(&timed, CU_EVENT_INTERPROCESS));
    CHECK_EQ(cuIpcGetEventHandle(&eh, timed), CUDA_ERROR_INVALID_VALUE);
    CK(cuEventCreate(&ev, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING));
    CHECK_EQ(cuIpcGetEventHandle(&eh, ev), CUDA_SUCCESS);

    /* The event's record follows a 3 s kernel; the child must see it pending until then. */
    launch_spin(s, IPC_SPIN_NS);
    unsigned long long launched = now_ns();
    CK(cuEventRecord(ev, s));

    int pipefd[2];
    EXPECT(pipe(pipefd) == 0, "pipe");
    char mem_hex[2 * sizeof h + 1], ev_hex[2 * sizeof eh + 1], at[32], fd[16];
    to_hex(&h, sizeof h, mem_hex);
    to_hex(&eh, sizeof eh, ev_hex);
    snprintf(at, sizeof at, "%llu", launched);
    snprintf(fd, sizeof fd, "%d", pipefd[1]);
    pid_t child = fork();
    EXPECT(child >= 0, "fork");
    if (child == 0) {
        close(pipefd[0]);
        execl(self, self, "ipc-child", mem_hex, ev_hex, at, fd, (char *)NULL);
        _exit(127);
    }
    close(pipefd[1]);
    /* The child writes its bytes, records the event after a kernel of its own, and says when it
     * launched that kernel. */
    unsigned long long child_launched = 0;
    int child_checks = 0;
    FILE *from_child = fdopen(pipefd[0], "r");
    EXPECT(from_child && fscanf(from_child, "%llu %d", &child_launched, &child_checks) == 2,
           "the child reports its record");
    /* The child's record is the event's latest: "cuEventRecord, cuEventSynchronize,
     * cuStreamWaitEvent and cuEventQuery may be used in either process". */
    CHECK_EQ(cuEventQuery(ev), CUDA_ERROR_NOT_READY);
    CHECK_EQ(cuEventSynchronize(ev), CUDA_SUCCESS);
    CHECK(now_ns() >= child_launched + IPC_SPIN_NS,
          "the parent's wait for the child's record returned before the child's kernel ended");
    /* cuIpcOpenMemHandle "maps memory exported from another process": the child's writes are
     * in this process's allocation. */
    CK(cuMemcpyDtoH(back, buf, IPC_BYTES));
    fill(host, 2);
    CHECK(memcmp(host, back, IPC_BYTES) == 0, "the child's writes are in the exporter's memory");
    int status;
    EXPECT(waitpid(child, &status, 0) == child, "waitpid");
    EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the child failed (status %d)", status);

    /* "If a region of memory is freed with cuMemFree and a subsequent call to cuMemAlloc returns
     * memory with the same device address, cuIpcGetMemHandle will return a unique handle for
     * the new memory." */
    CK(cuMemFree(buf));
    CUdeviceptr next;
    CK(cuMemAlloc(&next, IPC_BYTES));
    CK(cuIpcGetMemHandle(&again, next));
    CHECK(memcmp(&h, &again, sizeof h) != 0, "a new allocation gets a new handle");
    printf("{\"case\": \"ipc\", \"checks\": %d, \"child_checks\": %d, \"same_address\": %s}\n",
           checks, child_checks, next == buf ? "true" : "false");
}

static void ipc_child(const char *mem_hex, const char *ev_hex, const char *at, const char *fd) {
    CUdevice dev;
    CK(cuDeviceGet(&dev, 0));
    CUcontext ctx;
    CK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CK(cuCtxSetCurrent(ctx));
    load_spin();
    CUstream s;
    CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    unsigned long long parent_launched = strtoull(at, NULL, 10);
    CUipcMemHandle h;
    CUipcEventHandle eh;
    from_hex(mem_hex, &h, sizeof h);
    from_hex(ev_hex, &eh, sizeof eh);
    static uint32_t want[IPC_BYTES / 4], got[IPC_BYTES / 4];

    /* cuIpcOpenMemHandle: "Flags ... Must be specified as CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS";
     * "If the memory handle has already been opened by the current context, the reference
     * count on the handle is incremented by 1 and the existing device pointer is returned." */
    CUdeviceptr p, q;
    CHECK_EQ(cuIpcOpenMemHandle(&p, h, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_EQ(cuIpcOpenMemHandle(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), CUDA_SUCCESS);
    CHECK_EQ(cuIpcOpenMemHandle(&q, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), CUDA_SUCCESS);
    CHECK(p == q, "opening a handle again returns the same pointer");
    CK(cuMemcpyDtoH(got, p, IPC_BYTES));
    fill(want, 1);
    CHECK(memcmp(want, got, IPC_BYTES) == 0, "the exporter's bytes");
    fill(want, 2);
    CK(cuMemcpyHtoD(p, want, IPC_BYTES));

    /* cuIpcOpenEventHandle: "a CUevent that behaves like a locally created event with the
     * CU_EVENT_DISABLE_TIMING flag specified" (cuEventElapsedTime: "If either event was created
     * with the CU_EVENT_DISABLE_TIMING flag, then this function will return
     * CUDA_ERROR_INVALID_HANDLE"). */
    CUevent ev, mine;
    CHECK_EQ(cuIpcOpenEventHandle(&ev, eh), CUDA_SUCCESS);
    CK(cuEventCreate(&mine, CU_EVENT_DEFAULT));
    CK(cuEventRecord(mine, s));
    float ms;
    CHECK_EQ(cuEventElapsedTime(&ms, mine, ev), CUDA_ERROR_INVALID_HANDLE);
    /* The parent's record follows its 3 s kernel: waits here end after it. */
    CUevent after;
    CK(cuEventCreate(&after, CU_EVENT_DISABLE_TIMING));
    CHECK_EQ(cuStreamWaitEvent(s, ev, 0), CUDA_SUCCESS);
    CK(cuEventRecord(after, s));
    CK(cuEventSynchronize(after));
    CHECK(now_ns() >= parent_launched + IPC_SPIN_NS,
          "a stream waiting for the parent's event ran before the parent's kernel ended");
    CHECK_EQ(cuEventQuery(ev), CUDA_SUCCESS);

    /* "Decrements the reference count ... When the reference count reaches 0, this API unmaps
     * the memory. The original allocation in the exporting process ... will be unaffected." */
    CHECK_EQ(cuIpcCloseMemHandle(p), CUDA_SUCCESS);
    CHECK_EQ(cuIpcCloseMemHandle(q), CUDA_SUCCESS);

    /* Record the shared event here, after a kernel of this process, for the parent to wait. */
    launch_spin(s, IPC_SPIN_NS);
    unsigned long long launched = now_ns();
    CHECK_EQ(cuEventRecord(ev, s), CUDA_SUCCESS);
    FILE *to_parent = fdopen(atoi(fd), "w");
    EXPECT(to_parent, "the pipe to the parent");
    fprintf(to_parent, "%llu %d\n", launched, checks);
    fclose(to_parent);
    CK(cuStreamSynchronize(s));
}

int main(int argc, char **argv) {
    check_error_name = cuGetErrorName;
    CK(cuInit(0));
    if (argc == 2 && strcmp(argv[1], "green") == 0) {
        green();
        return 0;
    }
    if (argc == 2 && strcmp(argv[1], "ipc") == 0) {
        ipc("/proc/self/exe");
        return 0;
    }
    if (argc == 6 && strcmp(argv[1], "ipc-child") == 0) {
        ipc_child(argv[2], argv[3], argv[4], argv[5]);
        return 0;
    }
    fprintf(stderr, "usage: sharing_client green | ipc\n");
    return 2;
}
