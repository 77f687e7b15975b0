// kernels: device-time loops for compute shares and launch overhead.
//
//   kernels spin  --kernel-us U --seconds S   back-to-back kernels of U us
//   kernels graph --kernel-us U --graph-kernels K --seconds S
//                                             a captured graph of K such kernels
//   kernels empty --launches N --rounds R     launch rate of an empty kernel
//   kernels init                              time to the first runtime call
//
// Kernels spin on the GPU's global nanosecond timer, so their length does
// not depend on clocks. One block per multiprocessor keeps the whole device
// busy. The throughput loops print "ready" after a warm-up, measure from
// "go", and print one JSON line: launches (or graphs) completed per second.
#include <algorithm>
#include <vector>

#include "protocol.cuh"

__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__global__ void spin(unsigned long long ns) {
    unsigned long long start = global_ns();
    while (global_ns() - start < ns) {
    }
}

__global__ void empty() {}

static int multiprocessors() {
    int device = 0, count = 0;
    CHECK(cudaGetDevice(&device));
    CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
    return count;
}

// Runs `step` back to back for `seconds` after "go"; the window closes when
// the device has finished everything queued in it.
template <typename Step>
static void throughput(double seconds, cudaStream_t stream, Step step) {
    for (int i = 0; i < 20; i++) step();  // warm-up: first launches are timed by the shim
    CHECK(cudaStreamSynchronize(stream));
    ready_then_wait_for_go();
    double start = seconds_now();
    double end = start + seconds;
    long long done = 0;
    while (seconds_now() < end) {
        step();
        done++;
    }
    CHECK(cudaStreamSynchronize(stream));
    double elapsed = seconds_now() - start;
    char json[256];
    std::snprintf(json, sizeof json, "{\"steps\": %lld, \"seconds\": %.6f, \"rate\": %.3f}", done,
                  elapsed, done / elapsed);
    report_and_hold(json);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: kernels spin|graph|empty|init [--option value]...\n");
        return 2;
    }
    std::string mode = argv[1];
    // Options follow the mode word.
    argc -= 1;
    argv += 1;
    if (mode == "init") {
        double start = seconds_now();
        CHECK(cudaFree(nullptr));
        double elapsed = seconds_now() - start;
        char json[128];
        std::snprintf(json, sizeof json, "{\"init_seconds\": %.6f}", elapsed);
        std::printf("%s\n", json);
        return 0;
    }
    cudaStream_t stream;
    CHECK(cudaFree(nullptr));
    CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    int blocks = multiprocessors();
    if (mode == "spin") {
        double seconds = number_option(argc, argv, "--seconds", nullptr);
        auto ns = (unsigned long long)(number_option(argc, argv, "--kernel-us", nullptr) * 1000.0);
        throughput(seconds, stream, [&] {
            spin<<<blocks, 32, 0, stream>>>(ns);
            CHECK(cudaGetLastError());
        });
    } else if (mode == "graph") {
        double seconds = number_option(argc, argv, "--seconds", nullptr);
        auto ns = (unsigned long long)(number_option(argc, argv, "--kernel-us", nullptr) * 1000.0);
        int kernels = (int)number_option(argc, argv, "--graph-kernels", nullptr);
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        for (int i = 0; i < kernels; i++) spin<<<blocks, 32, 0, stream>>>(ns);
        CHECK(cudaStreamEndCapture(stream, &graph));
        CHECK(cudaGraphInstantiate(&exec, graph, 0));
        throughput(seconds, stream, [&] { CHECK(cudaGraphLaunch(exec, stream)); });
    } else if (mode == "empty") {
        long long launches = (long long)number_option(argc, argv, "--launches", nullptr);
        int rounds = std::max(1, (int)number_option(argc, argv, "--rounds", "5"));
        for (int i = 0; i < 1000; i++) empty<<<1, 1, 0, stream>>>();
        CHECK(cudaStreamSynchronize(stream));
        ready_then_wait_for_go();
        std::vector<double> rates;
        for (int r = 0; r < rounds; r++) {
            double start = seconds_now();
            for (long long i = 0; i < launches; i++) empty<<<1, 1, 0, stream>>>();
            CHECK(cudaStreamSynchronize(stream));
            rates.push_back(launches / (seconds_now() - start));
        }
        std::sort(rates.begin(), rates.end());
        char json[128];
        std::snprintf(json, sizeof json, "{\"rate\": %.1f}", rates[rates.size() / 2]);
        report_and_hold(json);
    } else {
        std::fprintf(stderr, "unknown mode '%s': spin, graph, empty or init\n", mode.c_str());
        return 2;
    }
    return 0;
}
