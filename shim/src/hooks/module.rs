//! Modules and libraries: a loaded module holds its code and constant data
//! on the device, charged at the size of the image it was loaded from.
//!
//! A library (CUDA 12 library management) is charged the same way, to the
//! device of the context current when it is loaded, and returned when it is
//! unloaded. The driver may load it into further contexts later (lazily, on
//! first use in each); those copies are not charged again.

use super::out::written_handle;
use crate::driver::cuda::signature;
use crate::enforcer::{current_context, mode, Mode};
use crate::table::{Charge, Resource};
use std::ffi::{c_char, c_void, CStr};
use vgpu_cuda_abi::cuda::*;
use vgpu_interpose::Real;
use vgpu_node_contract::region::MemoryKind;

const ELF_MAGIC: [u8; 4] = [0x7f, b'E', b'L', b'F'];
const FATBIN_MAGIC: u32 = 0xBA55_ED50;
/// Upper bound on an image size we believe (larger headers are corrupt).
const MAX_IMAGE_BYTES: u64 = 1 << 34;

/// Size of a module image in memory: an ELF cubin (to the end of its section
/// table), a fat binary (header plus payload), or NUL-terminated PTX text.
///
/// # Safety
/// `image` must point to a valid image as the driver API requires.
unsafe fn image_bytes(image: *const c_void) -> u64 {
    if image.is_null() {
        return 0;
    }
    let bytes = image.cast::<u8>();
    // SAFETY: every image kind is at least 16 bytes long or a NUL-terminated
    // string; reads stop at the first NUL for text.
    unsafe {
        let head: [u8; 4] = std::ptr::read_unaligned(bytes.cast());
        if head == ELF_MAGIC {
            let section_offset: u64 = std::ptr::read_unaligned(bytes.add(0x28).cast());
            let entry_size: u16 = std::ptr::read_unaligned(bytes.add(0x3a).cast());
            let entry_count: u16 = std::ptr::read_unaligned(bytes.add(0x3c).cast());
            let end = section_offset.saturating_add(entry_size as u64 * entry_count as u64);
            return end.min(MAX_IMAGE_BYTES);
        }
        if u32::from_le_bytes(head) == FATBIN_MAGIC {
            let header_size: u16 = std::ptr::read_unaligned(bytes.add(6).cast());
            let payload: u64 = std::ptr::read_unaligned(bytes.add(8).cast());
            return (header_size as u64)
                .saturating_add(payload)
                .min(MAX_IMAGE_BYTES);
        }
        CStr::from_ptr(image.cast::<c_char>()).to_bytes().len() as u64
    }
}

/// Loads a module or library image of `bytes` through `load`, charged to the
/// current context's device; `handle` is the out-pointer `load` fills.
fn load_image<H>(
    resource: Resource,
    handle: *mut *mut H,
    bytes: u64,
    load: impl FnOnce() -> CUresult,
) -> CUresult {
    match mode() {
        Mode::Passthrough => load(),
        Mode::FailClosed => CUDA_ERROR_NOT_INITIALIZED,
        Mode::Enforce(enforcer) => {
            let Some((device, context)) = current_context() else {
                return load();
            };
            let charge = Charge {
                device,
                kind: MemoryKind::Module,
                bytes,
                context,
                pool: 0,
                host: 0,
            };
            enforcer.charged(charge, resource, || {
                let code = load();
                // SAFETY: the caller's out-pointer, written on success.
                (code, unsafe { written_handle(handle) })
            })
        }
    }
}

/// Size of the image file at `path` (0 if it cannot be read: the driver
/// then fails the load).
///
/// # Safety
/// `path` must be null or NUL-terminated.
unsafe fn file_bytes(path: *const c_char) -> u64 {
    if path.is_null() {
        return 0;
    }
    // SAFETY: the driver API requires a NUL-terminated path.
    let path = unsafe { CStr::from_ptr(path) };
    path.to_str()
        .ok()
        .and_then(|p| std::fs::metadata(p).ok())
        .map(|m| m.len())
        .unwrap_or(0)
}

#[inline(always)]
pub(crate) unsafe fn cuModuleLoad(
    driver: Real<signature::cuModuleLoad>,
    module: *mut CUmodule,
    path: *const c_char,
) -> CUresult {
    // SAFETY: the driver API requires a NUL-terminated path.
    let bytes = unsafe { file_bytes(path) };
    // SAFETY: forwarded unchanged.
    load_image(Resource::Module, module, bytes, || unsafe {
        (driver.call)(module, path)
    })
}

#[inline(always)]
pub(crate) unsafe fn cuModuleLoadData(
    driver: Real<signature::cuModuleLoadData>,
    module: *mut CUmodule,
    image: *const c_void,
) -> CUresult {
    // SAFETY: the caller passes a valid image.
    let bytes = unsafe { image_bytes(image) };
    // SAFETY: forwarded unchanged.
    load_image(Resource::Module, module, bytes, || unsafe {
        (driver.call)(module, image)
    })
}

