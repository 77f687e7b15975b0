use std::ffi::{c_char, c_void};

mod hooks {
    use vgpu_interpose::Real;

    // Declared below as returning i32; the hook returns u32.
    #[allow(non_snake_case)]
    pub unsafe fn fakeFree(_real: Real<unsafe fn(u64) -> i32>, _ptr: u64) -> u32 {
        0
    }
}

unsafe fn resolve(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    unsafe { vgpu_interpose::libc::dlsym(handle, name) }
}

vgpu_interpose::driver_library! {
    library fake, sonames ["libvgpu-no-such-driver.so.1"], missing -1, on_panic -2,
        hooks crate::hooks, resolve resolve;
    hooked {
        fn fakeFree(ptr: u64) -> i32;
    }
    used {}
}

fn main() {}
