// Python bindings of gafused._C: argument checks, the per-call segment table, and kernel launches.
//
// Only CPU-available torch headers are used here (torch/extension.h, c10 core): the caller passes the CUDA
// stream as an integer (torch.cuda.current_stream(device).cuda_stream), so nothing from ATen/cuda or
// c10/cuda is needed and this file compiles against any torch build. The kernels live in the .cu files
// behind gafused_kernels.h.
#include <c10/core/DeviceGuard.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "gafused_kernels.h"

namespace {

using OptionalTensor = std::optional<at::Tensor>;

// Numbers go into error messages as strings made by std::to_string, never through an std::ostream. A toolchain
// that links a static libstdc++ into the extension (a GPU machine's /opt/gcc g++ did) leaves two copies of the
// library's locale in the process, and a number formatted through the stream that c10::str builds reached the
// other copy's facet table: SIGSEGV instead of the error. Strings and C strings do not use the locale's facets.
std::string num(int64_t value) { return std::to_string(value); }

std::string shape(at::IntArrayRef sizes) {
  std::string text = "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i > 0) text += ", ";
    text += std::to_string(sizes[i]);
  }
  return text + "]";
}

std::optional<gafused::DType> dtype_code(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return gafused::kFloat32;
    case at::kDouble:
      return gafused::kFloat64;
    case at::kBFloat16:
      return gafused::kBFloat16;
    case at::kHalf:
      return gafused::kFloat16;
    default:
      return std::nullopt;
  }
}

// Whether a tensor's first element sits at a multiple of its element size. Torch allows a view of storage cut at
// any byte; a kernel's load of such an element faults (misaligned address), and that error is sticky: the
// process's CUDA context is lost. Refused before any launch instead.
bool aligned(const at::Tensor& tensor) {
  return reinterpret_cast<uintptr_t>(tensor.data_ptr()) % static_cast<uintptr_t>(tensor.element_size()) == 0;
}

// The stream integer from Python back into the handle it was made from.
cudaStream_t as_stream(int64_t stream) { return reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(stream)); }

void check_launch(const char* op, cudaError_t error) {
  TORCH_CHECK(error == cudaSuccess, "gafused._C.", op, ": CUDA kernel launch failed: ", cudaGetErrorName(error), ": ",
              cudaGetErrorString(error));
}

gafused::DType check_acc(const char* op, const at::Tensor& acc) {
  TORCH_CHECK(acc.defined(), op, ": acc must be a tensor, got None");
  TORCH_CHECK(acc.is_cuda(), op, ": acc must be a CUDA tensor, got one on ", acc.device());
  TORCH_CHECK(acc.scalar_type() == at::kFloat || acc.scalar_type() == at::kDouble, op,
              ": acc must be float32 or float64, got ", acc.scalar_type());
  TORCH_CHECK(acc.dim() == 1, op, ": acc must be flat (1-d), got shape ", shape(acc.sizes()));
  TORCH_CHECK(acc.is_contiguous(), op, ": acc must be contiguous");
  TORCH_CHECK(aligned(acc), op, ": acc must start at a multiple of its ", num(acc.element_size()),
              "-byte element size (a view of storage cut at an odd byte)");
  return *dtype_code(acc.scalar_type());
}

void check_layout(const char* op, const at::Tensor& acc, const std::vector<int64_t>& offsets,
                  const std::vector<int64_t>& numels) {
  TORCH_CHECK(offsets.size() == numels.size(), op, ": offsets and numels must have the same length, got ",
              num(offsets.size()), " and ", num(numels.size()));
  const int64_t size = acc.numel();
  int64_t end = 0;  // where the previous segment ends
  for (size_t i = 0; i < offsets.size(); ++i) {
    TORCH_CHECK(offsets[i] >= 0 && numels[i] >= 0, op, ": segment ", num(i), " has a negative offset or numel (",
                num(offsets[i]), ", ", num(numels[i]), ")");
    // Overlapping segments would be read and written by different blocks at once (acc is __restrict__).
    TORCH_CHECK(offsets[i] >= end, op, ": segment ", num(i), " starts at ", num(offsets[i]), ", before segment ",
                num(i - 1), " ends at ", num(end), ": segments must be ordered and non-overlapping");
    // Written as a subtraction so that huge values cannot overflow past the check.
    TORCH_CHECK(offsets[i] <= size && numels[i] <= size - offsets[i], op, ": segment ", num(i), " [",
                num(offsets[i]), ", ", num(offsets[i]), " + ", num(numels[i]), ") ends past acc's ", num(size),
                " elements");
    end = offsets[i] + numels[i];
  }
}

