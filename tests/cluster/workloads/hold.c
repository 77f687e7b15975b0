/* hold: a container's workload for the cluster tests, small enough to run
 * hundreds at once. Makes a context on every device it sees, allocates
 * MIB MiB on each in one call, prints one line saying what it got, then
 * holds the memory until SIGTERM (it may be PID 1 of its PID namespace,
 * where an unhandled SIGTERM is ignored).
 *
 * usage: hold MIB        (0: make the contexts only)
 * prints: devices=N allocated_mib=M error=E   (E: first failing CUresult)
 * The driver is reached through dlsym, so the preloaded shim sees it. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "cuda_minimal.h"

static void stop(int signal_number) {
    (void)signal_number;
    _exit(0);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: hold MIB\n");
        return 2;
    }
    unsigned long long mib = strtoull(argv[1], NULL, 10);
    signal(SIGTERM, stop);
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
    if (!cuda) {
        fprintf(stderr, "hold: %s\n", dlerror());
        return 1;
    }
    CUresult (*init)(unsigned) = dlsym(cuda, "cuInit");
    CUresult (*count)(int *) = dlsym(cuda, "cuDeviceGetCount");
    CUresult (*get)(CUdevice *, int) = dlsym(cuda, "cuDeviceGet");
    CUresult (*create)(CUcontext *, unsigned, CUdevice) = dlsym(cuda, "cuCtxCreate_v2");
    CUresult (*alloc)(CUdeviceptr *, size_t) = dlsym(cuda, "cuMemAlloc_v2");
    if (!init || !count || !get || !create || !alloc) {
        fprintf(stderr, "hold: the driver lacks an entry point\n");
        return 1;
    }
    int devices = 0;
    CUresult error = init(0);
    if (error == CUDA_SUCCESS) {
        error = count(&devices);
    }
    unsigned long long allocated = 0;
    for (int i = 0; i < devices && error == CUDA_SUCCESS; i++) {
        CUdevice device;
        CUcontext context;
        CUdeviceptr pointer;
        error = get(&device, i);
        if (error == CUDA_SUCCESS) {
            error = create(&context, 0, device);
        }
        if (error == CUDA_SUCCESS && mib > 0) {
            error = alloc(&pointer, (size_t)(mib << 20));
            if (error == CUDA_SUCCESS) {
                allocated += mib;
            }
        }
    }
    printf("devices=%d allocated_mib=%llu error=%d\n", devices, allocated, error);
    fflush(stdout);
    for (;;) {
        pause();
    }
}
