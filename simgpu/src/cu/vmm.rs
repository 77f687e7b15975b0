//! Virtual memory management: physical handles, address reservations and
//! mappings.
//!
//! A handle owns a memfd of its size; `cuMemMap` maps that memfd over the
//! reserved addresses (`MAP_FIXED | MAP_SHARED`), so copies through mapped
//! addresses are real and two mappings of one handle alias. Device memory is
//! charged at `cuMemCreate` and returned once the handle is both released
//! and unmapped everywhere.

use std::ffi::{c_int, c_void};

use vgpu_cuda_abi::cuda::*;

use super::{inp, out};
use crate::driver::{
    charge, check_device, check_init, lock, new_handle, round_up, uncharge, Inner, Region,
    RegionKind, VmmHandle, GRANULARITY,
};

cuda_fn! {
    fn cuMemGetAllocationGranularity(
        granularity: *mut usize,
        prop: *const CUmemAllocationProp,
        option: c_int,
    ) {
        check_init()?;
        // SAFETY: caller's prop struct (NULL rejected).
        unsafe { inp(prop) }?;
        if !(0..=1).contains(&option) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: C API out-pointer.
        unsafe { out(granularity, GRANULARITY as usize) }
    }
}

cuda_fn! {
    fn cuMemCreate(
        handle: *mut CUmemGenericAllocationHandle,
        size: usize,
        prop: *const CUmemAllocationProp,
        flags: u64,
    ) {
        let cfg = check_init()?;
        // SAFETY: caller's prop struct (NULL rejected).
        let p = unsafe { inp(prop) }?;
        let size = size as u64;
        if handle.is_null() || flags != 0 || size == 0 || !size.is_multiple_of(GRANULARITY) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if p.type_ != CU_MEM_ALLOCATION_TYPE_PINNED {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let device = match p.location.type_ {
            CU_MEM_LOCATION_TYPE_DEVICE => Some(
                check_device(cfg, p.location.id).map_err(|_| CUDA_ERROR_INVALID_DEVICE)?,
            ),
            CU_MEM_LOCATION_TYPE_HOST
            | CU_MEM_LOCATION_TYPE_HOST_NUMA
            | CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT => None,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        };
        let mut inner = lock();
        if let Some(d) = device {
            charge(d, size)?;
        }
        let give_back = || {
            if let Some(d) = device {
                uncharge(d, size);
            }
        };
        // SAFETY: memfd_create with a static C string name.
        let fd = unsafe { libc::memfd_create(c"simgpu-vmm".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            give_back();
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        // SAFETY: fd is our fresh memfd.
        if unsafe { libc::ftruncate(fd, size as libc::off_t) } != 0 {
            // SAFETY: closing our own descriptor.
            unsafe { libc::close(fd) };
            give_back();
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let h = new_handle();
        inner.vmm.insert(
            h,
            VmmHandle {
                fd,
                size,
                prop: p,
                device,
                refs: 1,
                maps: 0,
            },
        );
        // SAFETY: C API out-pointer, checked non-NULL.
        unsafe { out(handle, h) }
    }
}

/// Destroys a handle that is neither referenced nor mapped.
fn maybe_destroy(inner: &mut Inner, handle: u64) {
    let done = inner
        .vmm
        .get(&handle)
        .is_some_and(|h| h.refs == 0 && h.maps == 0);
    if done {
        if let Some(h) = inner.vmm.remove(&handle) {
            // SAFETY: closing the handle's own memfd.
            unsafe { libc::close(h.fd) };
            if let Some(d) = h.device {
                uncharge(d, h.size);
            }
        }
    }
}

cuda_fn! {
    fn cuMemRelease(handle: CUmemGenericAllocationHandle) {
        check_init()?;
        let mut inner = lock();
        let h = inner.vmm.get_mut(&handle).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if h.refs == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        h.refs -= 1;
        maybe_destroy(&mut inner, handle);
        Ok(())
    }
}

cuda_fn! {
    fn cuMemRetainAllocationHandle(handle: *mut CUmemGenericAllocationHandle, addr: *mut c_void) {
        check_init()?;
        let mut inner = lock();
        let found = match inner.region_containing(addr as u64) {
            Some((_, Region { kind: RegionKind::Mapping { handle }, .. })) => handle,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        };
        let h = inner.vmm.get_mut(&found).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: C API out-pointer.
        unsafe { out(handle, found) }?;
        h.refs += 1;
        Ok(())
    }
}

cuda_fn! {
    fn cuMemGetAllocationPropertiesFromHandle(
        prop: *mut CUmemAllocationProp,
        handle: CUmemGenericAllocationHandle,
    ) {
        check_init()?;
        let inner = lock();
        let h = inner.vmm.get(&handle).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: C API out-pointer.
        unsafe { out(prop, h.prop) }
    }
}

/// Reserves `size` bytes of inaccessible address space aligned to `align`.
fn reserve(size: u64, align: u64, hint: u64) -> Option<u64> {
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
    if hint != 0 {
        // SAFETY: a hint-only anonymous PROT_NONE mapping replaces nothing.
        let p = unsafe {
            libc::mmap(
                hint as *mut c_void,
                size as usize,
                libc::PROT_NONE,
                flags,
                -1,
                0,
            )
        };
        if p != libc::MAP_FAILED {
            if p as u64 == hint && hint.is_multiple_of(align) {
                return Some(hint);
            }
            // SAFETY: unmapping the mapping just made.
            unsafe { libc::munmap(p, size as usize) };
        }
    }
    let total = size.checked_add(align)?;
    // SAFETY: a fresh anonymous PROT_NONE mapping.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            total as usize,
            libc::PROT_NONE,
            flags,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return None;
    }
    let start = p as u64;
    let aligned = round_up(start, align);
    // SAFETY: trimming the unaligned head and the tail of our own mapping.
    unsafe {
        if aligned > start {
            libc::munmap(p, (aligned - start) as usize);
        }
        let end = aligned + size;
        if start + total > end {
            libc::munmap(end as *mut c_void, (start + total - end) as usize);
        }
    }
    Some(aligned)
}

cuda_fn! {
    fn cuMemAddressReserve(
        ptr: *mut CUdeviceptr,
        size: usize,
        alignment: usize,
        addr: CUdeviceptr,
        flags: u64,
    ) {
        check_init()?;
        let size = size as u64;
        let align = if alignment == 0 { GRANULARITY } else { alignment as u64 };
        if ptr.is_null() || flags != 0 || size == 0 || !size.is_multiple_of(GRANULARITY) || !align.is_power_of_two() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let start = reserve(size, align.max(GRANULARITY), addr).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        lock().reservations.insert(start, size);
        // SAFETY: C API out-pointer, checked non-NULL.
        unsafe { out(ptr, start) }
    }
}

/// Mappings inside `[ptr, ptr+size)`; an error when one straddles an edge
/// or there are none.
fn mappings_in(inner: &Inner, ptr: u64, size: u64) -> Result<Vec<(u64, Region)>, CUresult> {
    let end = ptr.checked_add(size).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    if let Some((start, r)) = inner.region_containing(ptr) {
        if start < ptr && matches!(r.kind, RegionKind::Mapping { .. }) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
    }
    let found: Vec<(u64, Region)> = inner
        .regions
        .range(ptr..end)
        .filter(|(_, r)| matches!(r.kind, RegionKind::Mapping { .. }))
        .map(|(&a, &r)| (a, r))
        .collect();
    if found.iter().any(|(a, r)| a + r.span > end) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(found)
}

/// Unmaps one mapping, restoring the inaccessible reservation beneath.
fn unmap_one(inner: &mut Inner, start: u64, r: Region) {
    // SAFETY: the range is one of our mappings inside a reservation we own;
    // MAP_FIXED replaces exactly it with inaccessible address space.
    unsafe {
        libc::mmap(
            start as *mut c_void,
            r.span as usize,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    inner.regions.remove(&start);
    if let RegionKind::Mapping { handle } = r.kind {
        if let Some(h) = inner.vmm.get_mut(&handle) {
            h.maps = h.maps.saturating_sub(1);
        }
        maybe_destroy(inner, handle);
    }
}

cuda_fn! {
    fn cuMemAddressFree(ptr: CUdeviceptr, size: usize) {
        check_init()?;
        let mut inner = lock();
        if inner.reservations.get(&ptr) != Some(&(size as u64)) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        for (start, r) in mappings_in(&inner, ptr, size as u64).unwrap_or_default() {
            unmap_one(&mut inner, start, r);
        }
        inner.reservations.remove(&ptr);
        // SAFETY: the whole reservation is ours and no longer tracked.
        unsafe { libc::munmap(ptr as *mut c_void, size) };
        Ok(())
    }
}

cuda_fn! {
    fn cuMemMap(
        ptr: CUdeviceptr,
        size: usize,
        offset: usize,
        handle: CUmemGenericAllocationHandle,
        flags: u64,
    ) {
        check_init()?;
        let (size, offset) = (size as u64, offset as u64);
        if flags != 0 || size == 0 || size % GRANULARITY != 0 || offset % GRANULARITY != 0 || !ptr.is_multiple_of(GRANULARITY) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut inner = lock();
        let end = ptr.checked_add(size).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let inside = inner
            .reservations
            .range(..=ptr)
            .next_back()
            .is_some_and(|(&s, &len)| end <= s + len);
        if !inside {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if inner.region_containing(ptr).is_some() || inner.regions.range(ptr..end).next().is_some() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let h = inner.vmm.get_mut(&handle).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if h.refs == 0 || offset.checked_add(size).is_none_or(|e| e > h.size) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the range lies in a reservation we own and holds no other
        // mapping; MAP_FIXED replaces the inaccessible placeholder there.
        let p = unsafe {
            libc::mmap(
                ptr as *mut c_void,
                size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                h.fd,
                offset as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        h.maps += 1;
        let device = h.device.unwrap_or(0);
        inner.regions.insert(
            ptr,
            Region {
                size,
                span: size,
                kind: RegionKind::Mapping { handle },
                device,
                ctx: 0,
            },
        );
        Ok(())
    }
}

cuda_fn! {
    fn cuMemUnmap(ptr: CUdeviceptr, size: usize) {
        check_init()?;
        let mut inner = lock();
        let found = mappings_in(&inner, ptr, size as u64)?;
        if found.is_empty() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        for (start, r) in found {
            unmap_one(&mut inner, start, r);
        }
        Ok(())
    }
}

cuda_fn! {
    /// Mapped memory is always accessible in the simulation.
    fn cuMemSetAccess(ptr: CUdeviceptr, size: usize, desc: *const c_void, count: usize) {
        check_init()?;
        if desc.is_null() || count == 0 || size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let inner = lock();
        inner.check_device_range(ptr, size as u64)
    }
}
