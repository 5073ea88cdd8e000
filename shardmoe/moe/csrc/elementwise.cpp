// Fused elementwise passes of the MoE layer on CPU (shardmoe/moe/cpu.py builds, loads and documents
// these; the formulas are there).
//
// Each op makes one pass over its rows: kStep values of each input are loaded once, widened to
// float32 in registers (bf16) or loaded as they are (fp32), combined with ATen's vectorised float
// math (the closed forms and Sleef calls of aten's own activation kernels), and rounded once into
// the output. at::parallel_for splits the rows between threads (index_add_rows: the columns;
// combine_pairs: the tokens); every output element is written by one thread, so results do not
// depend on the thread count.
//
// Tensors: fp32 or bf16, 2-D with unit inner stride and any row stride (h[:, :F] views are fine);
// the Python side checks shapes and dtypes before calling.
//
// Every op writes only into buffers its caller passes (annotated Tensor(x!) in its schema) and
// returns nothing, so its Meta kernel, the one FakeTensorMode and torch.compile trace it with, has
// nothing to compute: the outputs' shapes, dtypes and strides are the caller's buffers'.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <type_traits>

namespace {

using at::BFloat16;
using Vec = at::vec::Vectorized<float>;

enum Activation : int64_t { kRelu = 0, kGelu = 1, kGeluTanh = 2, kSilu = 3, kIdentity = 4 };

// One step covers kStep values as two float32 vectors (lo, hi): bf16 is loaded as one
// Vectorized<BFloat16> and widened in registers, fp32 as two vectors. n < kStep loads the first
// n values (the rest read as zero) and stores only them: the ragged end of a row.
constexpr int64_t kStep = at::vec::Vectorized<BFloat16>::size();
static_assert(kStep == 2 * Vec::size(), "a bf16 vector widens to two float32 vectors");
struct Pair {
  Vec lo, hi;
};

inline Pair load(const float* p, int64_t n) {
  if (n >= kStep) return {Vec::loadu(p), Vec::loadu(p + Vec::size())};
  if (n > Vec::size()) return {Vec::loadu(p), Vec::loadu(p + Vec::size(), n - Vec::size())};
  return {Vec::loadu(p, n), Vec(0.f)};
}
inline Pair load(const BFloat16* p, int64_t n) {
  using VB = at::vec::Vectorized<BFloat16>;
  auto [lo, hi] = at::vec::convert_to_float<BFloat16>(n >= kStep ? VB::loadu(p) : VB::loadu(p, n));
  return {lo, hi};
}
inline void store(const Pair& v, float* p, int64_t n) {
  if (n >= kStep) {
    v.lo.store(p);
    v.hi.store(p + Vec::size());
  } else if (n > Vec::size()) {
    v.lo.store(p);
    v.hi.store(p + Vec::size(), n - Vec::size());
  } else {
    v.lo.store(p, n);
  }
}
inline void store(const Pair& v, BFloat16* p, int64_t n) {
  auto packed = at::vec::convert_from_float<BFloat16>(v.lo, v.hi);  // round to nearest even, once
  n >= kStep ? packed.store(p) : packed.store(p, n);
}
// the value rounded to T and widened back: where the torch path rounds a bf16 intermediate
// (act(hg) before the GLU product, dA * hu before act'), the fused pass rounds it too, so both
// paths give the same bits (a single rounding is more accurate on average, but moves individual
// results, and the check matrix's bf16 bars hold the torch path's)
inline Pair round_to(const Pair& v, const float*) { return v; }
inline Pair round_to(const Pair& v, const BFloat16*) {
  auto [lo, hi] = at::vec::convert_to_float<BFloat16>(at::vec::convert_from_float<BFloat16>(v.lo, v.hi));
  return {lo, hi};
}

// elementwise f over both halves
template <typename Fn>
inline Pair map(Fn&& f, const Pair& a) { return {f(a.lo), f(a.hi)}; }
template <typename Fn>
inline Pair map(Fn&& f, const Pair& a, const Pair& b) { return {f(a.lo, b.lo), f(a.hi, b.hi)}; }

// act(z), as aten's CPU kernels form it in float32
template <int64_t act>
inline Vec activate(const Vec& z) {
  const Vec one(1.f), half(0.5f);
  switch (act) {
    case kRelu: return at::vec::clamp_min(z, Vec(0.f));
    case kGelu: return z * half * (one + (z * Vec(static_cast<float>(M_SQRT1_2))).erf());
    case kGeluTanh: {
      const Vec beta(static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5)), kappa(0.044715f);
      const Vec cube = z * z * z;
      return half * z * (one + (beta * (z + kappa * cube)).tanh());
    }
    case kSilu: return z / (one + z.neg().exp());
    default: return z;
  }
}

