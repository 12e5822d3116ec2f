// The training step's single-rank reference and the check of a step against
// it (header: include/diffcomm/encoder_parallel/training_step.hpp; the order
// of every sum: docs/semantics.md, "The training step, exact").
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "diffcomm/encoder_parallel/exact_sum.hpp"
#include "diffcomm/encoder_parallel/training_step.hpp"
#include "encoder_parallel/step_data.hpp"

namespace diffcomm::encoder_parallel {

using detail::Drawn;
using detail::Synthetic;

std::pair<double, double> tolerance(DType dtype) {
  (void)dtype;  // every dtype: the step's sums are canonical, its reference exact
  return {0.0, 0.0};
}

namespace {

// out[j] = out[j] + a[0] B[0, j] + a[1] B[1, j] + ... + a[k-1] B[k-1, j]
// (left to right) for j < n; a[p] is a[p * lda], B[p, j] is b[p * ldb + j].
// The reference's sums are all of this form. Blocks of 16 outputs keep their
// accumulators in registers across p as 8 two-lane vectors (independent add
// chains; GCC/Clang vector extensions, plain SSE2 on x86-64): each lane is
// a separate multiply then add, and every output still sees its terms in
// increasing p, so the bits are those of the plain loop.
void accumulate_rows(const double* a, int64_t lda, int64_t k, const double* b, int64_t ldb,
                     double* out, int64_t n) {
  using v2d = double __attribute__((vector_size(16)));
  constexpr int kVecs = 8, kBlock = 2 * kVecs;
  int64_t j = 0;
  for (; j + kBlock <= n; j += kBlock) {
    v2d acc[kVecs];
    std::memcpy(acc, out + j, sizeof acc);
    for (int64_t p = 0; p < k; ++p) {
      const double ap = a[p * lda];
      const v2d av = {ap, ap};
      const double* bp = b + p * ldb + j;
      for (int q = 0; q < kVecs; ++q) {
        v2d bv;
        std::memcpy(&bv, bp + 2 * q, sizeof bv);
        acc[q] += av * bv;
      }
    }
    std::memcpy(out + j, acc, sizeof acc);
  }
  for (; j < n; ++j) {
    double acc = out[j];
    for (int64_t p = 0; p < k; ++p) acc += a[p * lda] * b[p * ldb + j];
    out[j] = acc;
  }
}

// Rounds float64 values to the step's dtype and back, in place, converting as
// tensors convert (T from compute_t<T>): the value a T tensor holds.
using Rounder = void (*)(double*, std::size_t);
template <class T>
void round_as(double* v, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i)
    v[i] = static_cast<double>(
        static_cast<compute_t<T>>(static_cast<T>(static_cast<compute_t<T>>(v[i]))));
}
Rounder rounder_for(DType dtype) {
  Rounder r = nullptr;
  dispatch_dtype(dtype, [&](auto tag) { r = &round_as<typename decltype(tag)::type>; });
  return r;
}

// The canonical tree (docs/semantics.md), written out for the reference:
// rows [m][n]; with m rows left, row i becomes row i + row i + floor(m/2)
// for i < floor(m/2), rounded to the dtype as a tensor add rounds, and the
// odd row out moves after them. m == 0 gives zeros.
std::vector<double> tree_sum(std::vector<double> rows, int64_t m, int64_t n, Rounder round) {
  if (m == 0) return std::vector<double>(static_cast<std::size_t>(n), 0.0);
  while (m > 1) {
    const int64_t h = m / 2;
    for (int64_t i = 0; i < h * n; ++i)
      rows[static_cast<std::size_t>(i)] += rows[static_cast<std::size_t>(i + h * n)];
    round(rows.data(), static_cast<std::size_t>(h * n));
    if (m % 2 == 1) std::copy_n(rows.begin() + 2 * h * n, n, rows.begin() + h * n);
    m = h + m % 2;
  }
  rows.resize(static_cast<std::size_t>(n));
  return rows;
}

}  // namespace

