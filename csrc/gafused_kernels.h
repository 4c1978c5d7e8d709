// Launchers of the gafused CUDA kernels.
//
// This header is the only thing the Python binding (bindings.cpp) sees of the kernels. It depends on the CUDA
// runtime API alone (no torch, no ATen), so the kernels compile with plain nvcc and the binding compiles with
// nothing but torch/extension.h: raw pointers, int64 sizes and a cudaStream_t cross the boundary.
//
// Work layout shared by every kernel: a flat accumulation buffer `acc` holds segments; segment i is
// acc[offsets[i] : offsets[i] + numels[i]]. Each segment is cut into chunks of kChunkElems elements (the last
// one shorter), chunks are numbered across the segments of a launch's table, and partial sums are kept per chunk.
// Because a chunk never spans two segments and its partial sum does not depend on which block computed it,
// every reduction below has a fixed order whatever the grid size or the device. One thing does change it: a fused
// fold's chunk sum is added per thread over 16-byte vectors when the chunk's gradient is 16-byte aligned and over
// single elements when it is not, so the same values at another alignment can round differently in the last bits.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace gafused {

// Elements per chunk: large enough that per-chunk bookkeeping is noise, small enough that a 7B-element buffer
// still yields enough chunks (~850k) to keep every SM busy.
constexpr int64_t kChunkElems = 8192;

// Element types the kernels know.
enum DType : int64_t {
  kFloat32 = 0,
  kFloat64 = 1,
  kBFloat16 = 2,
  kFloat16 = 3,
};

// Per-call description of the segments, in device memory: one int64 tensor of 4 * count + 1 values laid out
// as [grad_ptrs | offsets | numels | first_chunks], built on the host for every call because gradient pointers
// change every micro-step.
struct SegmentTable {
  const int64_t* grad_ptrs;     // [count] device address of segment i's gradient; 0 when it has none
  const int64_t* offsets;       // [count] element offset of segment i in acc
  const int64_t* numels;        // [count] elements of segment i
  const int64_t* first_chunks;  // [count + 1] exclusive prefix sum of ceil(numels[i] / kChunkElems)
  int64_t count;                // segments in the table
  int64_t num_chunks;           // first_chunks[count], mirrored on the host to size the launch

  // Points the four arrays into `table` (device memory of 4 * count + 1 int64 values).
  static SegmentTable from_packed(const int64_t* table, int64_t count, int64_t num_chunks) {
    return SegmentTable{table, table + count, table + 2 * count, table + 3 * count, count, num_chunks};
  }
};

// Number of int64 values of a packed table with `count` segments.
inline int64_t packed_table_size(int64_t count) { return 4 * count + 1; }

// Chunks of a segment of `numel` elements.
inline int64_t chunks_of(int64_t numel) { return (numel + kChunkElems - 1) / kChunkElems; }

// acc[seg] = (0 if first else acc[seg]) + weight * grad[seg] for every segment whose chunks lie in
// [chunk_begin, chunk_end), in acc's dtype (kFloat32 or kFloat64) with one rounding per operation. Every gradient
// in that range has dtype `grad_dtype`: the kernel is compiled once per gradient dtype, so the caller puts the
// segments of one gradient dtype next to each other in the table and launches once per such run (a segment
// without a gradient may join any run). A segment without a gradient is zeroed when `first` and left alone
// otherwise. With `finish`, every result is also multiplied by `scale`, and for every chunk c of the range the sum
// of squares of its results goes to chunk_sums[c] (acc's dtype) and whether any is inf/nan to chunk_nonfinite[c];
// both arrays hold table.num_chunks entries. `weight` and `scale` point to one value of acc's dtype in device
// memory; `scale`, `chunk_sums` and `chunk_nonfinite` may be null without `finish`.
cudaError_t launch_fold(DType acc_dtype, DType grad_dtype, int64_t chunk_begin, int64_t chunk_end, void* acc,
                        const SegmentTable& table, const void* weight, const void* scale, bool first, bool finish,
                        void* chunk_sums, uint8_t* chunk_nonfinite, cudaStream_t stream);

// chunk_sums[c] = sum of squares of chunk c of acc (acc's dtype), for every chunk of the table.
cudaError_t launch_chunk_sums_of_squares(DType acc_dtype, const void* acc, const SegmentTable& table, void* chunk_sums,
                                         cudaStream_t stream);

// The cleanup pass of the two-stage norm, one block in a fixed order: *total = sum of chunk_sums[0:num_chunks]
// and, when `nonfinite` is not null, *nonfinite = any of chunk_nonfinite[0:num_chunks] (which must then be given).
cudaError_t launch_reduce_chunks(DType acc_dtype, const void* chunk_sums, const uint8_t* chunk_nonfinite,
                                 int64_t num_chunks, void* total, bool* nonfinite, cudaStream_t stream);

// The per-segment variant: per_segment[i] = sum of chunk_sums over segment i's chunks, for every segment.
cudaError_t launch_reduce_chunks_per_segment(DType acc_dtype, const void* chunk_sums, const SegmentTable& table,
                                             void* per_segment, cudaStream_t stream);

// Every segment times *coef (one value of acc's dtype in device memory): in place when `out` is null, else
// out[seg] = acc[seg] * coef cast to out_dtype (acc untouched). `out` has acc's layout (same offsets).
cudaError_t launch_scale(DType acc_dtype, void* acc, DType out_dtype, void* out, const SegmentTable& table,
                         const void* coef, cudaStream_t stream);

// cudaSuccess when this build holds code (SASS, or PTX to compile) that the current device can run, else the error
// a launch would fail with (cudaErrorNoKernelImageForDevice or cudaErrorInvalidDeviceFunction). That error is
// cleared again: the next launch check does not see it.
cudaError_t kernel_image_status();

}  // namespace gafused
