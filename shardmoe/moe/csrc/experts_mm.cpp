// The per-expert GEMMs of the MoE layer on CPU, the experts spread over the intra-op threads
// (shardmoe/moe/experts.py TorchOps calls them where moe/cpu.py's CpuOps allows; cpu.py builds the
// library and documents them).
//
// A layer with many experts runs many small GEMMs (fine: 64 experts x 6 GEMMs of ~512 rows). Run
// one after another, each splits its rows over all threads, and every GEMM pays the threads'
// start and join; run side by side, one thread per expert, they don't: measured 1.04-1.32x
// (docs/history/cpu-layer-choices.md). Experts too large for one thread's share (rows >= total / threads) still
// run one at a time on every thread, first, so a skewed routing is never left to one thread.
// The rest are taken largest first from a shared counter by whichever thread is free.
//
// Inside at::parallel_for ATen runs each at::mm on the calling thread (nested parallelism off), so
// a GEMM's result is the single-thread GEMM's. Every output row (or weight-gradient slice) is
// written by one GEMM, so the result does not depend on which thread ran it.
//
// Both ops write only into the out buffer their caller passes (Tensor(a!) out) and return nothing,
// so their Meta kernel, the one FakeTensorMode and torch.compile trace them with, has nothing to
// compute: the output's shape, dtype and strides are the caller's buffer's.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <numeric>
#include <utility>
#include <vector>

