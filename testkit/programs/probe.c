/* probe: a CUDA program that exercises the shim on the simulated GPU.
 *
 * Built twice: `probe_linked` links against libcuda.so.1 (through the stub)
 * and calls the driver by symbol; `probe` does not link the driver and
 * reaches it with dlopen + dlsym or through cuGetProcAddress. Results are
 * printed as key=value lines on stdout for the Rust tests to check.
 *
 * usage: probe ACCESS COMMAND [ARGS]
 *   ACCESS  linked | dlsym | procaddr | elf
 *           (elf: every entry point read from the loaded driver's own
 *           dynamic symbol table, never asking dlsym or cuGetProcAddress:
 *           what a program that means to get past the shim does)
 *   fill CHUNK              allocate CHUNK-byte buffers until refused
 *   kinds                   charge of every counted allocation kind
 *   random ITERATIONS SEED MAX_CHUNK
 *                           random allocations and frees under the cap
 *   churn CHUNK             allocate and free forever (to be killed)
 *   hold BYTES              allocate, print ready, wait for stdin to close
 *   sample                  poll NVML device 0 used memory until stdin
 *                           closes; print the maximum (run without the shim)
 *   fork BYTES              fork: parent and child allocate separately
 *   memcpy BYTES            host -> device -> host round trip
 *   spill TOTAL CHUNK       allocate TOTAL bytes in CHUNK buffers, write and
 *                           read back every one, count those in host memory,
 *                           print ready and hold them until stdin closes
 *                           (dlsym and procaddr only)
 *   primary                 allocations die with the last primary-context
 *                           release (dlsym and procaddr only)
 *   getprocaddress          cuGetProcAddress variant and status semantics
 *   nvml                    NVML memory info, process list and device 0's
 *                           UUID (dlopen)
 *   rtld-next               dlsym(RTLD_NEXT) with another interposer loaded
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <elf.h>
#include <errno.h>
#include <link.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cuda_minimal.h"
#include "driver_symbols.h"

typedef CUresult (*GetProcAddressFn)(const char *, void **, int, unsigned long long, int *);

struct Driver {
    CUresult (*Init)(unsigned);
    CUresult (*DeviceGet)(CUdevice *, int);
    CUresult (*DeviceTotalMem)(size_t *, CUdevice);
    CUresult (*CtxCreate)(CUcontext *, unsigned, CUdevice);
    CUresult (*CtxDestroy)(CUcontext);
    CUresult (*MemAlloc)(CUdeviceptr *, size_t);
    CUresult (*MemFree)(CUdeviceptr);
    CUresult (*MemGetInfo)(size_t *, size_t *);
    CUresult (*MemcpyHtoD)(CUdeviceptr, const void *, size_t);
    CUresult (*MemcpyDtoH)(void *, CUdeviceptr, size_t);
    CUresult (*MemAllocPitch)(CUdeviceptr *, size_t *, size_t, size_t, unsigned);
    CUresult (*MemAllocManaged)(CUdeviceptr *, size_t, unsigned);
    CUresult (*MemCreate)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
    CUresult (*MemRelease)(CUmemGenericAllocationHandle);
    CUresult (*ArrayCreate)(CUarray *, const CUDA_ARRAY_DESCRIPTOR *);
    CUresult (*ArrayDestroy)(CUarray);
    CUresult (*ModuleLoadData)(CUmodule *, const void *);
    CUresult (*ModuleUnload)(CUmodule);
    CUresult (*LibraryLoadData)(CUlibrary *, const void *, void *, void **, unsigned, void *, void **, unsigned);
    CUresult (*LibraryLoadFromFile)(CUlibrary *, const char *, void *, void **, unsigned, void *, void **, unsigned);
    CUresult (*LibraryUnload)(CUlibrary);
    CUresult (*MemAllocAsync)(CUdeviceptr *, size_t, CUstream);
    CUresult (*MemFreeAsync)(CUdeviceptr, CUstream);
    CUresult (*StreamSynchronize)(CUstream);
    CUresult (*MemPoolTrimTo)(CUmemoryPool, size_t);
    CUresult (*DeviceGetDefaultMemPool)(CUmemoryPool *, CUdevice);
};

static struct Driver cu;
static const char *access_mode;

#ifdef VGPU_LINKED
CUresult cuInit(unsigned);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuDeviceTotalMem_v2(size_t *, CUdevice);
CUresult cuCtxCreate_v2(CUcontext *, unsigned, CUdevice);
CUresult cuCtxDestroy_v2(CUcontext);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemGetInfo_v2(size_t *, size_t *);
CUresult cuMemcpyHtoD_v2(CUdeviceptr, const void *, size_t);
CUresult cuMemcpyDtoH_v2(void *, CUdeviceptr, size_t);
CUresult cuMemAllocPitch_v2(CUdeviceptr *, size_t *, size_t, size_t, unsigned);
CUresult cuMemAllocManaged(CUdeviceptr *, size_t, unsigned);
CUresult cuMemCreate(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
CUresult cuMemRelease(CUmemGenericAllocationHandle);
CUresult cuArrayCreate_v2(CUarray *, const CUDA_ARRAY_DESCRIPTOR *);
CUresult cuArrayDestroy(CUarray);
CUresult cuModuleLoadData(CUmodule *, const void *);
CUresult cuModuleUnload(CUmodule);
CUresult cuLibraryLoadData(CUlibrary *, const void *, void *, void **, unsigned, void *, void **, unsigned);
CUresult cuLibraryLoadFromFile(CUlibrary *, const char *, void *, void **, unsigned, void *, void **, unsigned);
CUresult cuLibraryUnload(CUlibrary);
CUresult cuMemAllocAsync(CUdeviceptr *, size_t, CUstream);
CUresult cuMemFreeAsync(CUdeviceptr, CUstream);
CUresult cuStreamSynchronize(CUstream);
CUresult cuMemPoolTrimTo(CUmemoryPool, size_t);
CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *, CUdevice);

static int load_driver(void) {
    if (strcmp(access_mode, "linked") != 0) {
        fprintf(stderr, "probe_linked only supports the 'linked' access mode\n");
        return -1;
    }
    cu.Init = cuInit;
    cu.DeviceGet = cuDeviceGet;
    cu.DeviceTotalMem = cuDeviceTotalMem_v2;
    cu.CtxCreate = cuCtxCreate_v2;
    cu.CtxDestroy = cuCtxDestroy_v2;
    cu.MemAlloc = cuMemAlloc_v2;
    cu.MemFree = cuMemFree_v2;
    cu.MemGetInfo = cuMemGetInfo_v2;
    cu.MemcpyHtoD = cuMemcpyHtoD_v2;
    cu.MemcpyDtoH = cuMemcpyDtoH_v2;
    cu.MemAllocPitch = cuMemAllocPitch_v2;
    cu.MemAllocManaged = cuMemAllocManaged;
    cu.MemCreate = cuMemCreate;
    cu.MemRelease = cuMemRelease;
    cu.ArrayCreate = cuArrayCreate_v2;
    cu.ArrayDestroy = cuArrayDestroy;
    cu.ModuleLoadData = cuModuleLoadData;
    cu.ModuleUnload = cuModuleUnload;
    cu.LibraryLoadData = cuLibraryLoadData;
    cu.LibraryLoadFromFile = cuLibraryLoadFromFile;
    cu.LibraryUnload = cuLibraryUnload;
    cu.MemAllocAsync = cuMemAllocAsync;
    cu.MemFreeAsync = cuMemFreeAsync;
    cu.StreamSynchronize = cuStreamSynchronize;
    cu.MemPoolTrimTo = cuMemPoolTrimTo;
    cu.DeviceGetDefaultMemPool = cuDeviceGetDefaultMemPool;
    return 0;
}
#else
static void *driver_handle;
static GetProcAddressFn get_proc_address;

/* Resolves one function: by its versioned name through dlsym or the
 * driver's symbol table, or by its base name and a CUDA version through
 * cuGetProcAddress. */