// grad * act'(z), as aten's CPU activation-backward kernels form it in float32
template <int64_t act>
inline Vec activate_backward(const Vec& grad, const Vec& z) {
  const Vec one(1.f), half(0.5f);
  switch (act) {
    case kRelu: return Vec::blendv(Vec(0.f), grad, z > Vec(0.f));
    case kGelu: {
      const Vec alpha(static_cast<float>(M_SQRT1_2)), beta(static_cast<float>(M_2_SQRTPI * M_SQRT1_2 * 0.5));
      const Vec cdf = half * (one + (z * alpha).erf());
      const Vec pdf = beta * (Vec(-0.5f) * z * z).exp();
      return grad * (cdf + z * pdf);
    }
    case kGeluTanh: {
      const Vec beta(static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5)), kappa(0.044715f);
      const Vec z2 = z * z;
      const Vec t = (beta * (z + kappa * (z2 * z))).tanh();
      const Vec left = half * z, right = one + t;
      const Vec inner_d = beta * (one + Vec(3.f) * kappa * z2);
      return grad * (half * right + left * (one - t * t) * inner_d);
    }
    case kSilu: {
      const Vec s = one / (one + z.neg().exp());
      return grad * s * (one + z * (one - s));
    }
    default: return grad;
  }
}

int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(cols, 1)); }

// a = act(hg) * hu and optionally act(hg), for h = [hg | hu] [N, 2F] -> [N, F] each
template <typename T, int64_t act>
void glu_forward_impl(const at::Tensor& h, at::Tensor& a, at::Tensor* act_gate) {
  const int64_t rows = h.size(0), ffn = a.size(1);
  const T* hp = h.data_ptr<T>();
  T* ap = a.data_ptr<T>();
  T* gp = act_gate ? act_gate->data_ptr<T>() : nullptr;
  const int64_t hs = h.stride(0), as = a.stride(0), gs = act_gate ? act_gate->stride(0) : 0;
  at::parallel_for(0, rows, grain_rows(ffn), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T *g = hp + r * hs, *u = g + ffn;
      for (int64_t i = 0; i < ffn; i += kStep) {
        const int64_t n = ffn - i;
        const Pair av = round_to(map(activate<act>, load(g + i, n)), hp);
        store(map(std::multiplies<Vec>(), av, load(u + i, n)), ap + r * as + i, n);
        if (gp) store(av, gp + r * gs + i, n);
      }
    }
  });
}

// dh = [dA * hu * act'(hg) | dA * act(hg)], dA, act(hg) [N, F], h [N, 2F] -> dh [N, 2F]
template <typename T, int64_t act>
void glu_backward_impl(const at::Tensor& grad_a, const at::Tensor& h, const at::Tensor& act_gate, at::Tensor& grad_h) {
  const int64_t rows = h.size(0), ffn = grad_a.size(1);
  const T *dp = grad_a.data_ptr<T>(), *hp = h.data_ptr<T>(), *gp = act_gate.data_ptr<T>();
  T* op = grad_h.data_ptr<T>();
  const int64_t ds = grad_a.stride(0), hs = h.stride(0), gs = act_gate.stride(0), os = grad_h.stride(0);
  at::parallel_for(0, rows, grain_rows(ffn), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T *d = dp + r * ds, *g = hp + r * hs, *u = g + ffn, *ag = gp + r * gs;
      T* o = op + r * os;
      for (int64_t i = 0; i < ffn; i += kStep) {
        const int64_t n = ffn - i;
        const Pair dv = load(d + i, n);
        const Pair du = round_to(map(std::multiplies<Vec>(), dv, load(u + i, n)), hp);
        store(map(activate_backward<act>, du, load(g + i, n)), o + i, n);
        store(map(std::multiplies<Vec>(), dv, load(ag + i, n)), o + ffn + i, n);
      }
    }
  });
}

