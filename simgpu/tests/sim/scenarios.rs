//! Scenarios: what a child process does with the simulated driver. Each runs
//! in its own process (selected by `SIMGPU_TEST_SCENARIO`) with the
//! environment its parent test chose.

use std::collections::HashSet;
use std::ffi::{c_char, c_int, c_uint, c_void, CString};
use std::ptr::{null, null_mut};

use vgpu_cuda_abi::cuda::*;
use vgpu_cuda_abi::nvml::*;

use crate::common::*;

const MI: usize = 1 << 20;

pub(crate) fn env_u64(name: &str) -> u64 {
    std::env::var(name)
        .unwrap_or_else(|_| panic!("{name} not set"))
        .parse()
        .unwrap_or_else(|_| panic!("{name} is not a number"))
}

pub fn run(name: &str) {
    match name {
        "devices" => devices(),
        "bad_env" => bad_env(),
        "memory_accounting" => memory_accounting(),
        "memcpy" => memcpy(),
        "proc_address" => proc_address(),
        "hold" => hold(),
        "check_shared" => check_shared(),
        "nvml_expect" => nvml_expect(),
        "kernel_race" => kernel_race(),
        "timing" => timing(),
        "nvml_processes" => nvml_process_list(),
        "nvml_events" => nvml_events(),
        "nvml_topology" => nvml_topology(),
        "pool" => pool(),
        "vmm" => vmm(),
        "fork" => fork(),
        "contexts" => contexts(),
        "init_expect" => init_expect(),
        "launch_loop" => launch_loop(),
        "kernel_once" => kernel_once(),
        "graph_capture" => crate::graphs::graph_capture(),
        "graph_explicit" => crate::graphs::graph_explicit(),
        "busy_kernel" => crate::graphs::busy_kernel(),
        "busy_probe" => crate::graphs::busy_probe(),
        "multi_device" => crate::graphs::multi_device(),
        "busy_long" => crate::graphs::busy_long(),
        "wall_timing" => crate::wall::wall_timing(),
        "wall_jitter" => crate::wall::wall_jitter(),
        "wall_cross_device" => crate::wall::wall_cross_device(),
        "wall_saturate" => crate::wall::wall_saturate(),
        "wall_switch_step" => crate::wall::wall_switch_step(),
        "wall_exit_running" => crate::wall::wall_exit_running(),
        other => panic!("unknown scenario {other}"),
    }
}

pub(crate) fn load() -> (Lib, Cu) {
    let lib = Lib::open();
    let cu = Cu::load(&lib);
    (lib, cu)
}

/// cuInit + a context on device 0, current.
pub(crate) fn context(cu: &Cu) -> CUcontext {
    ok(cu.cuInit(0), "cuInit");
    let mut ctx = null_mut();
    ok(cu.cuCtxCreate_v2(&mut ctx, 0, 0), "cuCtxCreate_v2");
    ctx
}

pub(crate) fn alloc(cu: &Cu, bytes: usize) -> CUdeviceptr {
    let mut p = 0;
    ok(cu.cuMemAlloc_v2(&mut p, bytes), "cuMemAlloc_v2");
    p
}

pub(crate) fn load_module(cu: &Cu, text: &str) -> CUmodule {
    let image = CString::new(text).expect("image");
    let mut m = null_mut();
    ok(
        cu.cuModuleLoadData(&mut m, image.as_ptr().cast()),
        "cuModuleLoadData",
    );
    m
}

pub(crate) fn function(cu: &Cu, m: CUmodule, name: &str) -> CUfunction {
    let n = CString::new(name).expect("name");
    let mut f = null_mut();
    ok(
        cu.cuModuleGetFunction(&mut f, m, n.as_ptr()),
        "cuModuleGetFunction",
    );
    f
}

pub(crate) fn launch(cu: &Cu, f: CUfunction, stream: CUstream) -> CUresult {
    cu.cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, stream, null_mut(), null_mut())
}

