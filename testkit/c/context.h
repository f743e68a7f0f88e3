/* How the directly linked C clients start: the driver initialised and a context of their own on
 * device 0 made current. */
#ifndef GPUSHARE_CONTEXT_H
#define GPUSHARE_CONTEXT_H

#include "check.h"
#include "cuda_api.h"

/* cuInit, device 0 (stored in *dev unless dev is NULL) and a new context, current; returns it. */
static inline CUcontext context_create(CUdevice *dev) {
    CK(cuInit(0));
    CUdevice d;
    CK(cuDeviceGet(&d, 0));
    CUcontext ctx;
    CK(cuCtxCreate_v2(&ctx, 0, d));
    if (dev)
        *dev = d;
    return ctx;
}

#endif
