/* Linked into every C and C++ program the sandbox builds (languages.py), beside the program's own
 * source. Such a program's main stack may grow to its memory limit, as under SandboxFusion, which
 * sets RLIMIT_STACK to it: deep recursion (a depth-first search over a million nodes) passes there
 * and overflowed the 8 MB a process has by default. But glibc sizes every thread's stack by that
 * same limit, read when the program starts: a std::thread then asked for as much stack as the
 * program may have memory, and failed ("Resource temporarily unavailable"; so it does under
 * SandboxFusion). This sets the threads' default back to the 8 MB they have outside, before the
 * program's own constructors run. A program that asks for a size of its own gets it. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <pthread.h>
#include <stddef.h>

static void tangram_thread_stack(void) {
    const size_t outside = (size_t)8 << 20;
    pthread_attr_t attr;
    size_t size = 0;
    if (pthread_getattr_default_np(&attr) != 0) return;
    if (pthread_attr_getstacksize(&attr, &size) == 0 && size > outside &&
        pthread_attr_setstacksize(&attr, outside) == 0)
        pthread_setattr_default_np(&attr);
    pthread_attr_destroy(&attr);
}

/* In .preinit_array: run before every constructor of the program, whatever its priority (a
 * constructor of priority 101, as the first a program may declare, raced one of ours). glibc has
 * set its threads' default by then (at its own early start). */
__attribute__((section(".preinit_array"), used)) static void (*const tangram_preinit)(void) = tangram_thread_stack;
