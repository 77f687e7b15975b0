// bypass: a program that means to get past an interposer. The runtime is
// brought up as usual (any preloaded library sees that), then device memory
// is allocated, or kernels launched, through cuMemAlloc_v2 or cuLaunchKernel
// found in the loaded driver's own dynamic symbol table: never asking
// dlsym or cuGetProcAddress, so no interposer sees them. Only the node (the
// driver's own accounting, read through NVML) can hold it to its
// container's cap and share.
//
//   bypass --chunk-mib N --ceiling-mib M
//   bypass spin --kernel-us U --seconds S
//
// Prints "ready" once the runtime is up, then on "go" allocates (and prints
// one JSON line, keeping the memory until stdin closes or it is killed),
// or launches bursts of 32 kernels of U us, each burst synchronized, for S
// seconds, then prints one JSON line ({"steps", "seconds", "rate"}: kernels
// a second) and waits for stdin to close.
#include <dlfcn.h>
#include <elf.h>
#include <link.h>

#include <vector>

#include "protocol.cuh"

typedef int (*MemAlloc)(unsigned long long *, size_t);
typedef int (*LaunchKernel)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                            void *, void **, void **);

// Spins on the GPU's nanosecond clock for `ns`.
__global__ void spin(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}

namespace {

struct Driver {
    ElfW(Addr) base = 0;
    const ElfW(Sym) *symbols = nullptr;
    const char *names = nullptr;
    size_t count = 0;
} driver;

int find_driver(struct dl_phdr_info *info, size_t, void *) {
    if (!info->dlpi_name || !std::strstr(info->dlpi_name, "libcuda.so")) return 0;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        if (info->dlpi_phdr[i].p_type != PT_DYNAMIC) continue;
        auto dyn = reinterpret_cast<const ElfW(Dyn) *>(info->dlpi_addr + info->dlpi_phdr[i].p_vaddr);
        const uint32_t *gnu_hash = nullptr, *sysv_hash = nullptr;
        for (; dyn->d_tag != DT_NULL; dyn++) {
            if (dyn->d_tag == DT_SYMTAB) driver.symbols = reinterpret_cast<const ElfW(Sym) *>(dyn->d_un.d_ptr);
            if (dyn->d_tag == DT_STRTAB) driver.names = reinterpret_cast<const char *>(dyn->d_un.d_ptr);
            if (dyn->d_tag == DT_GNU_HASH) gnu_hash = reinterpret_cast<const uint32_t *>(dyn->d_un.d_ptr);
            if (dyn->d_tag == DT_HASH) sysv_hash = reinterpret_cast<const uint32_t *>(dyn->d_un.d_ptr);
        }
        if (sysv_hash) {
            driver.count = sysv_hash[1];
        } else if (gnu_hash) {
            uint32_t buckets = gnu_hash[0], offset = gnu_hash[1], bloom = gnu_hash[2];
            const uint32_t *bucket = gnu_hash + 4 + bloom * (sizeof(ElfW(Addr)) / 4);
            const uint32_t *chain = bucket + buckets;
            uint32_t last = 0;
            for (uint32_t b = 0; b < buckets; b++)
                if (bucket[b] > last) last = bucket[b];
            if (last >= offset)
                while (!(chain[last - offset] & 1)) last++;
            driver.count = last + 1;
        }
        driver.base = info->dlpi_addr;
        return 1;
    }
    return 0;
}

void *lookup(const char *name) {
    for (size_t i = 0; i < driver.count; i++) {
        const ElfW(Sym) *sym = &driver.symbols[i];
        if (sym->st_value && ELF64_ST_TYPE(sym->st_info) == STT_FUNC &&
            std::strcmp(driver.names + sym->st_name, name) == 0)
            return reinterpret_cast<void *>(driver.base + sym->st_value);
    }
    return nullptr;
}

}  // namespace

// Bursts of 32 spin kernels launched past any interposer, for `seconds`.
int spin_past_the_shim(int argc, char **argv) {
    double seconds = number_option(argc, argv, "--seconds", nullptr);
    auto ns = (unsigned long long)(number_option(argc, argv, "--kernel-us", nullptr) * 1000.0);
    CHECK(cudaFree(nullptr));
    dl_iterate_phdr(find_driver, nullptr);
    auto launch = reinterpret_cast<LaunchKernel>(driver.count ? lookup("cuLaunchKernel") : nullptr);
    if (!launch) {
        std::fprintf(stderr, "cuLaunchKernel not found in the loaded driver's symbol table\n");
        return 2;
    }
    cudaFunction_t function;
    CHECK(cudaGetFuncBySymbol(&function, reinterpret_cast<const void *>(spin)));
    cudaStream_t stream;
    CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    int device = 0, blocks = 0;
    CHECK(cudaGetDevice(&device));
    CHECK(cudaDeviceGetAttribute(&blocks, cudaDevAttrMultiProcessorCount, device));
    void *args[] = {&ns};
    auto burst = [&] {
        for (int i = 0; i < 32; i++) {
            int rc = launch(reinterpret_cast<void *>(function), blocks, 1, 1, 32, 1, 1, 0, stream, args, nullptr);
            if (rc != 0) {
                std::fprintf(stderr, "cuLaunchKernel failed: %d\n", rc);
                std::exit(1);
            }
        }
        CHECK(cudaStreamSynchronize(stream));
    };
    burst();  // warm-up
    ready_then_wait_for_go();
    double start = seconds_now();
    long long done = 0;
    while (seconds_now() < start + seconds) {
        burst();
        done += 32;
    }
    double elapsed = seconds_now() - start;
    char json[256];
    std::snprintf(json, sizeof json, "{\"steps\": %lld, \"seconds\": %.6f, \"rate\": %.3f}", done, elapsed,
                  done / elapsed);
    report_and_hold(json);
    return 0;
}

int main(int argc, char **argv) {
    if (argc > 1 && std::strcmp(argv[1], "spin") == 0) return spin_past_the_shim(argc - 1, argv + 1);
    const size_t mib = 1 << 20;
    size_t chunk = (size_t)number_option(argc, argv, "--chunk-mib", nullptr) * mib;
    size_t ceiling = (size_t)number_option(argc, argv, "--ceiling-mib", nullptr) * mib;
    if (chunk == 0) {
        std::fprintf(stderr, "--chunk-mib must be at least 1\n");
        return 2;
    }
    CHECK(cudaFree(nullptr));  // the runtime up, the primary context current
    dl_iterate_phdr(find_driver, nullptr);
    auto alloc = reinterpret_cast<MemAlloc>(driver.count ? lookup("cuMemAlloc_v2") : nullptr);
    if (!alloc) {
        std::fprintf(stderr, "cuMemAlloc_v2 not found in the loaded driver's symbol table\n");
        return 2;
    }
    ready_then_wait_for_go();

    std::vector<void *> held;
    size_t allocated = 0;
    int stopped = 0;
    while (allocated + chunk <= ceiling) {
        unsigned long long p = 0;
        stopped = alloc(&p, chunk);
        if (stopped != 0) break;
        CHECK(cudaMemset(reinterpret_cast<void *>(p), 0xa5, chunk));
        held.push_back(reinterpret_cast<void *>(p));
        allocated += chunk;
    }
    CHECK(cudaDeviceSynchronize());
    char json[256];
    std::snprintf(json, sizeof json, "{\"allocated\": %zu, \"driver_error\": %d}", allocated, stopped);
    report_and_hold(json);
    return 0;
}
