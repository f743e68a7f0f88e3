/* Checking helpers shared by the C clients: every failure prints which check failed and exits 1. */
#ifndef GPUSHARE_CHECK_H
#define GPUSHARE_CHECK_H

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

/* Set by each program: cuGetErrorName, however it was obtained (may stay NULL). (Helpers are
 * `static inline`: a client that needs only some of them compiles without warnings.) */
static CUresult (*check_error_name)(CUresult, const char **);

static inline const char *err_name(CUresult r) {
    const char *s = NULL;
    if (check_error_name && check_error_name(r, &s) == CUDA_SUCCESS && s)
        return s;
    return "?";
}

static void fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "FAIL: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    exit(1);
}

/* Run a driver call that must succeed. */
#define CK(call)                                                                              \
    do {                                                                                      \
        CUresult ck_r_ = (call);                                                              \
        if (ck_r_ != CUDA_SUCCESS)                                                            \
            fail("%s:%d: %s returned %d (%s)", __FILE__, __LINE__, #call, ck_r_,              \
                 err_name(ck_r_));                                                            \
    } while (0)

/* Run a driver call that must return `want`. */
#define CK_EQ(call, want)                                                                     \
    do {                                                                                      \
        CUresult ck_r_ = (call);                                                              \
        if (ck_r_ != (want))                                                                  \
            fail("%s:%d: %s returned %d (%s), expected %d (%s)", __FILE__, __LINE__, #call,   \
                 ck_r_, err_name(ck_r_), (int)(want), err_name(want));                        \
    } while (0)

/* A condition that must hold; the message explains it. */
#define EXPECT(cond, ...)                                                                     \
    do {                                                                                      \
        if (!(cond)) {                                                                        \
            fprintf(stderr, "FAIL: %s:%d: check `%s` failed: ", __FILE__, __LINE__, #cond);   \
            fprintf(stderr, __VA_ARGS__);                                                     \
            fprintf(stderr, "\n");                                                            \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

/* |got - want| <= tol * want */
#define EXPECT_NEAR(got, want, tol, what)                                                     \
    EXPECT((got) >= (want) * (1.0 - (tol)) && (got) <= (want) * (1.0 + (tol)),                \
           "%s: %.4f, expected %.4f +- %.0f%%", what, (double)(got), (double)(want),          \
           (tol) * 100.0)

static inline unsigned long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ull + (unsigned long long)ts.tv_nsec;
}

#endif
