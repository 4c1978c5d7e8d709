// Deterministic two-stage sum of squares: per-chunk partial sums in a fixed order, then one cleanup pass that
// adds them in a fixed order (no float atomics anywhere), for the whole buffer or for each segment.
#include "gafused_kernels.h"
#include "kernel_utils.cuh"

namespace gafused {
namespace detail {
namespace {

// One block is enough for the cleanup: it reads one value per chunk (1/8192 of the buffer).
constexpr int kReduceThreads = 1024;

template <typename acc_t>
__global__ void __launch_bounds__(kThreads)
    chunk_sums_kernel(const acc_t* __restrict__ acc, SegmentTable table, acc_t* __restrict__ chunk_sums) {
  constexpr int V = kVecElems<acc_t, acc_t>;
  constexpr int U = kUnrollFor<acc_t, V>;
  using AccVec = Vec<acc_t, V>;
  for_each_chunk(table, 0, table.num_chunks, [&](int64_t segment, int64_t begin, int count, int64_t chunk) {
    const acc_t* src = acc + table.offsets[segment] + begin;
    const AccVec* src_vecs = reinterpret_cast<const AccVec*>(src);
    ChunkStats<acc_t> stats;
    const int num_vecs = is_aligned_16(src) ? count / V : 0;
    for (int base = threadIdx.x; base < num_vecs; base += kThreads * U) {
      AccVec values[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = base + u * kThreads;
        if (i < num_vecs) values[u] = load_vec(src_vecs + i);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = base + u * kThreads;
        if (i < num_vecs) {
#pragma unroll
          for (int k = 0; k < V; ++k) stats.add(values[u].v[k]);
        }
      }
    }
    for (int i = num_vecs * V + threadIdx.x; i < count; i += kThreads) stats.add(src[i]);
    const acc_t sum = block_sum<kThreads>(stats.sum_of_squares);
    if (threadIdx.x == 0) chunk_sums[chunk] = sum;
  });
}

template <typename acc_t>
__global__ void __launch_bounds__(kReduceThreads)
    reduce_chunks_kernel(const acc_t* __restrict__ chunk_sums, const uint8_t* __restrict__ chunk_nonfinite,
                         int64_t num_chunks, acc_t* __restrict__ total, bool* __restrict__ nonfinite) {
  // Each thread adds num_chunks / kReduceThreads values one after another (over 800 for a 7B-parameter float32
  // buffer): in float32 that drifts by up to ~5e-5 relative, so the cleanup adds in double and rounds once.
  double sum = 0.0;
  bool any_nonfinite = false;
  for (int64_t i = threadIdx.x; i < num_chunks; i += kReduceThreads) {
    sum += static_cast<double>(chunk_sums[i]);
    if (nonfinite != nullptr) any_nonfinite |= chunk_nonfinite[i] != 0;
  }
  sum = block_sum<kReduceThreads>(sum);
  any_nonfinite = __syncthreads_or(any_nonfinite) != 0;
  if (threadIdx.x == 0) {
    *total = static_cast<acc_t>(sum);
    if (nonfinite != nullptr) *nonfinite = any_nonfinite;
  }
}

template <typename acc_t>
__global__ void __launch_bounds__(kThreads) reduce_chunks_per_segment_kernel(const acc_t* __restrict__ chunk_sums,
                                                                             SegmentTable table,
                                                                             acc_t* __restrict__ per_segment) {
  for (int64_t segment = blockIdx.x; segment < table.count; segment += gridDim.x) {
    const int64_t end = table.first_chunks[segment + 1];
    double sum = 0.0;  // as in reduce_chunks_kernel
    for (int64_t i = table.first_chunks[segment] + threadIdx.x; i < end; i += kThreads) {
      sum += static_cast<double>(chunk_sums[i]);
    }
    sum = block_sum<kThreads>(sum);
    if (threadIdx.x == 0) per_segment[segment] = static_cast<acc_t>(sum);
  }
}

template <typename acc_t>
cudaError_t launch_chunk_sums_typed(const void* acc, const SegmentTable& table, void* chunk_sums,
                                    cudaStream_t stream) {
  constexpr auto kernel = chunk_sums_kernel<acc_t>;
  static ResidentGrid resident;
  int grid = 0;
  const cudaError_t error = resident.size(kernel, kThreads, table.num_chunks, &grid);
  if (error != cudaSuccess) return error;
  kernel<<<grid, kThreads, 0, stream>>>(static_cast<const acc_t*>(acc), table, static_cast<acc_t*>(chunk_sums));
  return cudaGetLastError();
}

template <typename acc_t>
cudaError_t launch_per_segment_typed(const void* chunk_sums, const SegmentTable& table, void* per_segment,
                                     cudaStream_t stream) {
  constexpr auto kernel = reduce_chunks_per_segment_kernel<acc_t>;
  static ResidentGrid resident;
  int grid = 0;
  // One block per segment, or one full wave of blocks that stride over the segments.
  const cudaError_t error = resident.size(kernel, kThreads, table.count, &grid);
  if (error != cudaSuccess) return error;
  kernel<<<grid, kThreads, 0, stream>>>(static_cast<const acc_t*>(chunk_sums), table,
                                        static_cast<acc_t*>(per_segment));
  return cudaGetLastError();
}

}  // namespace
}  // namespace detail

cudaError_t launch_chunk_sums_of_squares(DType acc_dtype, const void* acc, const SegmentTable& table, void* chunk_sums,
                                         cudaStream_t stream) {
  if (table.num_chunks == 0) return cudaSuccess;
  switch (acc_dtype) {
    case kFloat32:
      return detail::launch_chunk_sums_typed<float>(acc, table, chunk_sums, stream);
    case kFloat64:
      return detail::launch_chunk_sums_typed<double>(acc, table, chunk_sums, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t launch_reduce_chunks(DType acc_dtype, const void* chunk_sums, const uint8_t* chunk_nonfinite,
                                 int64_t num_chunks, void* total, bool* nonfinite, cudaStream_t stream) {
  // Launched even for zero chunks: it is what writes the 0 and the false of an empty buffer.
  switch (acc_dtype) {
    case kFloat32:
      detail::reduce_chunks_kernel<float><<<1, detail::kReduceThreads, 0, stream>>>(
          static_cast<const float*>(chunk_sums), chunk_nonfinite, num_chunks, static_cast<float*>(total), nonfinite);
      return cudaGetLastError();
    case kFloat64:
      detail::reduce_chunks_kernel<double><<<1, detail::kReduceThreads, 0, stream>>>(
          static_cast<const double*>(chunk_sums), chunk_nonfinite, num_chunks, static_cast<double*>(total), nonfinite);
      return cudaGetLastError();
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t launch_reduce_chunks_per_segment(DType acc_dtype, const void* chunk_sums, const SegmentTable& table,
                                             void* per_segment, cudaStream_t stream) {
  if (table.count == 0) return cudaSuccess;
  switch (acc_dtype) {
    case kFloat32:
      return detail::launch_per_segment_typed<float>(chunk_sums, table, per_segment, stream);
    case kFloat64:
      return detail::launch_per_segment_typed<double>(chunk_sums, table, per_segment, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace gafused
