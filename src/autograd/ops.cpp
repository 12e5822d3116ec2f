// The differentiable tensor ops: each op's forward and backward side by side.
#include "diffcomm/autograd/ops.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "diffcomm/tensor/error.hpp"
#include "tensor/cuda/device_ops.hpp"

namespace diffcomm {
namespace {

void check_same(const char* op, const Tensor& a, const Tensor& b) {
  if (!a.defined() || !b.defined()) raise(op, "undefined tensor");
  if (a.dtype() != b.dtype() || a.shape() != b.shape() || a.device() != b.device())
    raise(op, fmt::format("operands differ: {} vs {} (no broadcasting)", a.str(), b.str()));
}

void require_cpu(const char* op, const Tensor& t) {
  if (!t.device().is_cpu())
    raise(op,
          fmt::format("{} is on {}; this op runs on CPU tensors only", t.str(), t.device().str()));
}

// out[i] = f(a[i], b[i]) computed in compute_t<T>.
template <class F>
Tensor binary_cpu(const char* op, const Tensor& a, const Tensor& b, F f) {
  check_same(op, a, b);
  require_cpu(op, a);
  Tensor out = empty_like(a);
  dispatch_dtype(a.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    using C = compute_t<T>;
    const T* pa = static_cast<const T*>(a.data_ptr());
    const T* pb = static_cast<const T*>(b.data_ptr());
    T* po = static_cast<T*>(out.data_ptr());
    const int64_t n = a.numel();
    for (int64_t i = 0; i < n; ++i)
      po[i] = static_cast<T>(static_cast<C>(f(static_cast<C>(pa[i]), static_cast<C>(pb[i]))));
  });
  return out;
}

Tensor raw_add(const Tensor& a, const Tensor& b, double alpha_b) {
  check_same("add", a, b);
  if (a.device().is_cuda()) {
    Tensor out = empty_like(a);
    detail::cuda_add(out, a, b, alpha_b);
    return out;
  }
  if (alpha_b == 1.0) return binary_cpu("add", a, b, [](auto x, auto y) { return x + y; });
  return binary_cpu("sub", a, b, [](auto x, auto y) { return x - y; });
}

Tensor raw_scale(const Tensor& x, double alpha) {
  Tensor out = empty_like(x);
  if (x.device().is_cuda()) {
    detail::cuda_scale(out, x, alpha);
    return out;
  }
  dispatch_dtype(x.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    using C = compute_t<T>;
    const T* px = static_cast<const T*>(x.data_ptr());
    T* po = static_cast<T*>(out.data_ptr());
    const C a = static_cast<C>(alpha);
    // numel() is out of line (a shape product): hoisted so the loop is a
    // plain pointer loop the compiler can vectorize.
    const int64_t n = x.numel();
    for (int64_t i = 0; i < n; ++i)
      po[i] = static_cast<T>(static_cast<C>(a * static_cast<C>(px[i])));
  });
  return out;
}

Tensor raw_mul(const Tensor& a, const Tensor& b) {
  return binary_cpu("mul", a, b, [](auto x, auto y) { return x * y; });
}

