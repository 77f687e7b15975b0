//! The machinery under the shim's hooks: how a driver library's functions
//! are declared once and what that one declaration produces.
//!
//! [`driver_library!`] takes each function's C signature, once. For every
//! function it gives a slot for the real function's address, filled when
//! the library is first needed (`dlopen` of the driver, then a `dlsym` that
//! bypasses the shim's own), and a typed caller. For a *hooked* function it
//! also exports the hook under the driver's exact symbol name, calls the
//! implementation `$hooks::<name>` inside a panic guard, and records the
//! pair (real address, hook address) so an address a program got from the
//! driver (through `dlsym` or `cuGetProcAddress`) can be swapped for the
//! hook of exactly that variant. A `twin` (the driver's `_ptsz` variant for
//! per-thread default streams) gets all of that too, from the same line and
//! the same implementation; so does an `alias` (another versioned name of
//! the same function with the same signature, such as `_v2`).
//!
//! The implementation must have exactly the declared signature, after a
//! leading [`Real`] through which it reaches the real function: a hook that
//! differs from the driver's C signature does not compile (see
//! `tests/declarations/`).
//!
//! The hot path of a typed caller is one relaxed atomic load and a call.

use std::ffi::{c_char, c_void, CStr};
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::OnceLock;

#[doc(hidden)]
pub use libc;

/// Looks a symbol up in a `dlopen` handle without going through any
/// `dlsym` override (the shim exports its own).
pub type Resolver = unsafe fn(*mut c_void, *const c_char) -> *mut c_void;

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

/// The real function a hook implementation forwards to: the driver's own
/// variant of the function that was called (the legacy one, or its
/// per-thread-default-stream twin).
#[derive(Clone, Copy)]
pub struct Real<F> {
    /// Calls the real function (returns the library's "missing" code when
    /// the driver lacks it).
    pub call: F,
    /// Whether the called variant is the `_ptsz` twin, whose stream 0 means
    /// the calling thread's default stream.
    pub per_thread: bool,
}

/// A driver library and the functions the shim takes from it.
pub struct Library {
    pub sonames: &'static [&'static CStr],
    pub functions: fn() -> &'static [&'static RealFn],
    pub hooks: fn() -> &'static [Hook],
    pub resolve: Resolver,
    /// Real address -> hook address, sorted by real address.
    pub redirects: OnceLock<Vec<(usize, usize)>>,
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
            return Vec::new();
        };
        for function in (self.functions)() {
            // SAFETY: the resolver is a plain dlsym; the handle is live and
            // the name NUL-terminated.
            let address = unsafe { (self.resolve)(handle, function.name.as_ptr()) };
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

/// A `&'static CStr` from a string literal, checked at compile time.
#[doc(hidden)]
#[macro_export]
macro_rules! c_name {
    ($name:expr) => {
        match ::std::ffi::CStr::from_bytes_with_nul(concat!($name, "\0").as_bytes()) {
            Ok(name) => name,
            Err(_) => panic!("a symbol name contains a NUL byte"),
        }
    };
}

/// A typed caller of a real function (see the crate docs).
#[doc(hidden)]
#[macro_export]
macro_rules! real_caller {
    ($name:ident, ($($arg:ident : $ty:ty),*) -> $ret:ty, $missing:expr) => {
        /// Calls the real function.
        ///
        /// # Safety
        /// The arguments must satisfy the C API's contract.
        // The SAFETY comments below are stripped by macro expansion, which
        // is why the lint is silenced here.
        #[allow(clippy::undocumented_unsafe_blocks)]
        #[inline(always)]
        pub unsafe fn $name($($arg: $ty),*) -> $ret {
            let address = real::$name.get(&LIBRARY);
            if address.is_null() {
                return $missing;
            }
            // SAFETY: the address was resolved for this symbol, whose C
            // signature is the one declared here.
            let function = unsafe {
                ::std::mem::transmute::<*mut ::std::ffi::c_void, unsafe extern "C" fn($($ty),*) -> $ret>(address)
            };
            // SAFETY: forwarded under the caller's contract.
            unsafe { function($($arg),*) }
        }
    };
}

/// An exported hook calling its implementation (see the crate docs).
#[doc(hidden)]
#[macro_export]
macro_rules! exported_hook {
    ($impl_name:ident, $name:ident, $per_thread:expr, ($($arg:ident : $ty:ty),*) -> $ret:ty, $on_panic:expr) => {
        #[unsafe(no_mangle)]
        #[allow(clippy::undocumented_unsafe_blocks)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> $ret {
            // The implementation must take exactly the declared C types.
            let implementation: unsafe fn($crate::Real<unsafe fn($($ty),*) -> $ret>, $($ty),*) -> $ret =
                super::hook_implementations::$impl_name;
            let real = $crate::Real {
                call: super::$name as unsafe fn($($ty),*) -> $ret,
                per_thread: $per_thread,
            };
            // A panic must not cross into the C caller.
            match ::std::panic::catch_unwind(::std::panic::AssertUnwindSafe(|| {
                // SAFETY: forwarded under the caller's contract.
                unsafe { implementation(real, $($arg),*) }
            })) {
                Ok(value) => value,
                Err(_) => $on_panic,
            }
        }
    };
}

