#pragma once
// The few differentiable tensor ops diffcomm needs. Each records a node when
// an input requires grad. No broadcasting: elementwise ops need equal shapes
// and dtypes (InvalidArgument otherwise). Kernels run on CPU; on CUDA the
// ops the autograd engine needs (add, scale, fill, copy, cat, narrow, clone)
// are available when built with CUDA. bfloat16/float16 compute in float32.
#include <vector>

#include "diffcomm/autograd/autograd.hpp"
#include "diffcomm/tensor/tensor.hpp"

namespace diffcomm {

/// a + b, elementwise (equal shapes). Backward: (g, g).
Tensor add(const Tensor& a, const Tensor& b);
namespace detail {
/// a + b exactly as add() computes it, for the autograd engine's gradient
/// accumulation: add() itself when either operand requires grad, else the
/// kernel without Function::apply's argument and result vectors.
Tensor accumulate_add(const Tensor& a, const Tensor& b);
}  // namespace detail
/// a - b. Backward: (g, -g).
Tensor sub(const Tensor& a, const Tensor& b);
/// a * b, elementwise. Backward: (g*b, g*a).
Tensor mul(const Tensor& a, const Tensor& b);
/// a / b, elementwise. Backward: (g/b, -g*a/b^2).
Tensor div(const Tensor& a, const Tensor& b);
/// alpha * x. Backward: alpha * g.
Tensor scale(const Tensor& x, double alpha);
/// Sum of all elements, a 0-d tensor (accumulated in float64 for floats,
/// int64 for integers). Backward: g broadcast to x's shape.
Tensor sum(const Tensor& x);
/// <a, b> over all elements (equal shapes), a 0-d tensor. Backward: (g*b, g*a).
Tensor dot(const Tensor& a, const Tensor& b);
/// [m, k] x [k, n] -> [m, n]. Backward: (g b^T, a^T g).
Tensor matmul(const Tensor& a, const Tensor& b);
/// Concatenation along dim 0 (trailing dims and dtypes must agree; zero-row
/// tensors allowed; at least one tensor). Backward: row slices of g.
Tensor cat(const std::vector<Tensor>& tensors);
/// Rows [start, start+length) of x, a zero-copy view. Backward: g placed in
/// zeros of x's shape.
Tensor narrow(const Tensor& x, int64_t start, int64_t length);
/// Same data, new shape (numel must match). Backward: g reshaped back.
Tensor reshape(const Tensor& x, const Shape& shape);
/// Deep copy. Backward: g.
Tensor clone(const Tensor& x);
/// x^T for a 2-d tensor (copies). Backward: g^T.
Tensor transpose(const Tensor& x);

// ---- not differentiable (masks, comparisons, casts) ----
/// 1 where a == b else 0, in a's dtype.
Tensor eq_mask(const Tensor& a, const Tensor& b);
/// Elementwise max / min of a and b.
Tensor maximum(const Tensor& a, const Tensor& b);
Tensor minimum(const Tensor& a, const Tensor& b);
/// Copy converted to dtype.
Tensor to_dtype(const Tensor& x, DType dtype);
/// Largest |a - b| over all elements (computed in float64).
double max_abs_diff(const Tensor& a, const Tensor& b);

}  // namespace diffcomm
