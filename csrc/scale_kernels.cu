// Scale every segment by a device scalar, in place or cast into a flat output with the buffer's layout
// (e.g. the bf16 gradients an inner optimizer reads). Padding between segments is neither read nor written.
#include "gafused_kernels.h"
#include "kernel_utils.cuh"

namespace gafused {
namespace detail {
namespace {

// out_t == acc_t with out == acc is the in-place case (so no __restrict__ on them).
template <typename acc_t, typename out_t>
__global__ void __launch_bounds__(kThreads)
    scale_kernel(const acc_t* acc, out_t* out, SegmentTable table, const acc_t* __restrict__ coef) {
  constexpr int V = kVecElems<acc_t, out_t>;
  constexpr int U = kUnrollFor<acc_t, V>;
  using AccVec = Vec<acc_t, V>;
  using OutVec = Vec<out_t, V>;
  const acc_t c = *coef;
  for_each_chunk(table, 0, table.num_chunks, [&](int64_t segment, int64_t begin, int count, int64_t) {
    const int64_t start = table.offsets[segment] + begin;
    const acc_t* src = acc + start;
    out_t* dst = out + start;
    const AccVec* src_vecs = reinterpret_cast<const AccVec*>(src);
    OutVec* dst_vecs = reinterpret_cast<OutVec*>(dst);
    const int num_vecs = is_aligned_16(src) && is_aligned_16(dst) ? count / V : 0;
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
          OutVec result;
#pragma unroll
          for (int k = 0; k < V; ++k) result.v[k] = from_acc<out_t>(mul_rn(values[u].v[k], c));
          store_vec(dst_vecs + i, result);
        }
      }
    }
    for (int i = num_vecs * V + threadIdx.x; i < count; i += kThreads) dst[i] = from_acc<out_t>(mul_rn(src[i], c));
  });
}

template <typename acc_t, typename out_t>
cudaError_t launch_scale_typed(const void* acc, void* out, const SegmentTable& table, const void* coef,
                               cudaStream_t stream) {
  constexpr auto kernel = scale_kernel<acc_t, out_t>;
  static ResidentGrid resident;
  int grid = 0;
  const cudaError_t error = resident.size(kernel, kThreads, table.num_chunks, &grid);
  if (error != cudaSuccess) return error;
  kernel<<<grid, kThreads, 0, stream>>>(static_cast<const acc_t*>(acc), static_cast<out_t*>(out), table,
                                        static_cast<const acc_t*>(coef));
  return cudaGetLastError();
}

template <typename acc_t>
cudaError_t launch_scale_out(void* acc, DType out_dtype, void* out, const SegmentTable& table, const void* coef,
                             cudaStream_t stream) {
  if (out == nullptr) return launch_scale_typed<acc_t, acc_t>(acc, acc, table, coef, stream);
  switch (out_dtype) {
    case kFloat32:
      return launch_scale_typed<acc_t, float>(acc, out, table, coef, stream);
    case kFloat64:
      return launch_scale_typed<acc_t, double>(acc, out, table, coef, stream);
    case kBFloat16:
      return launch_scale_typed<acc_t, __nv_bfloat16>(acc, out, table, coef, stream);
    case kFloat16:
      return launch_scale_typed<acc_t, __half>(acc, out, table, coef, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace
}  // namespace detail

cudaError_t launch_scale(DType acc_dtype, void* acc, DType out_dtype, void* out, const SegmentTable& table,
                         const void* coef, cudaStream_t stream) {
  if (table.num_chunks == 0) return cudaSuccess;
  switch (acc_dtype) {
    case kFloat32:
      return detail::launch_scale_out<float>(acc, out_dtype, out, table, coef, stream);
    case kFloat64:
      return detail::launch_scale_out<double>(acc, out_dtype, out, table, coef, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

// Every kernel is compiled for the same architectures, so one kernel answers for all of them.
cudaError_t kernel_image_status() {
  cudaFuncAttributes attributes;
  const cudaError_t error = cudaFuncGetAttributes(&attributes, detail::scale_kernel<float, float>);
  if (error != cudaSuccess) cudaGetLastError();
  return error;
}

}  // namespace gafused