/// The items of a `_ptsz` twin or an alias, if the declaration names one.
#[doc(hidden)]
#[macro_export]
macro_rules! twin {
    (real_caller, [], $($rest:tt)*) => {};
    (real_caller, [$twin:ident], $($rest:tt)*) => {
        $crate::real_caller!($twin, $($rest)*);
    };
    (exported_hook, [], $($rest:tt)*) => {};
    (exported_hook, [$twin:ident], $per_thread:expr, $hname:ident, $($rest:tt)*) => {
        $crate::exported_hook!($hname, $twin, $per_thread, $($rest)*);
    };
}

/// Declares a driver library and its functions (see the crate docs).
///
/// ```ignore
/// driver_library! {
///     library cuda, sonames ["libcuda.so.1"], missing CUDA_ERROR_NOT_SUPPORTED,
///         on_panic CUDA_ERROR_UNKNOWN, hooks crate::hooks, resolve crate::dlsym::real_dlsym;
///     hooked {
///         fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytes: usize) -> CUresult;
///         fn cuLaunchKernel(...) -> CUresult; twin cuLaunchKernel_ptsz;
///         fn cuDevicePrimaryCtxRelease(device: CUdevice) -> CUresult; alias cuDevicePrimaryCtxRelease_v2;
///     }
///     used {
///         fn cuCtxGetDevice(device: *mut CUdevice) -> CUresult;
///     }
/// }
/// ```
#[macro_export]
macro_rules! driver_library {
    (
        library $lib:ident, sonames [$($soname:literal),+], missing $missing:expr,
            on_panic $on_panic:expr, hooks $($hooks:ident)::+, resolve $resolve:path;
        hooked { $( fn $hname:ident ( $($harg:ident : $hty:ty),* $(,)? ) -> $hret:ty; $(twin $twin:ident;)? $(alias $alias:ident;)? )* }
        used { $( fn $uname:ident ( $($uarg:ident : $uty:ty),* $(,)? ) -> $uret:ty; )* }
    ) => {
        #[allow(non_snake_case, non_upper_case_globals, clippy::too_many_arguments)]
        pub mod $lib {
            use super::*;
            #[allow(unused_imports)]
            use $($hooks)::+ as hook_implementations;

            /// Real function addresses.
            pub mod real {
                use $crate::RealFn;
                $( pub static $hname: RealFn = RealFn::new($crate::c_name!(stringify!($hname)));
                   $( pub static $twin: RealFn = RealFn::new($crate::c_name!(stringify!($twin))); )?
                   $( pub static $alias: RealFn = RealFn::new($crate::c_name!(stringify!($alias))); )? )*
                $( pub static $uname: RealFn = RealFn::new($crate::c_name!(stringify!($uname))); )*
            }

            /// The Rust-side type of each hooked function's real caller, as
            /// its implementation receives it inside [`Real`]($crate::Real).
            #[allow(non_camel_case_types)]
            pub mod signature {
                use super::*;
                $( pub type $hname = unsafe fn($($hty),*) -> $hret; )*
            }

            static FUNCTIONS: &[&$crate::RealFn] = &[
                $( &real::$hname, $( &real::$twin, )? $( &real::$alias, )? )*
                $( &real::$uname, )*
            ];
            static HOOKS: &[$crate::Hook] = &[ $(
                $crate::Hook { real: &real::$hname, hook: exported::$hname as *const ::std::ffi::c_void },
                $( $crate::Hook { real: &real::$twin, hook: exported::$twin as *const ::std::ffi::c_void }, )?
                $( $crate::Hook { real: &real::$alias, hook: exported::$alias as *const ::std::ffi::c_void }, )?
            )* ];

            pub static LIBRARY: $crate::Library = $crate::Library {
                sonames: &[ $( $crate::c_name!($soname), )+ ],
                functions: || FUNCTIONS,
                hooks: || HOOKS,
                resolve: $resolve,
                redirects: ::std::sync::OnceLock::new(),
            };

            $(
                $crate::real_caller!($hname, ($($harg: $hty),*) -> $hret, $missing);
                $crate::twin!(real_caller, [$($twin)?], ($($harg: $hty),*) -> $hret, $missing);
                $crate::twin!(real_caller, [$($alias)?], ($($harg: $hty),*) -> $hret, $missing);
            )*
            $( $crate::real_caller!($uname, ($($uarg: $uty),*) -> $uret, $missing); )*

            /// The exported hooks, under the driver's symbol names.
            pub mod exported {
                use super::*;
                $(
                    $crate::exported_hook!($hname, $hname, false, ($($harg: $hty),*) -> $hret, $on_panic);
                    $crate::twin!(exported_hook, [$($twin)?], true, $hname, ($($harg: $hty),*) -> $hret, $on_panic);
                    $crate::twin!(exported_hook, [$($alias)?], false, $hname, ($($harg: $hty),*) -> $hret, $on_panic);
                )*
            }
        }
    };
}