fn format_uuid(b: &[u8; 16]) -> String {
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

fn nvml_device(nv: &Nvml, index: c_uint) -> nvmlDevice_t {
    let mut d = null_mut();
    assert_eq!(
        nv.nvmlDeviceGetHandleByIndex_v2(index, &mut d),
        NVML_SUCCESS
    );
    d
}

fn nvml_used(nv: &Nvml, d: nvmlDevice_t) -> u64 {
    let mut m = nvmlMemory_t::default();
    assert_eq!(nv.nvmlDeviceGetMemoryInfo(d, &mut m), NVML_SUCCESS);
    assert_eq!(m.free + m.used, m.total);
    m.used
}

fn nvml_processes(nv: &Nvml, d: nvmlDevice_t) -> Vec<nvmlProcessInfo_t> {
    let mut infos = vec![nvmlProcessInfo_t::default(); 64];
    let mut n: c_uint = 64;
    assert_eq!(
        nv.nvmlDeviceGetComputeRunningProcesses_v3(d, &mut n, infos.as_mut_ptr()),
        NVML_SUCCESS
    );
    infos.truncate(n as usize);
    infos
}

/// Device count, sizes, attributes, names, UUIDs and PCI ids from the env,
/// through CUDA and NVML alike.
fn devices() {
    let (lib, cu) = load();
    let nv = Nvml::load(&lib);
    let mut n = 0;
    assert_eq!(cu.cuDeviceGetCount(&mut n), CUDA_ERROR_NOT_INITIALIZED);
    let mut version = 0;
    ok(cu.cuDriverGetVersion(&mut version), "cuDriverGetVersion");
    assert_eq!(version, 12040);
    ok(cu.cuInit(0), "cuInit");
    assert_eq!(cu.cuInit(1), CUDA_ERROR_INVALID_VALUE);
    ok(cu.cuDeviceGetCount(&mut n), "cuDeviceGetCount");
    assert_eq!(n, 3);
    let mut dev = 0;
    assert_eq!(cu.cuDeviceGet(&mut dev, 3), CUDA_ERROR_INVALID_DEVICE);
    let totals = [8usize << 30, 4 << 30, 8 << 30];
    let mut uuids = Vec::new();
    for d in 0..3 {
        ok(cu.cuDeviceGet(&mut dev, d), "cuDeviceGet");
        assert_eq!(dev, d);
        let mut total = 0;
        ok(cu.cuDeviceTotalMem_v2(&mut total, d), "cuDeviceTotalMem_v2");
        assert_eq!(total, totals[d as usize]);
        let attr = |a: c_int| {
            let mut v = -1;
            ok(
                cu.cuDeviceGetAttribute(&mut v, a, d),
                "cuDeviceGetAttribute",
            );
            v
        };
        assert_eq!(attr(16), 66, "SM count");
        assert_eq!((attr(75), attr(76)), (9, 0), "compute capability");
        assert_eq!(attr(10), 32, "warp size");
        assert_eq!(attr(1), 1024, "max threads per block");
        assert_eq!(attr(51), 32, "texture pitch alignment");
        assert_eq!(attr(41), 1, "unified addressing");
        assert_eq!(attr(83), 1, "managed memory");
        assert_eq!(attr(102), 1, "VMM");
        assert_eq!(attr(115), 1, "memory pools");
        assert_eq!(attr(33), d + 1, "PCI bus");
        assert_eq!(attr(50), 0, "PCI domain");
        assert_eq!(attr(140), 0, "unknown attribute reads 0");
        let mut v = 0;
        assert_eq!(
            cu.cuDeviceGetAttribute(&mut v, 9999, d),
            CUDA_ERROR_INVALID_VALUE
        );
        let mut name = [0 as c_char; 64];
        ok(
            cu.cuDeviceGetName(name.as_mut_ptr(), 64, d),
            "cuDeviceGetName",
        );
        assert_eq!(buf_str(&name), "Test GPU");
        let mut u = CUuuid::default();
        ok(cu.cuDeviceGetUuid_v2(&mut u, d), "cuDeviceGetUuid_v2");
        uuids.push(u.bytes);
        let mut bus = [0 as c_char; 32];
        ok(
            cu.cuDeviceGetPCIBusId(bus.as_mut_ptr(), 32, d),
            "cuDeviceGetPCIBusId",
        );
        assert_eq!(buf_str(&bus), format!("0000:{:02x}:00.0", d + 1));
        let mut back = -1;
        ok(
            cu.cuDeviceGetByPCIBusId(&mut back, bus.as_ptr()),
            "cuDeviceGetByPCIBusId",
        );
        assert_eq!(back, d);
    }
    assert_eq!(
        uuids.iter().collect::<HashSet<_>>().len(),
        3,
        "UUIDs differ"
    );

    let mut s: *const c_char = null();
    ok(
        cu.cuGetErrorName(CUDA_ERROR_OUT_OF_MEMORY, &mut s),
        "cuGetErrorName",
    );
    assert_eq!(static_str(s), "CUDA_ERROR_OUT_OF_MEMORY");
    ok(
        cu.cuGetErrorString(CUDA_ERROR_OUT_OF_MEMORY, &mut s),
        "cuGetErrorString",
    );
    assert_eq!(static_str(s), "out of memory");
    assert_eq!(cu.cuGetErrorName(123_456, &mut s), CUDA_ERROR_INVALID_VALUE);

    assert_eq!(nv.nvmlInit_v2(), NVML_SUCCESS);
    let mut count = 0;
    assert_eq!(nv.nvmlDeviceGetCount_v2(&mut count), NVML_SUCCESS);
    assert_eq!(count, 3);
    let mut cuda_version = 0;
    assert_eq!(
        nv.nvmlSystemGetCudaDriverVersion_v2(&mut cuda_version),
        NVML_SUCCESS
    );
    assert_eq!(cuda_version, 12040);
    let mut text = [0 as c_char; 80];
    assert_eq!(
        nv.nvmlSystemGetDriverVersion(text.as_mut_ptr(), 80),
        NVML_SUCCESS
    );
    assert!(!buf_str(&text).is_empty());
    for i in 0..3u32 {
        let d = nvml_device(&nv, i);
        let mut index = 99;
        assert_eq!(nv.nvmlDeviceGetIndex(d, &mut index), NVML_SUCCESS);
        assert_eq!(index, i);
        assert_eq!(nv.nvmlDeviceGetName(d, text.as_mut_ptr(), 80), NVML_SUCCESS);
        assert_eq!(buf_str(&text), "Test GPU");
        assert_eq!(
            nv.nvmlDeviceGetName(d, text.as_mut_ptr(), 4),
            NVML_ERROR_INSUFFICIENT_SIZE
        );
        assert_eq!(nv.nvmlDeviceGetUUID(d, text.as_mut_ptr(), 80), NVML_SUCCESS);
        let uuid = buf_str(&text);
        assert_eq!(
            uuid,
            format_uuid(&uuids[i as usize]),
            "NVML and CUDA agree on the UUID"
        );
        let mut by_uuid = null_mut();
        assert_eq!(
            nv.nvmlDeviceGetHandleByUUID(text.as_ptr(), &mut by_uuid),
            NVML_SUCCESS
        );
        assert_eq!(by_uuid, d, "handles are stable");
        let mut m = nvmlMemory_t::default();
        assert_eq!(nv.nvmlDeviceGetMemoryInfo(d, &mut m), NVML_SUCCESS);
        assert_eq!(m.total, totals[i as usize] as u64);
        let mut pci = std::mem::MaybeUninit::<nvmlPciInfo_t>::zeroed();
        assert_eq!(
            nv.nvmlDeviceGetPciInfo_v3(d, pci.as_mut_ptr()),
            NVML_SUCCESS
        );
        // SAFETY: filled by the call above (and zero-initialised anyway).
        let pci = unsafe { pci.assume_init() };
        assert_eq!(pci.bus, i + 1);
        let bus_id = CString::new(format!("00000000:{:02X}:00.0", i + 1)).expect("bus id");
        let mut by_bus = null_mut();
        assert_eq!(
            nv.nvmlDeviceGetHandleByPciBusId_v2(bus_id.as_ptr(), &mut by_bus),
            NVML_SUCCESS
        );
        assert_eq!(by_bus, d);
        let (mut major, mut minor) = (0, 0);
        assert_eq!(
            nv.nvmlDeviceGetCudaComputeCapability(d, &mut major, &mut minor),
            NVML_SUCCESS
        );
        assert_eq!((major, minor), (9, 0));
    }
    let mut d = null_mut();
    assert_eq!(
        nv.nvmlDeviceGetHandleByIndex_v2(3, &mut d),
        NVML_ERROR_INVALID_ARGUMENT
    );

    // Installed as libcuda.so.1 and libnvidia-ml.so.1: one library, one state.
    let dir = std::env::temp_dir().join(format!("simgpu-links-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    for name in ["libcuda.so.1", "libnvidia-ml.so.1"] {
        std::os::unix::fs::symlink(lib_path(), dir.join(name)).expect("symlink");
    }
    let cuda = Lib::open_path(&dir.join("libcuda.so.1"));
    let nvml = Lib::open_path(&dir.join("libnvidia-ml.so.1"));
    assert_eq!(cuda.addr("cuInit"), lib.addr("cuInit"));
    assert_eq!(nvml.addr("nvmlInit_v2"), lib.addr("nvmlInit_v2"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A bad value: one stderr line, cuInit and nvmlInit fail.
fn bad_env() {
    let (lib, cu) = load();
    let nv = Nvml::load(&lib);
    assert_eq!(cu.cuInit(0), CUDA_ERROR_INVALID_VALUE);
    assert_eq!(cu.cuInit(0), CUDA_ERROR_INVALID_VALUE);
    let mut n = 0;
    assert_eq!(cu.cuDeviceGetCount(&mut n), CUDA_ERROR_NOT_INITIALIZED);
    assert_eq!(nv.nvmlInit_v2(), NVML_ERROR_UNKNOWN);
}

/// Memory caps, OOM, what counts as device memory, and context teardown.
fn memory_accounting() {
    let (_lib, cu) = load();
    ok(cu.cuInit(0), "cuInit");
    let mut p = 0;
    assert_eq!(cu.cuMemAlloc_v2(&mut p, 1024), CUDA_ERROR_INVALID_CONTEXT);
    let mut ctx = null_mut();
    ok(cu.cuCtxCreate_v2(&mut ctx, 0, 0), "cuCtxCreate_v2");
    let used = || cu.simgpu_device_used_bytes(0) as usize;
    assert_eq!(used(), 16 * MI, "a context costs SIMGPU_CONTEXT_BYTES");
    let (mut free, mut total) = (0, 0);
    ok(cu.cuMemGetInfo_v2(&mut free, &mut total), "cuMemGetInfo_v2");
    assert_eq!((free, total), (1024 * MI - 16 * MI, 1024 * MI));

    let a = alloc(&cu, 512 * MI);
    assert_eq!(a % 256, 0);
    assert_eq!(used(), 528 * MI);
    assert_eq!(cu.cuMemAlloc_v2(&mut p, 600 * MI), CUDA_ERROR_OUT_OF_MEMORY);
    assert_eq!(used(), 528 * MI, "a failed allocation charges nothing");
    assert_eq!(cu.cuMemAlloc_v2(&mut p, 0), CUDA_ERROR_INVALID_VALUE);
    ok(cu.cuMemFree_v2(a), "cuMemFree_v2");
    assert_eq!(cu.cuMemFree_v2(a), CUDA_ERROR_INVALID_VALUE, "double free");
    assert_eq!(used(), 16 * MI);
    let b = alloc(&cu, 600 * MI);
    ok(cu.cuMemFree_v2(b), "cuMemFree_v2");

    let mut pitch = 0;
    ok(
        cu.cuMemAllocPitch_v2(&mut p, &mut pitch, 1000, 10, 4),
        "cuMemAllocPitch_v2",
    );
    assert_eq!(pitch, 1024);
    assert_eq!(used(), 16 * MI + 10 * 1024);
    ok(cu.cuMemFree_v2(p), "free pitch");
    assert_eq!(
        cu.cuMemAllocPitch_v2(&mut p, &mut pitch, 1000, 10, 3),
        CUDA_ERROR_INVALID_VALUE
    );

    ok(
        cu.cuMemAllocManaged(&mut p, MI, CU_MEM_ATTACH_GLOBAL),
        "cuMemAllocManaged",
    );
    assert_eq!(used(), 17 * MI, "managed memory counts");
    ok(cu.cuMemFree_v2(p), "free managed");

    let mut host = null_mut();
    ok(
        cu.cuMemAllocHost_v2(&mut host, 64 * MI),
        "cuMemAllocHost_v2",
    );
    assert_eq!(used(), 16 * MI, "pinned host memory does not count");
    ok(cu.cuMemFreeHost(host), "cuMemFreeHost");
    assert_eq!(cu.cuMemFreeHost(host), CUDA_ERROR_INVALID_VALUE);

    let mut desc = CUDA_ARRAY3D_DESCRIPTOR {
        width: 64,
        height: 64,
        depth: 0,
        format: CU_AD_FORMAT_FLOAT,
        num_channels: 4,
        flags: 0,
    };
    let mut array = null_mut();
    ok(
        cu.cuArray3DCreate_v2(&mut array, &desc),
        "cuArray3DCreate_v2",
    );
    assert_eq!(used(), 16 * MI + 64 * 64 * 16);
    ok(cu.cuArrayDestroy(array), "cuArrayDestroy");
    assert_eq!(used(), 16 * MI);
    desc.format = 0x99;
    assert_eq!(
        cu.cuArray3DCreate_v2(&mut array, &desc),
        CUDA_ERROR_INVALID_VALUE
    );
    let mip_desc = CUDA_ARRAY3D_DESCRIPTOR {
        width: 8,
        height: 4,
        depth: 0,
        format: CU_AD_FORMAT_UNSIGNED_INT8,
        num_channels: 1,
        flags: 0,
    };
    let mut mip = null_mut();
    ok(
        cu.cuMipmappedArrayCreate(&mut mip, &mip_desc, 4),
        "cuMipmappedArrayCreate",
    );
    assert_eq!(used(), 16 * MI + 32 + 8 + 2 + 1);
    ok(cu.cuMipmappedArrayDestroy(mip), "cuMipmappedArrayDestroy");

    let text = "SIMGPU-MODULE\nk 1ms\n";
    let m = load_module(&cu, text);
    assert_eq!(
        used(),
        16 * MI + text.len(),
        "a module costs its image size"
    );
    ok(cu.cuModuleUnload(m), "cuModuleUnload");
    assert_eq!(used(), 16 * MI);
    let mut bad = null_mut();
    let elf = b"\x7fELF\x02\x01\x01\0";
    assert_eq!(
        cu.cuModuleLoadData(&mut bad, elf.as_ptr().cast()),
        CUDA_ERROR_INVALID_IMAGE
    );
    let file = std::env::temp_dir().join(format!("simgpu-module-{}.txt", std::process::id()));
    std::fs::write(&file, text).expect("write module");
    let path = CString::new(file.to_string_lossy().as_bytes()).expect("path");
    ok(cu.cuModuleLoad(&mut bad, path.as_ptr()), "cuModuleLoad");
    let _ = std::fs::remove_file(&file);
    assert_eq!(
        cu.cuModuleLoad(&mut bad, path.as_ptr()),
        CUDA_ERROR_FILE_NOT_FOUND
    );

    // Destroying the context frees everything it owns.
    alloc(&cu, 100 * MI);
    ok(
        cu.cuMemAllocManaged(&mut p, MI, CU_MEM_ATTACH_GLOBAL),
        "cuMemAllocManaged",
    );
    assert!(used() > 117 * MI);
    ok(cu.cuCtxDestroy_v2(ctx), "cuCtxDestroy_v2");
    assert_eq!(used(), 0);
}

/// Copies and fills return real bytes; bounds are checked.
fn memcpy() {
    let (_lib, cu) = load();
    let ctx = context(&cu);
    let src: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
    let d = alloc(&cu, 4096);
    let d2 = alloc(&cu, 4096);
    ok(cu.cuMemcpyHtoD_v2(d, src.as_ptr().cast(), 4096), "HtoD");
    ok(cu.cuMemcpyDtoD_v2(d2, d, 4096), "DtoD");
    let mut back = vec![0u8; 4096];
    ok(
        cu.cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), d2, 4096),
        "DtoH",
    );
    assert_eq!(back, src);
    ok(
        cu.cuMemcpyHtoD_v2_ptds(d2, src[1..].as_ptr().cast(), 100),
        "HtoD ptds",
    );
    ok(
        cu.cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), d2, 100),
        "DtoH",
    );
    assert_eq!(&back[..100], &src[1..101]);

    ok(cu.cuMemsetD8_v2(d, 0xab, 100), "cuMemsetD8_v2");
    ok(cu.cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), d, 101), "DtoH");
    assert!(back[..100].iter().all(|&b| b == 0xab));
    assert_eq!(back[100], src[100]);
    assert_eq!(
        cu.cuMemsetD32_v2(d + 1, 7, 4),
        CUDA_ERROR_INVALID_VALUE,
        "misaligned D32"
    );
    ok(cu.cuMemsetD32_v2(d + 8, 0xdead_beef, 2), "cuMemsetD32_v2");
    ok(
        cu.cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), d + 8, 8),
        "DtoH",
    );
    assert_eq!(
        &back[..8],
        &[0xef, 0xbe, 0xad, 0xde, 0xef, 0xbe, 0xad, 0xde]
    );

    assert_eq!(
        cu.cuMemcpyHtoD_v2(d, src.as_ptr().cast(), 4097),
        CUDA_ERROR_INVALID_VALUE
    );
    assert_eq!(
        cu.cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), d + 4000, 200),
        CUDA_ERROR_INVALID_VALUE
    );
    assert_eq!(cu.cuMemsetD8_v2(d + 4090, 0, 7), CUDA_ERROR_INVALID_VALUE);
    ok(cu.cuMemFree_v2(d2), "free");
    assert_eq!(
        cu.cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), d2, 16),
        CUDA_ERROR_INVALID_VALUE,
        "use after free"
    );

    // Unified copies: host and device addresses mix.
    ok(cu.cuMemcpyHtoD_v2(d, src.as_ptr().cast(), 64), "HtoD");
    let mut host = [0u8; 64];
    ok(cu.cuMemcpy(host.as_mut_ptr() as u64, d, 64), "cuMemcpy");
    assert_eq!(&host[..], &src[..64]);
    let mut pinned = null_mut();
    ok(cu.cuMemAllocHost_v2(&mut pinned, 4096), "cuMemAllocHost_v2");
    ok(cu.cuMemcpy(pinned as u64, d, 64), "cuMemcpy to pinned");
    // SAFETY: pinned holds 4096 bytes, 64 of which were just written.
    let pinned_bytes = unsafe { std::slice::from_raw_parts(pinned as *const u8, 64) };
    assert_eq!(pinned_bytes, &src[..64]);

    let (mut base, mut size) = (0, 0);
    ok(
        cu.cuMemGetAddressRange_v2(&mut base, &mut size, d + 100),
        "cuMemGetAddressRange_v2",
    );
    assert_eq!((base, size), (d, 4096));
    let attr_u64 = |a: CUpointer_attribute, p: CUdeviceptr| {
        let mut v = 0u64;
        ok(
            cu.cuPointerGetAttribute((&mut v as *mut u64).cast(), a, p),
            "cuPointerGetAttribute",
        );
        v
    };
    assert_eq!(
        attr_u64(CU_POINTER_ATTRIBUTE_MEMORY_TYPE, d + 5),
        u64::from(CU_MEMORYTYPE_DEVICE)
    );
    assert_eq!(
        attr_u64(CU_POINTER_ATTRIBUTE_MEMORY_TYPE, pinned as u64),
        u64::from(CU_MEMORYTYPE_HOST)
    );
    assert_eq!(attr_u64(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, d), 0);
    assert_eq!(attr_u64(CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, d + 5), d);
    assert_eq!(attr_u64(CU_POINTER_ATTRIBUTE_RANGE_SIZE, d + 5), 4096);
    assert_eq!(attr_u64(CU_POINTER_ATTRIBUTE_DEVICE_POINTER, d + 5), d + 5);
    assert_eq!(attr_u64(CU_POINTER_ATTRIBUTE_CONTEXT, d), ctx as u64);
    assert_eq!(attr_u64(CU_POINTER_ATTRIBUTE_IS_MANAGED, d), 0);
    let mut managed = 0;
    ok(
        cu.cuMemAllocManaged(&mut managed, 4096, CU_MEM_ATTACH_GLOBAL),
        "managed",
    );
    assert_eq!(attr_u64(CU_POINTER_ATTRIBUTE_IS_MANAGED, managed), 1);
    let mut v = 0u64;
    assert_eq!(
        cu.cuPointerGetAttribute(
            (&mut v as *mut u64).cast(),
            CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            0x1000
        ),
        CUDA_ERROR_INVALID_VALUE
    );

    // Async copies on a created stream.
    let mut stream = null_mut();
    ok(cu.cuStreamCreate(&mut stream, 0), "cuStreamCreate");
    ok(
        cu.cuMemsetD32Async(d, 0x0102_0304, 4, stream),
        "cuMemsetD32Async",
    );
    ok(
        cu.cuMemcpyDtoHAsync_v2(host.as_mut_ptr().cast(), d, 16, stream),
        "DtoHAsync",
    );
    ok(cu.cuStreamSynchronize(stream), "cuStreamSynchronize");
    assert_eq!(&host[..4], &[4, 3, 2, 1]);
    assert_eq!(
        cu.cuMemcpyDtoHAsync_v2(host.as_mut_ptr().cast(), d, 16, 0xdead_0000 as CUstream),
        CUDA_ERROR_INVALID_HANDLE
    );
    ok(cu.cuStreamDestroy_v2(stream), "cuStreamDestroy_v2");
    ok(cu.cuMemFreeHost(pinned), "cuMemFreeHost");
}