// The glu expert's backward elementwise work in one pass (cpu.py, glu_backward_one_pass): from h [N, 2F],
// gd = g Wdown [N, F] and w [N] float32, a = act(hg) * hu [N, F], dh [N, 2F] and the gate dots
// sum(gd * act(hg) * hu) [N] float32, with every rounding and the dot's summation order of
// glu_forward, rowwise_dot(gd, act(hg), hu), scale_rows (dA = w gd) and glu_backward run in turn:
// a and dh are their bits (the fp32 dots may differ by a fused multiply-add). SiLU evaluates
// exp(-hg) once for act and act' (the separate passes evaluate it twice, the same value). a may
// be g_down itself: each step loads its gd before storing a over it, and each element belongs to
// one thread.
template <typename T, int64_t act>
void glu_backward_one_pass_impl(const at::Tensor& h, const at::Tensor& g_down, const at::Tensor& weight, at::Tensor& a,
                   at::Tensor& grad_h, at::Tensor& dots) {
  const int64_t rows = h.size(0), ffn = g_down.size(1);
  const T *hp = h.data_ptr<T>(), *dp = g_down.data_ptr<T>();
  const float* wp = weight.data_ptr<float>();
  T *ap = a.data_ptr<T>(), *op = grad_h.data_ptr<T>();
  float* sp = dots.data_ptr<float>();
  const int64_t hs = h.stride(0), ds = g_down.stride(0), ws = weight.stride(0), as = a.stride(0),
                os = grad_h.stride(0), ss = dots.stride(0);
  const Vec one(1.f);
  at::parallel_for(0, rows, grain_rows(3 * ffn), [&](int64_t begin, int64_t end) {
    float lanes[Vec::size()];
    for (int64_t r = begin; r < end; ++r) {
      const T *g = hp + r * hs, *u = g + ffn, *d = dp + r * ds;
      T* o = op + r * os;
      const Vec w(wp[r * ws]);
      Vec acc_lo(0.f), acc_hi(0.f);
      for (int64_t i = 0; i < ffn; i += kStep) {
        const int64_t n = ffn - i;  // a ragged end loads zeros past n, which add nothing to the dot
        const Pair hg = load(g + i, n), hu = load(u + i, n), gd = load(d + i, n);
        Pair exp_neg{Vec(0.f), Vec(0.f)}, act_gate;
        if constexpr (act == kSilu) {
          exp_neg = map([](const Vec& z) { return z.neg().exp(); }, hg);
          act_gate = round_to(map([&](const Vec& z, const Vec& e) { return z / (one + e); }, hg, exp_neg), hp);
        } else {
          act_gate = round_to(map(activate<act>, hg), hp);
        }
        store(map(std::multiplies<Vec>(), act_gate, hu), ap + r * as + i, n);
        const Pair prod = map(std::multiplies<Vec>(), map(std::multiplies<Vec>(), gd, act_gate), hu);
        acc_lo = acc_lo + prod.lo;
        acc_hi = acc_hi + prod.hi;
        const Pair grad_a = round_to(map([&](const Vec& v) { return v * w; }, gd), hp);
        const Pair du = round_to(map(std::multiplies<Vec>(), grad_a, hu), hp);
        if constexpr (act == kSilu) {
          const auto silu_backward = [&](const Vec& grad, const Vec& z, const Vec& e) {
            const Vec s = one / (one + e);
            return grad * s * (one + z * (one - s));
          };
          store({silu_backward(du.lo, hg.lo, exp_neg.lo), silu_backward(du.hi, hg.hi, exp_neg.hi)}, o + i, n);
        } else {
          store(map(activate_backward<act>, du, hg), o + i, n);
        }
        store(map(std::multiplies<Vec>(), grad_a, act_gate), o + ffn + i, n);
      }
      (acc_lo + acc_hi).store(lanes);
      float sum = 0.f;
      for (int64_t l = 0; l < Vec::size(); ++l) sum += lanes[l];
      sp[r * ss] = sum;
    }
  });
}

