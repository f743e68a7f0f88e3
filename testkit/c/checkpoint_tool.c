/* checkpoint_tool.c: the driver's checkpoint API (cuCheckpointProcessLock / Checkpoint /
 * Restore / Unlock / GetState / GetRestoreThreadId) driven by a controlling process on a target
 * process it forks (before either initialises CUDA). It runs on the simulated driver and builds
 * as well against a real one (r570 or newer): `gcc checkpoint_tool.c -lcuda -ldl`.
 *
 * It judges nothing: each step prints one JSON line with the result code the driver returned
 * (and the state, timings and free memory around it); the tests compare them with the API's
 * documentation. The target prints its own lines ("target": …). The checkpoint entry points and
 * cuIpcGetMemHandle are looked up with cuGetProcAddress_v2 at CUDA 12.8, as a program built
 * against the runtime finds them (a driver without them answers 500, CUDA_ERROR_NOT_FOUND).
 *
 *   checkpoint_tool states BYTES        every call in every state, and a full round trip of
 *                                       BYTES of device memory: free memory seen by the
 *                                       controller, bytes and addresses seen by the target
 *   checkpoint_tool blocks HOLD_MS      a call the target makes while locked returns only at
 *                                       the unlock, HOLD_MS later
 *   checkpoint_tool timeout KERNEL_MS TIMEOUT_MS
 *                                       a lock with a timeout while the target's kernel of
 *                                       KERNEL_MS runs; then one without a timeout
 *   checkpoint_tool managed BYTES       the target holds managed memory (and device memory)
 *   checkpoint_tool ipc BYTES           the target exported device memory (cuIpcGetMemHandle)
 *   checkpoint_tool kinds BYTES         pitched, stream-ordered (pool) and VMM allocations
 *                                       across a round trip
 *   checkpoint_tool restore-oom BYTES   a restore while the memory is taken, then once it is
 *                                       free again
 *   checkpoint_tool bandwidth BYTES     host<->device copies of BYTES (pinned and pageable)
 *   checkpoint_tool state PID           the state of process PID, another program's
 *   checkpoint_tool hold PID MS         lock process PID (another program's, without a
 *                                       timeout), keep it locked MS ms, unlock it */
#define _GNU_SOURCE
#include "cuda_min.h"

#include "cuda_mem.h"

#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "gpushare_spin_ptx.h"

typedef unsigned int CUprocessState;
typedef struct {
    unsigned int timeoutMs;
    unsigned int reserved0;
    unsigned long long reserved1[7];
} CUcheckpointLockArgs;
typedef struct {
    unsigned long long reserved[8];
} CUcheckpointArgs; /* Checkpoint, Restore and Unlock arguments: all reserved */
typedef struct {
    char reserved[64];
} CUipcMemHandle;

CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr ptr);
CUresult cuMemAllocHost_v2(void **pp, size_t bytesize);
CUresult cuMemFreeHost(void *p);

static CUresult (*ckLock)(int, CUcheckpointLockArgs *);
static CUresult (*ckCheckpoint)(int, CUcheckpointArgs *);
static CUresult (*ckRestore)(int, CUcheckpointArgs *);
static CUresult (*ckUnlock)(int, CUcheckpointArgs *);
static CUresult (*ckGetState)(int, CUprocessState *);
static CUresult (*ckGetRestoreThreadId)(int, int *);
static CUresult (*ipcGetMemHandle)(CUipcMemHandle *, CUdeviceptr);

static CUresult not_found2(int a, void *b) {
    (void)a;
    (void)b;
    return CUDA_ERROR_NOT_FOUND;
}

/* Look `name` up as a program built against CUDA 12.8 would; a missing symbol answers 500. */
static void *lookup(const char *name) {
    void *p = NULL;
    int status = 0;
    CUresult r = cuGetProcAddress_v2(name, &p, 12080, 0, &status);
    if (r != CUDA_SUCCESS || !p)
        return (void *)not_found2;
    return p;
}

static CUdevice dev;