// The float64 sum of n float32 values when it is provably exact in every
// order, else false. Why: the serial, order-fixed accumulation is one
// dependent float64 add per element (latency-bound, ~13 % of a small fwd+bwd
// step), but when no partial sum can round, every order gives the same
// double, so independent accumulators give the serial loop's bits exactly.
// Proof: each float32 x is an integer multiple of its ulp, which is at least
// u = ulp of the smallest nonzero |x| (2^-149 for subnormals). So is every
// partial sum, in any order, and |partial| <= n * max|x|. When
// n * max|x| <= 2^53 * u, every partial sum is an integer multiple of u
// below 2^53 * u in magnitude, hence a double exactly, and all the adds are
// exact. In exponent fields (biased, e >= 1 for the ulp): max|x| < 2^(emax -
// 126), u = 2^(max(emin, 1) - 150), so the test is
// ceil(log2 n) + emax - max(emin, 1) <= 29.
bool exact_float_sum(const float* p, int64_t n, double* out) {
#if defined(__SSE2__)
  if (n <= 0 || n > (int64_t{1} << 24)) return false;
  // One pass: max |x|, min nonzero |x| (zeros become +inf), and the sum in
  // eight float64 lanes, computed speculatively and checked at the end. A
  // NaN or Inf element makes the sum non-finite (a finite float32 sum cannot
  // overflow float64), which takes the serial path.
  const __m128 absmask = _mm_castsi128_ps(_mm_set1_epi32(0x7FFFFFFF));
  const __m128 inf = _mm_set1_ps(INFINITY);
  const __m128 zero = _mm_setzero_ps();
  __m128 vmax = zero, vmin = inf;
  __m128d s0 = _mm_setzero_pd(), s1 = s0, s2 = s0, s3 = s0;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128 x0 = _mm_loadu_ps(p + i), x1 = _mm_loadu_ps(p + i + 4);
    const __m128 a0 = _mm_and_ps(x0, absmask), a1 = _mm_and_ps(x1, absmask);
    vmax = _mm_max_ps(vmax, _mm_max_ps(a0, a1));
    const __m128 n0 = _mm_or_ps(a0, _mm_and_ps(_mm_cmpeq_ps(a0, zero), inf));
    const __m128 n1 = _mm_or_ps(a1, _mm_and_ps(_mm_cmpeq_ps(a1, zero), inf));
    vmin = _mm_min_ps(vmin, _mm_min_ps(n0, n1));
    s0 = _mm_add_pd(s0, _mm_cvtps_pd(x0));
    s1 = _mm_add_pd(s1, _mm_cvtps_pd(_mm_movehl_ps(x0, x0)));
    s2 = _mm_add_pd(s2, _mm_cvtps_pd(x1));
    s3 = _mm_add_pd(s3, _mm_cvtps_pd(_mm_movehl_ps(x1, x1)));
  }
  float mx[4], mn[4];
  double s[8];
  _mm_storeu_ps(mx, vmax);
  _mm_storeu_ps(mn, vmin);
  _mm_storeu_pd(s, s0);
  _mm_storeu_pd(s + 2, s1);
  _mm_storeu_pd(s + 4, s2);
  _mm_storeu_pd(s + 6, s3);
  float amax = std::max(std::max(mx[0], mx[1]), std::max(mx[2], mx[3]));
  float amin = std::min(std::min(mn[0], mn[1]), std::min(mn[2], mn[3]));
  double sum = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  for (; i < n; ++i) {
    const float a = std::fabs(p[i]);
    amax = std::max(amax, a);
    if (a != 0) amin = std::min(amin, a);
    sum += static_cast<double>(p[i]);
  }
  if (!std::isfinite(sum)) return false;
  if (amin != INFINITY) {
    const int emax = static_cast<int>(std::bit_cast<uint32_t>(amax) >> 23);
    const int emin = std::max(static_cast<int>(std::bit_cast<uint32_t>(amin) >> 23), 1);
    const int log2n = std::bit_width(static_cast<uint64_t>(n - 1));
    if (log2n + emax - emin > 29) return false;
  }
  *out = sum;
  return true;
#else
  (void)p, (void)n, (void)out;
  return false;  // the serial loop everywhere else
#endif
}

Tensor raw_sum(const Tensor& x) {
  require_cpu("sum", x);
  Tensor out = empty({}, x.dtype());
  if (x.dtype() == DType::Float32) {
    double s = 0;
    if (exact_float_sum(static_cast<const float*>(x.data_ptr()), x.numel(), &s)) {
      *static_cast<float*>(out.data_ptr()) = static_cast<float>(s);
      return out;
    }
  }
  dispatch_dtype(x.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    using C = compute_t<T>;
    using Acc = std::conditional_t<std::is_floating_point_v<C>, double, int64_t>;
    const T* p = static_cast<const T*>(x.data_ptr());
    const T* const end = p + x.numel();  // once, not per element (out-of-line call)
    Acc s = 0;
    for (; p != end; ++p) s += static_cast<Acc>(static_cast<C>(*p));
    *static_cast<T*>(out.data_ptr()) = static_cast<T>(static_cast<C>(s));
  });
  return out;
}

