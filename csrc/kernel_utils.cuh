// Device helpers shared by the gafused kernels: element conversions, wide vectors, the chunk walker and a
// deterministic block reduction. CUDA headers only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "gafused_kernels.h"

namespace gafused {
namespace detail {

// Threads of the streaming kernels. Each thread moves kUnroll wide vectors per loop trip so several 16-byte
// loads are in flight before the first one is used.
constexpr int kThreads = 256;
constexpr int kUnroll = 4;
// Resident blocks per SM the grid is sized for; more blocks than that only add waves.
constexpr int kBlocksPerSm = 8;

// Marks "this segment has no gradient" in templates that take a gradient element type.
struct NoGrad {};

// --- element conversions: one rounding each, the same roundings as torch's Tensor.to -------------------------

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(double x) { return static_cast<float>(x); }  // round to nearest even
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

// Any supported element type into the accumulation type (float or double).
template <typename acc_t, typename src_t>
__device__ __forceinline__ acc_t to_acc(src_t x) {
  if constexpr (std::is_same_v<acc_t, double> && std::is_same_v<src_t, double>) {
    return x;
  } else if constexpr (std::is_same_v<acc_t, double>) {
    return static_cast<double>(to_float(x));  // exact: every narrower type fits in a double
  } else {
    return to_float(x);
  }
}

// The accumulation type into an output element type. torch casts a double to bf16/fp16 through float, so
// this does too: a result that matches the reference bit for bit beats a single rounding here.
template <typename out_t, typename acc_t>
__device__ __forceinline__ out_t from_acc(acc_t x) {
  if constexpr (std::is_same_v<out_t, acc_t>) {
    return x;
  } else if constexpr (std::is_same_v<out_t, double>) {
    return static_cast<double>(x);
  } else {
    const float f = static_cast<float>(x);
    if constexpr (std::is_same_v<out_t, float>) {
      return f;
    } else if constexpr (std::is_same_v<out_t, __nv_bfloat16>) {
      return __float2bfloat16_rn(f);
    } else {
      static_assert(std::is_same_v<out_t, __half>, "unsupported output type");
      return __float2half_rn(f);
    }
  }
}

// Multiply and add with explicit rounding: the compiler may not contract them into one fma, which would
// round once where the reference rounds twice and break bitwise agreement with it.
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

// --- wide vectors -----------------------------------------------------------------------------------------

// N elements loaded or stored as one aligned access (16 bytes for the accumulation type).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// Accumulator elements per 16-byte access: 4 floats or 2 doubles.
template <typename acc_t>
constexpr int kVecElems = 16 / static_cast<int>(sizeof(acc_t));

__device__ __forceinline__ bool is_aligned(const void* ptr, size_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

// --- work distribution ------------------------------------------------------------------------------------

// Calls body(segment, begin, count, chunk) for each chunk this block owns: chunk `chunk` of the table is
// elements [begin, begin + count) of segment `segment`. A block owns a contiguous run of chunks, so the
// binary search for its first segment runs once and later chunks advance linearly through the table.
// body must be called by every thread of the block (it may synchronize).
template <typename Body>
__device__ __forceinline__ void for_each_chunk(const SegmentTable& table, Body&& body) {
  const int64_t per_block = (table.num_chunks + gridDim.x - 1) / gridDim.x;
  int64_t chunk = static_cast<int64_t>(blockIdx.x) * per_block;
  const int64_t end = chunk + per_block < table.num_chunks ? chunk + per_block : table.num_chunks;
  if (chunk >= end) return;
  // Invariant: first_chunks[low] <= chunk < first_chunks[high]; ends on the one segment holding the chunk
  // (segments without elements own no chunk, so they are skipped by the strict upper bound).
  int64_t low = 0;
  int64_t high = table.count;
  while (high - low > 1) {
    const int64_t mid = low + (high - low) / 2;
    if (table.first_chunks[mid] <= chunk) {
      low = mid;
    } else {
      high = mid;
    }
  }
  int64_t segment = low;
  for (; chunk < end; ++chunk) {
    while (table.first_chunks[segment + 1] <= chunk) ++segment;
    const int64_t begin = (chunk - table.first_chunks[segment]) * kChunkElems;
    const int64_t left = table.numels[segment] - begin;
    body(segment, begin, left < kChunkElems ? left : kChunkElems, chunk);
  }
}

// Blocks for a launch over `num_chunks` chunks on the current device (at least 1).
inline cudaError_t grid_for_chunks(int64_t num_chunks, int* grid) {
  int device = 0;
  int sms = 0;
  cudaError_t error = cudaGetDevice(&device);
  if (error != cudaSuccess) return error;
  error = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (error != cudaSuccess) return error;
  const int64_t cap = static_cast<int64_t>(sms) * kBlocksPerSm;
  const int64_t blocks = num_chunks < cap ? num_chunks : cap;
  *grid = blocks > 0 ? static_cast<int>(blocks) : 1;
  return cudaSuccess;
}

// --- deterministic block reduction ------------------------------------------------------------------------

// Sum of `value` over the block, valid in thread 0. The order is fixed (a shuffle tree per warp, then a
// shuffle tree over the warp sums), so the same inputs give the same bits on every run. Every thread of the
// block must call it; it synchronizes, and may be called again right after.
template <int kBlockThreads, typename T>
__device__ __forceinline__ T block_sum(T value) {
  static_assert(kBlockThreads % 32 == 0 && kBlockThreads <= 1024, "block size must be whole warps");
  constexpr int kWarps = kBlockThreads / 32;
  __shared__ T warp_sums[kWarps];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_down_sync(0xffffffffu, value, offset);
  if (lane == 0) warp_sums[warp] = value;
  __syncthreads();
  if (warp == 0) {
    value = lane < kWarps ? warp_sums[lane] : T(0);
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) value += __shfl_down_sync(0xffffffffu, value, offset);
  }
  __syncthreads();  // warp_sums is free again for the next call
  return value;
}

// Sum of squares and "any inf/nan" of the values one thread produced.
template <typename acc_t>
struct ChunkStats {
  acc_t sum_of_squares = acc_t(0);
  bool nonfinite = false;

  __device__ __forceinline__ void add(acc_t value) {
    sum_of_squares += value * value;
    nonfinite |= !isfinite(value);
  }
};

}  // namespace detail
}  // namespace gafused