static void setup(void) {
    CK(cuInit(0));
    check_error_name = cuGetErrorName;
    CK(cuDeviceGet(&dev, 0));
    CUcontext ctx;
    CK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CK(cuCtxSetCurrent(ctx));
    ckLock = (CUresult(*)(int, CUcheckpointLockArgs *))lookup("cuCheckpointProcessLock");
    ckCheckpoint = (CUresult(*)(int, CUcheckpointArgs *))lookup("cuCheckpointProcessCheckpoint");
    ckRestore = (CUresult(*)(int, CUcheckpointArgs *))lookup("cuCheckpointProcessRestore");
    ckUnlock = (CUresult(*)(int, CUcheckpointArgs *))lookup("cuCheckpointProcessUnlock");
    ckGetState = (CUresult(*)(int, CUprocessState *))lookup("cuCheckpointProcessGetState");
    ckGetRestoreThreadId =
        (CUresult(*)(int, int *))lookup("cuCheckpointProcessGetRestoreThreadId");
    ipcGetMemHandle = (CUresult(*)(CUipcMemHandle *, CUdeviceptr))lookup("cuIpcGetMemHandle");
}

static size_t mem_free(void) {
    size_t free = 0, total = 0;
    CK(cuMemGetInfo_v2(&free, &total));
    return free;
}

static double ms_since(unsigned long long t0) { return (double)(now_ns() - t0) / 1e6; }

/* --- the pipes between controller and target --------------------------------------------- */

static int to_target[2], to_ctl[2];

static void put_byte(int fd, char c) {
    while (write(fd, &c, 1) != 1)
        if (errno != EINTR)
            fail("pipe write: %s", strerror(errno));
}

static char get_byte(int fd) {
    char c;
    ssize_t n;
    while ((n = read(fd, &c, 1)) != 1) {
        if (n == 0)
            return 0; /* the other side is gone */
        if (errno != EINTR)
            fail("pipe read: %s", strerror(errno));
    }
    return c;
}

/* Fork the target, which runs `body` (CUDA initialised in neither process yet). A target
 * that hangs is killed by its own alarm after `alarm_s`. */
static pid_t spawn_target(void (*body)(size_t), size_t arg, unsigned alarm_s) {
    if (pipe(to_target) || pipe(to_ctl))
        fail("pipe: %s", strerror(errno));
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0)
        fail("fork: %s", strerror(errno));
    if (pid == 0) {
        close(to_target[1]);
        close(to_ctl[0]);
        alarm(alarm_s);
        body(arg);
        fflush(stdout);
        _exit(0);
    }
    close(to_target[0]);
    close(to_ctl[1]);
    return pid;
}

static void target_says(char c) { put_byte(to_ctl[1], c); }
static char target_hears(void) { return get_byte(to_target[0]); }
static void tell_target(char c) { put_byte(to_target[1], c); }
static char hear_target(void) { return get_byte(to_ctl[0]); }

/* Wait for the target to exit; print how it ended. */
static void reap(pid_t pid, unsigned wait_s) {
    int status = 0;
    unsigned long long t0 = now_ns();
    for (;;) {
        pid_t r = waitpid(pid, &status, WNOHANG);
        if (r == pid)
            break;
        if (ms_since(t0) > wait_s * 1000.0) {
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            printf("{\"step\":\"target_end\",\"killed_after_s\":%u}\n", wait_s);
            fflush(stdout);
            return;
        }
        usleep(10000);
    }
    printf("{\"step\":\"target_end\",\"exit\":%d,\"signal\":%d}\n",
           WIFEXITED(status) ? WEXITSTATUS(status) : -1,
           WIFSIGNALED(status) ? WTERMSIG(status) : 0);
    fflush(stdout);
}

/* --- the controller's steps -------------------------------------------------------------- */

static int state_of(pid_t pid, CUresult *r) {
    CUprocessState s = 99;
    *r = ckGetState(pid, &s);
    return *r == CUDA_SUCCESS ? (int)s : -1;
}

/* Print one step: its result, how long it took, when it returned, and the target's state
 * after it. */
static void report(const char *step, pid_t pid, CUresult r, unsigned long long t0) {
    unsigned long long t1 = now_ns();
    CUresult sr;
    int st = state_of(pid, &sr);
    printf("{\"step\":\"%s\",\"result\":%d,\"ms\":%.3f,\"end_ns\":%llu,\"state\":%d,"
           "\"state_result\":%d}\n",
           step, r, (double)(t1 - t0) / 1e6, t1, st, sr);
    fflush(stdout);
}