namespace {

// Runs gemm(e) for every expert with rows: large ones on all threads in turn, then the rest one
// per thread, largest first.
template <typename Gemm>
void for_each_expert(const std::vector<int64_t>& sizes, Gemm&& gemm) {
  const int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  const int64_t threads = at::get_num_threads();
  std::vector<int64_t> small;
  for (int64_t e = 0; e < static_cast<int64_t>(sizes.size()); ++e) {
    if (sizes[e] == 0) continue;
    if (threads > 1 && sizes[e] * threads < total) {
      small.push_back(e);
    } else {
      gemm(e);  // outside a parallel region: the GEMM itself uses every thread
    }
  }
  std::stable_sort(small.begin(), small.end(), [&](int64_t a, int64_t b) { return sizes[a] > sizes[b]; });
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(small.size());
  at::parallel_for(0, std::min(threads, n), 1, [&](int64_t, int64_t) {
    // grad mode and the dispatch exclusions are thread-local: a worker starts with autograd on,
    // and at::mm_out would refuse the caller's weights (they require grad) as out= arguments
    at::NoGradGuard no_grad;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    for (int64_t i = next++; i < n; i = next++) gemm(small[i]);
  });
}

std::vector<int64_t> starts_of(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> starts(sizes.size(), 0);
  for (size_t e = 1; e < sizes.size(); ++e) starts[e] = starts[e - 1] + sizes[e - 1];
  return starts;
}

// Row blocks of the bf16 GEMMs. torch runs those through oneDNN, which builds a kernel for every
// new shape and keeps the last 1,024 (~0.65 MiB each); an expert's row count M changes every step,
// so a model's six GEMM families per layer meet more shapes than that and rebuild evicted kernels
// all the time. Each bf16 GEMM here runs over a whole number of 32-row blocks or fewer than 32
// rows: a family meets at most max(M) / kRowBlock + kRowBlock shapes.
constexpr int64_t kRowBlock = 32;

bool uses_row_blocks(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16; }

// A bad size or operand would make a GEMM (or rows_finite) read outside the operands, or mm_out
// resize a view of `out` from a worker thread: refused before any work.
void check_sizes(const char* op, at::IntArrayRef sizes, int64_t rows) {
  int64_t total = 0;
  for (size_t e = 0; e < sizes.size(); ++e) {
    TORCH_CHECK(sizes[e] >= 0, op, ": sizes: expected row counts >= 0, got ", sizes[e], " for expert ", e);
    TORCH_CHECK(sizes[e] <= rows - total, op, ": sizes: expected at most the operands' ", rows,
                " rows in all, got more by expert ", e);
    total += sizes[e];
  }
}

void check_operand(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef shape,
                   c10::ScalarType dtype) {
  TORCH_CHECK(t.sizes() == shape, op, ": ", name, ": expected shape ", shape, ", got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, ": expected dtype ", dtype, ", got ", t.scalar_type());
}

// out[rows of e] = rows[rows of e] @ weight[e]: rows [N, K], weight [E, K, O] (any strides), out [N, O]
void experts_mm(const at::Tensor& rows, const at::Tensor& weight, at::IntArrayRef sizes_ref, at::Tensor out) {
  TORCH_CHECK(rows.dim() == 2 && weight.dim() == 3, "experts_mm: expected rows [N, K] and weight [E, K, O], got ",
              rows.sizes(), " and ", weight.sizes());
  const auto dtype = rows.scalar_type();
  check_operand("experts_mm", "weight", weight, {static_cast<int64_t>(sizes_ref.size()), rows.size(1), weight.size(2)},
                dtype);
  check_operand("experts_mm", "out", out, {out.size(0), weight.size(2)}, dtype);
  check_sizes("experts_mm", sizes_ref, std::min(rows.size(0), out.size(0)));
  const std::vector<int64_t> sizes(sizes_ref.begin(), sizes_ref.end());
  const auto starts = starts_of(sizes);
  const bool blocks = uses_row_blocks(rows);
  // the whole blocks, then the rest: each output row is still computed by one GEMM
  for_each_expert(sizes, [&](int64_t e) {
    const int64_t whole = blocks ? sizes[e] / kRowBlock * kRowBlock : sizes[e];
    for (auto [start, count] : {std::pair{starts[e], whole}, std::pair{starts[e] + whole, sizes[e] - whole}}) {
      if (count == 0) continue;
      auto dest = out.narrow(0, start, count);
      at::mm_out(dest, rows.narrow(0, start, count), weight[e]);
    }
  });
}

// Whether rows [first, first + count) of the bf16 matrix t hold only finite values.
bool rows_finite(const at::Tensor& t, int64_t first, int64_t count) {
  const auto* data = t.const_data_ptr<at::BFloat16>();
  for (int64_t r = first; r < first + count; ++r) {
    for (int64_t c = 0; c < t.size(1); ++c) {
      if (!std::isfinite(static_cast<float>(data[r * t.stride(0) + c * t.stride(1)]))) return false;
    }
  }
  return true;
}

// Rows [start, start + count) of t copied into `padded` rows, zeros after them.
at::Tensor zero_padded_rows(const at::Tensor& t, int64_t start, int64_t count, int64_t padded) {
  auto copy = at::empty({padded, t.size(1)}, t.options());
  copy.narrow(0, 0, count).copy_(t.narrow(0, start, count));
  copy.narrow(0, count, padded - count).zero_();
  return copy;
}

// out[e] = grad_rows[rows of e]^T @ in_rows[rows of e]: [N, O], [N, K] -> out [E, O, K]; experts
// without rows get zeros
void experts_weight_grad(const at::Tensor& grad_rows, const at::Tensor& in_rows, at::IntArrayRef sizes_ref,
                         at::Tensor out) {
  TORCH_CHECK(grad_rows.dim() == 2 && in_rows.dim() == 2, "experts_weight_grad: expected grad_rows [N, O] and ",
              "in_rows [N, K], got ", grad_rows.sizes(), " and ", in_rows.sizes());
  const auto dtype = grad_rows.scalar_type();
  check_operand("experts_weight_grad", "in_rows", in_rows, {grad_rows.size(0), in_rows.size(1)}, dtype);
  check_operand("experts_weight_grad", "out", out,
                {static_cast<int64_t>(sizes_ref.size()), grad_rows.size(1), in_rows.size(1)}, dtype);
  check_sizes("experts_weight_grad", sizes_ref, grad_rows.size(0));
  const std::vector<int64_t> sizes(sizes_ref.begin(), sizes_ref.end());
  const auto starts = starts_of(sizes);
  for (int64_t e = 0; e < static_cast<int64_t>(sizes.size()); ++e) {
    if (sizes[e] == 0) out[e].zero_();
  }
  const bool blocks = uses_row_blocks(grad_rows);
  // The reduction runs over the rows, so splitting them (as experts_mm does) would round dW_e
  // twice: one GEMM over the rows padded to a whole block instead. The narrower operand is copied
  // with zero rows after its own; the wider one is read in place over the padded rows (the next
  // experts'), whose products with those zeros are exactly zero, where the rows exist and are
  // finite (0 * inf is nan), and is copied zero-padded too where not.
  const bool grad_narrower = grad_rows.size(1) <= in_rows.size(1);
  const auto& narrower = grad_narrower ? grad_rows : in_rows;
  const auto& wider = grad_narrower ? in_rows : grad_rows;
  for_each_expert(sizes, [&](int64_t e) {
    auto dest = out[e];
    const int64_t start = starts[e], count = sizes[e];
    const int64_t padded = blocks ? (count + kRowBlock - 1) / kRowBlock * kRowBlock : count;
    if (padded == count) {
      at::mm_out(dest, grad_rows.narrow(0, start, count).t(), in_rows.narrow(0, start, count));
      return;
    }
    const auto narrower_rows = zero_padded_rows(narrower, start, count, padded);
    const bool in_place = start + padded <= wider.size(0) && rows_finite(wider, start + count, padded - count);
    const auto wider_rows = in_place ? wider.narrow(0, start, padded) : zero_padded_rows(wider, start, count, padded);
    at::mm_out(dest, (grad_narrower ? narrower_rows : wider_rows).t(), grad_narrower ? wider_rows : narrower_rows);
  });
}

// The Meta kernel of both ops (see the top of the file): takes the arguments, writes nothing.
void meta_no_outputs(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  torch::jit::drop(*stack, op.schema().arguments().size());
}

}  // namespace

TORCH_LIBRARY(shardmoe_gemm, m) {
  m.def("experts_mm(Tensor rows, Tensor weight, int[] sizes, Tensor(a!) out) -> ()");
  m.def("experts_weight_grad(Tensor grad_rows, Tensor in_rows, int[] sizes, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(shardmoe_gemm, CPU, m) {
  m.impl("experts_mm", experts_mm);
  m.impl("experts_weight_grad", experts_weight_grad);
}

TORCH_LIBRARY_IMPL(shardmoe_gemm, Meta, m) {
  for (const char* name : {"experts_mm", "experts_weight_grad"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&meta_no_outputs>());
  }
}
