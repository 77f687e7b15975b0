//! The real CUDA driver and NVML underneath the shim.
//!
//! Each function the shim hooks or calls is declared once in [`cuda`] or
//! [`nvml`] with its C signature. The declaration yields:
//! - a slot for the real function's address, filled when the library is
//!   first needed (`dlopen` of `libcuda.so.1` / `libnvidia-ml.so.1`, then the
//!   real `dlsym` on that handle, which finds the driver's own definition and
//!   never ours);
//! - a typed caller, `driver::cuda::cuMemAlloc_v2(...)`;
//! - for hooked functions, an entry mapping the real address to our hook, so
//!   that an address the program obtained from the driver (through `dlsym` or
//!   `cuGetProcAddress`) can be swapped for the hook of exactly that variant.
//!
//! The hot path of a typed caller is one relaxed atomic load and a call.

use std::ffi::{c_char, c_void, CStr};
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::OnceLock;

/// One real function's address, resolved lazily.
pub struct RealFn {
    pub name: &'static CStr,
    address: AtomicPtr<c_void>,
}

impl RealFn {
    pub const fn new(name: &'static CStr) -> Self {
        Self {
            name,
            address: AtomicPtr::new(std::ptr::null_mut()),
        }
    }

    /// The real address, loading `library` on first use; null if the
    /// library or the symbol is missing.
    #[inline(always)]
    pub fn get(&self, library: &Library) -> *mut c_void {
        let address = self.address.load(Ordering::Relaxed);
        if !address.is_null() {
            return address;
        }
        library.ensure_loaded();
        self.address.load(Ordering::Relaxed)
    }
}

/// A hooked function: its real counterpart and our replacement.
pub struct Hook {
    pub real: &'static RealFn,
    pub hook: *const c_void,
}

// SAFETY: `hook` is the address of a function, immutable and valid in every
// thread.
unsafe impl Sync for Hook {}

/// A driver library and the functions the shim takes from it.
pub struct Library {
    sonames: &'static [&'static CStr],
    functions: fn() -> &'static [&'static RealFn],
    hooks: fn() -> &'static [Hook],
    /// Real address -> hook address, sorted by real address.
    redirects: OnceLock<Vec<(usize, usize)>>,
}

