//! The `dlsym` override.
//!
//! Programs that `dlopen` the driver and look functions up with `dlsym` would
//! bypass plain symbol interposition, so the shim exports its own `dlsym`:
//! a lookup that returns a real driver function we hook gets our hook instead.
//!
//! `dlsym(RTLD_NEXT, name)` is special: glibc finds "the next object after
//! the caller" from the return address of the call. If we called the real
//! `dlsym` from Rust, glibc would see *this library* as the caller, and an
//! interposer loaded after us that forwards with `RTLD_NEXT` would be handed
//! its own function again and recurse forever. So the exported entry point
//! is a few instructions of assembly that, for `RTLD_NEXT`, jump straight to
//! the real `dlsym` with the caller's return address untouched. No result
//! rewriting is needed there: whatever the caller is "next" to is by
//! definition what it asked for, and a program before us in the search order
//! gets our hook naturally, because we are next.

use std::ffi::{c_char, c_void};
use std::sync::atomic::{AtomicPtr, Ordering};

type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

/// glibc's `dlsym`, found with `dlvsym` (which we do not override).
static REAL_DLSYM: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());

/// Finds glibc's `dlsym`, trying the symbol versions current glibc exports
/// for x86_64 (2.34 moved it into libc) and the original one.
extern "C" fn resolve_real_dlsym() -> *mut c_void {
    let current = REAL_DLSYM.load(Ordering::Acquire);
    if !current.is_null() {
        return current;
    }
    let mut found = std::ptr::null_mut();
    for version in [c"GLIBC_2.34", c"GLIBC_2.2.5"] {
        // SAFETY: dlvsym with NUL-terminated strings; RTLD_NEXT from this
        // library finds the next definition after us, i.e. glibc's.
        found = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), version.as_ptr()) };
        if !found.is_null() {
            break;
        }
    }
    if found.is_null() {
        found = dlsym_unavailable as *mut c_void;
    }
    REAL_DLSYM.store(found, Ordering::Release);
    found
}

/// Stand-in used only if glibc's `dlsym` cannot be found at all.
extern "C" fn dlsym_unavailable(_handle: *mut c_void, _name: *const c_char) -> *mut c_void {
    std::ptr::null_mut()
}

/// Calls glibc's `dlsym` on an explicit handle.
///
/// # Safety
/// `handle` must be a handle from `dlopen` (or a pseudo-handle) and `name`
/// a NUL-terminated string.
pub unsafe fn real_dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    let address = resolve_real_dlsym();
    // SAFETY: `address` is glibc's dlsym (or our null-returning stand-in),
    // both with dlsym's signature.
    let function = unsafe { std::mem::transmute::<*mut c_void, DlsymFn>(address) };
    // SAFETY: forwarded under the caller's contract.
    unsafe { function(handle, name) }
}

/// Every lookup other than `RTLD_NEXT`.
extern "C" fn dlsym_lookup(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    let result = std::panic::catch_unwind(|| {
        // SAFETY: forwarded from the program's own dlsym call.
        let address = unsafe { real_dlsym(handle, name) };
        crate::driver::redirect_any(address, name)
    });
    match result {
        Ok(address) => address,
        // The lookup itself cannot have failed in a way we could repair:
        // answer as glibc would have without us.
        // SAFETY: as above.
        Err(_) => unsafe { real_dlsym(handle, name) },
    }
}

/// The exported `dlsym`. See the module documentation for why this is
/// assembly: the `RTLD_NEXT` path must reach glibc with the caller's return
/// address still on the stack.
///
/// # Safety
/// Same contract as glibc's `dlsym`.
#[unsafe(naked)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    core::arch::naked_asm!(
        // RTLD_NEXT is (void *)-1.
        "cmp rdi, -1",
        "jne {lookup}",
        "mov rax, qword ptr [rip + {real}]",
        "test rax, rax",
        "jz 2f",
        "jmp rax",
        // First call: resolve glibc's dlsym, keeping the arguments and a
        // 16-byte aligned stack across the call.
        "2:",
        "push rdi",
        "push rsi",
        "sub rsp, 8",
        "call {resolve}",
        "add rsp, 8",
        "pop rsi",
        "pop rdi",
        "jmp rax",
        lookup = sym dlsym_lookup,
        real = sym REAL_DLSYM,
        resolve = sym resolve_real_dlsym,
    )
}
