/* Link-time stand-in for libcuda.so.1, as the CUDA toolkit ships one in
 * stubs/: programs link against it, and at run time the dynamic linker loads
 * the real driver (here the simulated GPU) by its soname. Never run. */
#include "cuda_minimal.h"

#define STUB(name) CUresult name() { return 999; }

STUB(cuInit)
STUB(cuDeviceGet)
STUB(cuDeviceTotalMem_v2)
STUB(cuCtxCreate_v2)
STUB(cuCtxDestroy_v2)
STUB(cuDevicePrimaryCtxRetain)
STUB(cuDevicePrimaryCtxRelease_v2)
STUB(cuMemAlloc_v2)
STUB(cuMemFree_v2)
STUB(cuMemGetInfo_v2)
STUB(cuMemcpyHtoD_v2)
STUB(cuMemcpyDtoH_v2)
STUB(cuMemAllocPitch_v2)
STUB(cuMemAllocManaged)
STUB(cuMemCreate)
STUB(cuMemRelease)
STUB(cuArrayCreate_v2)
STUB(cuArrayDestroy)
STUB(cuModuleLoadData)
STUB(cuModuleUnload)
STUB(cuLibraryLoadData)
STUB(cuLibraryLoadFromFile)
STUB(cuLibraryUnload)
STUB(cuMemAllocAsync)
STUB(cuMemFreeAsync)
STUB(cuStreamSynchronize)
STUB(cuMemPoolTrimTo)
STUB(cuDeviceGetDefaultMemPool)
STUB(cuGetProcAddress_v2)
STUB(cuLaunchKernel)
STUB(cuModuleGetFunction)