// out_r = rows_r * w_r in float32, rounded once: [N, D], [N] float32 -> [N, D]
template <typename T>
void scale_rows_impl(const at::Tensor& rows, const at::Tensor& weight, at::Tensor& out) {
  const int64_t n_rows = rows.size(0), cols = rows.size(1);
  const T* rp = rows.data_ptr<T>();
  const float* wp = weight.data_ptr<float>();
  T* op = out.data_ptr<T>();
  const int64_t rs = rows.stride(0), os = out.stride(0), ws = weight.stride(0);
  at::parallel_for(0, n_rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const Vec w(wp[r * ws]);
      for (int64_t i = 0; i < cols; i += kStep) {
        const int64_t n = cols - i;
        store(map([&](const Vec& x) { return x * w; }, load(rp + r * rs + i, n)), op + r * os + i, n);
      }
    }
  });
}

// out_r = sum_d rows[r, d] * f1[r, d] (* f2[r, d]), products and sum in float32 -> [N] float32
template <typename T>
void rowwise_dot_impl(const at::Tensor& rows, const at::Tensor& f1, const at::Tensor* f2, at::Tensor& out) {
  const int64_t n_rows = rows.size(0), cols = rows.size(1);
  const T *rp = rows.data_ptr<T>(), *p1 = f1.data_ptr<T>(), *p2 = f2 ? f2->data_ptr<T>() : nullptr;
  const int64_t rs = rows.stride(0), s1 = f1.stride(0), s2 = f2 ? f2->stride(0) : 0, os = out.stride(0);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n_rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    float lanes[Vec::size()];
    for (int64_t r = begin; r < end; ++r) {
      Vec acc_lo(0.f), acc_hi(0.f);
      for (int64_t i = 0; i < cols; i += kStep) {
        const int64_t n = cols - i;  // a ragged end loads zeros past n, which add nothing
        Pair prod = map(std::multiplies<Vec>(), load(rp + r * rs + i, n), load(p1 + r * s1 + i, n));
        if (p2) prod = map(std::multiplies<Vec>(), prod, load(p2 + r * s2 + i, n));
        acc_lo = acc_lo + prod.lo;
        acc_hi = acc_hi + prod.hi;
      }
      (acc_lo + acc_hi).store(lanes);
      float sum = 0.f;
      for (int64_t l = 0; l < Vec::size(); ++l) sum += lanes[l];
      op[r * os] = sum;
    }
  });
}

// out[index_r] += w_r * rows_r (w optional), rows in order for each target; out float32 [M, D].
// Threads split the columns, so each target's sum keeps the row order whatever the thread count.
template <typename T>
void index_add_rows_impl(const at::Tensor& rows, const at::Tensor& index, const at::Tensor* weight, at::Tensor& out) {
  const int64_t n_rows = rows.size(0), cols = rows.size(1);
  const T* rp = rows.data_ptr<T>();
  const int64_t* tp = index.data_ptr<int64_t>();
  const float* wp = weight ? weight->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t rs = rows.stride(0), os = out.stride(0), ts = index.stride(0), ws = weight ? weight->stride(0) : 0;
  for (int64_t r = 0; r < n_rows; ++r) {  // index_add_'s check, before any write
    TORCH_CHECK_INDEX(tp[r * ts] >= 0 && tp[r * ts] < out.size(0), "index: expected indices in [0, ",
                      out.size(0), "), got ", tp[r * ts], " at row ", r);
  }
  constexpr int64_t kColumns = 8 * kStep;  // a column block per task; its rows stream through L1
  at::parallel_for(0, (cols + kColumns - 1) / kColumns, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = 0; r < n_rows; ++r) {
      const Vec w(wp ? wp[r * ws] : 1.f);
      float* o = op + tp[r * ts] * os;
      for (int64_t i = begin * kColumns; i < std::min(cols, end * kColumns); i += kStep) {
        const int64_t n = std::min(cols, end * kColumns) - i;
        const Pair x = load(rp + r * rs + i, n);
        // without weights x is added as it is, as index_add_ does (no multiply by 1.0 to round)
        store(map(std::plus<Vec>(), load(o + i, n), wp ? map([&](const Vec& v) { return v * w; }, x) : x), o + i, n);
      }
    }
  });
}

