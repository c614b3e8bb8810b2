//! Shared by the core's integration tests: a global allocator that tracks,
//! per thread, the heap in use and its peak, so a test can measure what one
//! call allocates while other tests run on other threads.
#![allow(dead_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// Counts this thread's allocations on top of the system allocator.
pub struct Counting;

thread_local! {
    // Const-initialized, no destructor: safe to touch from the allocator.
    static IN_USE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn add(delta: isize) {
    let _ = IN_USE.try_with(|u| {
        let now = u.get() + delta;
        u.set(now);
        let _ = PEAK.try_with(|p| p.set(p.get().max(now)));
    });
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            add(l.size() as isize);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) };
        add(-(l.size() as isize));
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let q = unsafe { System.realloc(p, l, new) };
        if !q.is_null() {
            add(new as isize - l.size() as isize);
        }
        q
    }
}

/// Runs `f` and returns its result with the peak heap it added on this
/// thread (bytes above what was in use when it started).
pub fn peak_alloc<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let start = IN_USE.with(Cell::get);
    PEAK.with(|p| p.set(start));
    let out = f();
    let peak = PEAK.with(Cell::get) - start;
    (out, peak.max(0) as usize)
}