static void *resolve(const char *versioned, const char *base, int cuda_version) {
    if (strcmp(access_mode, "dlsym") == 0) {
        return dlsym(driver_handle, versioned);
    }
    if (strcmp(access_mode, "elf") == 0) {
        return elf_lookup(versioned);
    }
    void *address = NULL;
    int status = -1;
    CUresult rc = get_proc_address(base, &address, cuda_version, 0, &status);
    if (rc != CUDA_SUCCESS || status != 0) {
        fprintf(stderr, "cuGetProcAddress(%s) failed: rc=%d status=%d\n", base, rc, status);
        return NULL;
    }
    return address;
}

#define RESOLVE(field, versioned, base, version)                              \
    do {                                                                      \
        *(void **)&cu.field = resolve(versioned, base, version);              \
        if (!cu.field) {                                                      \
            fprintf(stderr, "cannot resolve %s\n", versioned);                \
            return -1;                                                        \
        }                                                                     \
    } while (0)

static int load_driver(void) {
    driver_handle = dlopen("libcuda.so.1", RTLD_NOW);
    if (!driver_handle) {
        fprintf(stderr, "dlopen libcuda.so.1: %s\n", dlerror());
        return -1;
    }
    if (strcmp(access_mode, "procaddr") == 0) {
        get_proc_address = (GetProcAddressFn)dlsym(driver_handle, "cuGetProcAddress_v2");
        if (!get_proc_address) {
            fprintf(stderr, "no cuGetProcAddress_v2\n");
            return -1;
        }
    } else if (strcmp(access_mode, "elf") == 0) {
        if (!find_driver_symbols()) {
            fprintf(stderr, "no dynamic symbol table found for libcuda.so.1\n");
            return -1;
        }
    } else if (strcmp(access_mode, "dlsym") != 0) {
        fprintf(stderr, "unknown access mode %s\n", access_mode);
        return -1;
    }
    RESOLVE(Init, "cuInit", "cuInit", 12000);
    RESOLVE(DeviceGet, "cuDeviceGet", "cuDeviceGet", 12000);
    RESOLVE(DeviceTotalMem, "cuDeviceTotalMem_v2", "cuDeviceTotalMem", 12000);
    /* 11000 selects the _v2 signature used here (11040 introduced _v3). */
    RESOLVE(CtxCreate, "cuCtxCreate_v2", "cuCtxCreate", 11000);
    RESOLVE(CtxDestroy, "cuCtxDestroy_v2", "cuCtxDestroy", 12000);
    RESOLVE(MemAlloc, "cuMemAlloc_v2", "cuMemAlloc", 12000);
    RESOLVE(MemFree, "cuMemFree_v2", "cuMemFree", 12000);
    RESOLVE(MemGetInfo, "cuMemGetInfo_v2", "cuMemGetInfo", 12000);
    RESOLVE(MemcpyHtoD, "cuMemcpyHtoD_v2", "cuMemcpyHtoD", 12000);
    RESOLVE(MemcpyDtoH, "cuMemcpyDtoH_v2", "cuMemcpyDtoH", 12000);
    RESOLVE(MemAllocPitch, "cuMemAllocPitch_v2", "cuMemAllocPitch", 12000);
    RESOLVE(MemAllocManaged, "cuMemAllocManaged", "cuMemAllocManaged", 12000);
    RESOLVE(MemCreate, "cuMemCreate", "cuMemCreate", 12000);
    RESOLVE(MemRelease, "cuMemRelease", "cuMemRelease", 12000);
    RESOLVE(ArrayCreate, "cuArrayCreate_v2", "cuArrayCreate", 12000);
    RESOLVE(ArrayDestroy, "cuArrayDestroy", "cuArrayDestroy", 12000);
    RESOLVE(ModuleLoadData, "cuModuleLoadData", "cuModuleLoadData", 12000);
    RESOLVE(ModuleUnload, "cuModuleUnload", "cuModuleUnload", 12000);
    RESOLVE(LibraryLoadData, "cuLibraryLoadData", "cuLibraryLoadData", 12000);
    RESOLVE(LibraryLoadFromFile, "cuLibraryLoadFromFile", "cuLibraryLoadFromFile", 12000);
    RESOLVE(LibraryUnload, "cuLibraryUnload", "cuLibraryUnload", 12000);
    RESOLVE(MemAllocAsync, "cuMemAllocAsync", "cuMemAllocAsync", 12000);
    RESOLVE(MemFreeAsync, "cuMemFreeAsync", "cuMemFreeAsync", 12000);
    RESOLVE(StreamSynchronize, "cuStreamSynchronize", "cuStreamSynchronize", 12000);
    RESOLVE(MemPoolTrimTo, "cuMemPoolTrimTo", "cuMemPoolTrimTo", 12000);
    RESOLVE(DeviceGetDefaultMemPool, "cuDeviceGetDefaultMemPool", "cuDeviceGetDefaultMemPool", 12000);
    return 0;
}
#endif