Tensor raw_dot(const Tensor& a, const Tensor& b) {
  check_same("dot", a, b);
  require_cpu("dot", a);
  Tensor out = empty({}, a.dtype());
  dispatch_dtype(a.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    using C = compute_t<T>;
    using Acc = std::conditional_t<std::is_floating_point_v<C>, double, int64_t>;
    const T* pa = static_cast<const T*>(a.data_ptr());
    const T* pb = static_cast<const T*>(b.data_ptr());
    Acc s = 0;
    const int64_t n = a.numel();  // once, not per element
    for (int64_t i = 0; i < n; ++i)
      s += static_cast<Acc>(static_cast<C>(pa[i])) * static_cast<Acc>(static_cast<C>(pb[i]));
    *static_cast<T*>(out.data_ptr()) = static_cast<T>(static_cast<C>(s));
  });
  return out;
}

// Broadcast a 0-d value to a shape (the backward of sum).
Tensor expand_scalar(const Tensor& g, const Shape& shape) {
  Tensor out = empty(shape, g.dtype(), g.device());
  double v = 0;
  if (g.device().is_cpu() && g.numel() == 1) {
    // item() without its to_vector() copy (an allocation per backward).
    dispatch_dtype(g.dtype(), [&](auto tag) {
      using T = typename decltype(tag)::type;
      v = static_cast<double>(static_cast<compute_t<T>>(*static_cast<const T*>(g.data_ptr())));
    });
  } else {
    v = g.item();
  }
  out.fill_(v);
  return out;
}

// out = a b for a row-major [m, k] x [k, N] with N known at compile time: the
// N accumulators of an output row stay in registers instead of a vector that
// is stored and reloaded for every p. Each output element is the same sum,
// in the same order (0, then + a[i,p] b[p,j] for p = 0..k-1), as the generic
// loop in raw_matmul, so the bits are identical.
template <int N, class T, class C, class Acc>
void matmul_fixed_n(const T* __restrict pa, const T* __restrict pb, T* __restrict po, int64_t m,
                    int64_t k) {
  int64_t i = 0;
  // Two output rows at a time: independent add chains (the adds of one
  // element are serial, so one row alone waits on the add latency).
  for (; i + 1 < m; i += 2) {
    Acc acc0[N] = {}, acc1[N] = {};
    const T* arow0 = pa + i * k;
    const T* arow1 = arow0 + k;
    for (int64_t p = 0; p < k; ++p) {
      const Acc av0 = static_cast<Acc>(static_cast<C>(arow0[p]));
      const Acc av1 = static_cast<Acc>(static_cast<C>(arow1[p]));
      const T* brow = pb + p * N;
      for (int j = 0; j < N; ++j) {
        const Acc bv = static_cast<Acc>(static_cast<C>(brow[j]));
        acc0[j] += av0 * bv;
        acc1[j] += av1 * bv;
      }
    }
    for (int j = 0; j < N; ++j) {
      po[i * N + j] = static_cast<T>(static_cast<C>(acc0[j]));
      po[(i + 1) * N + j] = static_cast<T>(static_cast<C>(acc1[j]));
    }
  }
  for (; i < m; ++i) {
    Acc acc[N] = {};
    const T* arow = pa + i * k;
    for (int64_t p = 0; p < k; ++p) {
      const Acc av = static_cast<Acc>(static_cast<C>(arow[p]));
      const T* brow = pb + p * N;
      for (int j = 0; j < N; ++j) acc[j] += av * static_cast<Acc>(static_cast<C>(brow[j]));
    }
    for (int j = 0; j < N; ++j) po[i * N + j] = static_cast<T>(static_cast<C>(acc[j]));
  }
}

