/* bench: timing loops for the shim's added cost, run by `vgpu-bench`.
 *
 * The driver is reached through dlopen + dlsym, so the same binary measures
 * the driver alone (no LD_PRELOAD) and the driver under the shim.
 *
 *   bench alloc ITERATIONS BYTES   ns per cuMemAlloc_v2 + cuMemFree_v2 pair
 *   bench launch ITERATIONS        ns per cuLaunchKernel that the driver
 *                                  rejects at once (isolates the hook cost)
 *   bench kernel ITERATIONS        ns per cuLaunchKernel of a 1 ns kernel
 *                                  (the full launch path, limiter included)
 *   bench init                     ns for the first cuInit of the process
 *
 * Each loop prints "ready" and waits for a line on stdin before timing, so
 * the runner can start many processes at the same moment. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda_minimal.h"

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

static void wait_for_go(void) {
    printf("ready\n");
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) exit(4);
}

static void *need(void *handle, const char *name) {
    void *address = dlsym(handle, name);
    if (!address) {
        fprintf(stderr, "missing %s\n", name);
        exit(2);
    }
    return address;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: bench alloc ITER BYTES | launch ITER | init\n");
        return 2;
    }
    if (strcmp(argv[1], "init") == 0) {
        /* Timed from before the driver is opened: with the shim, its set-up
         * (configuration, region, slot) happens inside the first call. */
        wait_for_go();
        double start = now_ns();
        void *driver = dlopen("libcuda.so.1", RTLD_NOW);
        if (!driver) return 2;
        CUresult (*init)(unsigned) = need(driver, "cuInit");
        CUresult rc = init(0);
        double elapsed = now_ns() - start;
        if (rc != CUDA_SUCCESS) return 3;
        printf("ns=%.0f\n", elapsed);
        return 0;
    }
    void *driver = dlopen("libcuda.so.1", RTLD_NOW);
    if (!driver) {
        fprintf(stderr, "dlopen: %s\n", dlerror());
        return 2;
    }
    CUresult (*init)(unsigned) = need(driver, "cuInit");
    CUresult (*ctx_create)(CUcontext *, unsigned, CUdevice) = need(driver, "cuCtxCreate_v2");
    CUresult (*mem_alloc)(CUdeviceptr *, size_t) = need(driver, "cuMemAlloc_v2");
    CUresult (*mem_free)(CUdeviceptr) = need(driver, "cuMemFree_v2");
    CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                       unsigned, CUstream, void **, void **) = need(driver, "cuLaunchKernel");
    CUcontext context;
    if (init(0) != CUDA_SUCCESS || ctx_create(&context, 0, 0) != CUDA_SUCCESS) {
        fprintf(stderr, "cannot create a context\n");
        return 3;
    }
    if (strcmp(argv[1], "alloc") == 0 && argc == 4) {
        long iterations = atol(argv[2]);
        size_t bytes = strtoull(argv[3], NULL, 0);
        for (long i = 0; i < iterations / 10 + 1; i++) {
            CUdeviceptr ptr;
            if (mem_alloc(&ptr, bytes) != CUDA_SUCCESS || mem_free(ptr) != CUDA_SUCCESS) return 3;
        }
        wait_for_go();
        double start = now_ns();
        for (long i = 0; i < iterations; i++) {
            CUdeviceptr ptr;
            if (mem_alloc(&ptr, bytes) != CUDA_SUCCESS || mem_free(ptr) != CUDA_SUCCESS) return 3;
        }
        printf("ns=%.1f\n", (now_ns() - start) / (double)iterations);
        return 0;
    }
    if (strcmp(argv[1], "kernel") == 0 && argc == 3) {
        long iterations = atol(argv[2]);
        CUresult (*load)(CUmodule *, const void *) = need(driver, "cuModuleLoadData");
        CUresult (*get_function)(CUfunction *, CUmodule, const char *) = need(driver, "cuModuleGetFunction");
        CUresult (*synchronize)(void) = need(driver, "cuCtxSynchronize");
        CUmodule module;
        CUfunction function;
        if (load(&module, "SIMGPU-MODULE\nk1ns 1ns\n") != CUDA_SUCCESS ||
            get_function(&function, module, "k1ns") != CUDA_SUCCESS) {
            fprintf(stderr, "cannot load the bench kernel\n");
            return 3;
        }
        for (long i = 0; i < iterations / 10 + 1000; i++)
            if (launch(function, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL) != CUDA_SUCCESS) return 3;
        if (synchronize() != CUDA_SUCCESS) return 3;
        wait_for_go();
        double start = now_ns();
        for (long i = 0; i < iterations; i++)
            if (launch(function, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL) != CUDA_SUCCESS) return 3;
        double elapsed = now_ns() - start;
        if (synchronize() != CUDA_SUCCESS) return 3;
        printf("ns=%.2f\n", elapsed / (double)iterations);
        return 0;
    }
    if (strcmp(argv[1], "launch") == 0 && argc == 3) {
        long iterations = atol(argv[2]);
        int rejected = 0;
        for (long i = 0; i < 1000; i++) rejected += launch(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) != 0;
        if (rejected != 1000) {
            fprintf(stderr, "a null function must be rejected\n");
            return 3;
        }
        wait_for_go();
        double start = now_ns();
        for (long i = 0; i < iterations; i++) launch(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        printf("ns=%.2f\n", (now_ns() - start) / (double)iterations);
        return 0;
    }
    fprintf(stderr, "bad arguments\n");
    return 2;
}