static CUresult lock_step(const char *step, pid_t pid, unsigned timeout_ms) {
    CUcheckpointLockArgs a;
    memset(&a, 0, sizeof a);
    a.timeoutMs = timeout_ms;
    unsigned long long t0 = now_ns();
    CUresult r = ckLock(pid, &a);
    report(step, pid, r, t0);
    return r;
}

static CUresult args_step(const char *step, pid_t pid,
                          CUresult (*f)(int, CUcheckpointArgs *)) {
    CUcheckpointArgs a;
    memset(&a, 0, sizeof a);
    unsigned long long t0 = now_ns();
    CUresult r = f(pid, &a);
    report(step, pid, r, t0);
    return r;
}

static void free_step(const char *step) {
    printf("{\"step\":\"%s\",\"free\":%zu}\n", step, mem_free());
    fflush(stdout);
}

#include "pattern.h"

/* Print whether `p` still holds its pattern and is still an allocation of `bytes` at `p`. */
static void verify(const char *what, CUdeviceptr p, size_t bytes, uint64_t seed) {
    CUdeviceptr base = 0;
    size_t size = 0;
    CUresult r = cuMemGetAddressRange_v2(&base, &size, p);
    int same = r == CUDA_SUCCESS && base == p && size >= bytes;
    printf("{\"target\":\"%s\",\"intact\":%s,\"same_address\":%s,\"ptr\":%llu}\n", what,
           intact(p, bytes, seed) ? "true" : "false", same ? "true" : "false", p);
    fflush(stdout);
}

/* --- states -------------------------------------------------------------------------------- */

static void states_target(size_t bytes) {
    setup();
    CUdeviceptr p;
    CK(cuMemAlloc_v2(&p, bytes));
    fill(p, bytes, 1);
    printf("{\"target\":\"ready\",\"ptr\":%llu,\"pid\":%d}\n", p, getpid());
    fflush(stdout);
    target_says('r');
    target_hears();
    verify("after", p, bytes, 1);
    CK(cuMemFree_v2(p));
    target_says('d');
}

/* A process that never initialised CUDA. */
static void idle_target(size_t unused) {
    (void)unused;
    target_says('r');
    target_hears();
}

static void states(size_t bytes) {
    pid_t idle = spawn_target(idle_target, 0, 60);
    hear_target();
    int idle_pipe = to_target[1];
    pid_t pid = spawn_target(states_target, bytes, 120);
    setup();
    if (hear_target() != 'r')
        fail("the target did not start");
    CUresult r;
    int st = state_of(idle, &r);
    printf("{\"step\":\"get_state_no_cuda\",\"result\":%d,\"state\":%d}\n", r, st);
    CUprocessState s;
    r = ckGetState(pid, NULL);
    printf("{\"step\":\"get_state_null\",\"result\":%d}\n", r);
    r = ckGetState(-1, &s);
    printf("{\"step\":\"get_state_bad_pid\",\"result\":%d}\n", r);
    int tid = 0;
    r = ckGetRestoreThreadId(pid, &tid);
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/task/%d", pid, tid);
    struct stat sb;
    printf("{\"step\":\"restore_tid_running\",\"result\":%d,\"tid_in_target\":%s,"
           "\"tid_is_main\":%s}\n",
           r, r == CUDA_SUCCESS && stat(path, &sb) == 0 ? "true" : "false",
           tid == pid ? "true" : "false");
    fflush(stdout);
    unsigned long long t0 = now_ns();
    r = ckLock(pid, NULL);
    report("lock_null_args", pid, r, t0);
    if (r == CUDA_SUCCESS)
        args_step("unlock_after_null_lock", pid, ckUnlock);
    args_step("checkpoint_running", pid, ckCheckpoint);
    args_step("restore_running", pid, ckRestore);
    args_step("unlock_running", pid, ckUnlock);
    free_step("free_before");
    lock_step("lock", pid, 10000);
    lock_step("lock_locked", pid, 1000);
    args_step("restore_locked", pid, ckRestore);
    args_step("checkpoint", pid, ckCheckpoint);
    free_step("free_checkpointed");
    r = ckGetRestoreThreadId(pid, &tid);
    snprintf(path, sizeof path, "/proc/%d/task/%d", pid, tid);
    printf("{\"step\":\"restore_tid_checkpointed\",\"result\":%d,\"tid_in_target\":%s}\n", r,
           r == CUDA_SUCCESS && stat(path, &sb) == 0 ? "true" : "false");
    lock_step("lock_checkpointed", pid, 1000);
    args_step("checkpoint_checkpointed", pid, ckCheckpoint);
    args_step("unlock_checkpointed", pid, ckUnlock);
    args_step("restore", pid, ckRestore);
    free_step("free_restored");
    args_step("unlock", pid, ckUnlock);
    tell_target('v');
    hear_target();
    reap(pid, 30);
    put_byte(idle_pipe, 'x');
    reap(idle, 5);
}