thread_local! {
    /// Set while this thread is inside a library load. `dlopen` runs the
    /// library's constructors, which may look driver symbols up again; such
    /// a nested lookup must not wait for the load it is part of.
    static LOADING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl Library {
    /// Loads the library (once) and resolves every declared function.
    pub fn ensure_loaded(&self) {
        self.loaded();
    }

    /// The redirect table, loading the library first if needed; `None` for
    /// a lookup nested inside this thread's own load.
    fn loaded(&self) -> Option<&Vec<(usize, usize)>> {
        if let Some(redirects) = self.redirects.get() {
            return Some(redirects);
        }
        if LOADING.with(|loading| loading.replace(true)) {
            return None;
        }
        let redirects = self.redirects.get_or_init(|| self.load());
        LOADING.with(|loading| loading.set(false));
        Some(redirects)
    }

    fn load(&self) -> Vec<(usize, usize)> {
        let handle = self.sonames.iter().find_map(|soname| {
            // SAFETY: dlopen with a NUL-terminated name; RTLD_NOLOAD is not
            // used because a program that reaches a hook has the library
            // loaded already or wants it loaded.
            let handle =
                unsafe { libc::dlopen(soname.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
            (!handle.is_null()).then_some(handle)
        });
        let Some(handle) = handle else {
            tracing::debug!(library = ?self.sonames.first(), "driver library not found");
            return Vec::new();
        };
        for function in (self.functions)() {
            // SAFETY: real_dlsym is libc's dlsym; the handle is live and the
            // name NUL-terminated.
            let address = unsafe { crate::dlsym::real_dlsym(handle, function.name.as_ptr()) };
            function.address.store(address, Ordering::Relaxed);
        }
        let mut redirects: Vec<(usize, usize)> = (self.hooks)()
            .iter()
            .filter_map(|hook| {
                let real = hook.real.address.load(Ordering::Relaxed);
                (!real.is_null()).then_some((real as usize, hook.hook as usize))
            })
            .collect();
        redirects.sort_unstable();
        redirects
    }

    /// Our hook for a real address, if the address is a hooked function of
    /// this library. Loads the library if needed.
    pub fn redirect(&self, address: *mut c_void) -> Option<*mut c_void> {
        let redirects = self.loaded()?;
        redirects
            .binary_search_by_key(&(address as usize), |(real, _)| *real)
            .ok()
            .map(|index| redirects[index].1 as *mut c_void)
    }

    /// Whether `name` is one of the functions this library hooks.
    pub fn hooks_name(&self, name: &CStr) -> bool {
        (self.hooks)().iter().any(|hook| hook.real.name == name)
    }
}

/// Swaps a real driver address for our hook of the same function, if any.
pub fn redirect_any(address: *mut c_void, name: *const c_char) -> *mut c_void {
    if address.is_null() || name.is_null() {
        return address;
    }
    // SAFETY: the caller passed a NUL-terminated symbol name.
    let name = unsafe { CStr::from_ptr(name) };
    let bytes = name.to_bytes();
    let library = if bytes.starts_with(b"nvml") {
        &nvml::LIBRARY
    } else if bytes.starts_with(b"cu") {
        &cuda::LIBRARY
    } else {
        return address;
    };
    if !library.hooks_name(name) {
        return address;
    }
    library.redirect(address).unwrap_or(address)
}

macro_rules! driver_library {
    (
        library $lib:ident, sonames [$($soname:literal),+], missing $missing:expr;
        hooked { $( fn $hname:ident ( $($harg:ident : $hty:ty),* ) -> $hret:ty; )* }
        used { $( fn $uname:ident ( $($uarg:ident : $uty:ty),* ) -> $uret:ty; )* }
    ) => {
        #[allow(non_snake_case, non_upper_case_globals, clippy::too_many_arguments)]
        pub mod $lib {
            use super::*;
            #[allow(unused_imports)]
            use vgpu_cuda_abi::cuda::*;
            #[allow(unused_imports)]
            use vgpu_cuda_abi::nvml::*;

            /// Real function addresses.
            pub mod real {
                use super::super::RealFn;
                $( pub static $hname: RealFn = RealFn::new(
                    match std::ffi::CStr::from_bytes_with_nul(concat!(stringify!($hname), "\0").as_bytes()) {
                        Ok(name) => name,
                        Err(_) => panic!("symbol name"),
                    }); )*
                $( pub static $uname: RealFn = RealFn::new(
                    match std::ffi::CStr::from_bytes_with_nul(concat!(stringify!($uname), "\0").as_bytes()) {
                        Ok(name) => name,
                        Err(_) => panic!("symbol name"),
                    }); )*
            }

            static FUNCTIONS: &[&RealFn] = &[ $( &real::$hname, )* $( &real::$uname, )* ];
            static HOOKS: &[Hook] = &[ $( Hook {
                real: &real::$hname,
                hook: crate::hooks::$hname as *const c_void,
            }, )* ];

            pub static LIBRARY: Library = Library {
                sonames: &[ $( match std::ffi::CStr::from_bytes_with_nul(concat!($soname, "\0").as_bytes()) {
                    Ok(name) => name,
                    Err(_) => panic!("soname"),
                }, )+ ],
                functions: || FUNCTIONS,
                hooks: || HOOKS,
                redirects: OnceLock::new(),
            };

            $(
                /// Calls the real function.
                ///
                /// # Safety
                /// The arguments must satisfy the C API's contract.
                // The SAFETY comments below are stripped by macro expansion,
                // which is why the lint is silenced here.
                #[allow(clippy::undocumented_unsafe_blocks)]
                #[inline(always)]
                pub unsafe fn $hname($($harg: $hty),*) -> $hret {
                    let address = real::$hname.get(&LIBRARY);
                    if address.is_null() {
                        return $missing;
                    }
                    // SAFETY: the address was resolved for this symbol, whose
                    // C signature is the one declared here.
                    let function: unsafe extern "C" fn($($hty),*) -> $hret =
                        unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($hty),*) -> $hret>(address) };
                    // SAFETY: forwarded under the caller's contract.
                    unsafe { function($($harg),*) }
                }
            )*
            $(
                /// Calls the real function.
                ///
                /// # Safety
                /// The arguments must satisfy the C API's contract.
                // The SAFETY comments below are stripped by macro expansion,
                // which is why the lint is silenced here.
                #[allow(clippy::undocumented_unsafe_blocks)]
                #[inline(always)]
                pub unsafe fn $uname($($uarg: $uty),*) -> $uret {
                    let address = real::$uname.get(&LIBRARY);
                    if address.is_null() {
                        return $missing;
                    }
                    // SAFETY: the address was resolved for this symbol, whose
                    // C signature is the one declared here.
                    let function: unsafe extern "C" fn($($uty),*) -> $uret =
                        unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($uty),*) -> $uret>(address) };
                    // SAFETY: forwarded under the caller's contract.
                    unsafe { function($($uarg),*) }
                }
            )*
        }
    };
}