// A device scalar of acc's dtype on acc's device: kernels read it there, so no value crosses to the host.
void check_scalar(const char* op, const char* name, const at::Tensor& value, const at::Tensor& acc) {
  TORCH_CHECK(value.defined(), op, ": ", name, " must be a tensor, got None");
  TORCH_CHECK(value.device() == acc.device(), op, ": ", name, " must be on acc's device ", acc.device(), ", got ",
              value.device());
  TORCH_CHECK(value.dim() == 0, op, ": ", name, " must be a 0-d tensor, got shape ", shape(value.sizes()));
  TORCH_CHECK(value.scalar_type() == acc.scalar_type(), op, ": ", name, " must have acc's dtype ",
              acc.scalar_type(), ", got ", value.scalar_type());
}

// A run of the table's chunks whose gradients share one dtype: one fold launch each.
struct GradRun {
  gafused::DType grad_dtype;
  int64_t chunk_begin;
  int64_t chunk_end;
};

// The table in device memory and its view; the tensor must outlive the launches that read it (it does: the
// caching allocator keeps the block for the stream until the launches are done).
struct Table {
  at::Tensor storage;
  gafused::SegmentTable view;
  std::vector<GradRun> runs;  // for tables with gradients: chunk runs in table order, covering every chunk
};

// Builds the segment table of gafused_kernels.h on the host and copies it to acc's device on the current stream.
// grads is null for ops without gradients. Segments without a gradient are left out when keep_missing is false
// (a middle micro-batch does nothing to them).
//
// The fold kernels are compiled per gradient dtype, so segments are put in the table grouped by gradient dtype
// (a stable order: segment order within a group) and each group becomes one run. A model whose gradients share
// a dtype keeps segment order and gets one run; segments without a gradient join the first dtype's run.
Table pack_table(const char* op, const at::Tensor& acc, const std::vector<OptionalTensor>* grads,
                 const std::vector<int64_t>& offsets, const std::vector<int64_t>& numels, bool keep_missing) {
  check_layout(op, acc, offsets, numels);
  if (grads != nullptr) {
    TORCH_CHECK(grads->size() == offsets.size(), op, ": grads must hold one entry per segment (",
                num(offsets.size()), "), got ", num(grads->size()));
  }
  struct Entry {
    int64_t address;  // 0: no gradient
    int64_t code;     // gradient dtype, -1 without a gradient
    int64_t offset;
    int64_t numel;
  };
  std::vector<Entry> entries;
  entries.reserve(offsets.size());
  for (size_t i = 0; i < offsets.size(); ++i) {
    Entry entry{0, -1, offsets[i], numels[i]};
    if (grads != nullptr) {
      const OptionalTensor& grad = (*grads)[i];
      if (!grad.has_value() || !grad->defined()) {
        if (!keep_missing) continue;
      } else {
        TORCH_CHECK(grad->device() == acc.device(), op, ": grads[", num(i), "] is on ", grad->device(),
                    ", acc on ", acc.device());
        const auto grad_code = dtype_code(grad->scalar_type());
        TORCH_CHECK(grad_code.has_value(), op, ": grads[", num(i),
                    "] must be float32, float64, bfloat16 or float16, got ", grad->scalar_type());
        TORCH_CHECK(grad->is_contiguous(), op, ": grads[", num(i), "] must be contiguous");
        TORCH_CHECK(aligned(*grad), op, ": grads[", num(i), "] must start at a multiple of its ",
                    num(grad->element_size()), "-byte element size (a view of storage cut at an odd byte)");
        TORCH_CHECK(grad->numel() == numels[i], op, ": grads[", num(i), "] has ", num(grad->numel()),
                    " elements, its segment ", num(numels[i]));
        entry.address = static_cast<int64_t>(reinterpret_cast<uintptr_t>(grad->data_ptr()));
        entry.code = *grad_code;
      }
    }
    entries.push_back(entry);
  }
  // Missing gradients take the first present dtype (float32 when there is none): they stay in place when the
  // gradients share a dtype.
  int64_t missing_code = gafused::kFloat32;
  for (const Entry& entry : entries) {
    if (entry.code >= 0) {
      missing_code = entry.code;
      break;
    }
  }
  for (Entry& entry : entries) {
    if (entry.code < 0) entry.code = missing_code;
  }
  if (grads != nullptr) {
    std::stable_sort(entries.begin(), entries.end(),
                     [](const Entry& a, const Entry& b) { return a.code < b.code; });
  }

  const int64_t count = static_cast<int64_t>(entries.size());
  // Pinned, so the copy below is asynchronous; the caching host allocator holds the block until it is done.
  at::Tensor host =
      at::empty({gafused::packed_table_size(count)}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* packed = host.data_ptr<int64_t>();
  int64_t num_chunks = 0;
  std::vector<GradRun> runs;
  for (int64_t i = 0; i < count; ++i) {
    const Entry& entry = entries[i];
    packed[i] = entry.address;
    packed[count + i] = entry.offset;
    packed[2 * count + i] = entry.numel;
    packed[3 * count + i] = num_chunks;
    const auto dtype = static_cast<gafused::DType>(entry.code);
    if (runs.empty() || runs.back().grad_dtype != dtype) runs.push_back(GradRun{dtype, num_chunks, num_chunks});
    num_chunks += gafused::chunks_of(entry.numel);
    runs.back().chunk_end = num_chunks;
  }
  packed[4 * count] = num_chunks;

  at::Tensor device_table = host.to(acc.device(), at::kLong, /*non_blocking=*/true);
  return Table{device_table, gafused::SegmentTable::from_packed(device_table.data_ptr<int64_t>(), count, num_chunks),
               std::move(runs)};
}

// One fold launch per gradient-dtype run of the table (runs own disjoint chunks, so their order is free).
void launch_fold_runs(const char* op, gafused::DType acc_dtype, const at::Tensor& acc, const Table& table,
                      const at::Tensor& weight, const void* scale, bool first, bool finish, void* chunk_sums,
                      uint8_t* chunk_nonfinite, int64_t stream) {
  for (const GradRun& run : table.runs) {
    check_launch(op, gafused::launch_fold(acc_dtype, run.grad_dtype, run.chunk_begin, run.chunk_end, acc.data_ptr(),
                                          table.view, weight.data_ptr(), scale, first, finish, chunk_sums,
                                          chunk_nonfinite, as_stream(stream)));
  }
}

void fold(const at::Tensor& acc, const std::vector<OptionalTensor>& grads, const std::vector<int64_t>& offsets,
          const std::vector<int64_t>& numels, const at::Tensor& weight, bool first, int64_t stream) {
  const char* op = "fold_";
  const gafused::DType acc_dtype = check_acc(op, acc);
  check_scalar(op, "weight", weight, acc);
  const c10::DeviceGuard guard(acc.device());
  const Table table = pack_table(op, acc, &grads, offsets, numels, /*keep_missing=*/first);
  launch_fold_runs(op, acc_dtype, acc, table, weight, nullptr, first, /*finish=*/false, nullptr, nullptr, stream);
}

std::tuple<at::Tensor, at::Tensor> fold_finish(const at::Tensor& acc, const std::vector<OptionalTensor>& grads,
                                               const std::vector<int64_t>& offsets, const std::vector<int64_t>& numels,
                                               const at::Tensor& weight, const at::Tensor& scale, bool first,
                                               int64_t stream) {
  const char* op = "fold_finish_";
  const gafused::DType acc_dtype = check_acc(op, acc);
  check_scalar(op, "weight", weight, acc);
  check_scalar(op, "scale", scale, acc);
  const c10::DeviceGuard guard(acc.device());
  // Every segment is scaled and measured, with or without a gradient.
  const Table table = pack_table(op, acc, &grads, offsets, numels, /*keep_missing=*/true);
  const int64_t num_chunks = table.view.num_chunks;
  at::Tensor chunk_sums = at::empty({num_chunks}, acc.options());
  at::Tensor chunk_nonfinite = at::empty({num_chunks}, acc.options().dtype(at::kByte));
  at::Tensor total = at::empty({}, acc.options());
  at::Tensor nonfinite = at::empty({}, acc.options().dtype(at::kBool));
  launch_fold_runs(op, acc_dtype, acc, table, weight, scale.data_ptr(), first, /*finish=*/true, chunk_sums.data_ptr(),
                   chunk_nonfinite.data_ptr<uint8_t>(), stream);
  check_launch(op, gafused::launch_reduce_chunks(acc_dtype, chunk_sums.data_ptr(), chunk_nonfinite.data_ptr<uint8_t>(),
                                                 num_chunks, total.data_ptr(), nonfinite.data_ptr<bool>(),
                                                 as_stream(stream)));
  return {total, nonfinite};
}

at::Tensor sum_of_squares(const at::Tensor& acc, const std::vector<int64_t>& offsets,
                          const std::vector<int64_t>& numels, bool per_segment, int64_t stream) {
  const char* op = "sum_of_squares";
  const gafused::DType acc_dtype = check_acc(op, acc);
  const c10::DeviceGuard guard(acc.device());
  const Table table = pack_table(op, acc, nullptr, offsets, numels, /*keep_missing=*/true);
  const int64_t num_chunks = table.view.num_chunks;
  at::Tensor chunk_sums = at::empty({num_chunks}, acc.options());
  check_launch(op, gafused::launch_chunk_sums_of_squares(acc_dtype, acc.data_ptr(), table.view, chunk_sums.data_ptr(),
                                                         as_stream(stream)));
  if (per_segment) {
    at::Tensor result = at::empty({static_cast<int64_t>(offsets.size())}, acc.options());
    check_launch(op, gafused::launch_reduce_chunks_per_segment(acc_dtype, chunk_sums.data_ptr(), table.view,
                                                               result.data_ptr(), as_stream(stream)));
    return result;
  }
  at::Tensor total = at::empty({}, acc.options());
  check_launch(op, gafused::launch_reduce_chunks(acc_dtype, chunk_sums.data_ptr(), nullptr, num_chunks,
                                                 total.data_ptr(), nullptr, as_stream(stream)));
  return total;
}

void scale(const at::Tensor& acc, const std::vector<int64_t>& offsets, const std::vector<int64_t>& numels,
           const at::Tensor& coef, const OptionalTensor& out, int64_t stream) {
  const char* op = "scale_";
  const gafused::DType acc_dtype = check_acc(op, acc);
  check_scalar(op, "coef", coef, acc);
  gafused::DType out_dtype = acc_dtype;
  void* out_ptr = nullptr;
  if (out.has_value() && out->defined()) {
    TORCH_CHECK(out->device() == acc.device(), op, ": out must be on acc's device ", acc.device(), ", got ",
                out->device());
    const auto code = dtype_code(out->scalar_type());
    TORCH_CHECK(code.has_value(), op, ": out must be float32, float64, bfloat16 or float16, got ",
                out->scalar_type());
    TORCH_CHECK(out->dim() == 1 && out->numel() == acc.numel(), op, ": out must be flat with acc's ",
                num(acc.numel()), " elements, got shape ", shape(out->sizes()));
    TORCH_CHECK(out->is_contiguous(), op, ": out must be contiguous");
    TORCH_CHECK(aligned(*out), op, ": out must start at a multiple of its ", num(out->element_size()),
                "-byte element size (a view of storage cut at an odd byte)");
    out_dtype = *code;
    out_ptr = out->data_ptr();
  }
  const c10::DeviceGuard guard(acc.device());
  const Table table = pack_table(op, acc, nullptr, offsets, numels, /*keep_missing=*/true);
  check_launch(op, gafused::launch_scale(acc_dtype, acc.data_ptr(), out_dtype, out_ptr, table.view, coef.data_ptr(),
                                         as_stream(stream)));
}

// "" when the extension has code for CUDA device `device_index`, else why not (a build for other architectures).
std::string kernel_image_error(int64_t device_index) {
  const c10::DeviceGuard guard(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device_index)));
  const cudaError_t error = gafused::kernel_image_status();
  if (error == cudaSuccess) return "";
  return std::string(cudaGetErrorName(error)) + ": " + cudaGetErrorString(error);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "gafused CUDA kernels; call them through gafused.cuda_backend, which passes the current stream.";
  m.def("fold_", &fold, "acc[seg] = (0 if first else acc[seg]) + weight * grads[seg]", py::arg("acc"),
        py::arg("grads"), py::arg("offsets"), py::arg("numels"), py::arg("weight"), py::arg("first"),
        py::arg("stream"));
  m.def("fold_finish_", &fold_finish, "fold_, then every segment *= scale; returns (sum of squares, any non-finite)",
        py::arg("acc"), py::arg("grads"), py::arg("offsets"), py::arg("numels"), py::arg("weight"), py::arg("scale"),
        py::arg("first"), py::arg("stream"));
  m.def("sum_of_squares", &sum_of_squares, "deterministic sum of squares, total (0-d) or per segment",
        py::arg("acc"), py::arg("offsets"), py::arg("numels"), py::arg("per_segment"), py::arg("stream"));
  m.def("kernel_image_error", &kernel_image_error, "'' when the build runs on this CUDA device, else why not",
        py::arg("device_index"));
  m.def("scale_", &scale, "every segment *= coef, in place or cast into out", py::arg("acc"), py::arg("offsets"),
        py::arg("numels"), py::arg("coef"), py::arg("out"), py::arg("stream"));
}