/* --- blocks -------------------------------------------------------------------------------- */

static void blocks_target(size_t unused) {
    (void)unused;
    setup();
    CUdeviceptr p;
    CK(cuMemAlloc_v2(&p, 1 << 20));
    target_says('r');
    target_hears();
    unsigned long long t0 = now_ns();
    CUresult r = cuMemGetInfo_v2(&(size_t){0}, &(size_t){0});
    double info_ms = ms_since(t0);
    unsigned long long t1 = now_ns();
    CUresult r2 = cuMemFree_v2(p);
    printf("{\"target\":\"call_returned\",\"result\":%d,\"blocked_ms\":%.3f,\"next_result\":%d,"
           "\"next_ms\":%.3f,\"returned_ns\":%llu}\n",
           r, info_ms, r2, ms_since(t1), now_ns());
    fflush(stdout);
    target_says('d');
    target_hears(); /* stays until the controller has read its state after the unlock */
}

static void blocks(unsigned hold_ms) {
    pid_t pid = spawn_target(blocks_target, 0, 60);
    setup();
    if (hear_target() != 'r')
        fail("the target did not start");
    lock_step("lock", pid, 10000);
    tell_target('c');
    usleep(hold_ms * 1000);
    unsigned long long t0 = now_ns();
    CUresult r = ckUnlock(pid, NULL);
    report("unlock", pid, r, t0);
    printf("{\"step\":\"unlocked_at\",\"unlocked_ns\":%llu}\n", t0);
    fflush(stdout);
    hear_target();
    tell_target('x');
    reap(pid, 30);
}

/* --- timeout ------------------------------------------------------------------------------- */

static void timeout_target(size_t kernel_ms) {
    setup();
    CUmodule mod;
    CUfunction spin;
    CUstream s;
    CK(cuModuleLoadData(&mod, GPUSHARE_SPIN_PTX));
    CK(cuModuleGetFunction(&spin, mod, "gpushare_spin"));
    CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    unsigned long long ns = kernel_ms * 1000000ull;
    void *args[] = {&ns};
    unsigned long long t0 = now_ns();
    CK(cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, s, args, NULL));
    target_says('r');
    CK(cuStreamSynchronize(s));
    printf("{\"target\":\"kernel_done\",\"ms\":%.3f,\"launched_ns\":%llu}\n", ms_since(t0), t0);
    fflush(stdout);
    target_hears();
    CUresult r = cuMemGetInfo_v2(&(size_t){0}, &(size_t){0});
    printf("{\"target\":\"after_unlock\",\"result\":%d}\n", r);
    fflush(stdout);
    target_says('d');
}

static void timeout(unsigned kernel_ms, unsigned timeout_ms) {
    pid_t pid = spawn_target(timeout_target, kernel_ms, 60);
    setup();
    if (hear_target() != 'r')
        fail("the target did not start");
    lock_step("lock_timeout", pid, timeout_ms);
    lock_step("lock_no_timeout", pid, 0);
    args_step("unlock", pid, ckUnlock);
    tell_target('v');
    hear_target();
    reap(pid, 30);
}

/* --- managed / ipc: memory the driver does not checkpoint -------------------------------- */

static int with_ipc;