/// Base name → exported symbol with the cudaVersion/flags rules.
fn proc_address() {
    let (lib, cu) = load();
    let gpa = |name: &str, version: c_int, flags: u64| {
        let sym = CString::new(name).expect("name");
        let mut pfn: *mut c_void = std::ptr::dangling_mut();
        let mut status: CUdriverProcAddressQueryResult = 99;
        let r = cu.cuGetProcAddress_v2(sym.as_ptr(), &mut pfn, version, flags, &mut status);
        (r, pfn as usize, status)
    };
    let hit = |name: &str, version: c_int, flags: u64, want: &str| {
        let (r, p, st) = gpa(name, version, flags);
        assert_eq!(
            (r, st),
            (CUDA_SUCCESS, CU_GET_PROC_ADDRESS_SUCCESS),
            "{name}@{version}"
        );
        assert_eq!(
            p,
            lib.addr(want),
            "{name}@{version} flags {flags} should be {want}"
        );
    };
    hit("cuMemAlloc", 12080, 0, "cuMemAlloc_v2");
    hit("cuMemAlloc", 3020, 0, "cuMemAlloc_v2");
    hit("cuCtxCreate", 11030, 0, "cuCtxCreate_v2");
    hit("cuCtxCreate", 11040, 0, "cuCtxCreate_v3");
    hit("cuCtxCreate", 12000, 0, "cuCtxCreate_v3");
    hit("cuCtxCreate", 12050, 0, "cuCtxCreate_v4");
    hit("cuCtxCreate", 12080, 0, "cuCtxCreate_v4");
    hit("cuGetProcAddress", 11030, 0, "cuGetProcAddress");
    hit("cuGetProcAddress", 12000, 0, "cuGetProcAddress_v2");
    hit("cuDeviceGetUuid", 11000, 0, "cuDeviceGetUuid");
    hit("cuDeviceGetUuid", 11040, 0, "cuDeviceGetUuid_v2");
    hit(
        "cuDevicePrimaryCtxRelease",
        10020,
        0,
        "cuDevicePrimaryCtxRelease",
    );
    hit(
        "cuDevicePrimaryCtxRelease",
        11000,
        0,
        "cuDevicePrimaryCtxRelease_v2",
    );
    hit("cuDeviceTotalMem", 12080, 0, "cuDeviceTotalMem_v2");
    hit("cuMemGetInfo", 12080, 0, "cuMemGetInfo_v2");
    hit("cuMemcpyHtoD", 12080, 0, "cuMemcpyHtoD_v2");
    hit(
        "cuMemcpyHtoD",
        12080,
        CU_GET_PROC_ADDRESS_LEGACY_STREAM,
        "cuMemcpyHtoD_v2",
    );
    hit(
        "cuMemcpyHtoD",
        12080,
        CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM,
        "cuMemcpyHtoD_v2_ptds",
    );
    hit("cuMemcpyHtoDAsync", 12080, 2, "cuMemcpyHtoDAsync_v2_ptsz");
    hit("cuStreamSynchronize", 12080, 2, "cuStreamSynchronize_ptsz");
    hit("cuStreamSynchronize", 12080, 0, "cuStreamSynchronize");
    hit("cuLaunchKernel", 12080, 2, "cuLaunchKernel_ptsz");
    hit("cuMemAllocAsync", 11020, 2, "cuMemAllocAsync_ptsz");
    hit("cuMemAlloc", 12080, 2, "cuMemAlloc_v2");
    // Per-thread and legacy variants are distinct functions.
    assert_ne!(
        lib.addr("cuMemcpyHtoD_v2"),
        lib.addr("cuMemcpyHtoD_v2_ptds")
    );
    assert_ne!(
        lib.addr("cuDevicePrimaryCtxRelease"),
        lib.addr("cuDevicePrimaryCtxRelease_v2")
    );

    let (r, p, st) = gpa("cuMemAllocAsync", 11010, 0);
    assert_eq!(
        (r, p, st),
        (
            CUDA_ERROR_NOT_FOUND,
            0,
            CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT
        )
    );
    let (r, p, st) = gpa("cuCtxCreate", 3000, 0);
    assert_eq!(
        (r, p, st),
        (
            CUDA_ERROR_NOT_FOUND,
            0,
            CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT
        )
    );
    let (r, p, st) = gpa("cuNoSuchFunction", 12080, 0);
    assert_eq!(
        (r, p, st),
        (
            CUDA_ERROR_NOT_FOUND,
            0,
            CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND
        )
    );
    let (r, p, st) = gpa("cuMemAlloc_v2", 12080, 0);
    assert_eq!(
        (r, p, st),
        (
            CUDA_ERROR_NOT_FOUND,
            0,
            CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND
        )
    );
    assert_eq!(gpa("cuMemAlloc", 12080, 4).0, CUDA_ERROR_INVALID_VALUE);
    // The status pointer is optional, and the 11.3 entry point works.
    let sym = CString::new("cuInit").expect("name");
    let mut pfn = null_mut();
    ok(
        cu.cuGetProcAddress_v2(sym.as_ptr(), &mut pfn, 12080, 0, null_mut()),
        "no status",
    );
    assert_eq!(pfn as usize, lib.addr("cuInit"));
    pfn = null_mut();
    ok(
        cu.cuGetProcAddress(sym.as_ptr(), &mut pfn, 11030, 0),
        "cuGetProcAddress",
    );
    assert_eq!(pfn as usize, lib.addr("cuInit"));

    // Every exported driver function is reachable through the table.
    let nm = std::process::Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(lib_path())
        .output();
    let Ok(nm) = nm else {
        eprintln!("nm not available: skipping the export coverage check");
        return;
    };
    let exported: Vec<String> = String::from_utf8_lossy(&nm.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        .filter(|n| n.starts_with("cu"))
        .map(str::to_string)
        .collect();
    assert!(
        exported.len() > 100,
        "nm found {} cu* symbols",
        exported.len()
    );
    let base = |name: &str| {
        let mut b = name.to_string();
        loop {
            let before = b.clone();
            for suffix in ["_ptds", "_ptsz"] {
                if let Some(s) = b.strip_suffix(suffix) {
                    b = s.to_string();
                }
            }
            if let Some(pos) = b.rfind("_v") {
                if b[pos + 2..].chars().all(|c| c.is_ascii_digit()) && pos + 2 < b.len() {
                    b.truncate(pos);
                }
            }
            if b == before {
                return b;
            }
        }
    };
    let mut reachable = HashSet::new();
    for name in &exported {
        let b = base(name);
        for version in (2000..=13000).step_by(10) {
            for flags in [0, 2] {
                let (r, p, _) = gpa(&b, version, flags);
                if r == CUDA_SUCCESS {
                    reachable.insert(p);
                }
            }
        }
    }
    for name in &exported {
        assert!(
            reachable.contains(&lib.addr(name)),
            "{name} is not reachable through cuGetProcAddress"
        );
    }
    report("EXPORTS", exported.len());
}

/// Allocates HOLD_BYTES and keeps them until the parent says so.
fn hold() {
    let (_lib, cu) = load();
    let ctx = context(&cu);
    let p = alloc(&cu, env_u64("HOLD_BYTES") as usize);
    report("READY", std::process::id());
    wait_parent();
    ok(cu.cuMemFree_v2(p), "free");
    ok(cu.cuCtxDestroy_v2(ctx), "destroy");
}

/// Another process's memory is visible through CUDA and NVML.
fn check_shared() {
    let (lib, cu) = load();
    let nv = Nvml::load(&lib);
    context(&cu);
    let expect = env_u64("EXPECT_USED") as usize;
    let holder = env_u64("HOLDER_PID") as u32;
    let (mut free, mut total) = (0, 0);
    ok(cu.cuMemGetInfo_v2(&mut free, &mut total), "cuMemGetInfo_v2");
    assert_eq!(free, total - expect, "free memory counts every process");
    assert_eq!(nv.nvmlInit_v2(), NVML_SUCCESS);
    let d = nvml_device(&nv, 0);
    assert_eq!(nvml_used(&nv, d), expect as u64);
    let procs = nvml_processes(&nv, d);
    assert!(
        procs
            .iter()
            .any(|p| p.pid == holder && p.used_gpu_memory == expect as u64),
        "holder listed: {procs:?}"
    );
    assert!(
        procs.iter().any(|p| p.pid == std::process::id()),
        "we have a context"
    );
    let mut p = 0;
    assert_eq!(cu.cuMemAlloc_v2(&mut p, free + 1), CUDA_ERROR_OUT_OF_MEMORY);
    let all = alloc(&cu, free);
    assert_eq!(cu.simgpu_device_used_bytes(0), total as u64);
    ok(cu.cuMemFree_v2(all), "free");
}

/// NVML only (no cuInit): expected used bytes and process presence.
fn nvml_expect() {
    let lib = Lib::open();
    let nv = Nvml::load(&lib);
    assert_eq!(nv.nvmlInit_v2(), NVML_SUCCESS);
    let d = nvml_device(&nv, 0);
    assert_eq!(nvml_used(&nv, d), env_u64("EXPECT_USED"));
    let pid = env_u64("EXPECT_PID") as u32;
    let present = env_u64("EXPECT_PRESENT") == 1;
    let procs = nvml_processes(&nv, d);
    assert_eq!(procs.iter().any(|p| p.pid == pid), present, "{procs:?}");
    assert_eq!(nv.nvmlShutdown(), NVML_SUCCESS);
}

/// Launches one kernel when the parent says go; reports its timing.
fn kernel_race() {
    let (_lib, cu) = load();
    context(&cu);
    let m = load_module(&cu, "SIMGPU-MODULE\nbusy 20ms\n");
    let f = function(&cu, m, "busy");
    report("READY", std::process::id());
    wait_parent();
    let t0 = mono_ns();
    ok(launch(&cu, f, null_mut()), "cuLaunchKernel");
    let returned = mono_ns();
    ok(cu.cuCtxSynchronize(), "cuCtxSynchronize");
    let t1 = mono_ns();
    report("TIMES", format!("{t0} {returned} {t1}"));
}

/// Events, stream queries, waits, queue depth, and NVML utilization.
fn timing() {
    let (lib, cu) = load();
    let nv = Nvml::load(&lib);
    context(&cu);
    let m = load_module(&cu, "SIMGPU-MODULE\nk30 30ms\nk1 1ms\nk0 0ns\nk200 200ms\n");
    let (k30, k1, k0, k200) = (
        function(&cu, m, "k30"),
        function(&cu, m, "k1"),
        function(&cu, m, "k0"),
        function(&cu, m, "k200"),
    );
    let mut s1 = null_mut();
    let mut s2 = null_mut();
    ok(cu.cuStreamCreate(&mut s1, 0), "stream");
    ok(cu.cuStreamCreate(&mut s2, 1), "stream");
    let event = || {
        let mut e = null_mut();
        ok(cu.cuEventCreate(&mut e, 0), "cuEventCreate");
        e
    };
    let (e0, e1, e2) = (event(), event(), event());
    let mut ms = 0f32;

    let recording = mono_ns();
    ok(cu.cuEventRecord(e0, s1), "record");
    let before = mono_ns();
    ok(launch(&cu, k30, s1), "launch");
    let launched = mono_ns();
    assert!(launched - before < 25_000_000, "launch is asynchronous");
    // The device is idle between the record and the kernel for as long as
    // this host took between the two calls (beyond the launch overhead,
    // nothing on an idle host; on a busy one, the time it was descheduled),
    // as on a GPU.
    let host_ms = (launched - recording) as f32 / 1e6;
    ok(cu.cuEventRecord(e1, s1), "record");
    assert_eq!(cu.cuEventQuery(e1), CUDA_ERROR_NOT_READY);
    assert_eq!(cu.cuStreamQuery(s1), CUDA_ERROR_NOT_READY);
    assert_eq!(cu.cuEventElapsedTime(&mut ms, e0, e1), CUDA_ERROR_NOT_READY);
    ok(cu.cuEventSynchronize(e1), "cuEventSynchronize");
    assert!(
        mono_ns() - before >= 30_000_000,
        "synchronize waits for the kernel"
    );
    ok(cu.cuEventQuery(e1), "cuEventQuery");
    ok(cu.cuStreamQuery(s1), "cuStreamQuery");
    ok(cu.cuEventElapsedTime(&mut ms, e0, e1), "cuEventElapsedTime");
    assert!(
        (29.5..=31.5 + host_ms).contains(&ms),
        "elapsed {ms} ms (the host took {host_ms} ms to record and launch)"
    );

    // A stream waiting on an event starts after it.
    ok(cu.cuEventRecord(e0, s1), "record");
    ok(launch(&cu, k30, s1), "launch");
    ok(cu.cuEventRecord(e1, s1), "record");
    ok(cu.cuStreamWaitEvent(s2, e1, 0), "cuStreamWaitEvent");
    ok(launch(&cu, k1, s2), "launch");
    ok(cu.cuEventRecord(e2, s2), "record");
    ok(cu.cuEventSynchronize(e2), "sync");
    ok(cu.cuEventElapsedTime(&mut ms, e0, e2), "elapsed");
    assert!(ms >= 30.9, "waited for the event: {ms} ms");

    // Utilization: 300 ms of kernels, measured right after.
    let since_us = realtime_us();
    for _ in 0..10 {
        ok(launch(&cu, k30, s1), "launch");
    }
    ok(cu.cuStreamSynchronize(s1), "cuStreamSynchronize");
    assert_eq!(nv.nvmlInit_v2(), NVML_SUCCESS);
    let d = nvml_device(&nv, 0);
    let mut util = nvmlUtilization_t::default();
    assert_eq!(nv.nvmlDeviceGetUtilizationRates(d, &mut util), NVML_SUCCESS);
    assert!(
        (30..=50).contains(&util.gpu),
        "gpu utilization {}",
        util.gpu
    );
    let mut n: c_uint = 0;
    assert_eq!(
        nv.nvmlDeviceGetProcessUtilization(d, null_mut(), &mut n, since_us),
        NVML_ERROR_INSUFFICIENT_SIZE
    );
    assert!(n >= 1);
    let mut samples = vec![nvmlProcessUtilizationSample_t::default(); n as usize];
    assert_eq!(
        nv.nvmlDeviceGetProcessUtilization(d, samples.as_mut_ptr(), &mut n, since_us),
        NVML_SUCCESS
    );
    let mine = samples[..n as usize]
        .iter()
        .find(|s| s.pid == std::process::id())
        .expect("own sample");
    assert!(
        mine.sm_util >= 70,
        "busy since the launches: {}",
        mine.sm_util
    );
    assert!(mine.time_stamp >= since_us);
    let mut temp = 0;
    assert_eq!(
        nv.nvmlDeviceGetTemperature(d, NVML_TEMPERATURE_GPU, &mut temp),
        NVML_SUCCESS
    );
    assert!(temp > 35);
    let mut power = 0;
    assert_eq!(nv.nvmlDeviceGetPowerUsage(d, &mut power), NVML_SUCCESS);
    assert!(power > 70_000);

    // Queue depth: behind a 200 ms kernel, 1023 more fill the queue; the
    // next launch blocks until the first kernel is done.
    let start = mono_ns();
    ok(launch(&cu, k200, s1), "launch");
    for _ in 0..1023 {
        ok(launch(&cu, k0, s1), "launch");
    }
    assert!(
        mono_ns() - start < 150_000_000,
        "1024 launches do not block"
    );
    ok(launch(&cu, k0, s1), "launch");
    assert!(mono_ns() - start >= 200_000_000, "the 1025th launch waited");
    ok(cu.cuStreamSynchronize(s1), "sync");
}

/// NVML memory info, process lists and their size protocol.
fn nvml_process_list() {
    let (lib, cu) = load();
    let nv = Nvml::load(&lib);
    let mut count = 0;
    assert_eq!(
        nv.nvmlDeviceGetCount_v2(&mut count),
        NVML_ERROR_UNINITIALIZED
    );
    context(&cu);
    alloc(&cu, 100 * MI);
    let expect = 110 * MI as u64;
    assert_eq!(nv.nvmlInit_v2(), NVML_SUCCESS);
    let d = nvml_device(&nv, 0);
    assert_eq!(nvml_used(&nv, d), expect);
    let mut m2 = nvmlMemory_v2_t::default();
    assert_eq!(
        nv.nvmlDeviceGetMemoryInfo_v2(d, &mut m2),
        NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    );
    m2.version = NVML_MEMORY_V2;
    assert_eq!(nv.nvmlDeviceGetMemoryInfo_v2(d, &mut m2), NVML_SUCCESS);
    assert_eq!(
        (m2.total, m2.used, m2.free),
        (2 << 30, expect, (2 << 30) - expect)
    );

    let mut n: c_uint = 0;
    assert_eq!(
        nv.nvmlDeviceGetComputeRunningProcesses_v3(d, &mut n, null_mut()),
        NVML_ERROR_INSUFFICIENT_SIZE
    );
    assert_eq!(n, 1);
    let procs = nvml_processes(&nv, d);
    assert_eq!(procs.len(), 1);
    assert_eq!(procs[0].pid, std::process::id());
    assert_eq!(procs[0].used_gpu_memory, expect);
    assert_eq!(procs[0].gpu_instance_id, 0xFFFF_FFFF);
    let mut v1 = [nvmlProcessInfo_v1_t::default(); 4];
    n = 4;
    assert_eq!(
        nv.nvmlDeviceGetComputeRunningProcesses(d, &mut n, v1.as_mut_ptr()),
        NVML_SUCCESS
    );
    assert_eq!(
        (n, v1[0].pid, v1[0].used_gpu_memory),
        (1, std::process::id(), expect)
    );
    n = 0;
    assert_eq!(
        nv.nvmlDeviceGetGraphicsRunningProcesses_v3(d, &mut n, null_mut()),
        NVML_SUCCESS
    );
    assert_eq!(n, 0);

    let mut util = nvmlUtilization_t::default();
    assert_eq!(nv.nvmlDeviceGetUtilizationRates(d, &mut util), NVML_SUCCESS);
    assert_eq!(util.gpu, 0);
    let mut samples = [nvmlProcessUtilizationSample_t::default(); 4];
    n = 4;
    assert_eq!(
        nv.nvmlDeviceGetProcessUtilization(d, samples.as_mut_ptr(), &mut n, 0),
        NVML_SUCCESS
    );
    assert_eq!(
        (n, samples[0].pid, samples[0].sm_util),
        (1, std::process::id(), 0)
    );
    assert_eq!(
        static_str(nv.nvmlErrorString(NVML_ERROR_INSUFFICIENT_SIZE)),
        "Insufficient Size"
    );

    assert_eq!(nv.nvmlShutdown(), NVML_SUCCESS);
    assert_eq!(
        nv.nvmlDeviceGetCount_v2(&mut count),
        NVML_ERROR_UNINITIALIZED
    );
    assert_eq!(nv.nvmlShutdown(), NVML_ERROR_UNINITIALIZED);
}

fn pool_attr(cu: &Cu, pool: CUmemoryPool, attr: CUmemPool_attribute) -> u64 {
    let mut v = 0u64;
    ok(
        cu.cuMemPoolGetAttribute(pool, attr, (&mut v as *mut u64).cast()),
        "cuMemPoolGetAttribute",
    );
    v
}

/// Pools reserve 2 MiB chunks; free keeps them; sync and trim release.
fn pool() {
    let (_lib, cu) = load();
    context(&cu);
    let used = || cu.simgpu_device_used_bytes(0) as usize;
    let base = used();
    let mut pool = null_mut();
    ok(cu.cuDeviceGetDefaultMemPool(&mut pool, 0), "default pool");
    let mut current = null_mut();
    ok(cu.cuDeviceGetMemPool(&mut current, 0), "current pool");
    assert_eq!(pool, current);

    let mut p = 0;
    ok(
        cu.cuMemAllocAsync(&mut p, MI, null_mut()),
        "cuMemAllocAsync",
    );
    assert_eq!(used(), base + 2 * MI, "reserved in 2 MiB chunks");
    assert_eq!(
        pool_attr(&cu, pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT),
        2 * MI as u64
    );
    assert_eq!(
        pool_attr(&cu, pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT),
        MI as u64
    );
    let data = [5u8; 64];
    let mut back = [0u8; 64];
    ok(cu.cuMemcpyHtoD_v2(p, data.as_ptr().cast(), 64), "HtoD");
    ok(cu.cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), p, 64), "DtoH");
    assert_eq!(back, data);
    ok(cu.cuMemFreeAsync(p, null_mut()), "cuMemFreeAsync");
    assert_eq!(
        used(),
        base + 2 * MI,
        "freed bytes stay reserved until a sync"
    );
    assert_eq!(pool_attr(&cu, pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT), 0);
    ok(cu.cuStreamSynchronize(null_mut()), "sync");
    assert_eq!(used(), base, "released above the threshold (0)");
    assert_eq!(
        pool_attr(&cu, pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT),
        0
    );

    let mut threshold = 64 * MI as u64;
    ok(
        cu.cuMemPoolSetAttribute(
            pool,
            CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        ),
        "set threshold",
    );
    assert_eq!(
        pool_attr(&cu, pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD),
        64 * MI as u64
    );
    ok(
        cu.cuMemAllocAsync_ptsz(&mut p, 10 * MI, null_mut()),
        "cuMemAllocAsync_ptsz",
    );
    ok(cu.cuMemFreeAsync(p, null_mut()), "free");
    ok(cu.cuCtxSynchronize(), "sync");
    assert_eq!(used(), base + 10 * MI, "kept below the threshold");
    assert!(pool_attr(&cu, pool, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH) >= 10 * MI as u64);
    let mut v = 5u64;
    assert_eq!(
        cu.cuMemPoolSetAttribute(
            pool,
            CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
            (&mut v as *mut u64).cast()
        ),
        CUDA_ERROR_INVALID_VALUE
    );
    v = 0;
    ok(
        cu.cuMemPoolSetAttribute(
            pool,
            CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
            (&mut v as *mut u64).cast(),
        ),
        "reset high",
    );
    ok(cu.cuMemPoolTrimTo(pool, 4 * MI), "trim to 4 MiB");
    assert_eq!(used(), base + 4 * MI);
    ok(cu.cuMemPoolTrimTo(pool, 0), "trim");
    assert_eq!(used(), base);

    let props = CUmemPoolProps {
        alloc_type: CU_MEM_ALLOCATION_TYPE_PINNED,
        handle_types: 0,
        location: CUmemLocation {
            type_: CU_MEM_LOCATION_TYPE_DEVICE,
            id: 0,
        },
        win32_security_attributes: null_mut(),
        max_size: 0,
        usage: 0,
        reserved: [0; 54],
    };
    let mut own = null_mut();
    ok(cu.cuMemPoolCreate(&mut own, &props), "cuMemPoolCreate");
    ok(
        cu.cuMemAllocFromPoolAsync(&mut p, 3 * MI, own, null_mut()),
        "from pool",
    );
    assert_eq!(used(), base + 4 * MI);
    ok(
        cu.cuMemPoolDestroy(own),
        "destroy with an outstanding allocation",
    );
    assert_eq!(used(), base + 4 * MI);
    ok(cu.cuMemFreeAsync(p, null_mut()), "free");
    assert_eq!(used(), base, "a destroyed pool goes once empty");
    assert_eq!(
        cu.cuMemPoolDestroy(pool),
        CUDA_ERROR_INVALID_VALUE,
        "default pool"
    );
    assert_eq!(
        cu.cuMemAllocAsync(&mut p, 2 << 30, null_mut()),
        CUDA_ERROR_OUT_OF_MEMORY
    );
    assert_eq!(used(), base);
}

