//! A small lock that a forked child can take over.
//!
//! `std::sync::Mutex` cannot be reset in a child forked while another thread
//! held it; this lock can, because the fork handlers take it before the
//! address space is copied and the child's handler releases it after
//! resetting the data. Critical sections under it are a few hash-map or
//! vector operations long, so waiting spins briefly and then yields.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, Ordering};

pub struct ForkSafeLock<T> {
    locked: AtomicBool,
    data: UnsafeCell<T>,
}

// SAFETY: `data` is only reached while `locked` is held (see `with`), which
// serialises access across threads.
unsafe impl<T: Send> Sync for ForkSafeLock<T> {}

impl<T> ForkSafeLock<T> {
    pub const fn new(data: T) -> Self {
        Self {
            locked: AtomicBool::new(false),
            data: UnsafeCell::new(data),
        }
    }

    fn lock(&self) {
        let mut spins = 0u32;
        while self
            .locked
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    fn unlock(&self) {
        self.locked.store(false, Ordering::Release);
    }

    /// Runs `f` on the data under the lock. The lock is released however
    /// `f` ends, a panic included: every hook catches panics at the FFI
    /// boundary and the process goes on, so a lock left held would hang the
    /// next driver call instead.
    pub fn with<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
        self.lock();
        let held = Held(self);
        // SAFETY: the lock gives this thread exclusive access until `held`
        // is dropped.
        f(unsafe { &mut *held.0.data.get() })
    }

    /// Like `with`, but gives up at once if the lock is held.
    pub fn try_with<R>(&self, f: impl FnOnce(&mut T) -> R) -> Option<R> {
        if self
            .locked
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            return None;
        }
        let held = Held(self);
        // SAFETY: the lock gives this thread exclusive access until `held`
        // is dropped.
        Some(f(unsafe { &mut *held.0.data.get() }))
    }

    /// `pthread_atfork` prepare handler.
    pub fn before_fork(&self) {
        self.lock();
    }

    /// `pthread_atfork` parent handler.
    pub fn after_fork_in_parent(&self) {
        self.unlock();
    }

    /// `pthread_atfork` child handler: `reset` runs on the data (the prepare
    /// handler holds the lock and the child has one thread), then the lock
    /// is released.
    pub fn after_fork_in_child(&self, reset: impl FnOnce(&mut T)) {
        // SAFETY: held since the prepare handler; the child is single-threaded.
        reset(unsafe { &mut *self.data.get() });
        self.unlock();
    }
}

/// Releases the lock when dropped, on return and on unwind alike.
struct Held<'a, T>(&'a ForkSafeLock<T>);

impl<T> Drop for Held<'_, T> {
    fn drop(&mut self) {
        self.0.unlock();
    }
}

impl<T> ForkSafeLock<T> {
    /// For a lock that the fork handlers did not take: in the
    /// single-threaded child, resets the data and releases the lock whoever
    /// held it in the parent. The data may have been mid-update, so `reset`
    /// must not read it.
    pub fn reset_in_child(&self, reset: impl FnOnce(&mut T)) {
        // SAFETY: called only in a forked child, which has one thread.
        reset(unsafe { &mut *self.data.get() });
        self.unlock();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn with_and_try_with() {
        let lock = ForkSafeLock::new(vec![1]);
        lock.with(|v| v.push(2));
        assert_eq!(lock.try_with(|v| v.len()), Some(2));
        lock.before_fork();
        assert_eq!(lock.try_with(|v| v.len()), None, "held across fork");
        lock.after_fork_in_child(|v| v.clear());
        assert_eq!(lock.with(|v| v.len()), 0);
    }

    #[test]
    fn a_panic_inside_releases_the_lock() {
        let lock = ForkSafeLock::new(0u32);
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            lock.with(|value| {
                *value = 1;
                panic!("inside the critical section");
            })
        }));
        assert!(caught.is_err());
        assert_eq!(lock.try_with(|value| *value), Some(1), "released on unwind");
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            lock.try_with(|_| panic!("inside try_with"))
        }));
        assert!(caught.is_err());
        assert_eq!(lock.try_with(|value| *value + 1), Some(2));
    }
}
