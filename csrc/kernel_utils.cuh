// Device helpers shared by the gafused kernels: element conversions, wide vectors, the chunk walker and a
// deterministic block reduction. CUDA headers only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "gafused_kernels.h"

namespace gafused {
namespace detail {

// Threads of the streaming kernels.
constexpr int kThreads = 256;

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

// Every global access of the streaming kernels' main loops is 16 bytes wide (LDG.E.128 / STG.E.128), on every
// stream: a thread handles kVecElems elements at a time, enough that the narrowest of the two element types fills
// 16 bytes (4 floats; 8 bf16 gradients, whose float accumulators then take two 16-byte accesses).
template <typename acc_t, typename other_t>
constexpr int kVecElems = 16 / static_cast<int>(sizeof(acc_t) < sizeof(other_t) ? sizeof(acc_t) : sizeof(other_t));

// Vectors a thread loads before it uses the first: 32 bytes of accumulator (plus its gradients) per thread in
// flight. At the 4-8 resident blocks per SM this leaves, that is 48-128 KB per SM, against the ~20 KB an H100
// needs by Little's law (3.35 TB/s x ~0.8 us over 132 SMs); unrolling deeper would only cost registers, and so
// resident blocks.
constexpr int kBytesInFlight = 32;
template <typename acc_t, int kVec>
constexpr int kUnrollFor = kVec * static_cast<int>(sizeof(acc_t)) >= kBytesInFlight
                               ? 1
                               : kBytesInFlight / (kVec * static_cast<int>(sizeof(acc_t)));

// N elements moved as sizeof(T) * N / 16 aligned 16-byte words.
template <typename T, int N>
struct alignas(16) Vec {
  static_assert(sizeof(T) * N % 16 == 0, "a vector is a whole number of 16-byte words");
  static constexpr int kWords = static_cast<int>(sizeof(T)) * N / 16;
  T v[N];
};

// The word accessors below spell out the 16-byte accesses, so the vector width does not depend on how the
// compiler splits a struct copy.
template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const Vec<T, N>* ptr) {
  Vec<T, N> out;
#pragma unroll
  for (int k = 0; k < Vec<T, N>::kWords; ++k) {
    reinterpret_cast<uint4*>(&out)[k] = reinterpret_cast<const uint4*>(ptr)[k];
  }
  return out;
}

// Gradients are read once per micro-step and never again: a streaming load (ld.global.cs, SASS LDG.E.EF) marks
// them evict-first so they do not push the accumulator out of L2. It also tells the compiler the address is
// global memory: a pointer rebuilt from the table's integers would otherwise get a generic LD.
template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_vec_streaming(const Vec<T, N>* ptr) {
  Vec<T, N> out;
#pragma unroll
  for (int k = 0; k < Vec<T, N>::kWords; ++k) {
    reinterpret_cast<uint4*>(&out)[k] = __ldcs(reinterpret_cast<const uint4*>(ptr) + k);
  }
  return out;
}

template <typename T>
__device__ __forceinline__ T load_streaming(const T* ptr) {
  return __ldcs(ptr);
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(Vec<T, N>* ptr, const Vec<T, N>& value) {
#pragma unroll
  for (int k = 0; k < Vec<T, N>::kWords; ++k) {
    reinterpret_cast<uint4*>(ptr)[k] = reinterpret_cast<const uint4*>(&value)[k];
  }
}

__device__ __forceinline__ bool is_aligned_16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// --- work distribution ------------------------------------------------------------------------------------

// Calls body(segment, begin, count, chunk) for each chunk of [chunk_begin, chunk_end) this block owns: chunk
// `chunk` of the table is elements [begin, begin + count) of segment `segment`, count <= kChunkElems. A block
// owns a contiguous run of chunks, so the binary search for its first segment runs once and later chunks advance
// linearly through the table. body must be called by every thread of the block (it may synchronize).
template <typename Body>
__device__ __forceinline__ void for_each_chunk(const SegmentTable& table, int64_t chunk_begin, int64_t chunk_end,
                                               Body&& body) {
  const int64_t per_block = (chunk_end - chunk_begin + gridDim.x - 1) / gridDim.x;
  int64_t chunk = chunk_begin + static_cast<int64_t>(blockIdx.x) * per_block;
  const int64_t end = chunk + per_block < chunk_end ? chunk + per_block : chunk_end;
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
    // Within a chunk int indices suffice (count <= kChunkElems) and cost half the registers of int64 ones.
    body(segment, begin, static_cast<int>(left < kChunkElems ? left : kChunkElems), chunk);
  }
}

// The grid of a launch: as many blocks as the device holds at once for this kernel, fewer when there is less
// work; each block then walks its run of chunks. Sized from the kernel's real occupancy (registers, shared
// memory), so the grid is one full wave whatever the compiler made of the kernel. One instance per kernel (a
// function-local static of the launcher) caches the device's capacity: launches pay no occupancy query.
class ResidentGrid {
 public:
  template <typename Kernel>
  cudaError_t size(Kernel kernel, int block_threads, int64_t work_items, int* grid) {
    int device = 0;
    cudaError_t error = cudaGetDevice(&device);
    if (error != cudaSuccess) return error;
    int capacity = device < kMaxDevices ? capacity_[device].load(std::memory_order_relaxed) : 0;
    if (capacity == 0) {
      int sms = 0;
      int per_sm = 0;
      error = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
      if (error != cudaSuccess) return error;
      error = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, block_threads, 0);
      if (error != cudaSuccess) return error;
      // Zero means the kernel cannot run at this block size on this device; say so instead of launching.
      if (per_sm < 1) return cudaErrorLaunchOutOfResources;
      capacity = sms * per_sm;
      if (device < kMaxDevices) capacity_[device].store(capacity, std::memory_order_relaxed);
    }
    *grid = static_cast<int>(work_items < 1 ? 1 : (work_items < capacity ? work_items : capacity));
    return cudaSuccess;
  }

 private:
  static constexpr int kMaxDevices = 64;  // devices past this are queried on every launch
  std::atomic<int> capacity_[kMaxDevices] = {};
};

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
