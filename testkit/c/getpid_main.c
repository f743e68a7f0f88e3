/* getpid_main.c: calls getpid() (through whatever interposes it) and compares its answer with
 * the kernel's; prints {"getpid":…,"pid":…} and exits 0 if they agree, 1 if not. */
#define _GNU_SOURCE
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>

int main(void) {
    pid_t got = getpid();
    long pid = syscall(SYS_getpid);
    printf("{\"getpid\":%d,\"pid\":%ld}\n", (int)got, pid);
    return got == pid ? 0 : 1;
}
