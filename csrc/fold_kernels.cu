// Multi-tensor fold: every gradient of a micro-batch into the flat accumulation buffer in one launch.
//
// One kernel per (accumulation type, first, finish); the gradient dtype is read per segment from the table,
// so a model that mixes bf16 and fp32 parameters still takes one launch. Branches on it are uniform within a
// block (a block works on one chunk, a chunk lies in one segment).
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
__device__ __forceinline__ void fold_chunk(acc_t* __restrict__ dst, const grad_t* __restrict__ src, int64_t count,
                                           acc_t w, acc_t s, ChunkStats<acc_t>& stats) {
  constexpr bool kHasGrad = !std::is_same_v<grad_t, NoGrad>;
  // A missing gradient in the middle of a window changes nothing; the host drops such segments anyway.
  if constexpr (!kHasGrad && !kFirst && !kFinish) return;
  constexpr int V = kVecElems<acc_t>;
  using AccVec = Vec<acc_t, V>;
  using GradVec = Vec<grad_t, V>;

  const bool vectorized = is_aligned(dst, sizeof(AccVec)) && (!kHasGrad || is_aligned(src, sizeof(GradVec)));
  const int64_t num_vecs = vectorized ? count / V : 0;
  for (int64_t base = threadIdx.x; base < num_vecs; base += static_cast<int64_t>(kThreads) * kUnroll) {
    AccVec old[kUnroll];
    GradVec grad[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * kThreads;
      if (i < num_vecs) {
        if constexpr (!kFirst) old[u] = reinterpret_cast<const AccVec*>(dst)[i];
        if constexpr (kHasGrad) grad[u] = reinterpret_cast<const GradVec*>(src)[i];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * kThreads;
      if (i < num_vecs) {
        AccVec result;
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const acc_t previous = kFirst ? acc_t(0) : old[u].v[k];
          result.v[k] = fold_value<acc_t, grad_t, kFirst, kFinish>(previous, grad[u].v[k], w, s);
          if constexpr (kFinish) stats.add(result.v[k]);
        }
        reinterpret_cast<AccVec*>(dst)[i] = result;
      }
    }
  }
  // The tail after the last whole vector, or the whole chunk when the pointers are not aligned.
  for (int64_t i = num_vecs * V + threadIdx.x; i < count; i += kThreads) {
    const acc_t previous = kFirst ? acc_t(0) : dst[i];
    grad_t grad{};
    if constexpr (kHasGrad) grad = src[i];
    const acc_t value = fold_value<acc_t, grad_t, kFirst, kFinish>(previous, grad, w, s);
    if constexpr (kFinish) stats.add(value);
    dst[i] = value;
  }
}

template <typename acc_t, bool kFirst, bool kFinish>
__global__ void __launch_bounds__(kThreads)
    fold_kernel(acc_t* __restrict__ acc, SegmentTable table, const acc_t* __restrict__ weight,
                const acc_t* __restrict__ scale, acc_t* __restrict__ chunk_sums, uint8_t* __restrict__ chunk_nonfinite) {
  const acc_t w = *weight;
  const acc_t s = kFinish ? *scale : acc_t(1);
  for_each_chunk(table, [&](int64_t segment, int64_t begin, int64_t count, int64_t chunk) {
    acc_t* dst = acc + table.offsets[segment] + begin;
    const int64_t grad_address = table.grad_ptrs[segment];
    ChunkStats<acc_t> stats;
    if (grad_address == 0) {
      fold_chunk<acc_t, NoGrad, kFirst, kFinish>(dst, nullptr, count, w, s, stats);
    } else {
      switch (table.grad_dtypes[segment]) {
        case kFloat32:
          fold_chunk<acc_t, float, kFirst, kFinish>(dst, reinterpret_cast<const float*>(grad_address) + begin, count,
                                                    w, s, stats);
          break;
        case kFloat64:
          fold_chunk<acc_t, double, kFirst, kFinish>(dst, reinterpret_cast<const double*>(grad_address) + begin,
                                                     count, w, s, stats);
          break;
        case kBFloat16:
          fold_chunk<acc_t, __nv_bfloat16, kFirst, kFinish>(
              dst, reinterpret_cast<const __nv_bfloat16*>(grad_address) + begin, count, w, s, stats);
          break;
        case kFloat16:
          fold_chunk<acc_t, __half, kFirst, kFinish>(dst, reinterpret_cast<const __half*>(grad_address) + begin,
                                                     count, w, s, stats);
          break;
        default:
          // The binding only writes the codes above; anything else is a corrupted table, not a no-op.
          __trap();
      }
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

template <typename acc_t, bool kFirst, bool kFinish>
cudaError_t launch_fold_typed(void* acc, const SegmentTable& table, const void* weight, const void* scale,
                              void* chunk_sums, uint8_t* chunk_nonfinite, cudaStream_t stream) {
  int grid = 0;
  const cudaError_t error = grid_for_chunks(table.num_chunks, &grid);
  if (error != cudaSuccess) return error;
  fold_kernel<acc_t, kFirst, kFinish><<<grid, kThreads, 0, stream>>>(
      static_cast<acc_t*>(acc), table, static_cast<const acc_t*>(weight), static_cast<const acc_t*>(scale),
      static_cast<acc_t*>(chunk_sums), chunk_nonfinite);
  return cudaGetLastError();
}

template <typename acc_t>
cudaError_t launch_fold_modes(void* acc, const SegmentTable& table, const void* weight, const void* scale, bool first,
                              bool finish, void* chunk_sums, uint8_t* chunk_nonfinite, cudaStream_t stream) {
  if (first && finish) {
    return launch_fold_typed<acc_t, true, true>(acc, table, weight, scale, chunk_sums, chunk_nonfinite, stream);
  }
  if (first) {
    return launch_fold_typed<acc_t, true, false>(acc, table, weight, scale, chunk_sums, chunk_nonfinite, stream);
  }
  if (finish) {
    return launch_fold_typed<acc_t, false, true>(acc, table, weight, scale, chunk_sums, chunk_nonfinite, stream);
  }
  return launch_fold_typed<acc_t, false, false>(acc, table, weight, scale, chunk_sums, chunk_nonfinite, stream);
}

}  // namespace
}  // namespace detail

cudaError_t launch_fold(DType acc_dtype, void* acc, const SegmentTable& table, const void* weight, const void* scale,
                        bool first, bool finish, void* chunk_sums, uint8_t* chunk_nonfinite, cudaStream_t stream) {
  if (table.num_chunks == 0) return cudaSuccess;
  switch (acc_dtype) {
    case kFloat32:
      return detail::launch_fold_modes<float>(acc, table, weight, scale, first, finish, chunk_sums, chunk_nonfinite,
                                              stream);
    case kFloat64:
      return detail::launch_fold_modes<double>(acc, table, weight, scale, first, finish, chunk_sums, chunk_nonfinite,
                                               stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace gafused
