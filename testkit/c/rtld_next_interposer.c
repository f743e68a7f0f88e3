/* rtld_next_interposer.c: a preloadable library that interposes getpid() the way tracing and
 * sandboxing libraries interpose libc functions: it finds the definition it wraps with
 * dlsym(RTLD_NEXT, "getpid"), says on stderr where that led (and where dlsym(RTLD_NEXT,
 * "cuLaunchKernel") leads), then calls it. A lookup that leads back to this library itself is
 * reported as "(itself)" and answered with -1 instead of recursing forever.
 *
 * Built once per TAG, so that several can be chained:
 *   gcc -shared -fPIC -DTAG='"a"' rtld_next_interposer.c -o librtld_next_a.so -ldl */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#ifndef TAG
#error "build with -DTAG='\"name\"'"
#endif

/* An address inside this library. */
static const char marker;

/* Base name of the object `p` lies in. */
static const char *object_of(void *p) {
    Dl_info info;
    if (!p || !dladdr(p, &info) || !info.dli_fname)
        return "(nothing)";
    const char *f = strrchr(info.dli_fname, '/');
    return f ? f + 1 : info.dli_fname;
}

pid_t getpid(void) {
    void *next = dlsym(RTLD_NEXT, "getpid");
    void *cu = dlsym(RTLD_NEXT, "cuLaunchKernel");
    Dl_info me, it;
    int itself = next && dladdr(&marker, &me) && dladdr(next, &it) &&
                 me.dli_fbase == it.dli_fbase;
    fprintf(stderr, "interposer %s: next getpid in %s%s, next cuLaunchKernel in %s\n", TAG,
            object_of(next), itself ? " (itself)" : "", object_of(cu));
    if (!next || itself)
        return -1;
    return ((pid_t(*)(void))next)();
}
