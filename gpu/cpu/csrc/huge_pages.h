// Memory for what every step reads whole: the packed weights (ops.cpp gemm_pack, quant_ops.cpp
// wpack) and the paged KV cache (huge_zeros). Mapped on its own, 2 MiB-aligned and advised
// MADV_HUGEPAGE, so that the kernel backs it with transparent huge pages wherever the system
// allows them: in "madvise" mode, the usual default, only memory that asks gets them, and
// torch's allocator does not ask (unless THP_MEM_ALLOC_ENABLE is set). A one-row product
// streams its weights once a token; on 4 KiB pages that is a TLB miss every 4 KiB. Measured on
// a 2-core Zen 4 (benchmarks/huge_pages.py, docs/benchmarks.md): one-row products over 150-290
// MB of weights 1.27-1.36x on one thread, 1.09-1.14x on two. The advice is only advice: where
// it is refused (no THP in the kernel) the memory is ordinary pages.
#pragma once

#include <sys/mman.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <cstdint>

namespace weir_ops {

constexpr int64_t kHugePage = int64_t(2) << 20;

// An uninitialized tensor of `sizes` and `type` (zero-filled when it is mapped: at least one
// huge page of bytes); smaller ones come from torch's allocator. Only whole huge pages are
// advised: the tail past the last one stays in 4 KiB pages, so a tensor costs no more resident
// memory than its bytes (a huge page for its last few bytes would add up to 2 MiB a weight).
inline at::Tensor huge_empty(at::IntArrayRef sizes, at::ScalarType type) {
    int64_t numel = 1;
    for (const int64_t s : sizes) numel *= s;
    const int64_t bytes = numel * int64_t(c10::elementSize(type));
    const auto options = at::TensorOptions().dtype(type);
    if (bytes < kHugePage) return at::empty(sizes, options);
    const int64_t size = (bytes + 4095) / 4096 * 4096;
    // map a huge page more than needed, then give back the slack before and after the aligned part
    void* raw = mmap(nullptr, size_t(size + kHugePage), PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK(raw != MAP_FAILED, "out of memory: could not map ", size, " bytes");
    const uintptr_t start = uintptr_t(raw), end = start + uintptr_t(size + kHugePage);
    const uintptr_t aligned = (start + kHugePage - 1) / kHugePage * kHugePage;
    if (aligned > start) munmap(raw, aligned - start);
    if (end > aligned + size) munmap(reinterpret_cast<void*>(aligned + size), end - aligned - size);
    void* p = reinterpret_cast<void*>(aligned);
    madvise(p, size_t(bytes / kHugePage * kHugePage), MADV_HUGEPAGE);
    return at::from_blob(
        p, sizes, [size](void* q) { munmap(q, size_t(size)); }, options);
}

}  // namespace weir_ops
