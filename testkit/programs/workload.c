/* workload: keeps a (simulated) GPU busy with one launch pattern, for the
 * compute-share tests and the accuracy table.
 *
 * usage: workload PATTERN KERNEL SECONDS [DEVICES]
 *   PATTERN  burst    32 launches on one stream, then synchronize
 *            sync     one launch, then synchronize, again and again
 *            streams  launches spread over four streams, synchronize all
 *                     every 32 launches
 *            graph    a captured graph of 100 kernels, launched and
 *                     synchronized again and again
 *   KERNEL   k20us | k1ms | k30ms (the simulated kernel's duration)
 *   DEVICES  run the pattern on devices 0..DEVICES-1 at once, one thread
 *            each (default 1)
 * On a real GPU the kernels are PTX that spin on the GPU's clock for as long.
 * Prints "ready" once every device has its context and module, then runs
 * for SECONDS and prints launches=N. With WORKLOAD_EVERY_SECOND set, the
 * first device's thread also prints "second=K kernels=N" after each whole
 * second (K from 1), for shares that change while it runs. The driver is
 * reached through dlsym so the shim, when preloaded, sees every call; with
 * WORKLOAD_DRIVER=elf every entry point is read from the loaded driver's
 * own symbol table instead (driver_symbols.h), so no interposer sees any:
 * a program that means to get past the shim. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cuda_minimal.h"
#include "driver_symbols.h"

typedef void *CUgraph;
typedef void *CUgraphExec;

static CUresult (*Init)(unsigned);
static CUresult (*DeviceGet)(CUdevice *, int);
static CUresult (*CtxCreate)(CUcontext *, unsigned, CUdevice);
static CUresult (*CtxSetCurrent)(CUcontext);
static CUresult (*ModuleLoadData)(CUmodule *, const void *);
static CUresult (*ModuleGetFunction)(CUfunction *, CUmodule, const char *);
static CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                unsigned, CUstream, void **, void **);
static CUresult (*StreamCreate)(CUstream *, unsigned);
static CUresult (*StreamSynchronize)(CUstream);
static CUresult (*BeginCapture)(CUstream, int);
static CUresult (*EndCapture)(CUstream, CUgraph *);
static CUresult (*GraphInstantiate)(CUgraphExec *, CUgraph, unsigned long long);
static CUresult (*GraphLaunch)(CUgraphExec, CUstream);

static const char module_image[] = "SIMGPU-MODULE\nk20us 20us\nk1ms 1ms\nk30ms 30ms\n";

/* A real driver refuses the simulated module; there the same kernels are
 * PTX (compiled by the driver for the GPU it finds) that spin for their
 * duration on the GPU's nanosecond clock, so a kernel takes as long on a
 * real GPU as on the simulated one (`vgpu demo` runs on both). */
#define SPIN_KERNEL(name, ns)            \
    ".visible .entry " name "()\n"       \
    "{\n"                                \
    "  .reg .pred %p;\n"                 \
    "  .reg .b64 %t<3>;\n"               \
    "  mov.u64 %t0, %globaltimer;\n"     \
    "  add.u64 %t1, %t0, " ns ";\n"      \
    "spin:\n"                            \
    "  mov.u64 %t2, %globaltimer;\n"     \
    "  setp.lt.u64 %p, %t2, %t1;\n"      \
    "  @%p bra spin;\n"                  \
    "  ret;\n"                           \
    "}\n"
static const char ptx_image[] = ".version 6.0\n.target sm_50\n.address_size 64\n" SPIN_KERNEL(
    "k20us", "20000") SPIN_KERNEL("k1ms", "1000000") SPIN_KERNEL("k30ms", "30000000");
static const char *pattern, *kernel_name;
static double seconds;
static pthread_barrier_t ready_barrier;
static long total_launches;
static pthread_mutex_t total_lock = PTHREAD_MUTEX_INITIALIZER;

