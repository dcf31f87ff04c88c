//! A global allocator that keeps freed large blocks for reuse ([`LargeBlockCache`]), opt-in for
//! binaries (`#[global_allocator]`).
//!
//! A training step allocates the same multi-gigabyte buffers every time (expert weight
//! gradients alone are 2.4 GB per Qwen3-30B-A3B layer step) and frees them at its end. The
//! system allocator returns such blocks to the OS (`munmap`), so every step faults every page
//! back in and the kernel zeroes it — on two cores that was as much time as the expert GEMMs
//! themselves. This wrapper around [`System`] parks freed blocks of at least
//! [`LargeBlockCache::min_block`] bytes (up to a byte budget) and hands them out again to
//! requests of exactly the same size and alignment: no page faults, and no zeroing for plain
//! allocations (zeroed allocations are cleared with `memset`). Everything else goes straight to
//! [`System`].
//!
//! ```
//! use moe_backend::alloc::LargeBlockCache;
//!
//! #[global_allocator]
//! static ALLOC: LargeBlockCache = LargeBlockCache::new(64 << 20, 8 << 30);
//! # fn main() {}
//! ```

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// Blocks the cache can hold at once.
const SLOTS: usize = 64;

/// A parked block.
#[derive(Clone, Copy)]
struct Slot {
    /// Address (0: empty slot).
    ptr: usize,
    size: usize,
    align: usize,
}

const EMPTY: Slot = Slot {
    ptr: 0,
    size: 0,
    align: 0,
};

struct Parked {
    slots: [Slot; SLOTS],
    bytes: usize,
}

/// [`System`] plus a cache of freed large blocks (see the module docs).
pub struct LargeBlockCache {
    min_block: usize,
    budget: usize,
    enabled: AtomicBool,
    parked: Mutex<Parked>,
}

impl LargeBlockCache {
    /// Caches freed blocks of at least `min_block` bytes while the parked total stays within
    /// `budget` bytes.
    pub const fn new(min_block: usize, budget: usize) -> Self {
        Self {
            min_block,
            budget,
            enabled: AtomicBool::new(true),
            parked: Mutex::new(Parked {
                slots: [EMPTY; SLOTS],
                bytes: 0,
            }),
        }
    }

    /// Turns caching on or off at run time (e.g. to measure its effect); blocks parked earlier
    /// stay available while it is off.
    pub fn set_enabled(&self, on: bool) {
        self.enabled.store(on, Ordering::Relaxed);
    }

    /// The smallest block size that is cached.
    pub fn min_block(&self) -> usize {
        self.min_block
    }

    /// Bytes parked right now.
    pub fn parked_bytes(&self) -> usize {
        self.parked.lock().map(|p| p.bytes).unwrap_or(0)
    }

    /// A parked block of exactly `layout`, removed from the cache.
    fn take(&self, layout: Layout) -> Option<*mut u8> {
        if layout.size() < self.min_block || !self.enabled.load(Ordering::Relaxed) {
            return None;
        }
        let mut parked = self.parked.lock().ok()?;
        let slot = parked
            .slots
            .iter_mut()
            .find(|s| s.ptr != 0 && s.size == layout.size() && s.align == layout.align())?;
        let ptr = slot.ptr as *mut u8;
        *slot = EMPTY;
        parked.bytes -= layout.size();
        Some(ptr)
    }

    /// Parks `ptr` if it is large and fits the budget; returns whether it was kept.
    fn park(&self, ptr: *mut u8, layout: Layout) -> bool {
        if layout.size() < self.min_block || !self.enabled.load(Ordering::Relaxed) {
            return false;
        }
        let Ok(mut parked) = self.parked.lock() else {
            return false;
        };
        if parked.bytes + layout.size() > self.budget {
            return false;
        }
        let Some(slot) = parked.slots.iter_mut().find(|s| s.ptr == 0) else {
            return false;
        };
        *slot = Slot {
            ptr: ptr as usize,
            size: layout.size(),
            align: layout.align(),
        };
        parked.bytes += layout.size();
        true
    }
}

// SAFETY: every block handed out is either fresh from `System` for that layout or a block
// `System` allocated earlier for an identical layout and that the program freed (so nothing
// else refers to it); blocks are only returned to `System` with the layout they were
// allocated with.
unsafe impl GlobalAlloc for LargeBlockCache {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        match self.take(layout) {
            Some(ptr) => ptr,
            // SAFETY: forwarded contract.
            None => unsafe { System.alloc(layout) },
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        match self.take(layout) {
            Some(ptr) => {
                // SAFETY: `ptr` is valid for `layout.size()` bytes (a block of that layout).
                unsafe { std::ptr::write_bytes(ptr, 0, layout.size()) };
                ptr
            }
            // SAFETY: forwarded contract.
            None => unsafe { System.alloc_zeroed(layout) },
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if !self.park(ptr, layout) {
            // SAFETY: forwarded contract (`ptr` came from `System` with `layout`).
            unsafe { System.dealloc(ptr, layout) }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if layout.size() < self.min_block && new_size < self.min_block {
            // SAFETY: forwarded contract; small blocks are never parked.
            return unsafe { System.realloc(ptr, layout, new_size) };
        }
        // SAFETY: `new_size` with the old alignment is a valid layout (GlobalAlloc contract).
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        // SAFETY: forwarded contract.
        let new = unsafe { self.alloc(new_layout) };
        if !new.is_null() {
            // SAFETY: both blocks are valid for the copied length and do not overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
        }
        new
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_blocks_are_reused_zeroed_on_request_and_budgeted() {
        let cache = LargeBlockCache::new(1 << 20, 3 << 20);
        let big = Layout::from_size_align(1 << 20, 64).unwrap();
        let small = Layout::from_size_align(4096, 8).unwrap();
        // SAFETY: layouts are non-zero; every block is freed with its layout.
        unsafe {
            let a = cache.alloc(big);
            assert!(!a.is_null());
            a.write_bytes(0xAB, big.size());
            cache.dealloc(a, big);
            assert_eq!(cache.parked_bytes(), 1 << 20);
            // The same layout gets the parked block back; a zeroed request is cleared.
            let b = cache.alloc_zeroed(big);
            assert_eq!(b, a);
            assert!(
                std::slice::from_raw_parts(b, big.size())
                    .iter()
                    .all(|&x| x == 0)
            );
            assert_eq!(cache.parked_bytes(), 0);
            // Another alignment is not served from the cache.
            cache.dealloc(b, big);
            let other = Layout::from_size_align(1 << 20, 4096).unwrap();
            let c = cache.alloc(other);
            assert_ne!(c, b);
            cache.dealloc(c, other);
            // Small blocks never park; the budget caps the parked bytes.
            let s = cache.alloc(small);
            cache.dealloc(s, small);
            assert_eq!(cache.parked_bytes(), 2 << 20);
            let d = cache.alloc(Layout::from_size_align(2 << 20, 64).unwrap());
            cache.dealloc(d, Layout::from_size_align(2 << 20, 64).unwrap());
            assert_eq!(
                cache.parked_bytes(),
                2 << 20,
                "over budget: freed to the system"
            );
            // Growing a block through realloc keeps its contents.
            let e = cache.alloc(big);
            e.write_bytes(7, big.size());
            let f = cache.realloc(e, big, 2 << 20);
            assert_eq!(*f.add((1 << 20) - 1), 7);
            cache.dealloc(f, Layout::from_size_align(2 << 20, 64).unwrap());
        }
    }
}