fn device_prop() -> CUmemAllocationProp {
    CUmemAllocationProp {
        type_: CU_MEM_ALLOCATION_TYPE_PINNED,
        requested_handle_types: 0,
        location: CUmemLocation {
            type_: CU_MEM_LOCATION_TYPE_DEVICE,
            id: 0,
        },
        win32_handle_meta_data: null_mut(),
        alloc_flags: CUmemAllocationPropFlags::default(),
    }
}

/// VMM: create, reserve, map, copy across mappings, alias, release.
fn vmm() {
    let (_lib, cu) = load();
    context(&cu);
    let used = || cu.simgpu_device_used_bytes(0) as usize;
    let base = used();
    let prop = device_prop();
    let mut gran = 0;
    ok(
        cu.cuMemGetAllocationGranularity(&mut gran, &prop, 0),
        "granularity",
    );
    assert_eq!(gran, 2 * MI);
    let mut h1 = 0;
    let mut h2 = 0;
    assert_eq!(
        cu.cuMemCreate(&mut h1, 3 * MI, &prop, 0),
        CUDA_ERROR_INVALID_VALUE
    );
    ok(cu.cuMemCreate(&mut h1, 4 * MI, &prop, 0), "cuMemCreate");
    ok(cu.cuMemCreate(&mut h2, 2 * MI, &prop, 0), "cuMemCreate");
    assert_eq!(used(), base + 6 * MI);
    let mut host_prop = prop;
    host_prop.location.type_ = CU_MEM_LOCATION_TYPE_HOST;
    let mut hh = 0;
    ok(
        cu.cuMemCreate(&mut hh, 2 * MI, &host_prop, 0),
        "host handle",
    );
    assert_eq!(used(), base + 6 * MI, "host memory is not device memory");
    let mut got = device_prop();
    got.location.id = 7;
    ok(
        cu.cuMemGetAllocationPropertiesFromHandle(&mut got, h1),
        "props",
    );
    assert_eq!(
        (got.location.type_, got.location.id),
        (CU_MEM_LOCATION_TYPE_DEVICE, 0)
    );

    let mut va = 0;
    ok(cu.cuMemAddressReserve(&mut va, 8 * MI, 0, 0, 0), "reserve");
    assert_eq!(va % (2 * MI as u64), 0);
    ok(cu.cuMemMap(va, 4 * MI, 0, h1, 0), "map h1");
    ok(cu.cuMemMap(va + 4 * MI as u64, 2 * MI, 0, h2, 0), "map h2");
    assert_eq!(
        cu.cuMemMap(va, 2 * MI, 0, h2, 0),
        CUDA_ERROR_INVALID_VALUE,
        "overlap"
    );
    let access = [0u8; 16];
    ok(
        cu.cuMemSetAccess(va, 6 * MI, access.as_ptr().cast(), 1),
        "set access",
    );
    let data: Vec<u8> = (0..64u8).collect();
    let edge = va + 4 * MI as u64 - 32;
    ok(
        cu.cuMemcpyHtoD_v2(edge, data.as_ptr().cast(), 64),
        "copy across mappings",
    );
    let mut back = vec![0u8; 64];
    ok(
        cu.cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), edge, 64),
        "read back",
    );
    assert_eq!(back, data);
    assert_eq!(
        cu.cuMemcpyHtoD_v2(va + 6 * MI as u64 - 8, data.as_ptr().cast(), 64),
        CUDA_ERROR_INVALID_VALUE,
        "past the mapped range"
    );

    ok(cu.cuMemUnmap(va, 4 * MI), "unmap h1");
    ok(cu.cuMemRelease(h1), "release h1");
    assert_eq!(used(), base + 2 * MI);
    ok(cu.cuMemRelease(h2), "release h2 while mapped");
    assert_eq!(used(), base + 2 * MI, "still mapped: still used");
    ok(
        cu.cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), va + 4 * MI as u64, 32),
        "mapped after release",
    );
    ok(cu.cuMemUnmap(va + 4 * MI as u64, 2 * MI), "unmap h2");
    assert_eq!(used(), base, "released and unmapped");
    assert_eq!(
        cu.cuMemcpyHtoD_v2(va, data.as_ptr().cast(), 8),
        CUDA_ERROR_INVALID_VALUE
    );
    ok(cu.cuMemAddressFree(va, 8 * MI), "address free");
    ok(cu.cuMemRelease(hh), "release host handle");
    assert_eq!(cu.cuMemRelease(hh), CUDA_ERROR_INVALID_VALUE);

    // Two mappings of one handle alias the same memory.
    let mut h3 = 0;
    ok(cu.cuMemCreate(&mut h3, 2 * MI, &prop, 0), "create");
    let mut va2 = 0;
    ok(cu.cuMemAddressReserve(&mut va2, 4 * MI, 0, 0, 0), "reserve");
    ok(cu.cuMemMap(va2, 2 * MI, 0, h3, 0), "map");
    ok(
        cu.cuMemMap(va2 + 2 * MI as u64, 2 * MI, 0, h3, 0),
        "map again",
    );
    ok(
        cu.cuMemcpyHtoD_v2(va2 + 100, data.as_ptr().cast(), 64),
        "write first",
    );
    ok(
        cu.cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), va2 + 2 * MI as u64 + 100, 64),
        "read second",
    );
    assert_eq!(back, data);
    ok(cu.cuMemRelease(h3), "release");
    ok(cu.cuMemAddressFree(va2, 4 * MI), "address free unmaps");
    assert_eq!(used(), base);
}