static void unsupported_target(size_t bytes) {
    setup();
    CUdeviceptr p, q = 0;
    CK(cuMemAlloc_v2(&p, bytes));
    fill(p, bytes, 2);
    CUresult r;
    if (with_ipc) {
        CUipcMemHandle h;
        r = ipcGetMemHandle(&h, p);
        printf("{\"target\":\"ipc_export\",\"result\":%d}\n", r);
    } else {
        r = cuMemAllocManaged(&q, bytes, CU_MEM_ATTACH_GLOBAL);
        printf("{\"target\":\"managed_alloc\",\"result\":%d}\n", r);
    }
    fflush(stdout);
    target_says('r');
    target_hears();
    verify("after", p, bytes, 2);
    target_says('d');
}

static void unsupported(size_t bytes, int ipc) {
    with_ipc = ipc;
    pid_t pid = spawn_target(unsupported_target, bytes, 60);
    setup();
    if (hear_target() != 'r')
        fail("the target did not start");
    free_step("free_before");
    if (lock_step("lock", pid, 10000) == CUDA_SUCCESS) {
        CUresult r = args_step("checkpoint", pid, ckCheckpoint);
        free_step("free_after_checkpoint");
        CUresult sr;
        if (r == CUDA_SUCCESS)
            args_step("restore", pid, ckRestore);
        if (state_of(pid, &sr) == 1)
            args_step("unlock", pid, ckUnlock);
    }
    tell_target('v');
    hear_target();
    reap(pid, 20);
}

/* --- kinds: pitched, pool and VMM memory across a round trip ------------------------------ */

