/* pattern.h: device memory filled with a pattern derived from each word's offset and a seed,
 * and checked later (bytes intact across a swap to host memory and back). Needs check.h and the
 * driver's prototypes included first. */
#ifndef GPUSHARE_PATTERN_H
#define GPUSHARE_PATTERN_H

#include <stdint.h>
#include <stdlib.h>


static inline uint64_t word(uint64_t seed, uint64_t i) {
    uint64_t x = seed ^ (i * 0x9E3779B97F4A7C15ull);
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    return x;
}

#define CHUNK ((size_t)64 << 20)

static inline void fill(CUdeviceptr p, size_t bytes, uint64_t seed) {
    uint64_t *buf = malloc(CHUNK);
    if (!buf)
        fail("malloc");
    for (size_t off = 0; off < bytes; off += CHUNK) {
        size_t n = bytes - off < CHUNK ? bytes - off : CHUNK;
        for (size_t i = 0; i < n / 8; i++)
            buf[i] = word(seed, off / 8 + i);
        CK(cuMemcpyHtoD_v2(p + off, buf, n));
    }
    free(buf);
}

static inline int intact(CUdeviceptr p, size_t bytes, uint64_t seed) {
    uint64_t *buf = malloc(CHUNK);
    if (!buf)
        fail("malloc");
    int ok = 1;
    for (size_t off = 0; off < bytes && ok; off += CHUNK) {
        size_t n = bytes - off < CHUNK ? bytes - off : CHUNK;
        CK(cuMemcpyDtoH_v2(buf, p + off, n));
        for (size_t i = 0; i < n / 8; i++)
            if (buf[i] != word(seed, off / 8 + i)) {
                ok = 0;
                break;
            }
    }
    free(buf);
    return ok;
}

#endif
