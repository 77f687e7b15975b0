// What every CUDA program of the GPU suite shares: the handshake with
// run.py (print "ready", wait for "go", print one JSON line, hold until
// stdin closes) and error checks that name the call that failed.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

// Exits with the CUDA error named, so run.py reports which call failed
// instead of a wrong measurement.
#define CHECK(call)                                                                  \
    do {                                                                             \
        cudaError_t status_ = (call);                                                \
        if (status_ != cudaSuccess) {                                                \
            std::fprintf(stderr, "%s failed: %s (%s)\n", #call,                       \
                         cudaGetErrorName(status_), cudaGetErrorString(status_));    \
            std::exit(3);                                                            \
        }                                                                            \
    } while (0)

inline double seconds_now() {
    using clock = std::chrono::steady_clock;
    return std::chrono::duration<double>(clock::now().time_since_epoch()).count();
}

// Set-up is done: tell run.py, and wait for its word to start measuring, so
// several programs measure the same window and process start-up is never
// inside it.
inline void ready_then_wait_for_go() {
    std::printf("ready\n");
    std::fflush(stdout);
    char line[64];
    if (!std::fgets(line, sizeof line, stdin)) std::exit(4);
}

// The result line, then hold every allocation until run.py has taken its
// own NVML readings and closes our stdin.
inline void report_and_hold(const std::string &json) {
    std::printf("%s\n", json.c_str());
    std::fflush(stdout);
    char line[64];
    while (std::fgets(line, sizeof line, stdin)) {
    }
}

// Arguments are "--name value" pairs; a missing or malformed one is a usage
// error naming it.
inline const char *option(int argc, char **argv, const char *name, const char *fallback) {
    for (int i = 1; i + 1 < argc; i += 2) {
        if (std::strcmp(argv[i], name) == 0) return argv[i + 1];
    }
    if (fallback) return fallback;
    std::fprintf(stderr, "missing option %s\n", name);
    std::exit(2);
}

inline double number_option(int argc, char **argv, const char *name, const char *fallback) {
    const char *text = option(argc, argv, name, fallback);
    char *end = nullptr;
    double value = std::strtod(text, &end);
    if (end == text || *end != '\0' || value < 0) {
        std::fprintf(stderr, "option %s: '%s' is not a non-negative number\n", name, text);
        std::exit(2);
    }
    return value;
}

inline std::string error_name(cudaError_t status) {
    return status == cudaSuccess ? "" : cudaGetErrorName(status);
}