// out_t = sum over j of (w_r *) rows_r for the rows r = token_rows[t, j] >= 0, in the order given
// (ascending: a token's rows are added in row order, as index_add_ adds them) -> [S, D] float32.
// A gather: each token's k rows are read once and its output row written once, by one thread,
// where index_add_rows scatters every row into its token's output (a read-modify-write per row).
template <typename T>
void combine_pairs_impl(const at::Tensor& rows, const at::Tensor& token_rows, const at::Tensor* weight,
                        at::Tensor& out) {
  const int64_t n_tokens = token_rows.size(0), k = token_rows.size(1), cols = rows.size(1);
  const T* rp = rows.data_ptr<T>();
  const int64_t* ip = token_rows.data_ptr<int64_t>();
  const float* wp = weight ? weight->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t rs = rows.stride(0), is = token_rows.stride(0), os = out.stride(0), ws = weight ? weight->stride(0) : 0;
  for (int64_t p = 0; p < n_tokens * k; ++p) {
    const int64_t r = ip[(p / k) * is + p % k];
    TORCH_CHECK_INDEX(r >= -1 && r < rows.size(0), "token_rows: expected row indices in [-1, ", rows.size(0),
                      "), got ", r, " for token ", p / k);
  }
  at::parallel_for(0, n_tokens, grain_rows(cols * k), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t* idx = ip + t * is;
      for (int64_t i = 0; i < cols; i += kStep) {
        const int64_t n = cols - i;
        Pair sum{Vec(0.f), Vec(0.f)};
        for (int64_t j = 0; j < k; ++j) {
          const int64_t r = idx[j];
          if (r < 0) continue;  // a dropped pair
          const Pair x = load(rp + r * rs + i, n);
          const Vec w(wp ? wp[r * ws] : 1.f);
          // the same operations as index_add_rows: the sum starts at zero, x is added as it is
          // without weights, else x * w rounded to float32 first
          sum = map(std::plus<Vec>(), sum, wp ? map([&](const Vec& v) { return v * w; }, x) : x);
        }
        store(sum, op + t * os + i, n);
      }
    }
  });
}

#define DISPATCH_FLOAT_BF16(dtype, ...)                      \
  if ((dtype) == at::kFloat) {                               \
    using scalar = float;                                    \
    __VA_ARGS__;                                             \
  } else {                                                   \
    TORCH_CHECK((dtype) == at::kBFloat16, "dtype: expected float32 or bfloat16, got ", (dtype)); \
    using scalar = BFloat16;                                 \
    __VA_ARGS__;                                             \
  }

// calls fn(std::integral_constant<int64_t, activation>{}) for a runtime activation code
template <typename Fn>
void dispatch_activation(int64_t act, Fn&& fn) {
  switch (act) {
    case kRelu: return fn(std::integral_constant<int64_t, kRelu>{});
    case kGelu: return fn(std::integral_constant<int64_t, kGelu>{});
    case kGeluTanh: return fn(std::integral_constant<int64_t, kGeluTanh>{});
    case kSilu: return fn(std::integral_constant<int64_t, kSilu>{});
    case kIdentity: return fn(std::integral_constant<int64_t, kIdentity>{});
  }
  TORCH_CHECK(false, "activation: expected a code in 0..4, got ", act);
}

