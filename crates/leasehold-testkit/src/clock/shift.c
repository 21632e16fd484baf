/*
 * LD_PRELOAD shim for leasehold-testkit's ServerClock: shifts the wall clock (gettimeofday,
 * time, clock_gettime REALTIME*) of the process it is loaded into by the signed number of
 * milliseconds written in the file named by LEASEHOLD_CLOCK_OFFSET_FILE, read again on every
 * call so that a test can step the clock of a running process. Monotonic clocks are untouched.
 *
 * Why not libfaketime: it recurses into clock_gettime while initialising under jemalloc, which
 * Debian's redis-server links (libfaketime issue #130), and the server never starts. This shim
 * allocates nothing, resolves no symbols, and asks the kernel directly.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static long long offset_ms(void) {
    const char *path = getenv("LEASEHOLD_CLOCK_OFFSET_FILE");
    if (path == NULL) {
        return 0;
    }
    int saved = errno;
    long long offset = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        char buf[32];
        ssize_t n = read(fd, buf, sizeof buf - 1);
        close(fd);
        if (n > 0) {
            buf[n] = '\0';
            offset = strtoll(buf, NULL, 10);
        }
    }
    errno = saved;
    return offset;
}

static void shift_ns(time_t *sec, long long *nsec, long long offset) {
    long long total = (long long)*nsec + (offset % 1000) * 1000000LL;
    long long carry = total / 1000000000LL;
    total -= carry * 1000000000LL;
    if (total < 0) {
        total += 1000000000LL;
        carry -= 1;
    }
    *sec += (time_t)(offset / 1000 + carry);
    *nsec = total;
}

int clock_gettime(clockid_t clock, struct timespec *ts) {
    long r = syscall(SYS_clock_gettime, clock, ts);
    if (r == 0 && (clock == CLOCK_REALTIME || clock == CLOCK_REALTIME_COARSE)) {
        long long nsec = ts->tv_nsec;
        shift_ns(&ts->tv_sec, &nsec, offset_ms());
        ts->tv_nsec = (long)nsec;
    }
    return (int)r;
}

int gettimeofday(struct timeval *restrict tv, void *restrict tz) {
    long r = syscall(SYS_gettimeofday, tv, tz);
    if (r == 0) {
        long long nsec = (long long)tv->tv_usec * 1000LL;
        shift_ns(&tv->tv_sec, &nsec, offset_ms());
        tv->tv_usec = (suseconds_t)(nsec / 1000LL);
    }
    return (int)r;
}

time_t time(time_t *out) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (out != NULL) {
        *out = ts.tv_sec;
    }
    return ts.tv_sec;
}
