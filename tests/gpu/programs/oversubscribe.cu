// oversubscribe: allocates more than the memory cap with cudaMalloc (the
// shim serves what does not fit from host memory when CUDA_OVERSUBSCRIBE is
// on), writes every word, reads it all back, and measures the bandwidth of
// a kernel over a buffer in device memory against one served from host
// memory.
//
//   oversubscribe --total-mib N --chunk-mib C
#include <algorithm>
#include <vector>

#include "protocol.cuh"

__device__ __host__ inline unsigned pattern(unsigned chunk, size_t word) {
    return (unsigned)(word * 2654435761u) ^ (chunk * 40503u + 7u);
}

__global__ void write_pattern(unsigned *p, size_t words, unsigned chunk) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < words;
         i += (size_t)gridDim.x * blockDim.x)
        p[i] = pattern(chunk, i);
}

__global__ void count_mismatches(const unsigned *p, size_t words, unsigned chunk,
                                 unsigned long long *mismatches) {
    unsigned long long local = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < words;
         i += (size_t)gridDim.x * blockDim.x)
        local += p[i] != pattern(chunk, i);
    if (local) atomicAdd(mismatches, local);
}

// Reads and writes every word (twice an xor, so the data is unchanged).
__global__ void touch(unsigned *p, size_t words) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < words;
         i += (size_t)gridDim.x * blockDim.x)
        p[i] ^= 0x5a5a5a5au;
}

// Median GB/s (bytes read plus written) of `touch` over one buffer.
static double bandwidth(unsigned *p, size_t words) {
    cudaEvent_t start, stop;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
    std::vector<double> rates;
    for (int r = 0; r < 6; r++) {
        CHECK(cudaEventRecord(start));
        touch<<<1024, 256>>>(p, words);
        CHECK(cudaEventRecord(stop));
        CHECK(cudaEventSynchronize(stop));
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, start, stop));
        rates.push_back(2.0 * words * sizeof(unsigned) / (ms * 1e-3) / 1e9);
    }
    std::sort(rates.begin(), rates.end());
    return rates[rates.size() / 2];
}

int main(int argc, char **argv) {
    const size_t mib = 1 << 20;
    size_t total = (size_t)number_option(argc, argv, "--total-mib", nullptr) * mib;
    size_t chunk = (size_t)number_option(argc, argv, "--chunk-mib", nullptr) * mib;
    if (chunk == 0 || chunk % sizeof(unsigned)) {
        std::fprintf(stderr, "--chunk-mib must be at least 1\n");
        return 2;
    }
    CHECK(cudaFree(nullptr));
    unsigned long long *mismatches = nullptr;
    CHECK(cudaMalloc(&mismatches, sizeof *mismatches));
    CHECK(cudaMemset(mismatches, 0, sizeof *mismatches));
    ready_then_wait_for_go();

    std::vector<unsigned *> chunks;
    std::vector<bool> on_host;
    size_t allocated = 0, host_bytes = 0;
    cudaError_t stopped = cudaSuccess;
    while (allocated + chunk <= total) {
        void *p = nullptr;
        stopped = cudaMalloc(&p, chunk);
        if (stopped != cudaSuccess) {
            cudaGetLastError();
            break;
        }
        cudaPointerAttributes attributes{};
        CHECK(cudaPointerGetAttributes(&attributes, p));
        bool host = attributes.type == cudaMemoryTypeHost;
        chunks.push_back((unsigned *)p);
        on_host.push_back(host);
        allocated += chunk;
        host_bytes += host ? chunk : 0;
    }
    size_t words = chunk / sizeof(unsigned);
    for (size_t c = 0; c < chunks.size(); c++) write_pattern<<<1024, 256>>>(chunks[c], words, (unsigned)c);
    CHECK(cudaGetLastError());
    for (size_t c = 0; c < chunks.size(); c++)
        count_mismatches<<<1024, 256>>>(chunks[c], words, (unsigned)c, mismatches);
    CHECK(cudaGetLastError());
    unsigned long long device_mismatches = 0;
    CHECK(cudaMemcpy(&device_mismatches, mismatches, sizeof device_mismatches, cudaMemcpyDeviceToHost));

    // A second reader: the last MiB of every chunk copied to the host.
    std::vector<unsigned> tail(mib / sizeof(unsigned));
    unsigned long long copied_mismatches = 0;
    size_t tail_start = words - tail.size();
    for (size_t c = 0; c < chunks.size(); c++) {
        CHECK(cudaMemcpy(tail.data(), chunks[c] + tail_start, mib, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < tail.size(); i++)
            copied_mismatches += tail[i] != pattern((unsigned)c, tail_start + i);
    }

    double device_gbps = 0, host_gbps = 0;
    auto device_chunk = std::find(on_host.begin(), on_host.end(), false);
    auto host_chunk = std::find(on_host.begin(), on_host.end(), true);
    if (device_chunk != on_host.end()) device_gbps = bandwidth(chunks[device_chunk - on_host.begin()], words);
    if (host_chunk != on_host.end()) host_gbps = bandwidth(chunks[host_chunk - on_host.begin()], words);

    char json[512];
    std::snprintf(json, sizeof json,
                  "{\"allocated\": %zu, \"host_bytes\": %zu, \"device_mismatches\": %llu, "
                  "\"copied_mismatches\": %llu, \"device_gbps\": %.1f, \"host_gbps\": %.1f, "
                  "\"error\": \"%s\"}",
                  allocated, host_bytes, device_mismatches, copied_mismatches, device_gbps, host_gbps,
                  error_name(stopped).c_str());
    report_and_hold(json);
    for (unsigned *p : chunks) cudaFree(p);
    return 0;
}