#[inline(always)]
pub(crate) unsafe fn cuModuleLoadDataEx(
    driver: Real<signature::cuModuleLoadDataEx>,
    module: *mut CUmodule,
    image: *const c_void,
    num_options: u32,
    options: *mut c_void,
    values: *mut *mut c_void,
) -> CUresult {
    // SAFETY: the caller passes a valid image.
    let bytes = unsafe { image_bytes(image) };
    load_image(Resource::Module, module, bytes, || {
        // SAFETY: forwarded unchanged.
        unsafe { (driver.call)(module, image, num_options, options, values) }
    })
}

#[inline(always)]
pub(crate) unsafe fn cuModuleLoadFatBinary(
    driver: Real<signature::cuModuleLoadFatBinary>,
    module: *mut CUmodule,
    image: *const c_void,
) -> CUresult {
    // SAFETY: the caller passes a valid image.
    let bytes = unsafe { image_bytes(image) };
    // SAFETY: forwarded unchanged.
    load_image(Resource::Module, module, bytes, || unsafe {
        (driver.call)(module, image)
    })
}

#[inline(always)]
pub(crate) unsafe fn cuModuleUnload(
    driver: Real<signature::cuModuleUnload>,
    module: CUmodule,
) -> CUresult {
    match mode() {
        Mode::Enforce(enforcer) => {
            // SAFETY: forwarded unchanged.
            enforcer.uncharged(Resource::Module, module as u64, || unsafe {
                (driver.call)(module)
            })
        }
        // SAFETY: forwarded unchanged.
        _ => unsafe { (driver.call)(module) },
    }
}

#[inline(always)]
pub(crate) unsafe fn cuLibraryLoadData(
    driver: Real<signature::cuLibraryLoadData>,
    library: *mut CUlibrary,
    code: *const c_void,
    jit_options: *mut c_void,
    jit_values: *mut *mut c_void,
    jit_count: u32,
    library_options: *mut c_void,
    library_values: *mut *mut c_void,
    library_count: u32,
) -> CUresult {
    // SAFETY: the caller passes a valid image.
    let bytes = unsafe { image_bytes(code) };
    load_image(Resource::Library, library, bytes, || {
        // SAFETY: forwarded unchanged.
        unsafe {
            (driver.call)(
                library,
                code,
                jit_options,
                jit_values,
                jit_count,
                library_options,
                library_values,
                library_count,
            )
        }
    })
}

#[inline(always)]
pub(crate) unsafe fn cuLibraryLoadFromFile(
    driver: Real<signature::cuLibraryLoadFromFile>,
    library: *mut CUlibrary,
    path: *const c_char,
    jit_options: *mut c_void,
    jit_values: *mut *mut c_void,
    jit_count: u32,
    library_options: *mut c_void,
    library_values: *mut *mut c_void,
    library_count: u32,
) -> CUresult {
    // SAFETY: the driver API requires a NUL-terminated path.
    let bytes = unsafe { file_bytes(path) };
    load_image(Resource::Library, library, bytes, || {
        // SAFETY: forwarded unchanged.
        unsafe {
            (driver.call)(
                library,
                path,
                jit_options,
                jit_values,
                jit_count,
                library_options,
                library_values,
                library_count,
            )
        }
    })
}

#[inline(always)]
pub(crate) unsafe fn cuLibraryUnload(
    driver: Real<signature::cuLibraryUnload>,
    library: CUlibrary,
) -> CUresult {
    match mode() {
        Mode::Enforce(enforcer) => {
            // SAFETY: forwarded unchanged.
            enforcer.uncharged(Resource::Library, library as u64, || unsafe {
                (driver.call)(library)
            })
        }
        // SAFETY: forwarded unchanged.
        _ => unsafe { (driver.call)(library) },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_text_elf_and_fatbin_images() {
        let ptx = c"//\n.version 8.0\n";
        // SAFETY: a NUL-terminated string.
        assert_eq!(unsafe { image_bytes(ptx.as_ptr().cast()) }, 16);

        let mut elf = [0u8; 64];
        elf[..4].copy_from_slice(&ELF_MAGIC);
        elf[0x28..0x30].copy_from_slice(&1000u64.to_le_bytes());
        elf[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        elf[0x3c..0x3e].copy_from_slice(&3u16.to_le_bytes());
        // SAFETY: a 64-byte ELF header.
        assert_eq!(unsafe { image_bytes(elf.as_ptr().cast()) }, 1192);

        let mut fatbin = [0u8; 16];
        fatbin[..4].copy_from_slice(&FATBIN_MAGIC.to_le_bytes());
        fatbin[6..8].copy_from_slice(&16u16.to_le_bytes());
        fatbin[8..16].copy_from_slice(&4096u64.to_le_bytes());
        // SAFETY: a 16-byte fat binary header.
        assert_eq!(unsafe { image_bytes(fatbin.as_ptr().cast()) }, 4112);
    }
}
