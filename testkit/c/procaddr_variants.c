/* procaddr_variants.c: asks cuGetProcAddress_v2 (found with dlsym on libcuda.so.1) for each
 * NAME@VERSION/FLAGS argument and prints one JSON object mapping each argument to where the
 * pointer it got lies: "SYMBOL@FILE" (the exported symbol at exactly that address, and the base
 * name of its object), "?@FILE" (inside FILE but at no exported symbol), or "?".
 * On a failed lookup prints "FAIL: …" on stderr and exits 1.
 *
 *   procaddr_variants cuMemAlloc@3020/0 cuLaunchKernel@12000/2 …
 *
 * Build: gcc procaddr_variants.c -ldl (no link against libcuda). */
#define _GNU_SOURCE
#include "cuda_min.h"

#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

typedef CUresult (*PFN_getProcAddress_v2)(const char *symbol, void **pfn, int cudaVersion,
                                          unsigned long long flags, int *symbolStatus);

static const char *where(void *p) {
    static char buf[512];
    Dl_info info;
    if (!p || !dladdr(p, &info) || !info.dli_fname)
        return "?";
    const char *f = strrchr(info.dli_fname, '/');
    f = f ? f + 1 : info.dli_fname;
    const char *sym = info.dli_sname && info.dli_saddr == p ? info.dli_sname : "?";
    snprintf(buf, sizeof buf, "%s@%s", sym, f);
    return buf;
}

int main(int argc, char **argv) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib)
        fail("dlopen(libcuda.so.1): %s", dlerror());
    PFN_getProcAddress_v2 get_proc;
    *(void **)&get_proc = dlsym(lib, "cuGetProcAddress_v2");
    if (!get_proc)
        fail("dlsym(cuGetProcAddress_v2): %s", dlerror());
    printf("{");
    for (int i = 1; i < argc; i++) {
        char name[256];
        int version;
        unsigned long long flags;
        if (sscanf(argv[i], "%255[^@]@%d/%llu", name, &version, &flags) != 3)
            fail("argument %s is not NAME@VERSION/FLAGS", argv[i]);
        void *p = NULL;
        int status = -1;
        CUresult r = get_proc(name, &p, version, flags, &status);
        if (r != CUDA_SUCCESS || !p || status != 0)
            fail("cuGetProcAddress_v2(%s, %d, %llu) = %d, pfn %p, status %d", name, version,
                 flags, r, p, status);
        printf("%s\"%s\":\"%s\"", i > 1 ? "," : "", argv[i], where(p));
    }
    printf("}\n");
    return 0;
}
