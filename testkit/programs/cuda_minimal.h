/* The few CUDA driver API and NVML declarations the test programs use.
 * Values and layouts follow cuda.h / nvml.h for x86_64 Linux. */
#ifndef VGPU_TESTS_CUDA_MINIMAL_H
#define VGPU_TESTS_CUDA_MINIMAL_H

#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef void *CUcontext;
typedef void *CUmodule;
typedef void *CUlibrary;
typedef void *CUfunction;
typedef void *CUstream;
typedef void *CUarray;
typedef void *CUmemoryPool;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_FOUND 500

typedef struct {
    int type;
    int requestedHandleTypes;
    struct { int type; int id; } location;
    void *win32HandleMetaData;
    struct { unsigned char compressionType, gpuDirectRDMACapable; unsigned short usage; unsigned char reserved[4]; } allocFlags;
} CUmemAllocationProp;

typedef struct {
    size_t Width;
    size_t Height;
    unsigned int Format;
    unsigned int NumChannels;
} CUDA_ARRAY_DESCRIPTOR;

typedef int nvmlReturn_t;
typedef void *nvmlDevice_t;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;
typedef struct { unsigned int pid; unsigned long long usedGpuMemory; unsigned int gpuInstanceId, computeInstanceId; } nvmlProcessInfo_t;

#endif