Tensor raw_matmul(const Tensor& a, const Tensor& b) {
  if (a.dim() != 2 || b.dim() != 2 || a.size(1) != b.size(0) || a.dtype() != b.dtype())
    raise("matmul",
          fmt::format("needs [m, k] x [k, n] of one dtype, got {} x {}", a.str(), b.str()));
  require_cpu("matmul", a);
  require_cpu("matmul", b);
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  Tensor out = empty({m, n}, a.dtype());
  dispatch_dtype(a.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    using C = compute_t<T>;
    using Acc = std::conditional_t<std::is_floating_point_v<C>, double, int64_t>;
    const T* pa = static_cast<const T*>(a.data_ptr());
    const T* pb = static_cast<const T*>(b.data_ptr());
    T* po = static_cast<T*>(out.data_ptr());
    if constexpr (std::is_floating_point_v<T>) {
      // The narrow right-hand sides of the training step (n = 8, 16, 32).
      switch (n) {
        case 8: return matmul_fixed_n<8, T, C, Acc>(pa, pb, po, m, k);
        case 16: return matmul_fixed_n<16, T, C, Acc>(pa, pb, po, m, k);
        case 32: return matmul_fixed_n<32, T, C, Acc>(pa, pb, po, m, k);
        default: break;
      }
    }
    std::vector<Acc> row(static_cast<std::size_t>(n));
    for (int64_t i = 0; i < m; ++i) {
      std::fill(row.begin(), row.end(), Acc{0});
      for (int64_t p = 0; p < k; ++p) {
        const Acc av = static_cast<Acc>(static_cast<C>(pa[i * k + p]));
        for (int64_t j = 0; j < n; ++j)
          row[static_cast<std::size_t>(j)] += av * static_cast<Acc>(static_cast<C>(pb[p * n + j]));
      }
      for (int64_t j = 0; j < n; ++j)
        po[i * n + j] = static_cast<T>(static_cast<C>(row[static_cast<std::size_t>(j)]));
    }
  });
  return out;
}

Tensor raw_transpose(const Tensor& x) {
  if (x.dim() != 2) raise("transpose", fmt::format("needs a 2-d tensor, got {}", x.str()));
  require_cpu("transpose", x);
  const int64_t r = x.size(0), c = x.size(1);
  Tensor out = empty({c, r}, x.dtype());
  const std::size_t es = element_size(x.dtype());
  const char* src = static_cast<const char*>(x.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  // Element copies of a fixed size (a memcpy call per element cost more than
  // the copy itself).
  auto typed = [&](auto size) {
    constexpr std::size_t E = decltype(size)::value;
    for (int64_t i = 0; i < r; ++i)
      for (int64_t j = 0; j < c; ++j)
        std::memcpy(dst + static_cast<std::size_t>(j * r + i) * E,
                    src + static_cast<std::size_t>(i * c + j) * E, E);
  };
  switch (es) {
    case 1: typed(std::integral_constant<std::size_t, 1>{}); break;
    case 2: typed(std::integral_constant<std::size_t, 2>{}); break;
    case 4: typed(std::integral_constant<std::size_t, 4>{}); break;
    case 8: typed(std::integral_constant<std::size_t, 8>{}); break;
    default:
      for (int64_t i = 0; i < r; ++i)
        for (int64_t j = 0; j < c; ++j)
          std::memcpy(dst + static_cast<std::size_t>(j * r + i) * es,
                      src + static_cast<std::size_t>(i * c + j) * es, es);
  }
  return out;
}

// ---- Function definitions: forward and backward side by side ----

struct AddFn : Function<AddFn> {
  static constexpr const char* kName = "AddBackward";
  double alpha_b = 1.0;  // 1 for add, -1 for sub
  std::vector<Tensor> forward(const std::vector<Tensor>& in) {
    return {raw_add(in[0], in[1], alpha_b)};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) {
    return {g[0], alpha_b == 1.0 ? g[0] : raw_scale(g[0], -1.0)};
  }
};

struct MulFn : Function<MulFn> {
  static constexpr const char* kName = "MulBackward";
  SavedTensor a, b;
  std::vector<Tensor> saved() const { return {a.peek(), b.peek()}; }
  std::vector<Tensor> forward(const std::vector<Tensor>& in) {
    a = SavedTensor(in[0], 0);
    b = SavedTensor(in[1], 1);
    return {raw_mul(in[0], in[1])};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) {
    return {raw_mul(g[0], b.get(kName)), raw_mul(g[0], a.get(kName))};
  }
};

struct DivFn : Function<DivFn> {
  static constexpr const char* kName = "DivBackward";
  SavedTensor a, b;
  std::vector<Tensor> saved() const { return {a.peek(), b.peek()}; }
  std::vector<Tensor> forward(const std::vector<Tensor>& in) {
    a = SavedTensor(in[0], 0);
    b = SavedTensor(in[1], 1);
    return {binary_cpu("div", in[0], in[1], [](auto x, auto y) { return x / y; })};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) {
    Tensor ga = binary_cpu("div", g[0], b.get(kName), [](auto x, auto y) { return x / y; });
    Tensor q = binary_cpu("div", a.get(kName), b.get(kName), [](auto x, auto y) { return x / y; });
    Tensor gb = raw_scale(raw_mul(ga, q), -1.0);
    return {ga, gb};
  }
};

struct ScaleFn : Function<ScaleFn> {
  static constexpr const char* kName = "ScaleBackward";
  double alpha = 1.0;
  std::vector<Tensor> forward(const std::vector<Tensor>& in) { return {raw_scale(in[0], alpha)}; }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) { return {raw_scale(g[0], alpha)}; }
};