#define CHECK(call)                                                           \
    do {                                                                      \
        CUresult rc_ = (call);                                                \
        if (rc_ != CUDA_SUCCESS) {                                            \
            fprintf(stderr, "%s:%d: %s failed: %d\n", __FILE__, __LINE__,     \
                    #call, rc_);                                              \
            exit(3);                                                          \
        }                                                                     \
    } while (0)

static CUcontext context;

static void start(void) {
    if (load_driver() != 0) exit(2);
    CUdevice device;
    CHECK(cu.Init(0));
    CHECK(cu.DeviceGet(&device, 0));
    CHECK(cu.CtxCreate(&context, 0, device));
}

/* Memory the container holds, as the capped cuMemGetInfo reports it. */
static unsigned long long used_now(void) {
    size_t free_bytes = 0, total_bytes = 0;
    CHECK(cu.MemGetInfo(&free_bytes, &total_bytes));
    return (unsigned long long)(total_bytes - free_bytes);
}

static int cmd_fill(size_t chunk) {
    start();
    size_t capacity = 1 << 16, count = 0;
    CUdeviceptr *buffers = calloc(capacity, sizeof *buffers);
    CUresult last = CUDA_SUCCESS;
    while (count < capacity) {
        last = cu.MemAlloc(&buffers[count], chunk);
        if (last != CUDA_SUCCESS) break;
        count++;
    }
    size_t free_bytes = 0, total_bytes = 0, device_total = 0;
    CHECK(cu.MemGetInfo(&free_bytes, &total_bytes));
    CHECK(cu.DeviceTotalMem(&device_total, 0));
    printf("chunks=%zu\nallocated=%llu\nrefusal=%d\n", count,
           (unsigned long long)count * chunk, last);
    printf("mem_total=%zu\nmem_free=%zu\ndevice_total=%zu\n", total_bytes, free_bytes, device_total);
    for (size_t i = 0; i < count; i++) CHECK(cu.MemFree(buffers[i]));
    CHECK(cu.MemGetInfo(&free_bytes, &total_bytes));
    printf("free_after=%zu\n", free_bytes);
    CHECK(cu.CtxDestroy(context));
    return 0;
}

static const char sim_module[] = "SIMGPU-MODULE\nprobe_kernel 20us\n";

static int cmd_kinds(void) {
    start();
    unsigned long long base = used_now();
    printf("context=%llu\n", base);
    unsigned long long before;

    CUdeviceptr ptr;
    before = used_now();
    CHECK(cu.MemAlloc(&ptr, 64 << 20));
    printf("alloc=%llu\n", used_now() - before);
    CHECK(cu.MemFree(ptr));
    printf("alloc_back=%llu\n", used_now() - before);

    size_t pitch = 0;
    before = used_now();
    CHECK(cu.MemAllocPitch(&ptr, &pitch, 1000, 100, 4));
    printf("pitch=%zu\npitched=%llu\n", pitch, used_now() - before);
    CHECK(cu.MemFree(ptr));
    printf("pitched_back=%llu\n", used_now() - before);

    before = used_now();
    CHECK(cu.MemAllocManaged(&ptr, 32 << 20, 1));
    printf("managed=%llu\n", used_now() - before);
    CHECK(cu.MemFree(ptr));
    printf("managed_back=%llu\n", used_now() - before);

    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = 1;
    prop.location.type = 1; /* device */
    prop.location.id = 0;
    CUmemGenericAllocationHandle handle;
    before = used_now();
    CHECK(cu.MemCreate(&handle, 16 << 20, &prop, 0));
    printf("vmm=%llu\n", used_now() - before);
    CHECK(cu.MemRelease(handle));
    printf("vmm_back=%llu\n", used_now() - before);

    CUDA_ARRAY_DESCRIPTOR desc = {1024, 1024, 0x20 /* float */, 1};
    CUarray array;
    before = used_now();
    CHECK(cu.ArrayCreate(&array, &desc));
    printf("array=%llu\n", used_now() - before);
    CHECK(cu.ArrayDestroy(array));
    printf("array_back=%llu\n", used_now() - before);

    CUmodule module;
    before = used_now();
    CHECK(cu.ModuleLoadData(&module, sim_module));
    printf("module=%llu\nmodule_image=%zu\n", used_now() - before, strlen(sim_module));
    CHECK(cu.ModuleUnload(module));
    printf("module_back=%llu\n", used_now() - before);

    CUlibrary library;
    before = used_now();
    CHECK(cu.LibraryLoadData(&library, sim_module, NULL, NULL, 0, NULL, NULL, 0));
    printf("library=%llu\n", used_now() - before);
    CHECK(cu.LibraryUnload(library));
    printf("library_back=%llu\n", used_now() - before);

    char library_path[] = "/tmp/vgpu-probe-library-XXXXXX";
    int library_fd = mkstemp(library_path);
    if (library_fd < 0 || write(library_fd, sim_module, strlen(sim_module)) != (ssize_t)strlen(sim_module)) {
        fprintf(stderr, "cannot write %s\n", library_path);
        return 1;
    }
    close(library_fd);
    before = used_now();
    CUresult file_rc = cu.LibraryLoadFromFile(&library, library_path, NULL, NULL, 0, NULL, NULL, 0);
    unlink(library_path);
    CHECK(file_rc);
    printf("library_file=%llu\n", used_now() - before);
    CHECK(cu.LibraryUnload(library));
    printf("library_file_back=%llu\n", used_now() - before);

    CUmemoryPool pool;
    CHECK(cu.DeviceGetDefaultMemPool(&pool, 0));
    before = used_now();
    CHECK(cu.MemAllocAsync(&ptr, 10 << 20, NULL));
    printf("async=%llu\n", used_now() - before);
    CHECK(cu.MemFreeAsync(ptr, NULL));
    CHECK(cu.StreamSynchronize(NULL));
    CHECK(cu.MemPoolTrimTo(pool, 0));
    printf("async_back=%llu\n", used_now() - before);

    CHECK(cu.CtxDestroy(context));
    return 0;
}

static int cmd_random(long iterations, unsigned seed, size_t max_chunk) {
    start();
    enum { LIVE = 64 };
    CUdeviceptr live[LIVE] = {0};
    long refused = 0, allocated = 0, other_errors = 0;
    srand(seed);
    for (long i = 0; i < iterations; i++) {
        int index = rand() % LIVE;
        if (live[index]) {
            CHECK(cu.MemFree(live[index]));
            live[index] = 0;
        } else {
            size_t bytes = 1 + (size_t)rand() % max_chunk;
            CUresult rc = cu.MemAlloc(&live[index], bytes);
            if (rc == CUDA_SUCCESS) allocated++;
            else if (rc == CUDA_ERROR_OUT_OF_MEMORY) { refused++; live[index] = 0; }
            else { other_errors++; live[index] = 0; }
        }
    }
    for (int i = 0; i < LIVE; i++)
        if (live[i]) CHECK(cu.MemFree(live[i]));
    printf("allocated=%ld\nrefused=%ld\nother_errors=%ld\n", allocated, refused, other_errors);
    CHECK(cu.CtxDestroy(context));
    return other_errors ? 1 : 0;
}

static int cmd_churn(size_t chunk) {
    start();
    CUdeviceptr held;
    CHECK(cu.MemAlloc(&held, chunk));
    printf("ready\n");
    fflush(stdout);
    for (;;) {
        CUdeviceptr ptr;
        if (cu.MemAlloc(&ptr, chunk) == CUDA_SUCCESS) CHECK(cu.MemFree(ptr));
    }
}

static int cmd_hold(size_t bytes) {
    start();
    CUdeviceptr held;
    CHECK(cu.MemAlloc(&held, bytes));
    printf("ready\n");
    fflush(stdout);
    char buffer[64];
    while (read(0, buffer, sizeof buffer) > 0) {
    }
    CHECK(cu.MemFree(held));
    CHECK(cu.CtxDestroy(context));
    return 0;
}

static int cmd_fork(size_t bytes) {
    start();
    CUdeviceptr ptr;
    CHECK(cu.MemAlloc(&ptr, bytes));
    unsigned long long parent_before = used_now();
    fflush(stdout);
    pid_t child = fork();
    if (child < 0) { perror("fork"); return 1; }
    if (child == 0) {
        /* A forked child may not use its parent's context: it starts its own. */
        CUcontext child_context;
        CHECK(cu.Init(0));
        CHECK(cu.CtxCreate(&child_context, 0, 0));
        CUdeviceptr mine;
        unsigned long long before = used_now();
        CHECK(cu.MemAlloc(&mine, bytes));
        printf("child_alloc=%llu\n", used_now() - before);
        CHECK(cu.MemFree(mine));
        CHECK(cu.CtxDestroy(child_context));
        fflush(stdout);
        _exit(0);
    }
    int status = 0;
    waitpid(child, &status, 0);
    printf("child_status=%d\n", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    printf("parent_before=%llu\nparent_after=%llu\n", parent_before, used_now());
    CHECK(cu.MemFree(ptr));
    CHECK(cu.CtxDestroy(context));
    return 0;
}

static int cmd_memcpy(size_t bytes) {
    start();
    unsigned char *out = malloc(bytes), *back = malloc(bytes);
    for (size_t i = 0; i < bytes; i++) out[i] = (unsigned char)(i * 2654435761u >> 13);
    memset(back, 0, bytes);
    CUdeviceptr ptr;
    CHECK(cu.MemAlloc(&ptr, bytes));
    CHECK(cu.MemcpyHtoD(ptr, out, bytes));
    CHECK(cu.MemcpyDtoH(back, ptr, bytes));
    printf("equal=%d\n", memcmp(out, back, bytes) == 0);
    CHECK(cu.MemFree(ptr));
    CHECK(cu.CtxDestroy(context));
    return 0;
}

#ifndef VGPU_LINKED
static int cmd_spill(size_t total, size_t chunk) {
    if (load_driver() != 0) return 2;
    CUresult (*attribute)(void *, int, CUdeviceptr) = resolve("cuPointerGetAttribute", "cuPointerGetAttribute", 12000);
    if (!attribute) return 2;
    CUdevice device;
    CHECK(cu.Init(0));
    CHECK(cu.DeviceGet(&device, 0));
    CHECK(cu.CtxCreate(&context, 0, device));
    size_t count = total / chunk, made = 0, in_host = 0;
    CUdeviceptr *buffers = calloc(count, sizeof *buffers);
    CUresult refusal = CUDA_SUCCESS;
    for (; made < count; made++) {
        refusal = cu.MemAlloc(&buffers[made], chunk);
        if (refusal != CUDA_SUCCESS) break;
    }
    unsigned char *out = malloc(chunk), *back = malloc(chunk);
    int equal = 1;
    for (size_t i = 0; i < made; i++) {
        memset(out, (int)(i * 37 + 11), chunk);
        out[chunk - 1] = (unsigned char)i;
        CHECK(cu.MemcpyHtoD(buffers[i], out, chunk));
    }
    for (size_t i = 0; i < made; i++) {
        memset(out, (int)(i * 37 + 11), chunk);
        out[chunk - 1] = (unsigned char)i;
        CHECK(cu.MemcpyDtoH(back, buffers[i], chunk));
        equal &= memcmp(out, back, chunk) == 0;
        unsigned memory_type = 0;
        CHECK(attribute(&memory_type, 2 /* CU_POINTER_ATTRIBUTE_MEMORY_TYPE */, buffers[i]));
        in_host += memory_type == 1; /* CU_MEMORYTYPE_HOST */
    }
    size_t free_bytes = 0, total_bytes = 0;
    CHECK(cu.MemGetInfo(&free_bytes, &total_bytes));
    printf("chunks=%zu\nallocated=%llu\nrefusal=%d\nhost_chunks=%zu\nequal=%d\n", made,
           (unsigned long long)made * chunk, refusal, in_host, equal);
    printf("mem_total=%zu\nmem_free=%zu\nready\n", total_bytes, free_bytes);
    fflush(stdout);
    char buffer[64];
    while (read(0, buffer, sizeof buffer) > 0) {
    }
    for (size_t i = 0; i < made; i++) CHECK(cu.MemFree(buffers[i]));
    CHECK(cu.MemGetInfo(&free_bytes, &total_bytes));
    printf("free_after=%zu\n", free_bytes);
    CHECK(cu.CtxDestroy(context));
    return 0;
}

static int cmd_primary(void) {
    if (load_driver() != 0) return 2;
    CUresult (*retain)(CUcontext *, CUdevice) = resolve("cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRetain", 12000);
    CUresult (*release)(CUdevice) = resolve("cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease", 12000);
    CUresult (*set_current)(CUcontext) = resolve("cuCtxSetCurrent", "cuCtxSetCurrent", 12000);
    if (!retain || !release || !set_current) return 2;
    CHECK(cu.Init(0));
    CUcontext primary;
    CHECK(retain(&primary, 0));
    CHECK(set_current(primary));
    CUdeviceptr ptr;
    CHECK(cu.MemAlloc(&ptr, 64 << 20));
    printf("held=%llu\n", used_now());
    /* The last release destroys the primary context and its memory. */
    CHECK(release(0));
    CHECK(retain(&primary, 0));
    CHECK(set_current(primary));
    printf("after_release=%llu\n", used_now());
    CHECK(release(0));
    return 0;
}

static int cmd_getprocaddress(void) {
    if (load_driver() != 0) return 2;
    CHECK(cu.Init(0));
    /* Our hooks, as plain symbol lookup in the global scope finds them. */
    void *hook_launch = dlsym(RTLD_DEFAULT, "cuLaunchKernel");
    void *hook_launch_ptsz = dlsym(RTLD_DEFAULT, "cuLaunchKernel_ptsz");
    void *hook_alloc = dlsym(RTLD_DEFAULT, "cuMemAlloc_v2");
    void *address = NULL;
    int status = -1;
    CUresult rc;

    rc = get_proc_address("cuLaunchKernel", &address, 12000, 0, &status);
    printf("launch_default_is_hook=%d\nlaunch_default_status=%d\nlaunch_default_rc=%d\n",
           address == hook_launch, status, rc);
    rc = get_proc_address("cuLaunchKernel", &address, 12000, 2, &status);
    printf("launch_ptsz_is_hook=%d\nlaunch_ptsz_status=%d\n", address == hook_launch_ptsz, status);
    rc = get_proc_address("cuMemAlloc", &address, 12000, 0, &status);
    printf("alloc_is_hook=%d\n", address == hook_alloc);

    /* A function we do not hook comes back as the driver's own. */
    void *real_sync = dlsym(driver_handle, "cuStreamSynchronize");
    rc = get_proc_address("cuStreamSynchronize", &address, 12000, 0, &status);
    printf("unhooked_is_driver=%d\n", address == real_sync && address != NULL);
    void *real_sync_ptsz = dlsym(driver_handle, "cuStreamSynchronize_ptsz");
    rc = get_proc_address("cuStreamSynchronize", &address, 12000, 2, &status);
    printf("unhooked_ptsz_is_driver=%d\n", address == real_sync_ptsz && address != NULL);

    address = (void *)1;
    rc = get_proc_address("cuNoSuchFunction", &address, 12000, 0, &status);
    printf("unknown_rc=%d\nunknown_status=%d\nunknown_null=%d\n", rc, status, address == NULL);
    address = (void *)1;
    rc = get_proc_address("cuGetProcAddress", &address, 11000, 0, &status);
    printf("too_old_rc=%d\ntoo_old_status=%d\ntoo_old_null=%d\n", rc, status, address == NULL);
    rc = get_proc_address("cuGetProcAddress", &address, 12000, 0, &status);
    printf("self_is_hook=%d\n", address == dlsym(RTLD_DEFAULT, "cuGetProcAddress_v2"));

    /* dlsym(RTLD_NEXT) from the program: the next object is the shim. */
    printf("rtld_next_is_hook=%d\n", dlsym(RTLD_NEXT, "cuMemAlloc_v2") == hook_alloc);
    /* dlsym on the driver's own handle is redirected too. */
    printf("handle_lookup_is_hook=%d\n", dlsym(driver_handle, "cuMemAlloc_v2") == hook_alloc);
    return 0;
}

static int cmd_nvml(void) {
    void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!nvml) { fprintf(stderr, "dlopen nvml: %s\n", dlerror()); return 2; }
    nvmlReturn_t (*init)(void) = dlsym(nvml, "nvmlInit_v2");
    nvmlReturn_t (*by_index)(unsigned, nvmlDevice_t *) = dlsym(nvml, "nvmlDeviceGetHandleByIndex_v2");
    nvmlReturn_t (*memory)(nvmlDevice_t, nvmlMemory_t *) = dlsym(nvml, "nvmlDeviceGetMemoryInfo");
    nvmlReturn_t (*memory_v2)(nvmlDevice_t, nvmlMemory_v2_t *) = dlsym(nvml, "nvmlDeviceGetMemoryInfo_v2");
    nvmlReturn_t (*processes)(nvmlDevice_t, unsigned *, nvmlProcessInfo_t *) =
        dlsym(nvml, "nvmlDeviceGetComputeRunningProcesses_v3");
    if (!init || !by_index || !memory || !memory_v2 || !processes) {
        fprintf(stderr, "missing NVML symbols\n");
        return 2;
    }
    nvmlDevice_t device;
    if (init() != 0 || by_index(0, &device) != 0) { fprintf(stderr, "nvml init failed\n"); return 2; }
    nvmlMemory_t info;
    printf("nvml_rc=%d\n", memory(device, &info));
    printf("nvml_total=%llu\nnvml_used=%llu\nnvml_free=%llu\n", info.total, info.used, info.free);
    nvmlMemory_v2_t info2;
    memset(&info2, 0, sizeof info2);
    info2.version = (unsigned)sizeof info2 | (2u << 24);
    printf("nvml_v2_rc=%d\n", memory_v2(device, &info2));
    printf("nvml_v2_total=%llu\nnvml_v2_used=%llu\n", info2.total, info2.used);
    nvmlProcessInfo_t infos[64];
    unsigned count = 64;
    printf("processes_rc=%d\n", processes(device, &count, infos));
    unsigned long long sum = 0;
    for (unsigned i = 0; i < count; i++) sum += infos[i].usedGpuMemory;
    printf("processes=%u\nprocesses_memory=%llu\n", count, sum);
    printf("process_pids=");
    for (unsigned i = 0; i < count; i++) printf("%s%u", i ? "," : "", infos[i].pid);
    printf("\n");
    nvmlReturn_t (*uuid)(nvmlDevice_t, char *, unsigned) = dlsym(nvml, "nvmlDeviceGetUUID");
    char text[96] = {0};
    if (uuid && uuid(device, text, sizeof text) == 0) printf("uuid=%s\n", text);
    return 0;
}
#endif

#ifndef VGPU_LINKED
static int cmd_sample(void) {
    void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!nvml) { fprintf(stderr, "dlopen nvml: %s\n", dlerror()); return 2; }
    nvmlReturn_t (*init)(void) = dlsym(nvml, "nvmlInit_v2");
    nvmlReturn_t (*by_index)(unsigned, nvmlDevice_t *) = dlsym(nvml, "nvmlDeviceGetHandleByIndex_v2");
    nvmlReturn_t (*memory)(nvmlDevice_t, nvmlMemory_t *) = dlsym(nvml, "nvmlDeviceGetMemoryInfo");
    nvmlDevice_t device;
    if (!init || !by_index || !memory || init() != 0 || by_index(0, &device) != 0) {
        fprintf(stderr, "nvml unavailable\n");
        return 2;
    }
    printf("ready\n");
    fflush(stdout);
    unsigned long long max_used = 0, samples = 0;
    struct pollfd input = {0, POLLIN, 0};
    for (;;) {
        nvmlMemory_t info;
        if (memory(device, &info) == 0) {
            if (info.used > max_used) max_used = info.used;
            samples++;
        }
        if (poll(&input, 1, 0) > 0) {
            char buffer[64];
            if (read(0, buffer, sizeof buffer) <= 0) break;
        }
    }
    printf("max_used=%llu\nsamples=%llu\n", max_used, samples);
    return 0;
}
#endif

