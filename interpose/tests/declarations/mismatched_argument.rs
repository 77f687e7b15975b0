use std::ffi::{c_char, c_void};

mod hooks {
    use vgpu_interpose::Real;

    // Declared below with `bytes: usize`; the hook takes a u32.
    #[allow(non_snake_case)]
    pub unsafe fn fakeAlloc(real: Real<unsafe fn(*mut u64, u32) -> i32>, ptr: *mut u64, bytes: u32) -> i32 {
        unsafe { (real.call)(ptr, bytes) }
    }
}

unsafe fn resolve(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    unsafe { vgpu_interpose::libc::dlsym(handle, name) }
}

vgpu_interpose::driver_library! {
    library fake, sonames ["libvgpu-no-such-driver.so.1"], missing -1, on_panic -2,
        hooks crate::hooks, resolve resolve;
    hooked {
        fn fakeAlloc(ptr: *mut u64, bytes: usize) -> i32;
    }
    used {}
}

fn main() {}