use vgpu_cuda_abi::cuda::CUDA_ERROR_NOT_SUPPORTED;
use vgpu_cuda_abi::nvml::NVML_ERROR_FUNCTION_NOT_FOUND;

driver_library! {
    library cuda, sonames ["libcuda.so.1", "libcuda.so"], missing CUDA_ERROR_NOT_SUPPORTED;
    hooked {
        fn cuInit(flags: u32) -> CUresult;
        fn cuGetProcAddress(symbol: *const c_char, pfn: *mut *mut c_void, cuda_version: i32, flags: u64) -> CUresult;
        fn cuGetProcAddress_v2(symbol: *const c_char, pfn: *mut *mut c_void, cuda_version: i32, flags: u64, status: *mut CUdriverProcAddressQueryResult) -> CUresult;
        fn cuDeviceTotalMem_v2(bytes: *mut usize, device: CUdevice) -> CUresult;
        fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult;
        fn cuCtxCreate_v2(ctx: *mut CUcontext, flags: u32, device: CUdevice) -> CUresult;
        fn cuCtxCreate_v3(ctx: *mut CUcontext, params: *mut c_void, num_params: i32, flags: u32, device: CUdevice) -> CUresult;
        fn cuCtxCreate_v4(ctx: *mut CUcontext, params: *mut c_void, flags: u32, device: CUdevice) -> CUresult;
        fn cuCtxDestroy_v2(ctx: CUcontext) -> CUresult;
        fn cuDevicePrimaryCtxRetain(ctx: *mut CUcontext, device: CUdevice) -> CUresult;
        fn cuDevicePrimaryCtxRelease(device: CUdevice) -> CUresult;
        fn cuDevicePrimaryCtxRelease_v2(device: CUdevice) -> CUresult;
        fn cuDevicePrimaryCtxReset(device: CUdevice) -> CUresult;
        fn cuDevicePrimaryCtxReset_v2(device: CUdevice) -> CUresult;
        fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytes: usize) -> CUresult;
        fn cuMemAllocPitch_v2(dptr: *mut CUdeviceptr, pitch: *mut usize, width: usize, height: usize, element_bytes: u32) -> CUresult;
        fn cuMemAllocManaged(dptr: *mut CUdeviceptr, bytes: usize, flags: u32) -> CUresult;
        fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult;
        fn cuMemCreate(handle: *mut CUmemGenericAllocationHandle, bytes: usize, prop: *const CUmemAllocationProp, flags: u64) -> CUresult;
        fn cuMemRelease(handle: CUmemGenericAllocationHandle) -> CUresult;
        fn cuMemAllocAsync(dptr: *mut CUdeviceptr, bytes: usize, stream: CUstream) -> CUresult;
        fn cuMemAllocAsync_ptsz(dptr: *mut CUdeviceptr, bytes: usize, stream: CUstream) -> CUresult;
        fn cuMemAllocFromPoolAsync(dptr: *mut CUdeviceptr, bytes: usize, pool: CUmemoryPool, stream: CUstream) -> CUresult;
        fn cuMemAllocFromPoolAsync_ptsz(dptr: *mut CUdeviceptr, bytes: usize, pool: CUmemoryPool, stream: CUstream) -> CUresult;
        fn cuMemFreeAsync(dptr: CUdeviceptr, stream: CUstream) -> CUresult;
        fn cuMemFreeAsync_ptsz(dptr: CUdeviceptr, stream: CUstream) -> CUresult;
        fn cuMemPoolTrimTo(pool: CUmemoryPool, keep: usize) -> CUresult;
        fn cuMemPoolCreate(pool: *mut CUmemoryPool, props: *const CUmemPoolProps) -> CUresult;
        fn cuMemPoolDestroy(pool: CUmemoryPool) -> CUresult;
        fn cuDeviceGetDefaultMemPool(pool: *mut CUmemoryPool, device: CUdevice) -> CUresult;
        fn cuDeviceGetMemPool(pool: *mut CUmemoryPool, device: CUdevice) -> CUresult;
        fn cuArrayCreate_v2(array: *mut CUarray, desc: *const CUDA_ARRAY_DESCRIPTOR) -> CUresult;
        fn cuArray3DCreate_v2(array: *mut CUarray, desc: *const CUDA_ARRAY3D_DESCRIPTOR) -> CUresult;
        fn cuArrayDestroy(array: CUarray) -> CUresult;
        fn cuMipmappedArrayCreate(array: *mut CUmipmappedArray, desc: *const CUDA_ARRAY3D_DESCRIPTOR, levels: u32) -> CUresult;
        fn cuMipmappedArrayDestroy(array: CUmipmappedArray) -> CUresult;
        fn cuModuleLoad(module: *mut CUmodule, path: *const c_char) -> CUresult;
        fn cuModuleLoadData(module: *mut CUmodule, image: *const c_void) -> CUresult;
        fn cuModuleLoadDataEx(module: *mut CUmodule, image: *const c_void, num_options: u32, options: *mut c_void, values: *mut *mut c_void) -> CUresult;
        fn cuModuleLoadFatBinary(module: *mut CUmodule, image: *const c_void) -> CUresult;
        fn cuModuleUnload(module: CUmodule) -> CUresult;
        fn cuLaunchKernel(function: CUfunction, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, shared: u32, stream: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void) -> CUresult;
        fn cuLaunchKernel_ptsz(function: CUfunction, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, shared: u32, stream: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void) -> CUresult;
        fn cuLaunchKernelEx(config: *const CUlaunchConfig, function: CUfunction, params: *mut *mut c_void, extra: *mut *mut c_void) -> CUresult;
        fn cuLaunchKernelEx_ptsz(config: *const CUlaunchConfig, function: CUfunction, params: *mut *mut c_void, extra: *mut *mut c_void) -> CUresult;
        fn cuLaunchCooperativeKernel(function: CUfunction, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, shared: u32, stream: CUstream, params: *mut *mut c_void) -> CUresult;
        fn cuLaunchCooperativeKernel_ptsz(function: CUfunction, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, shared: u32, stream: CUstream, params: *mut *mut c_void) -> CUresult;
        fn cuLaunchCooperativeKernelMultiDevice(launches: *mut CUDA_LAUNCH_PARAMS, count: u32, flags: u32) -> CUresult;
        fn cuGraphLaunch(exec: CUgraphExec, stream: CUstream) -> CUresult;
        fn cuGraphLaunch_ptsz(exec: CUgraphExec, stream: CUstream) -> CUresult;
        fn cuStreamBeginCapture_v2(stream: CUstream, mode: i32) -> CUresult;
        fn cuStreamBeginCapture_v2_ptsz(stream: CUstream, mode: i32) -> CUresult;
        fn cuStreamBeginCaptureToGraph(stream: CUstream, graph: CUgraph, dependencies: *const CUgraphNode, edges: *const c_void, count: usize, mode: i32) -> CUresult;
        fn cuStreamBeginCaptureToGraph_ptsz(stream: CUstream, graph: CUgraph, dependencies: *const CUgraphNode, edges: *const c_void, count: usize, mode: i32) -> CUresult;
        fn cuStreamEndCapture(stream: CUstream, graph: *mut CUgraph) -> CUresult;
        fn cuStreamEndCapture_ptsz(stream: CUstream, graph: *mut CUgraph) -> CUresult;
    }
    used {
        fn cuEventCreate(event: *mut CUevent, flags: u32) -> CUresult;
        fn cuEventRecord(event: CUevent, stream: CUstream) -> CUresult;
        fn cuEventRecord_ptsz(event: CUevent, stream: CUstream) -> CUresult;
        fn cuEventQuery(event: CUevent) -> CUresult;
        fn cuEventElapsedTime(milliseconds: *mut f32, start: CUevent, end: CUevent) -> CUresult;
        fn cuEventDestroy_v2(event: CUevent) -> CUresult;
        fn cuStreamIsCapturing(stream: CUstream, status: *mut CUstreamCaptureStatus) -> CUresult;
        fn cuStreamIsCapturing_ptsz(stream: CUstream, status: *mut CUstreamCaptureStatus) -> CUresult;
        fn cuStreamGetCtx(stream: CUstream, context: *mut CUcontext) -> CUresult;
        fn cuStreamQuery(stream: CUstream) -> CUresult;
        fn cuStreamSynchronize(stream: CUstream) -> CUresult;
        fn cuStreamSynchronize_ptsz(stream: CUstream) -> CUresult;
        fn cuMemHostAlloc(pointer: *mut *mut c_void, bytes: usize, flags: u32) -> CUresult;
        fn cuMemHostGetDevicePointer_v2(dptr: *mut CUdeviceptr, pointer: *mut c_void, flags: u32) -> CUresult;
        fn cuMemFreeHost(pointer: *mut c_void) -> CUresult;
        fn cuStreamQuery_ptsz(stream: CUstream) -> CUresult;
        fn cuCtxGetDevice(device: *mut CUdevice) -> CUresult;
        fn cuCtxGetCurrent(ctx: *mut CUcontext) -> CUresult;
        fn cuDeviceGetCount(count: *mut i32) -> CUresult;
        fn cuDeviceGetUuid(uuid: *mut CUuuid, device: CUdevice) -> CUresult;
        fn cuMemPoolGetAttribute(pool: CUmemoryPool, attribute: CUmemPool_attribute, value: *mut c_void) -> CUresult;
    }
}