struct SumFn : Function<SumFn> {
  static constexpr const char* kName = "SumBackward";
  Shape shape;
  std::vector<Tensor> forward(const std::vector<Tensor>& in) {
    shape = in[0].shape();
    return {raw_sum(in[0])};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) {
    return {expand_scalar(g[0], shape)};
  }
};

struct DotFn : Function<DotFn> {
  static constexpr const char* kName = "DotBackward";
  SavedTensor a, b;
  std::vector<Tensor> saved() const { return {a.peek(), b.peek()}; }
  std::vector<Tensor> forward(const std::vector<Tensor>& in) {
    a = SavedTensor(in[0], 0);
    b = SavedTensor(in[1], 1);
    return {raw_dot(in[0], in[1])};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) {
    const double s = g[0].item();
    return {raw_scale(b.get(kName), s), raw_scale(a.get(kName), s)};
  }
};

struct MatmulFn : Function<MatmulFn> {
  static constexpr const char* kName = "MatmulBackward";
  SavedTensor a, b;
  std::vector<Tensor> saved() const { return {a.peek(), b.peek()}; }
  std::vector<Tensor> forward(const std::vector<Tensor>& in) {
    a = SavedTensor(in[0], 0);
    b = SavedTensor(in[1], 1);
    return {raw_matmul(in[0], in[1])};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) {
    return {raw_matmul(g[0], raw_transpose(b.get(kName))),
            raw_matmul(raw_transpose(a.get(kName)), g[0])};
  }
};

struct TransposeFn : Function<TransposeFn> {
  static constexpr const char* kName = "TransposeBackward";
  std::vector<Tensor> forward(const std::vector<Tensor>& in) { return {raw_transpose(in[0])}; }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) { return {raw_transpose(g[0])}; }
};

struct CatFn : Function<CatFn> {
  static constexpr const char* kName = "CatBackward";
  std::vector<int64_t> rows;
  std::vector<Tensor> forward(const std::vector<Tensor>& in) {
    if (in.empty()) raise("cat", "needs at least one tensor");
    const Tensor& first = in[0];
    if (first.dim() == 0) raise("cat", "cannot concatenate 0-d tensors along dim 0");
    Shape trailing(first.shape().begin() + 1, first.shape().end());
    int64_t total = 0;
    for (std::size_t i = 0; i < in.size(); ++i) {
      const Tensor& t = in[i];
      Shape tt(t.shape().begin() + std::min<std::ptrdiff_t>(1, t.dim()), t.shape().end());
      if (t.dim() == 0 || tt != trailing || t.dtype() != first.dtype() ||
          t.device() != first.device())
        raise(
            "cat",
            fmt::format(
                "tensor {} is {}, but tensor 0 is {} (trailing dims, dtype and device must agree)",
                i, t.str(), first.str()));
      rows.push_back(t.size(0));
      total += t.size(0);
    }
    Shape out_shape = first.shape();
    out_shape[0] = total;
    Tensor out = empty(out_shape, first.dtype(), first.device());
    int64_t at = 0;
    for (const auto& t : in) {
      out.row_view(at, t.size(0)).copy_(t);
      at += t.size(0);
    }
    return {out};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) {
    std::vector<Tensor> out;
    int64_t at = 0;
    for (int64_t r : rows) {
      out.push_back(g[0].row_view(at, r));
      at += r;
    }
    return out;
  }
};

