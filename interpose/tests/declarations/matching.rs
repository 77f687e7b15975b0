use std::ffi::{c_char, c_void};

mod hooks {
    use vgpu_interpose::Real;

    #[allow(non_snake_case)]
    pub unsafe fn fakeAlloc(real: Real<unsafe fn(*mut u64, usize) -> i32>, ptr: *mut u64, bytes: usize) -> i32 {
        // SAFETY: forwarded unchanged.
        let code = unsafe { (real.call)(ptr, bytes) };
        if real.per_thread { code - 10 } else { code }
    }
}

unsafe fn resolve(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    // SAFETY: forwarded unchanged.
    unsafe { vgpu_interpose::libc::dlsym(handle, name) }
}

vgpu_interpose::driver_library! {
    library fake, sonames ["libvgpu-no-such-driver.so.1"], missing -1, on_panic -2,
        hooks crate::hooks, resolve resolve;
    hooked {
        fn fakeAlloc(ptr: *mut u64, bytes: usize) -> i32;
        twin fakeAlloc_ptsz;
    }
    used {}
}

fn main() {
    let mut pointer = 0u64;
    // No such driver: the real function is missing, the hook still runs.
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { fake::exported::fakeAlloc(&mut pointer, 1) }, -1);
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { fake::exported::fakeAlloc_ptsz(&mut pointer, 1) }, -11);
    assert!(fake::LIBRARY.hooks_name(c"fakeAlloc_ptsz"));
    assert!(!fake::LIBRARY.hooks_name(c"fakeFree"));
}