driver_library! {
    library nvml, sonames ["libnvidia-ml.so.1", "libnvidia-ml.so"], missing NVML_ERROR_FUNCTION_NOT_FOUND;
    hooked {
        fn nvmlInit_v2() -> nvmlReturn_t;
        fn nvmlInitWithFlags(flags: u32) -> nvmlReturn_t;
        fn nvmlDeviceGetMemoryInfo(device: nvmlDevice_t, memory: *mut nvmlMemory_t) -> nvmlReturn_t;
        fn nvmlDeviceGetMemoryInfo_v2(device: nvmlDevice_t, memory: *mut nvmlMemory_v2_t) -> nvmlReturn_t;
        fn nvmlDeviceGetComputeRunningProcesses(device: nvmlDevice_t, count: *mut u32, infos: *mut nvmlProcessInfo_v1_t) -> nvmlReturn_t;
        fn nvmlDeviceGetComputeRunningProcesses_v2(device: nvmlDevice_t, count: *mut u32, infos: *mut nvmlProcessInfo_t) -> nvmlReturn_t;
        fn nvmlDeviceGetComputeRunningProcesses_v3(device: nvmlDevice_t, count: *mut u32, infos: *mut nvmlProcessInfo_t) -> nvmlReturn_t;
    }
    used {
        fn nvmlDeviceGetUUID(device: nvmlDevice_t, uuid: *mut c_char, length: u32) -> nvmlReturn_t;
        fn nvmlDeviceGetIndex(device: nvmlDevice_t, index: *mut u32) -> nvmlReturn_t;
    }
}