StepReference reference_step(const StepConfig& cfg, const std::vector<Batch>& per_dp) {
  detail::validate_step(cfg, per_dp);
  const Synthetic syn{cfg};
  const Drawn W_drawn = syn.W(), A_drawn = syn.A();
  const double* const W = W_drawn->data();
  const double* const A = A_drawn->data();
  const int64_t H = cfg.hidden, I = cfg.in_features, Fn = cfg.ffn, B = cfg.grad_block_rows;
  const int64_t G = cfg.ffn_blocks, w = Fn / G;  // dX's column blocks, w columns each
  const Rounder round = rounder_for(cfg.dtype);
  // Every value below is what the step's tensors hold: each sum is a plain
  // loop in float64 (0, then + a_p b_p in increasing p, as matmul sums)
  // rounded to the dtype once, each tree addition rounded. The loops are
  // arranged so that independent elements are computed side by side.
  // At = A^T ([ffn, hidden]).
  std::vector<double> At(static_cast<std::size_t>(Fn * H));
  for (int64_t h = 0; h < H; ++h)
    for (int64_t c = 0; c < Fn; ++c)
      At[static_cast<std::size_t>(c * H + h)] = A[static_cast<std::size_t>(h * Fn + c)];
  StepReference ref;
  ExactSum loss;
  std::vector<double> y(static_cast<std::size_t>(Fn)), leaves(static_cast<std::size_t>(G * H));
  std::vector<double> F, micro_batches;
  for (int d = 0; d < cfg.dp; ++d) {
    const Batch& batch = per_dp[static_cast<std::size_t>(d)];
    ref.embeddings.emplace_back();
    std::vector<double> blocks;  // [blocks of this micro-batch, I * H], in id order
    int64_t item_id = 0;
    for (std::size_t b = 0; b < batch.samples.size(); ++b) {
      const Sample& s = batch.samples[b];
      std::vector<double> E = *syn.text(d, static_cast<int64_t>(b), s.seq_len);
      const std::vector<double> U_table = syn.u(d, static_cast<int64_t>(b), s.seq_len);
      const double* const U = U_table.data();
      struct Img {
        int64_t start, tokens;
        Drawn P;
      };
      std::vector<Img> imgs;
      for (const ImageSpan& im : s.images) {
        Img img{im.token_start, im.tokens, syn.patches(d, item_id++, im.tokens)};
        F.assign(static_cast<std::size_t>(im.tokens * H), 0.0);  // F = P W
        const double* const P = img.P->data();
        for (int64_t r = 0; r < im.tokens; ++r)
          accumulate_rows(P + r * I, 1, I, W, H, F.data() + r * H, H);
        round(F.data(), F.size());
        std::copy(F.begin(), F.end(), E.begin() + im.token_start * H);
        imgs.push_back(std::move(img));
      }
      // The loss's terms, and dE = U + dX on image rows (the only ones dW
      // reads): dX = the tree over the column blocks of y_b A[:, b]^T.
      std::vector<double> dE(E.size());
      std::vector<char> image_row(static_cast<std::size_t>(s.seq_len), 0);
      for (const Img& img : imgs) std::fill_n(image_row.begin() + img.start, img.tokens, char{1});
      for (int64_t t = 0; t < s.seq_len; ++t) {
        const double* const e = &E[static_cast<std::size_t>(t * H)];
        const double* const u = U + t * H;
        std::fill(y.begin(), y.end(), 0.0);
        accumulate_rows(e, 1, H, A, Fn, y.data(), Fn);  // y = e A
        round(y.data(), y.size());
        for (int64_t h = 0; h < H; ++h) {
          loss.add(e[h] * u[h]);
          ref.loss_scale += std::abs(e[h] * u[h]);
        }
        for (int64_t c = 0; c < Fn; ++c) {
          const double term =
              0.5 * (y[static_cast<std::size_t>(c)] * y[static_cast<std::size_t>(c)]);
          loss.add(term);
          ref.loss_scale += term;
        }
        if (image_row[static_cast<std::size_t>(t)] == 0) continue;
        std::fill(leaves.begin(), leaves.end(), 0.0);
        for (int64_t g = 0; g < G; ++g)  // leaf g = sum over its w columns c of y_c A[:, c]
          accumulate_rows(y.data() + g * w, 1, w, At.data() + g * w * H, H, leaves.data() + g * H,
                          H);
        round(leaves.data(), leaves.size());
        const std::vector<double> back = tree_sum(leaves, G, H, round);
        double* const de = dE.data() + t * H;
        for (int64_t h = 0; h < H; ++h) de[h] = u[h] + back[static_cast<std::size_t>(h)];
        round(de, static_cast<std::size_t>(H));
      }
      // Each block's dW = P_b^T dE_b, in id order (images in order, blocks
      // of B rows).
      for (const Img& img : imgs) {
        const double* const P = img.P->data();
        for (int64_t r0 = 0; r0 < img.tokens; r0 += B) {
          const int64_t n = std::min(B, img.tokens - r0);
          const std::size_t at = blocks.size();
          blocks.resize(at + static_cast<std::size_t>(I * H), 0.0);
          double* const out = blocks.data() + at;
          for (int64_t k = 0; k < I; ++k)  // out[k, :] = sum over rows r of P[r, k] dE[r, :]
            accumulate_rows(P + r0 * I + k, I, n, dE.data() + (img.start + r0) * H, H, out + k * H,
                            H);
          round(out, static_cast<std::size_t>(I * H));
        }
      }
      ref.embeddings.back().push_back(std::move(E));
    }
    const auto nb = static_cast<int64_t>(blocks.size()) / (I * H);
    const std::vector<double> dW_d = tree_sum(std::move(blocks), nb, I * H, round);
    micro_batches.insert(micro_batches.end(), dW_d.begin(), dW_d.end());
  }
  ref.encoder_grad = tree_sum(std::move(micro_batches), cfg.dp, I * H, round);
  ref.loss = loss.value();
  return ref;
}