/// A forked child gets its own slot; its memory comes back when it dies
/// without cleaning up.
fn fork() {
    let (lib, cu) = load();
    let nv = Nvml::load(&lib);
    context(&cu);
    alloc(&cu, 100 * MI);
    assert_eq!(cu.simgpu_device_used_bytes(0), 100 * MI as u64);
    // SAFETY: the child only calls the simulated driver and then _exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork");
    if pid == 0 {
        let code = (|| {
            let mut p = 0;
            if cu.cuMemAlloc_v2(&mut p, MI) != CUDA_ERROR_INVALID_CONTEXT {
                return 2;
            }
            if cu.cuInit(0) != CUDA_SUCCESS {
                return 3;
            }
            let mut ctx = null_mut();
            if cu.cuCtxCreate_v2(&mut ctx, 0, 0) != CUDA_SUCCESS {
                return 4;
            }
            if cu.cuMemAlloc_v2(&mut p, 50 * MI) != CUDA_SUCCESS {
                return 5;
            }
            if cu.simgpu_device_used_bytes(0) != 150 * MI as u64 {
                return 6;
            }
            0
        })();
        // SAFETY: leaving the forked child without running exit handlers.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: reaping our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status), "child status {status}");
    assert_eq!(libc::WEXITSTATUS(status), 0, "child check failed");
    assert_eq!(nv.nvmlInit_v2(), NVML_SUCCESS);
    let d = nvml_device(&nv, 0);
    assert_eq!(
        nvml_used(&nv, d),
        100 * MI as u64,
        "the dead child's memory came back"
    );
    let procs = nvml_processes(&nv, d);
    assert_eq!(procs.len(), 1, "{procs:?}");
    assert_eq!(procs[0].pid, std::process::id());
    let mut p = 0;
    ok(cu.cuMemAlloc_v2(&mut p, MI), "the parent still works");
}

/// Context stack, primary contexts and initialisation errors.
fn contexts() {
    let (_lib, cu) = load();
    let mut c = null_mut();
    assert_eq!(cu.cuCtxGetCurrent(&mut c), CUDA_ERROR_NOT_INITIALIZED);
    ok(cu.cuInit(0), "cuInit");
    ok(cu.cuCtxGetCurrent(&mut c), "no context yet");
    assert!(c.is_null());
    assert_eq!(cu.cuCtxSynchronize(), CUDA_ERROR_INVALID_CONTEXT);
    let used = || cu.simgpu_device_used_bytes(0) as usize;
    let (mut flags, mut active) = (9, 9);
    ok(
        cu.cuDevicePrimaryCtxGetState(0, &mut flags, &mut active),
        "state",
    );
    assert_eq!((flags, active), (0, 0));
    let (mut p1, mut p2) = (null_mut(), null_mut());
    ok(cu.cuDevicePrimaryCtxRetain(&mut p1, 0), "retain");
    ok(cu.cuDevicePrimaryCtxRetain(&mut p2, 0), "retain");
    assert_eq!(p1, p2);
    assert_eq!(used(), 8 * MI, "the primary context is charged once");
    ok(
        cu.cuDevicePrimaryCtxGetState(0, &mut flags, &mut active),
        "state",
    );
    assert_eq!(active, 1);
    ok(cu.cuCtxSetCurrent(p1), "set current");
    let mut dev = 9;
    ok(cu.cuCtxGetDevice(&mut dev), "device");
    assert_eq!(dev, 0);
    alloc(&cu, MI);
    assert_eq!(
        cu.cuCtxDestroy_v2(p1),
        CUDA_ERROR_INVALID_CONTEXT,
        "primary cannot be destroyed"
    );
    ok(cu.cuDevicePrimaryCtxRelease_v2(0), "release");
    assert_eq!(used(), 9 * MI);
    ok(cu.cuDevicePrimaryCtxRelease_v2(0), "last release");
    assert_eq!(used(), 0, "last release frees the context and its memory");
    assert_eq!(
        cu.cuDevicePrimaryCtxRelease_v2(0),
        CUDA_ERROR_INVALID_CONTEXT
    );
    let mut p = 0;
    assert_eq!(cu.cuMemAlloc_v2(&mut p, MI), CUDA_ERROR_INVALID_CONTEXT);
    ok(cu.cuCtxSetCurrent(null_mut()), "pop");
    ok(cu.cuCtxGetCurrent(&mut c), "current");
    assert!(c.is_null());

    let (mut c1, mut c2) = (null_mut(), null_mut());
    ok(cu.cuCtxCreate_v2(&mut c1, 0, 0), "create");
    ok(cu.cuCtxCreate_v2(&mut c2, 0, 0), "create");
    assert_eq!(used(), 16 * MI);
    ok(cu.cuCtxGetCurrent(&mut c), "current");
    assert_eq!(c, c2);
    let mut popped = null_mut();
    ok(cu.cuCtxPopCurrent_v2(&mut popped), "pop");
    assert_eq!(popped, c2);
    ok(cu.cuCtxGetCurrent(&mut c), "current");
    assert_eq!(c, c1);
    ok(cu.cuCtxPushCurrent_v2(c2), "push");
    ok(cu.cuCtxDestroy_v2(c2), "destroy current");
    ok(cu.cuCtxGetCurrent(&mut c), "current");
    assert_eq!(c, c1, "destroying the current context pops it");
    ok(cu.cuCtxDestroy_v2(c1), "destroy");
    assert_eq!(cu.cuCtxDestroy_v2(c1), CUDA_ERROR_INVALID_CONTEXT);
    assert_eq!(cu.cuCtxPushCurrent_v2(c1), CUDA_ERROR_INVALID_CONTEXT);
    assert_eq!(used(), 0);
    let mut empty = null_mut();
    assert_eq!(
        cu.cuCtxPopCurrent_v2(&mut empty),
        CUDA_ERROR_INVALID_CONTEXT
    );
}

/// cuInit returns EXPECT_INIT; with HOLD=1 the process then waits.
fn init_expect() {
    let (_lib, cu) = load();
    assert_eq!(cu.cuInit(0) as u64, env_u64("EXPECT_INIT"));
    if std::env::var("HOLD").is_ok() {
        report("READY", std::process::id());
        wait_parent();
    }
}

/// Launches tiny kernels until killed.
fn launch_loop() {
    let (_lib, cu) = load();
    context(&cu);
    let m = load_module(&cu, "SIMGPU-MODULE\nk 1us\n");
    let f = function(&cu, m, "k");
    report("READY", std::process::id());
    loop {
        ok(launch(&cu, f, null_mut()), "launch");
    }
}

/// One 1 ms kernel, synchronised.
fn kernel_once() {
    let (_lib, cu) = load();
    context(&cu);
    let m = load_module(&cu, "SIMGPU-MODULE\nk 1ms\n");
    let f = function(&cu, m, "k");
    ok(launch(&cu, f, null_mut()), "launch");
    ok(cu.cuCtxSynchronize(), "sync");
}

/// XID events: injected with the test hook, reported once per registered
/// set, only after registration; unsupported types are refused.
fn nvml_events() {
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct EventData {
        device: nvmlDevice_t,
        event_type: u64,
        event_data: u64,
        gpu_instance_id: c_uint,
        compute_instance_id: c_uint,
    }
    type Create = unsafe extern "C" fn(*mut *mut c_void) -> nvmlReturn_t;
    type Register = unsafe extern "C" fn(nvmlDevice_t, u64, *mut c_void) -> nvmlReturn_t;
    type Wait = unsafe extern "C" fn(*mut c_void, *mut EventData, c_uint) -> nvmlReturn_t;
    type Free = unsafe extern "C" fn(*mut c_void) -> nvmlReturn_t;
    type Supported = unsafe extern "C" fn(nvmlDevice_t, *mut u64) -> nvmlReturn_t;
    type Inject = unsafe extern "C" fn(c_int, u32) -> u64;

    let lib = Lib::open();
    let nv = Nvml::load(&lib);
    let create: Create = lib.sym("nvmlEventSetCreate");
    let register: Register = lib.sym("nvmlDeviceRegisterEvents");
    let wait: Wait = lib.sym("nvmlEventSetWait_v2");
    let free: Free = lib.sym("nvmlEventSetFree");
    let supported: Supported = lib.sym("nvmlDeviceGetSupportedEventTypes");
    let inject: Inject = lib.sym("simgpu_inject_xid");
    const XID: u64 = 0x8;

    assert_eq!(nv.nvmlInit_v2(), NVML_SUCCESS);
    let d0 = nvml_device(&nv, 0);
    let d1 = nvml_device(&nv, 1);
    // SAFETY: the signatures match the exported functions and
    // every pointer passed is valid for the call.
    unsafe {
        let mut types = 0u64;
        assert_eq!(supported(d0, &mut types), NVML_SUCCESS);
        assert_eq!(types, XID);
        // Injected before the set exists: never reported to it.
        assert_eq!(inject(0, 79), 1);
        let mut set = null_mut();
        assert_eq!(create(&mut set), NVML_SUCCESS);
        assert_eq!(register(d0, 0x2, set), NVML_ERROR_NOT_SUPPORTED);
        assert_eq!(register(d0, XID, set), NVML_SUCCESS);
        assert_eq!(register(d1, XID, set), NVML_SUCCESS);
        let mut data = std::mem::zeroed::<EventData>();
        assert_eq!(wait(set, &mut data, 20), NVML_ERROR_TIMEOUT);
        // A wait with nothing to report sleeps the whole time (as a real
        // driver's does), spending next to no CPU: a node agent waits here
        // all the time. Polling every 2 ms spent 8.4 ms of CPU in a wait
        // this long (1.4 % of a core per waiting thread).
        let (cpu, wall) = (thread_cpu(), std::time::Instant::now());
        assert_eq!(wait(set, &mut data, 600), NVML_ERROR_TIMEOUT);
        let (cpu, wall) = (thread_cpu() - cpu, wall.elapsed());
        assert!(wall >= std::time::Duration::from_millis(600), "{wall:?}");
        assert!(
            cpu < std::time::Duration::from_micros(400),
            "{cpu:?} of CPU in {wall:?}"
        );
        assert_eq!(inject(1, 48), 1);
        assert_eq!(wait(set, &mut data, 1000), NVML_SUCCESS);
        assert_eq!(data.device, d1);
        assert_eq!((data.event_type, data.event_data), (XID, 48));
        assert_eq!(data.gpu_instance_id, 0xFFFF_FFFF);
        assert_eq!(
            wait(set, &mut data, 20),
            NVML_ERROR_TIMEOUT,
            "reported once"
        );
        // Injected by another thread while waiting.
        let injector = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(30));
            inject(0, 63)
        });
        assert_eq!(wait(set, &mut data, 2000), NVML_SUCCESS);
        assert_eq!(injector.join().expect("injector"), 2);
        assert_eq!((data.device, data.event_data), (d0, 63));
        assert_eq!(inject(5, 48), u64::MAX, "no such device");
        assert_eq!(free(set), NVML_SUCCESS);
    }
}