#define CHECK(call)                                                                   \
    do {                                                                              \
        CUresult rc_ = (call);                                                        \
        if (rc_ != CUDA_SUCCESS) {                                                    \
            fprintf(stderr, "%s:%d: %s failed: %d\n", __FILE__, __LINE__, #call, rc_); \
            exit(3);                                                                  \
        }                                                                             \
    } while (0)

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Entry points from the driver's symbol table (WORKLOAD_DRIVER=elf). */
static int from_symbol_table;

static void *need(void *handle, const char *name) {
    void *address = from_symbol_table ? elf_lookup(name) : dlsym(handle, name);
    if (!address) {
        fprintf(stderr, "missing %s\n", name);
        exit(2);
    }
    return address;
}

static void *run(void *argument) {
    int ordinal = (int)(long)argument;
    CUdevice device;
    CUcontext context;
    CUmodule module;
    CUfunction function;
    CHECK(DeviceGet(&device, ordinal));
    CHECK(CtxCreate(&context, 0, device));
    if (ModuleLoadData(&module, module_image) != CUDA_SUCCESS) CHECK(ModuleLoadData(&module, ptx_image));
    CHECK(ModuleGetFunction(&function, module, kernel_name));
    CUstream streams[4];
    for (int i = 0; i < 4; i++) CHECK(StreamCreate(&streams[i], 1 /* non-blocking */));
    CUgraphExec exec = NULL;
    if (strcmp(pattern, "graph") == 0) {
        CUgraph graph;
        CHECK(BeginCapture(streams[0], 2 /* relaxed */));
        for (int i = 0; i < 100; i++)
            CHECK(LaunchKernel(function, 1, 1, 1, 128, 1, 1, 0, streams[0], NULL, NULL));
        CHECK(EndCapture(streams[0], &graph));
        CHECK(GraphInstantiate(&exec, graph, 0));
    }
    pthread_barrier_wait(&ready_barrier);
    double started = now_s();
    double deadline = started + seconds;
    long launches = 0;
    int every_second = ordinal == 0 && getenv("WORKLOAD_EVERY_SECOND") != NULL;
    int second = 1;
    long counted = 0;
    while (now_s() < deadline) {
        if (every_second && now_s() >= started + second) {
            printf("second=%d kernels=%ld\n", second, launches - counted);
            fflush(stdout);
            counted = launches;
            second++;
        }
        if (strcmp(pattern, "burst") == 0) {
            for (int i = 0; i < 32; i++, launches++)
                CHECK(LaunchKernel(function, 1, 1, 1, 128, 1, 1, 0, streams[0], NULL, NULL));
            CHECK(StreamSynchronize(streams[0]));
        } else if (strcmp(pattern, "sync") == 0) {
            CHECK(LaunchKernel(function, 1, 1, 1, 128, 1, 1, 0, streams[0], NULL, NULL));
            launches++;
            CHECK(StreamSynchronize(streams[0]));
        } else if (strcmp(pattern, "streams") == 0) {
            for (int i = 0; i < 32; i++, launches++)
                CHECK(LaunchKernel(function, 1, 1, 1, 128, 1, 1, 0, streams[i % 4], NULL, NULL));
            for (int i = 0; i < 4; i++) CHECK(StreamSynchronize(streams[i]));
        } else if (strcmp(pattern, "graph") == 0) {
            CHECK(GraphLaunch(exec, streams[0]));
            launches += 100;
            CHECK(StreamSynchronize(streams[0]));
        } else {
            fprintf(stderr, "unknown pattern %s\n", pattern);
            exit(2);
        }
    }
    pthread_mutex_lock(&total_lock);
    total_launches += launches;
    pthread_mutex_unlock(&total_lock);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: workload PATTERN KERNEL SECONDS [DEVICES]\n");
        return 2;
    }
    pattern = argv[1];
    kernel_name = argv[2];
    seconds = atof(argv[3]);
    int devices = argc > 4 ? atoi(argv[4]) : 1;
    void *driver = dlopen("libcuda.so.1", RTLD_NOW);
    if (!driver) {
        fprintf(stderr, "dlopen: %s\n", dlerror());
        return 2;
    }
    const char *access = getenv("WORKLOAD_DRIVER");
    if (access && strcmp(access, "elf") == 0) {
        from_symbol_table = 1;
        if (!find_driver_symbols()) {
            fprintf(stderr, "no dynamic symbol table found for libcuda.so.1\n");
            return 2;
        }
    } else if (access && *access && strcmp(access, "dlsym") != 0) {
        fprintf(stderr, "bad WORKLOAD_DRIVER=%s: expected dlsym or elf\n", access);
        return 2;
    }
    Init = need(driver, "cuInit");
    DeviceGet = need(driver, "cuDeviceGet");
    CtxCreate = need(driver, "cuCtxCreate_v2");
    CtxSetCurrent = need(driver, "cuCtxSetCurrent");
    ModuleLoadData = need(driver, "cuModuleLoadData");
    ModuleGetFunction = need(driver, "cuModuleGetFunction");
    LaunchKernel = need(driver, "cuLaunchKernel");
    StreamCreate = need(driver, "cuStreamCreate");
    StreamSynchronize = need(driver, "cuStreamSynchronize");
    if (strcmp(pattern, "graph") == 0) {
        BeginCapture = need(driver, "cuStreamBeginCapture_v2");
        EndCapture = need(driver, "cuStreamEndCapture");
        GraphInstantiate = need(driver, "cuGraphInstantiateWithFlags");
        GraphLaunch = need(driver, "cuGraphLaunch");
    }
    CHECK(Init(0));
    pthread_barrier_init(&ready_barrier, NULL, (unsigned)devices + 1);
    pthread_t threads[16];
    for (int i = 0; i < devices && i < 16; i++) pthread_create(&threads[i], NULL, run, (void *)(long)i);
    pthread_barrier_wait(&ready_barrier);
    printf("ready\n");
    fflush(stdout);
    for (int i = 0; i < devices && i < 16; i++) pthread_join(threads[i], NULL);
    printf("launches=%ld\n", total_launches);
    return 0;
}
