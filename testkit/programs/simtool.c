/* simtool: reads the simulated GPU's own record of device time, outside the
 * shim. Each line "DEVICE PID" on stdin is answered with
 * "NOW_NS PROCESS_BUSY_NS DEVICE_BUSY_NS" (PID 0: the device only), where
 * NOW_NS is CLOCK_MONOTONIC when the figures were read. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

int main(void) {
    void *sim = dlopen("libcuda.so.1", RTLD_NOW);
    if (!sim) {
        fprintf(stderr, "dlopen: %s\n", dlerror());
        return 2;
    }
    uint64_t (*process_busy)(int, uint32_t) = (uint64_t (*)(int, uint32_t))dlsym(sim, "simgpu_process_busy_ns");
    uint64_t (*device_busy)(int) = (uint64_t (*)(int))dlsym(sim, "simgpu_device_busy_ns");
    if (!process_busy || !device_busy) {
        fprintf(stderr, "the simulated GPU lacks its busy-time hooks\n");
        return 2;
    }
    int device;
    unsigned pid;
    while (scanf("%d %u", &device, &pid) == 2) {
        struct timespec t;
        clock_gettime(CLOCK_MONOTONIC, &t);
        uint64_t now = (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
        uint64_t mine = pid ? process_busy(device, pid) : 0;
        printf("%llu %llu %llu\n", (unsigned long long)now, (unsigned long long)mine,
               (unsigned long long)device_busy(device));
        fflush(stdout);
    }
    return 0;
}