/// The CPU time the calling thread has used.
fn thread_cpu() -> std::time::Duration {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid clock id and a writable timespec.
    let read = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) };
    assert_eq!(read, 0);
    std::time::Duration::new(now.tv_sec as u64, now.tv_nsec as u32)
}

fn no_pci() -> nvmlPciInfo_t {
    nvmlPciInfo_t {
        bus_id_legacy: [0; 16],
        domain: 0,
        bus: 0,
        device: 0,
        pci_device_id: 0,
        pci_sub_system_id: 0,
        bus_id: [0; 32],
    }
}

/// Every active link of `d` as the bus id of its far end, the way NVML
/// clients walk them (links 0..NVML_NVLINK_MAX_LINKS).
fn nvlink_remotes(nv: &Nvml, d: nvmlDevice_t) -> Vec<String> {
    let mut remotes = Vec::new();
    for link in 0..18 {
        let mut state = 7;
        assert_eq!(
            nv.nvmlDeviceGetNvLinkState(d, link, &mut state),
            NVML_SUCCESS
        );
        let mut pci = no_pci();
        let remote = nv.nvmlDeviceGetNvLinkRemotePciInfo_v2(d, link, &mut pci);
        let mut kind = 7;
        let kind_result = nv.nvmlDeviceGetNvLinkRemoteDeviceType(d, link, &mut kind);
        match state {
            1 => {
                assert_eq!(remote, NVML_SUCCESS);
                assert_eq!(
                    (kind_result, kind),
                    (NVML_SUCCESS, 0),
                    "a GPU at the far end"
                );
                let text: Vec<c_char> = pci.bus_id.iter().map(|&b| b as c_char).collect();
                remotes.push(buf_str(&text));
            }
            0 => {
                assert_eq!(remote, NVML_ERROR_NOT_SUPPORTED, "inactive link {link}");
                assert_eq!(kind_result, NVML_ERROR_NOT_SUPPORTED);
            }
            other => panic!("link state {other}"),
        }
    }
    let mut state = 0;
    assert_eq!(
        nv.nvmlDeviceGetNvLinkState(d, 18, &mut state),
        NVML_ERROR_INVALID_ARGUMENT
    );
    remotes
}