static void kinds_target(size_t bytes) {
    setup();
    CUdeviceptr pitched, pooled, vmm;
    size_t pitch;
    CK(cuMemAllocPitch_v2(&pitched, &pitch, 4096, bytes / 4096, 4));
    fill(pitched, pitch * (bytes / 4096), 3);
    CUstream s;
    CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CK(cuMemAllocAsync(&pooled, bytes, s));
    CK(cuStreamSynchronize(s));
    fill(pooled, bytes, 4);
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    size_t gran = 0;
    CK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    size_t vbytes = (bytes + gran - 1) / gran * gran;
    CUmemGenericAllocationHandle h;
    CK(cuMemCreate(&h, vbytes, &prop, 0));
    CK(cuMemAddressReserve(&vmm, vbytes, 0, 0, 0));
    CK(cuMemMap(vmm, vbytes, 0, h, 0));
    CUmemAccessDesc acc = {.location = prop.location, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    CK(cuMemSetAccess(vmm, vbytes, &acc, 1));
    fill(vmm, vbytes, 5);
    target_says('r');
    target_hears();
    verify("pitched", pitched, pitch * (bytes / 4096), 3);
    verify("pooled", pooled, bytes, 4);
    verify("vmm", vmm, vbytes, 5);
    target_says('d');
}

static void kinds(size_t bytes) {
    pid_t pid = spawn_target(kinds_target, bytes, 60);
    setup();
    if (hear_target() != 'r')
        fail("the target did not start");
    free_step("free_before");
    lock_step("lock", pid, 10000);
    args_step("checkpoint", pid, ckCheckpoint);
    free_step("free_checkpointed");
    args_step("restore", pid, ckRestore);
    free_step("free_restored");
    args_step("unlock", pid, ckUnlock);
    tell_target('v');
    hear_target();
    reap(pid, 30);
}

/* --- restore-oom --------------------------------------------------------------------------- */

static void restore_oom(size_t bytes) {
    pid_t pid = spawn_target(states_target, bytes, 60);
    setup();
    if (hear_target() != 'r')
        fail("the target did not start");
    lock_step("lock", pid, 10000);
    args_step("checkpoint", pid, ckCheckpoint);
    /* Take all but half of the target's memory. */
    size_t take = mem_free() - bytes / 2;
    CUdeviceptr hog;
    CUresult r = cuMemAlloc_v2(&hog, take);
    printf("{\"step\":\"take\",\"result\":%d,\"bytes\":%zu}\n", r, take);
    fflush(stdout);
    args_step("restore_no_room", pid, ckRestore);
    if (r == CUDA_SUCCESS)
        CK(cuMemFree_v2(hog));
    free_step("free_given_back");
    CUresult rr = args_step("restore", pid, ckRestore);
    if (rr == CUDA_SUCCESS)
        args_step("unlock", pid, ckUnlock);
    if (rr == CUDA_SUCCESS) {
        tell_target('v');
        hear_target();
    }
    reap(pid, rr == CUDA_SUCCESS ? 30 : 1);
}

/* --- bandwidth ----------------------------------------------------------------------------- */

static void bandwidth(size_t bytes) {
    setup();
    CUdeviceptr d;
    void *pinned;
    CK(cuMemAlloc_v2(&d, bytes));
    CK(cuMemAllocHost_v2(&pinned, bytes));
    void *pageable = malloc(bytes);
    if (!pageable)
        fail("malloc");
    memset(pageable, 1, bytes);
    memset(pinned, 1, bytes);
    for (int i = 0; i < 3; i++) {
        unsigned long long t0 = now_ns();
        CK(cuMemcpyHtoD_v2(d, pinned, bytes));
        CK(cuCtxSynchronize());
        double h2d = ms_since(t0);
        t0 = now_ns();
        CK(cuMemcpyDtoH_v2(pinned, d, bytes));
        double d2h = ms_since(t0);
        t0 = now_ns();
        CK(cuMemcpyHtoD_v2(d, pageable, bytes));
        CK(cuCtxSynchronize());
        double h2d_p = ms_since(t0);
        t0 = now_ns();
        CK(cuMemcpyDtoH_v2(pageable, d, bytes));
        double d2h_p = ms_since(t0);
        double gb = (double)bytes / 1e9;
        printf("{\"step\":\"bandwidth\",\"bytes\":%zu,\"pinned_h2d_gbs\":%.2f,"
               "\"pinned_d2h_gbs\":%.2f,\"pageable_h2d_gbs\":%.2f,\"pageable_d2h_gbs\":%.2f}\n",
               bytes, gb / (h2d / 1e3), gb / (d2h / 1e3), gb / (h2d_p / 1e3),
               gb / (d2h_p / 1e3));
        fflush(stdout);
    }
}

/* The state the driver holds process `pid` in, another program's. */
static void state(pid_t pid) {
    setup();
    CUresult r;
    int st = state_of(pid, &r);
    printf("{\"step\":\"state\",\"pid\":%d,\"result\":%d,\"state\":%d}\n", (int)pid, r, st);
    fflush(stdout);
}

/* Lock process `pid`, another program's, for `ms` ms: the "lock" step once it is locked, the
 * "unlock" step once it runs again. */
static void hold(pid_t pid, unsigned ms) {
    setup();
    CUcheckpointLockArgs a;
    memset(&a, 0, sizeof a);
    unsigned long long t0 = now_ns();
    CUresult r = ckLock(pid, &a);
    report("lock", pid, r, t0);
    if (r != CUDA_SUCCESS)
        return;
    usleep(ms * 1000);
    args_step("unlock", pid, ckUnlock);
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc < 3)
        fail("usage: checkpoint_tool states|blocks|timeout|managed|ipc|kinds|restore-oom|"
             "bandwidth|state|hold ARG...");
    const char *cmd = argv[1];
    size_t arg = strtoull(argv[2], NULL, 0);
    if (!strcmp(cmd, "states"))
        states(arg);
    else if (!strcmp(cmd, "blocks"))
        blocks((unsigned)arg);
    else if (!strcmp(cmd, "timeout") && argc > 3)
        timeout((unsigned)arg, (unsigned)strtoul(argv[3], NULL, 0));
    else if (!strcmp(cmd, "managed"))
        unsupported(arg, 0);
    else if (!strcmp(cmd, "ipc"))
        unsupported(arg, 1);
    else if (!strcmp(cmd, "kinds"))
        kinds(arg);
    else if (!strcmp(cmd, "restore-oom"))
        restore_oom(arg);
    else if (!strcmp(cmd, "bandwidth"))
        bandwidth(arg);
    else if (!strcmp(cmd, "state"))
        state((pid_t)arg);
    else if (!strcmp(cmd, "hold") && argc > 3)
        hold((pid_t)arg, (unsigned)strtoul(argv[3], NULL, 0));
    else
        fail("unknown command %s", cmd);
    return 0;
}