StepCheck check_step(const StepConfig& cfg, const std::vector<Batch>& per_dp,
                     const std::vector<StepRankResult>& ranks, const StepReference& ref) {
  (void)per_dp;
  StepCheck chk;
  double ref_max = 0;
  for (double v : ref.encoder_grad) ref_max = std::max(ref_max, std::abs(v));
  ExactSum total;
  for (const auto& r : ranks) {
    total.add(ExactSum::from_limbs(r.loss_limbs, r.loss_special));
    const auto got = r.decoder_input.to_vector();
    for (std::size_t k = 0; k < r.shard_tokens.size(); ++k) {
      const auto [b, t] = r.shard_tokens[k];
      const auto& row =
          ref.embeddings[static_cast<std::size_t>(r.dp_rank)][static_cast<std::size_t>(b)];
      for (int64_t h = 0; h < cfg.hidden; ++h)
        chk.forward_max_abs_diff = std::max(
            chk.forward_max_abs_diff,
            std::abs(got[k * static_cast<std::size_t>(cfg.hidden) + static_cast<std::size_t>(h)] -
                     row[static_cast<std::size_t>(t * cfg.hidden + h)]));
    }
    const auto g = r.encoder_grad.to_vector();
    double worst = 0;
    for (std::size_t i = 0; i < g.size(); ++i)
      worst = std::max(worst, std::abs(g[i] - ref.encoder_grad[i]));
    chk.grad_max_rel_diff = std::max(chk.grad_max_rel_diff, ref_max > 0 ? worst / ref_max : worst);
  }
  // Relative to the sum of the terms' magnitudes, not to the loss itself:
  // the e.u terms can cancel the 0.5 y^2 ones, and rounding is relative to
  // the terms (a near-zero loss of a tiny image gave 1.25e-11 "relative"
  // from ordinary float64 rounding, a rare false failure).
  const double loss = total.value();
  chk.loss_rel_diff =
      std::abs(loss - ref.loss) / std::max({ref.loss_scale, std::abs(ref.loss), 1e-300});
  const auto [fwd_tol, grad_tol] = tolerance(cfg.dtype);
  chk.passed = chk.forward_max_abs_diff <= fwd_tol && chk.grad_max_rel_diff <= grad_tol &&
               chk.loss_rel_diff <= grad_tol;
  return chk;
}

}  // namespace diffcomm::encoder_parallel