void glu_forward(const at::Tensor& h, int64_t act, at::Tensor a, const std::optional<at::Tensor>& act_gate) {
  at::Tensor g = act_gate.has_value() ? *act_gate : at::Tensor();
  at::Tensor* gp = act_gate.has_value() ? &g : nullptr;
  dispatch_activation(act, [&](auto code) {
    DISPATCH_FLOAT_BF16(h.scalar_type(), glu_forward_impl<scalar, decltype(code)::value>(h, a, gp));
  });
}
void glu_backward(const at::Tensor& grad_a, const at::Tensor& h, const at::Tensor& act_gate, int64_t act,
                  at::Tensor grad_h) {
  dispatch_activation(act, [&](auto code) {
    DISPATCH_FLOAT_BF16(h.scalar_type(), glu_backward_impl<scalar, decltype(code)::value>(grad_a, h, act_gate, grad_h));
  });
}
void glu_backward_one_pass(const at::Tensor& h, const at::Tensor& g_down, const at::Tensor& weight, int64_t act, at::Tensor a,
              at::Tensor grad_h, at::Tensor dots) {
  dispatch_activation(act, [&](auto code) {
    DISPATCH_FLOAT_BF16(h.scalar_type(),
                        glu_backward_one_pass_impl<scalar, decltype(code)::value>(h, g_down, weight, a, grad_h, dots));
  });
}
void scale_rows(const at::Tensor& rows, const at::Tensor& weight, at::Tensor out) {
  DISPATCH_FLOAT_BF16(rows.scalar_type(), scale_rows_impl<scalar>(rows, weight, out));
}
void rowwise_dot(const at::Tensor& rows, const at::Tensor& f1, const std::optional<at::Tensor>& f2, at::Tensor out) {
  DISPATCH_FLOAT_BF16(rows.scalar_type(), rowwise_dot_impl<scalar>(rows, f1, f2.has_value() ? &*f2 : nullptr, out));
}
void index_add_rows(const at::Tensor& rows, const at::Tensor& index, const std::optional<at::Tensor>& weight,
                  at::Tensor out) {
  DISPATCH_FLOAT_BF16(rows.scalar_type(),
                      index_add_rows_impl<scalar>(rows, index, weight.has_value() ? &*weight : nullptr, out));
}

void combine_pairs(const at::Tensor& rows, const at::Tensor& token_rows, const std::optional<at::Tensor>& weight,
                   at::Tensor out) {
  DISPATCH_FLOAT_BF16(rows.scalar_type(),
                      combine_pairs_impl<scalar>(rows, token_rows, weight.has_value() ? &*weight : nullptr, out));
}

// The Meta kernel of every op (see the top of the file): takes the arguments, writes nothing.
void meta_no_outputs(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  torch::jit::drop(*stack, op.schema().arguments().size());
}

}  // namespace

TORCH_LIBRARY(shardmoe_elementwise, m) {
  m.def("glu_forward(Tensor h, int activation, Tensor(a!) a, Tensor(b!)? act_gate) -> ()");
  m.def("glu_backward(Tensor grad_a, Tensor h, Tensor act_gate, int activation, Tensor(a!) grad_h) -> ()");
  m.def("glu_backward_one_pass(Tensor h, Tensor g_down, Tensor weight, int activation, Tensor(a!) a, "
        "Tensor(b!) grad_h, Tensor(c!) dots) -> ()");
  m.def("scale_rows(Tensor rows, Tensor weight, Tensor(a!) out) -> ()");
  m.def("rowwise_dot(Tensor rows, Tensor f1, Tensor? f2, Tensor(a!) out) -> ()");
  m.def("index_add_rows(Tensor rows, Tensor index, Tensor? weight, Tensor(a!) out) -> ()");
  m.def("combine_pairs(Tensor rows, Tensor token_rows, Tensor? weight, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(shardmoe_elementwise, CPU, m) {
  m.impl("glu_forward", glu_forward);
  m.impl("glu_backward", glu_backward);
  m.impl("glu_backward_one_pass", glu_backward_one_pass);
  m.impl("scale_rows", scale_rows);
  m.impl("rowwise_dot", rowwise_dot);
  m.impl("index_add_rows", index_add_rows);
  m.impl("combine_pairs", combine_pairs);
}

TORCH_LIBRARY_IMPL(shardmoe_elementwise, Meta, m) {
  for (const char* name :
       {"glu_forward", "glu_backward", "glu_backward_one_pass", "scale_rows", "rowwise_dot", "index_add_rows", "combine_pairs"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&meta_no_outputs>());
  }
}