static int cmd_rtld_next(void) {
    /* puts is wrapped by next_interposer.so, which finds glibc's with
     * dlsym(RTLD_NEXT); a wrong caller would make it find itself. */
    int (*calls)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "next_interposer_calls");
    puts("through-the-interposer");
    fflush(stdout);
    printf("interposer_calls=%d\n", calls ? calls() : -1);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s ACCESS COMMAND [ARGS]\n", argv[0]);
        return 2;
    }
    access_mode = argv[1];
    const char *command = argv[2];
    if (strcmp(command, "fill") == 0 && argc == 4) return cmd_fill(strtoull(argv[3], NULL, 0));
    if (strcmp(command, "kinds") == 0) return cmd_kinds();
    if (strcmp(command, "random") == 0 && argc == 6)
        return cmd_random(atol(argv[3]), (unsigned)atoi(argv[4]), strtoull(argv[5], NULL, 0));
    if (strcmp(command, "churn") == 0 && argc == 4) return cmd_churn(strtoull(argv[3], NULL, 0));
    if (strcmp(command, "hold") == 0 && argc == 4) return cmd_hold(strtoull(argv[3], NULL, 0));
    if (strcmp(command, "fork") == 0 && argc == 4) return cmd_fork(strtoull(argv[3], NULL, 0));
    if (strcmp(command, "memcpy") == 0 && argc == 4) return cmd_memcpy(strtoull(argv[3], NULL, 0));
#ifndef VGPU_LINKED
    if (strcmp(command, "getprocaddress") == 0) return cmd_getprocaddress();
    if (strcmp(command, "primary") == 0) return cmd_primary();
    if (strcmp(command, "spill") == 0 && argc == 5)
        return cmd_spill(strtoull(argv[3], NULL, 0), strtoull(argv[4], NULL, 0));
    if (strcmp(command, "nvml") == 0) return cmd_nvml();
    if (strcmp(command, "sample") == 0) return cmd_sample();
#endif
    if (strcmp(command, "rtld-next") == 0) return cmd_rtld_next();
    fprintf(stderr, "unknown command %s\n", command);
    return 2;
}