/// NUMA nodes, common ancestors and NVLinks as `SIMGPU_NUMA` /
/// `SIMGPU_NVLINK` configure them; `TOPOLOGY_CASE` picks the machine.
fn nvml_topology() {
    let lib = Lib::open();
    let nv = Nvml::load(&lib);
    assert_eq!(nv.nvmlInit_v2(), NVML_SUCCESS);
    let case = std::env::var("TOPOLOGY_CASE").expect("TOPOLOGY_CASE");
    match case.as_str() {
        // 4 GPUs, NUMA 0,0,1,1, islands {0,2} {1,3} (across NUMA nodes).
        "islands" => {
            let d: Vec<nvmlDevice_t> = (0..4).map(|i| nvml_device(&nv, i)).collect();
            let numa: Vec<c_uint> = d
                .iter()
                .map(|&dev| {
                    let mut node = 99;
                    assert_eq!(nv.nvmlDeviceGetNumaNodeId(dev, &mut node), NVML_SUCCESS);
                    node
                })
                .collect();
            assert_eq!(numa, vec![0, 0, 1, 1]);
            let level = |a: usize, b: usize| {
                let mut level = 99;
                assert_eq!(
                    nv.nvmlDeviceGetTopologyCommonAncestor(d[a], d[b], &mut level),
                    NVML_SUCCESS
                );
                level
            };
            assert_eq!(level(0, 0), 0, "INTERNAL");
            assert_eq!(level(0, 1), 40, "NODE");
            assert_eq!(level(2, 3), 40, "NODE");
            assert_eq!(level(0, 2), 50, "SYSTEM");
            assert_eq!(level(3, 0), 50, "SYSTEM");
            assert_eq!(nvlink_remotes(&nv, d[0]), vec!["00000000:03:00.0"]);
            assert_eq!(nvlink_remotes(&nv, d[1]), vec!["00000000:04:00.0"]);
            assert_eq!(nvlink_remotes(&nv, d[2]), vec!["00000000:01:00.0"]);
            assert_eq!(nvlink_remotes(&nv, d[3]), vec!["00000000:02:00.0"]);
            let mut out = 0;
            assert_eq!(
                nv.nvmlDeviceGetNumaNodeId(null_mut(), &mut out),
                NVML_ERROR_INVALID_ARGUMENT
            );
            assert_eq!(
                nv.nvmlDeviceGetNumaNodeId(d[0], null_mut()),
                NVML_ERROR_INVALID_ARGUMENT
            );
            assert_eq!(
                nv.nvmlDeviceGetTopologyCommonAncestor(d[0], d[1], null_mut()),
                NVML_ERROR_INVALID_ARGUMENT
            );
        }
        // The same machine seen from a container holding GPU 2 only: its
        // link still reaches GPU 0's bus.
        "one_visible" => {
            let d = nvml_device(&nv, 0);
            let mut node = 99;
            assert_eq!(nv.nvmlDeviceGetNumaNodeId(d, &mut node), NVML_SUCCESS);
            assert_eq!(node, 1);
            assert_eq!(nvlink_remotes(&nv, d), vec!["00000000:01:00.0"]);
        }
        // No topology configured: NUMA and NVLink unsupported, one node.
        "flat" => {
            let (a, b) = (nvml_device(&nv, 0), nvml_device(&nv, 1));
            let mut out = 99;
            assert_eq!(
                nv.nvmlDeviceGetNumaNodeId(a, &mut out),
                NVML_ERROR_NOT_SUPPORTED
            );
            assert_eq!(
                nv.nvmlDeviceGetNvLinkState(a, 0, &mut out),
                NVML_ERROR_NOT_SUPPORTED
            );
            let mut pci = no_pci();
            assert_eq!(
                nv.nvmlDeviceGetNvLinkRemotePciInfo_v2(a, 0, &mut pci),
                NVML_ERROR_NOT_SUPPORTED
            );
            assert_eq!(
                nv.nvmlDeviceGetTopologyCommonAncestor(a, b, &mut out),
                NVML_SUCCESS
            );
            assert_eq!(out, 40, "NODE");
        }
        other => panic!("unknown TOPOLOGY_CASE {other}"),
    }
}
