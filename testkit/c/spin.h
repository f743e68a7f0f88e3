/* The `gpushare_spin` kernel, loaded for the C clients that launch it. */
#ifndef GPUSHARE_SPIN_H
#define GPUSHARE_SPIN_H

#include "check.h"
#include "context.h"
#include "cuda_api.h"
#include "gpushare_spin_ptx.h"

/* Load `gpushare_spin` into the current context, and create a stream to launch it on. */
static void spin_load(CUfunction *spin, CUstream *s) {
    CUmodule mod;
    CK(cuModuleLoadData(&mod, GPUSHARE_SPIN_PTX));
    CK(cuModuleGetFunction(spin, mod, "gpushare_spin"));
    CK(cuStreamCreate(s, CU_STREAM_NON_BLOCKING));
}

/* A context of the client's own on device 0 (returned) with `gpushare_spin` loaded into it. */
static inline CUcontext spin_setup(CUfunction *spin, CUstream *s) {
    CUcontext ctx = context_create(NULL);
    spin_load(spin, s);
    return ctx;
}

#endif
