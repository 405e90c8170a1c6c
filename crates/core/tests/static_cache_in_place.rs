//! Proof that the static cache writes in place: appending a token allocates memory in
//! proportion to the token, not to the cache. burn copies a whole tensor on `slice_assign` when
//! its handle is shared, so a cache that kept a second handle (or forgot `inplace`) would
//! allocate a full layer per write and fail here.
//!
//! A counting global allocator is used, so this runs on the CPU backends, whose tensors live
//! on the heap; `benches/kv_cache.rs` shows the same on every backend as time per append. It
//! counts what the measuring thread allocates (a copy of the cache is allocated by the thread
//! that asks for the write): the tests of this binary run in parallel, and a global count
//! would add theirs.

#![allow(clippy::unwrap_used)] // a test that fails on unwrap is the point

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use burn::tensor::{Tensor, TensorData};
use kiln_core::attention::{AttentionPlan, attend};
use kiln_core::kv_cache::{KvCache, KvLayout, StaticKvCache};
use kiln_core::{Batch, Dtype, Position, SeqId, TokenId};

struct Counting;

thread_local! {
    /// Bytes this thread has allocated (const-initialised: no allocation of its own).
    static ALLOCATED: Cell<usize> = const { Cell::new(0) };
}

/// Bytes the current thread has allocated so far.
fn allocated() -> usize {
    ALLOCATED.with(Cell::get)
}

// SAFETY: forwards to the system allocator, only counting bytes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // `try_with`: a thread being torn down has no counter left, and is not measured.
        let _ = ALLOCATED.try_with(|n| n.set(n.get() + layout.size()));
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const LAYOUT: KvLayout = KvLayout {
    n_layers: 1,
    n_kv_heads: 4,
    head_dim: 64,
};

fn decode_allocations<B: kiln_core::InferenceBackend>(device: &B::Device) -> (usize, usize) {
    // 8 rows x 4096 slots x 4 heads x 64 x 4 bytes = 32 MiB per K or V tensor.
    let mut cache = StaticKvCache::<B>::new(LAYOUT, 8, 4096, Dtype::F32, device).unwrap();
    let layer_bytes = 8 * 4096 * LAYOUT.n_kv_heads * LAYOUT.head_dim * 4;
    let mut measured = 0;
    for step in 0..8u32 {
        let batch = Batch::single(SeqId(1), &[TokenId(step)], Position(step)).unwrap();
        let kv = || {
            Tensor::<B, 3>::from_data(
                TensorData::new(
                    vec![0.5f32; LAYOUT.n_kv_heads * LAYOUT.head_dim],
                    [1, 4, 64],
                ),
                device,
            )
        };
        let (k, v) = (kv(), kv());
        let plan = cache.plan(&batch).unwrap();
        let before = allocated();
        cache.write(0, &plan, k, v);
        B::sync(device).unwrap();
        let bytes = allocated() - before;
        // The first write may allocate lazily (zeros materialised on first use).
        if step > 0 {
            measured = measured.max(bytes);
        }
    }
    (measured, layer_bytes)
}

/// The counter sees a copy: writing one row into a tensor whose handle is shared makes burn
/// copy the whole tensor, on the writing thread (the failure the tests below guard against).
#[test]
fn a_write_through_a_shared_handle_is_counted_as_a_copy() {
    type B = burn::backend::Flex;
    let device = Default::default();
    let tensor = Tensor::<B, 2>::zeros([1024, 1024], &device);
    let shared = tensor.clone();
    let row = Tensor::<B, 2>::ones([1, 1024], &device);
    let before = allocated();
    let written = tensor.slice_assign([0..1, 0..1024], row);
    let bytes = allocated() - before;
    drop((written, shared));
    assert!(bytes >= 1024 * 1024 * 4, "the copy allocated {bytes} bytes");
}

#[test]
fn static_cache_appends_without_copying_the_cache_flex() {
    let (bytes, layer) = decode_allocations::<burn::backend::Flex>(&Default::default());
    assert!(
        bytes < layer / 64,
        "a one-token append allocated {bytes} bytes; the layer is {layer} bytes"
    );
}

#[cfg(feature = "ndarray")]
#[test]
fn static_cache_appends_without_copying_the_cache_ndarray() {
    let (bytes, layer) = decode_allocations::<burn::backend::NdArray>(&Default::default());
    assert!(
        bytes < layer / 64,
        "a one-token append allocated {bytes} bytes; the layer is {layer} bytes"
    );
}

/// The same guarantee through attention: a decode step reads the cache but must not leave a
/// handle behind that makes the next write copy, so what a step allocates stays far below a
/// layer's K/V (a copy would be all of it) and barely grows with the cache's capacity. (It
/// may grow a little: when the thread pool is busy with other tests, the calling thread runs
/// the flash-decoding partitions itself, and their per-partition scratch, one row per 512
/// keys, is counted here.)
#[test]
fn decode_step_allocations_do_not_grow_with_capacity() {
    let small = decode_step_bytes(1024);
    let large = decode_step_bytes(8192);
    let large_layer = 8 * 8192 * LAYOUT.n_kv_heads * LAYOUT.head_dim * 4;
    assert!(
        large <= small + large_layer / 1024 && large < large_layer / 256,
        "a decode step allocated {small} bytes with 1024 slots per row and {large} with 8192 \
         (one layer's K is {large_layer} bytes)"
    );
}

fn decode_step_bytes(slots: usize) -> usize {
    type B = burn::backend::Flex;
    let device = Default::default();
    let mut cache = StaticKvCache::<B>::new(LAYOUT, 8, slots, Dtype::F32, &device).unwrap();
    let mut worst = 0;
    for step in 0..6u32 {
        let batch = Batch::single(SeqId(1), &[TokenId(step)], Position(step)).unwrap();
        let plan = cache.plan(&batch).unwrap();
        let plan = AttentionPlan::new(&batch, plan, 8, 4, &device);
        let q = Tensor::<B, 3>::ones([1, 8, 64], &device);
        let kv = Tensor::<B, 3>::ones([1, 4, 64], &device);
        let before = allocated();
        let out = attend(&mut cache, 0, &plan, q, kv.clone(), kv);
        drop(out);
        let bytes = allocated() - before;
        if step > 0 {
            worst = worst.max(bytes);
        }
    }
    worst
}
