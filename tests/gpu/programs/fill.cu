// fill: allocates device memory with cudaMalloc in chunks until an
// allocation fails or a ceiling is reached, writes every byte, and reports
// what the runtime said the device holds. Built by nvcc with its default
// static cudart, which reaches the driver through cuGetProcAddress.
//
//   fill --chunk-mib N --ceiling-mib M
//
// Prints "ready" once the runtime is up, allocates on "go", prints one
// JSON line and keeps the memory until stdin closes.
#include <vector>

#include "protocol.cuh"

int main(int argc, char **argv) {
    const size_t mib = 1 << 20;
    size_t chunk = (size_t)number_option(argc, argv, "--chunk-mib", nullptr) * mib;
    size_t ceiling = (size_t)number_option(argc, argv, "--ceiling-mib", nullptr) * mib;
    if (chunk == 0) {
        std::fprintf(stderr, "--chunk-mib must be at least 1\n");
        return 2;
    }
    CHECK(cudaFree(nullptr));
    size_t free_bytes = 0, total_bytes = 0;
    CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    ready_then_wait_for_go();

    std::vector<void *> held;
    size_t allocated = 0;
    cudaError_t stopped = cudaSuccess;
    while (allocated + chunk <= ceiling) {
        void *p = nullptr;
        stopped = cudaMalloc(&p, chunk);
        if (stopped != cudaSuccess) {
            cudaGetLastError();  // clear the sticky-free error state
            break;
        }
        CHECK(cudaMemset(p, 0xa5, chunk));
        held.push_back(p);
        allocated += chunk;
    }
    CHECK(cudaDeviceSynchronize());
    char json[512];
    std::snprintf(json, sizeof json,
                  "{\"total\": %zu, \"free\": %zu, \"allocated\": %zu, \"error\": \"%s\"}",
                  total_bytes, free_bytes, allocated, error_name(stopped).c_str());
    report_and_hold(json);
    for (void *p : held) cudaFree(p);
    return 0;
}
