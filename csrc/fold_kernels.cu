// Multi-tensor fold: every gradient of a micro-batch into the flat accumulation buffer, one launch per gradient
// dtype present (one for a model whose gradients share a dtype).
//
// One kernel per (accumulation type, gradient type, first, finish). The gradient type is a template parameter,
// not a per-segment switch: a switch keeps the loads of all four types live in one kernel and costs it the
// registers of the widest (112-119 per thread for float, two resident blocks per SM).
#include "gafused_kernels.h"
#include "kernel_utils.cuh"

namespace gafused {
namespace detail {
namespace {

// One element of the fold contract, rounding after every operation exactly like the reference backend:
// c = g * w; v = first ? c : old + c; a missing gradient gives v = first ? 0 : old (0 * w is not computed:
// w may be inf). With finish, v *= s.
template <typename acc_t, typename grad_t, bool kFirst, bool kFinish>
__device__ __forceinline__ acc_t fold_value(acc_t old, grad_t grad, acc_t w, acc_t s) {
  acc_t value;
  if constexpr (std::is_same_v<grad_t, NoGrad>) {
    value = kFirst ? acc_t(0) : old;
  } else {
    const acc_t contribution = mul_rn(to_acc<acc_t>(grad), w);
    value = kFirst ? contribution : add_rn(old, contribution);
  }
  if constexpr (kFinish) value = mul_rn(value, s);
  return value;
}

// Folds `count` elements of one chunk: dst[i] = fold_value(dst[i], src[i]). src is unused for NoGrad.
template <typename acc_t, typename grad_t, bool kFirst, bool kFinish>
__device__ __forceinline__ void fold_chunk(acc_t* __restrict__ dst, const grad_t* __restrict__ src, int count,
                                           acc_t w, acc_t s, ChunkStats<acc_t>& stats) {
  constexpr bool kHasGrad = !std::is_same_v<grad_t, NoGrad>;
  // A missing gradient in the middle of a window changes nothing; the host drops such segments anyway.
  if constexpr (!kHasGrad && !kFirst && !kFinish) return;
  constexpr int V = kVecElems<acc_t, std::conditional_t<kHasGrad, grad_t, acc_t>>;
  constexpr int U = kUnrollFor<acc_t, V>;
  using AccVec = Vec<acc_t, V>;
  // NoGrad vectors are declared (fold_value takes an argument) but never loaded.
  using GradVec = Vec<std::conditional_t<kHasGrad, grad_t, acc_t>, V>;

  const bool vectorized = is_aligned_16(dst) && (!kHasGrad || is_aligned_16(src));
  const int num_vecs = vectorized ? count / V : 0;
  AccVec* dst_vecs = reinterpret_cast<AccVec*>(dst);
  const GradVec* src_vecs = reinterpret_cast<const GradVec*>(src);
  for (int base = threadIdx.x; base < num_vecs; base += kThreads * U) {
    AccVec old[U];
    GradVec grad[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = base + u * kThreads;
      if (i < num_vecs) {
        if constexpr (!kFirst) old[u] = load_vec(dst_vecs + i);
        if constexpr (kHasGrad) grad[u] = load_vec_streaming(src_vecs + i);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = base + u * kThreads;
      if (i < num_vecs) {
        // Results overwrite the loaded values: no second vector of registers.
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const acc_t previous = kFirst ? acc_t(0) : old[u].v[k];
          if constexpr (kHasGrad) {
            old[u].v[k] = fold_value<acc_t, grad_t, kFirst, kFinish>(previous, grad[u].v[k], w, s);
          } else {
            old[u].v[k] = fold_value<acc_t, NoGrad, kFirst, kFinish>(previous, NoGrad{}, w, s);
          }
          if constexpr (kFinish) stats.add(old[u].v[k]);
        }
        store_vec(dst_vecs + i, old[u]);
      }
    }
  }
  // The tail after the last whole vector, or the whole chunk when the pointers are not aligned.
  for (int i = num_vecs * V + threadIdx.x; i < count; i += kThreads) {
    const acc_t previous = kFirst ? acc_t(0) : dst[i];
    acc_t value;
    if constexpr (kHasGrad) {
      value = fold_value<acc_t, grad_t, kFirst, kFinish>(previous, load_streaming(src + i), w, s);
    } else {
      value = fold_value<acc_t, NoGrad, kFirst, kFinish>(previous, NoGrad{}, w, s);
    }
    if constexpr (kFinish) stats.add(value);
    dst[i] = value;
  }
}

template <typename acc_t, typename grad_t, bool kFirst, bool kFinish>
__global__ void __launch_bounds__(kThreads)
    fold_kernel(acc_t* __restrict__ acc, SegmentTable table, int64_t chunk_begin, int64_t chunk_end,
                const acc_t* __restrict__ weight, const acc_t* __restrict__ scale, acc_t* __restrict__ chunk_sums,
                uint8_t* __restrict__ chunk_nonfinite) {
  const acc_t w = *weight;
  const acc_t s = kFinish ? *scale : acc_t(1);
  for_each_chunk(table, chunk_begin, chunk_end, [&](int64_t segment, int64_t begin, int count, int64_t chunk) {
    acc_t* dst = acc + table.offsets[segment] + begin;
    const int64_t grad_address = table.grad_ptrs[segment];
    ChunkStats<acc_t> stats;
    // Uniform over the block: a block works on one chunk, a chunk lies in one segment.
    if (grad_address == 0) {
      fold_chunk<acc_t, NoGrad, kFirst, kFinish>(dst, nullptr, count, w, s, stats);
    } else {
      fold_chunk<acc_t, grad_t, kFirst, kFinish>(dst, reinterpret_cast<const grad_t*>(grad_address) + begin, count,
                                                 w, s, stats);
    }
    if constexpr (kFinish) {
      const acc_t sum = block_sum<kThreads>(stats.sum_of_squares);
      const bool nonfinite = __syncthreads_or(stats.nonfinite) != 0;
      if (threadIdx.x == 0) {
        chunk_sums[chunk] = sum;
        chunk_nonfinite[chunk] = nonfinite ? 1 : 0;
      }
    }
  });
}

template <typename acc_t, typename grad_t, bool kFirst, bool kFinish>
cudaError_t launch_fold_typed(int64_t chunk_begin, int64_t chunk_end, void* acc, const SegmentTable& table,
                              const void* weight, const void* scale, void* chunk_sums, uint8_t* chunk_nonfinite,
                              cudaStream_t stream) {
  constexpr auto kernel = fold_kernel<acc_t, grad_t, kFirst, kFinish>;
  static ResidentGrid resident;
  int grid = 0;
  const cudaError_t error = resident.size(kernel, kThreads, chunk_end - chunk_begin, &grid);
  if (error != cudaSuccess) return error;
  kernel<<<grid, kThreads, 0, stream>>>(static_cast<acc_t*>(acc), table, chunk_begin, chunk_end,
                                        static_cast<const acc_t*>(weight), static_cast<const acc_t*>(scale),
                                        static_cast<acc_t*>(chunk_sums), chunk_nonfinite);
  return cudaGetLastError();
}

template <typename acc_t, typename grad_t>
cudaError_t launch_fold_modes(int64_t chunk_begin, int64_t chunk_end, void* acc, const SegmentTable& table,
                              const void* weight, const void* scale, bool first, bool finish, void* chunk_sums,
                              uint8_t* chunk_nonfinite, cudaStream_t stream) {
  if (first && finish) {
    return launch_fold_typed<acc_t, grad_t, true, true>(chunk_begin, chunk_end, acc, table, weight, scale,
                                                        chunk_sums, chunk_nonfinite, stream);
  }
  if (first) {
    return launch_fold_typed<acc_t, grad_t, true, false>(chunk_begin, chunk_end, acc, table, weight, scale,
                                                         chunk_sums, chunk_nonfinite, stream);
  }
  if (finish) {
    return launch_fold_typed<acc_t, grad_t, false, true>(chunk_begin, chunk_end, acc, table, weight, scale,
                                                         chunk_sums, chunk_nonfinite, stream);
  }
  return launch_fold_typed<acc_t, grad_t, false, false>(chunk_begin, chunk_end, acc, table, weight, scale,
                                                        chunk_sums, chunk_nonfinite, stream);
}

template <typename acc_t>
cudaError_t launch_fold_grads(DType grad_dtype, int64_t chunk_begin, int64_t chunk_end, void* acc,
                              const SegmentTable& table, const void* weight, const void* scale, bool first,
                              bool finish, void* chunk_sums, uint8_t* chunk_nonfinite, cudaStream_t stream) {
  switch (grad_dtype) {
    case kFloat32:
      return launch_fold_modes<acc_t, float>(chunk_begin, chunk_end, acc, table, weight, scale, first, finish,
                                             chunk_sums, chunk_nonfinite, stream);
    case kFloat64:
      return launch_fold_modes<acc_t, double>(chunk_begin, chunk_end, acc, table, weight, scale, first, finish,
                                              chunk_sums, chunk_nonfinite, stream);
    case kBFloat16:
      return launch_fold_modes<acc_t, __nv_bfloat16>(chunk_begin, chunk_end, acc, table, weight, scale, first,
                                                     finish, chunk_sums, chunk_nonfinite, stream);
    case kFloat16:
      return launch_fold_modes<acc_t, __half>(chunk_begin, chunk_end, acc, table, weight, scale, first, finish,
                                              chunk_sums, chunk_nonfinite, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace
}  // namespace detail

cudaError_t launch_fold(DType acc_dtype, DType grad_dtype, int64_t chunk_begin, int64_t chunk_end, void* acc,
                        const SegmentTable& table, const void* weight, const void* scale, bool first, bool finish,
                        void* chunk_sums, uint8_t* chunk_nonfinite, cudaStream_t stream) {
  if (chunk_begin < 0 || chunk_end > table.num_chunks || chunk_begin > chunk_end) return cudaErrorInvalidValue;
  if (chunk_begin == chunk_end) return cudaSuccess;
  switch (acc_dtype) {
    case kFloat32:
      return detail::launch_fold_grads<float>(grad_dtype, chunk_begin, chunk_end, acc, table, weight, scale, first,
                                              finish, chunk_sums, chunk_nonfinite, stream);
    case kFloat64:
      return detail::launch_fold_grads<double>(grad_dtype, chunk_begin, chunk_end, acc, table, weight, scale, first,
                                               finish, chunk_sums, chunk_nonfinite, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace gafused