struct NarrowFn : Function<NarrowFn> {
  static constexpr const char* kName = "NarrowBackward";
  int64_t start = 0, length = 0;
  Shape shape;
  std::vector<Tensor> forward(const std::vector<Tensor>& in) {
    shape = in[0].shape();
    return {in[0].row_view(start, length)};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) {
    Tensor out = zeros(shape, g[0].dtype(), g[0].device());
    out.row_view(start, length).copy_(g[0]);
    return {out};
  }
};

struct ReshapeFn : Function<ReshapeFn> {
  static constexpr const char* kName = "ReshapeBackward";
  Shape to, from;
  std::vector<Tensor> forward(const std::vector<Tensor>& in) {
    from = in[0].shape();
    return {in[0].view_as_shape(to)};
  }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) { return {g[0].view_as_shape(from)}; }
};

struct CloneFn : Function<CloneFn> {
  static constexpr const char* kName = "CloneBackward";
  std::vector<Tensor> forward(const std::vector<Tensor>& in) { return {in[0].copy_data()}; }
  std::vector<Tensor> backward(const std::vector<Tensor>& g) { return {g[0]}; }
};

}  // namespace

Tensor add(const Tensor& a, const Tensor& b) { return AddFn{{}, 1.0}.apply({a, b})[0]; }
Tensor detail::accumulate_add(const Tensor& a, const Tensor& b) {
  if (a.defined() && b.defined() && !a.requires_grad() && !b.requires_grad())
    return raw_add(a, b, 1.0);  // what AddFn::forward returns (a fresh tensor)
  return add(a, b);
}
Tensor sub(const Tensor& a, const Tensor& b) { return AddFn{{}, -1.0}.apply({a, b})[0]; }
Tensor mul(const Tensor& a, const Tensor& b) { return MulFn{}.apply({a, b})[0]; }
Tensor div(const Tensor& a, const Tensor& b) { return DivFn{}.apply({a, b})[0]; }
Tensor scale(const Tensor& x, double alpha) { return ScaleFn{{}, alpha}.apply({x})[0]; }
Tensor sum(const Tensor& x) { return SumFn{}.apply({x})[0]; }
Tensor dot(const Tensor& a, const Tensor& b) { return DotFn{}.apply({a, b})[0]; }
Tensor matmul(const Tensor& a, const Tensor& b) { return MatmulFn{}.apply({a, b})[0]; }
Tensor transpose(const Tensor& x) { return TransposeFn{}.apply({x})[0]; }
Tensor cat(const std::vector<Tensor>& tensors) { return CatFn{}.apply(tensors)[0]; }
Tensor narrow(const Tensor& x, int64_t start, int64_t length) {
  if (!x.defined()) raise("narrow", "undefined tensor");
  x.row_view(start, length);  // validates the range before recording anything
  return NarrowFn{{}, start, length, {}}.apply({x})[0];
}
Tensor reshape(const Tensor& x, const Shape& shape) {
  if (!x.defined()) raise("reshape", "undefined tensor");
  x.view_as_shape(shape);  // validates
  return ReshapeFn{{}, shape, {}}.apply({x})[0];
}
Tensor clone(const Tensor& x) { return CloneFn{}.apply({x})[0]; }

Tensor eq_mask(const Tensor& a, const Tensor& b) {
  return binary_cpu("eq_mask", a, b,
                    [](auto x, auto y) { return x == y ? decltype(x){1} : decltype(x){0}; });
}
Tensor maximum(const Tensor& a, const Tensor& b) {
  return binary_cpu("maximum", a, b, [](auto x, auto y) { return x < y ? y : x; });
}
Tensor minimum(const Tensor& a, const Tensor& b) {
  return binary_cpu("minimum", a, b, [](auto x, auto y) { return y < x ? y : x; });
}

Tensor to_dtype(const Tensor& x, DType dtype) {
  require_cpu("to_dtype", x);
  return from_vector(x.to_vector(), x.shape(), dtype);
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  if (a.numel() != b.numel())
    raise("max_abs_diff", fmt::format("{} vs {} elements", a.numel(), b.numel()));
  const auto va = a.to_vector(), vb = b.to_vector();
  double m = 0.0;
  for (std::size_t i = 0; i < va.size(); ++i) m = std::max(m, std::abs(va[i] - vb[i]));
  return m;
}

}  // namespace diffcomm
