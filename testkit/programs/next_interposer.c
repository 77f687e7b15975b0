/* A second LD_PRELOAD library, loaded after libvgpu.so, that wraps puts()
 * and finds the real one with dlsym(RTLD_NEXT, ...) as interposers do. If
 * libvgpu's dlsym made glibc see the wrong caller, RTLD_NEXT would return
 * this very function and the program would recurse until it crashed. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>

static int wrapped_calls;

int puts(const char *text) {
    static int (*next_puts)(const char *);
    if (!next_puts) {
        next_puts = (int (*)(const char *))dlsym(RTLD_NEXT, "puts");
    }
    if (!next_puts || (void *)next_puts == (void *)puts) {
        fprintf(stderr, "next_interposer: RTLD_NEXT resolved to itself\n");
        return EOF;
    }
    wrapped_calls++;
    return next_puts(text);
}

int next_interposer_calls(void) { return wrapped_calls; }
