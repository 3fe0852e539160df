// GroupNorm followed by ReLU as one autograd function on CPU, in the
// channels-last layout (see group_norm_relu.h for why).
//
// Notation, per example n and group g: the group's M = (C/G) HW values x,
// their mean mu and r = 1/sqrt(var + eps) (biased variance, as torch's
// GroupNorm), and for channel c of the group
//   z = gamma_c (x - mu) r + beta_c = a_c x + b_c,  a_c = gamma_c r,  b_c = beta_c - mu a_c,
//   y = max(z, 0).
// Forward, per example (its [HW, C] block is a few tens of KiB, so the three
// passes after the first read come from cache): per-channel sums -> mu per
// group; per-channel sums of (x - mu)^2 -> r per group; y.
// Saved: x, mu, r (and gamma, beta). The ReLU mask is recomputed from x, so
// neither z nor y is kept (torch's pair keeps x for the norm and y for ReLU).
//
// Backward. With m = [z > 0] (ReLU's gradient, 0 at z = 0 as torch's) and
// dz = m dy, GroupNorm's backward with xh = (x - mu) r and dxh = gamma dz is
//   dx = r (dxh - mean(dxh) - xh mean(dxh xh))          (means over the M values),
//   dgamma_c = sum_{n, hw} dz xh,  dbeta_c = sum_{n, hw} dz.
// With the per-channel sums s1_c = sum_hw dz and s2_c = sum_hw dz x of one
// example, and g1 = sum_{c in g} gamma_c s1_c, g2 = sum_{c in g} gamma_c s2_c:
//   mean(dxh)    = A  = g1 / M,
//   mean(dxh xh) = Bm = r (g2 - mu g1) / M,
//   dx = r (gamma_c dz - A - r (x - mu) Bm)
//      = (r gamma_c) dz + (-r^2 Bm) x + r (mu r Bm - A),
//   dgamma_c = sum_n r (s2_c - mu s1_c),  dbeta_c = sum_n s1_c.
// So the backward is one pass for the sums and one that writes dx, where
// torch's ReLU and GroupNorm backwards take three and an extra tensor. The
// upstream gradient may be broadcast over H and W (the backward of a sum over
// the map, as the encoder's pooling): then dy is read once per channel.
#include "contrax/train/image/group_norm_relu.h"

#include <torch/csrc/autograd/custom_function.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace contrax::train {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct Shape {
  int64_t C, HW, G, cg;
};

// The per-example functions are inlined into copies compiled for AVX-512,
// AVX2 and the baseline, one chosen when the library is loaded (GCC's
// target_clones; the passes are short loops over C that the compiler
// vectorises, ~25% faster with AVX-512 than with SSE2 on a Sapphire Rapids).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__ELF__)
#define CONTRAX_ISA_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CONTRAX_ISA_CLONES
#endif
#define CONTRAX_INLINE inline __attribute__((always_inline))

// Per-channel scale and shift of one example: z = a_c x + b_c.
template <typename T>
CONTRAX_INLINE void scale_shift(const T* gamma, const T* beta, const Shape& s, const T* mean, const T* rstd, T* a,
                                T* b) {
  for (int64_t g = 0; g < s.G; ++g) {
    for (int64_t c = g * s.cg; c < (g + 1) * s.cg; ++c) {
      a[c] = gamma[c] * rstd[g];
      b[c] = beta[c] - mean[g] * a[c];
    }
  }
}

// One example's forward. x, y: [HW, C]; mean, rstd: [G]; w: 3C scratch.
template <typename T>
CONTRAX_INLINE void forward_example(const T* x, T* y, const T* gamma, const T* beta, const Shape& s, double eps, T* mean,
                     T* rstd, T* w) {
  const int64_t C = s.C;
  T* acc = w;          // per-channel sums
  T* a = w + C;        // per-channel scale
  T* b = w + 2 * C;    // per-channel shift (the group's mean first)
  const T inv_m = T(1) / static_cast<T>(s.cg * s.HW);
  std::fill(acc, acc + C, T(0));
  for (int64_t p = 0; p < s.HW; ++p) {
    const T* __restrict__ xp = x + p * C;
    T* __restrict__ ar = acc;
    for (int64_t c = 0; c < C; ++c) ar[c] += xp[c];
  }
  for (int64_t g = 0; g < s.G; ++g) {
    T t = 0;
    for (int64_t c = g * s.cg; c < (g + 1) * s.cg; ++c) t += acc[c];
    mean[g] = t * inv_m;
    for (int64_t c = g * s.cg; c < (g + 1) * s.cg; ++c) b[c] = mean[g];
  }
  std::fill(acc, acc + C, T(0));
  for (int64_t p = 0; p < s.HW; ++p) {
    const T* __restrict__ xp = x + p * C;
    const T* __restrict__ mr = b;
    T* __restrict__ ar = acc;
    for (int64_t c = 0; c < C; ++c) {
      const T d = xp[c] - mr[c];
      ar[c] += d * d;
    }
  }
  for (int64_t g = 0; g < s.G; ++g) {
    T t = 0;
    for (int64_t c = g * s.cg; c < (g + 1) * s.cg; ++c) t += acc[c];
    rstd[g] = static_cast<T>(1.0 / std::sqrt(static_cast<double>(t * inv_m) + eps));
  }
  scale_shift(gamma, beta, s, mean, rstd, a, b);
  for (int64_t p = 0; p < s.HW; ++p) {
    const T* __restrict__ xp = x + p * C;
    T* __restrict__ yp = y + p * C;
    const T* __restrict__ ar = a;
    const T* __restrict__ br = b;
    for (int64_t c = 0; c < C; ++c) {
      const T z = ar[c] * xp[c] + br[c];
      yp[c] = z > T(0) ? z : T(0);
    }
  }
}

// One example's backward. dy: [HW, C] (kBroadcast: [C], the same for every
// position); dx: [HW, C]; s1, s2: [C] out; w: 5C scratch.
template <typename T, bool kBroadcast>
CONTRAX_INLINE void backward_example(const T* x, const T* dy, T* dx, const T* gamma, const T* beta, const Shape& s, const T* mean,
                      const T* rstd, T* s1, T* s2, T* w) {
  const int64_t C = s.C;
  T* a = w;
  T* b = w + C;
  T* c1 = w + 2 * C;
  T* c2 = w + 3 * C;
  T* c3 = w + 4 * C;
  scale_shift(gamma, beta, s, mean, rstd, a, b);
  std::fill(s1, s1 + C, T(0));
  std::fill(s2, s2 + C, T(0));
  for (int64_t p = 0; p < s.HW; ++p) {
    const T* __restrict__ xp = x + p * C;
    const T* __restrict__ dyp = kBroadcast ? dy : dy + p * C;
    T* __restrict__ s1r = s1;
    T* __restrict__ s2r = s2;
    const T* __restrict__ ar = a;
    const T* __restrict__ br = b;
    for (int64_t c = 0; c < C; ++c) {
      // Both operands are loaded and one is selected (no branch: the signs of
      // z are as good as random, and a mispredicted branch per value costs
      // more than the whole pass).
      const T xi = xp[c], gi = dyp[c];
      const T dz = ar[c] * xi + br[c] > T(0) ? gi : T(0);
      s1r[c] += dz;
      s2r[c] += dz * xi;
    }
  }
  const T inv_m = T(1) / static_cast<T>(s.cg * s.HW);
  for (int64_t g = 0; g < s.G; ++g) {
    T g1 = 0, g2 = 0;
    for (int64_t c = g * s.cg; c < (g + 1) * s.cg; ++c) {
      g1 += gamma[c] * s1[c];
      g2 += gamma[c] * s2[c];
    }
    const T r = rstd[g], mu = mean[g];
    const T A = g1 * inv_m, Bm = r * (g2 - mu * g1) * inv_m;
    for (int64_t c = g * s.cg; c < (g + 1) * s.cg; ++c) {
      c1[c] = r * gamma[c];
      c2[c] = -r * r * Bm;
      c3[c] = r * (mu * r * Bm - A);
    }
  }
  for (int64_t p = 0; p < s.HW; ++p) {
    const T* __restrict__ xp = x + p * C;
    const T* __restrict__ dyp = kBroadcast ? dy : dy + p * C;
    T* __restrict__ dxp = dx + p * C;
    const T* __restrict__ ar = a;
    const T* __restrict__ br = b;
    const T* __restrict__ c1r = c1;
    const T* __restrict__ c2r = c2;
    const T* __restrict__ c3r = c3;
    for (int64_t c = 0; c < C; ++c) {
      const T xi = xp[c], gi = dyp[c];
      const T dz = ar[c] * xi + br[c] > T(0) ? gi : T(0);
      dxp[c] = c1r[c] * dz + c2r[c] * xi + c3r[c];
    }
  }
}

template <typename T>
CONTRAX_ISA_CLONES void forward_examples(const T* x, T* y, const T* gamma, const T* beta, const Shape& s, double eps,
                                         T* mean, T* rstd, int64_t lo, int64_t hi) {
  std::vector<T> w(3 * s.C);
  for (int64_t n = lo; n < hi; ++n) {
    const int64_t off = n * s.HW * s.C;
    forward_example(x + off, y + off, gamma, beta, s, eps, mean + n * s.G, rstd + n * s.G, w.data());
  }
}

template <typename T, bool kBroadcast>
CONTRAX_ISA_CLONES void backward_examples(const T* x, const T* dy, T* dx, const T* gamma, const T* beta,
                                          const Shape& s, const T* mean, const T* rstd, T* s1, T* s2, int64_t lo,
                                          int64_t hi) {
  std::vector<T> w(5 * s.C);
  for (int64_t n = lo; n < hi; ++n) {
    const int64_t off = n * s.HW * s.C;
    backward_example<T, kBroadcast>(x + off, dy + (kBroadcast ? n * s.C : off), dx + off, gamma, beta, s,
                                    mean + n * s.G, rstd + n * s.G, s1 + n * s.C, s2 + n * s.C, w.data());
  }
}

constexpr auto kChannelsLast = at::MemoryFormat::ChannelsLast;

Shape shape_of(const torch::Tensor& x, int64_t groups) {
  return Shape{x.size(1), x.size(2) * x.size(3), groups, x.size(1) / groups};
}

class GroupNormReLUFunction : public torch::autograd::Function<GroupNormReLUFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& input, const torch::Tensor& weight,
                               const torch::Tensor& bias, int64_t groups, double eps) {
    auto x = input.contiguous(kChannelsLast);
    const int64_t N = x.size(0);
    const Shape s = shape_of(x, groups);
    auto y = torch::empty_like(x, kChannelsLast);
    auto mean = torch::empty({N, groups}, x.options());
    auto rstd = torch::empty({N, groups}, x.options());
    auto gamma = weight.contiguous(), beta = bias.contiguous();
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "group_norm_relu", [&] {
      const auto* xp = x.data_ptr<scalar_t>();
      auto* yp = y.data_ptr<scalar_t>();
      const auto* gp = gamma.data_ptr<scalar_t>();
      const auto* bp = beta.data_ptr<scalar_t>();
      auto* mp = mean.data_ptr<scalar_t>();
      auto* rp = rstd.data_ptr<scalar_t>();
      at::parallel_for(0, N, 1, [&](int64_t lo, int64_t hi) {
        forward_examples<scalar_t>(xp, yp, gp, bp, s, eps, mp, rp, lo, hi);
      });
    });
    ctx->save_for_backward({x, gamma, beta, mean, rstd});
    ctx->saved_data["groups"] = groups;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(!torch::GradMode::is_enabled(),
                "group_norm_relu(): double backward (create_graph=true) is not supported");
    const auto saved = ctx->get_saved_variables();
    const auto& x = saved[0];
    const auto& gamma = saved[1];
    const auto& beta = saved[2];
    const auto& mean = saved[3];
    const auto& rstd = saved[4];
    const int64_t groups = ctx->saved_data["groups"].toInt();
    const int64_t N = x.size(0);
    const Shape s = shape_of(x, groups);
    // A gradient broadcast over the map (stride 0 in H and W) stays [N, C].
    const auto& g = grads[0];
    const bool broadcast = g.stride(2) == 0 && g.stride(3) == 0;
    const auto dy = broadcast ? g.select(3, 0).select(2, 0).contiguous() : g.contiguous(kChannelsLast);
    auto dx = torch::empty_like(x, kChannelsLast);
    auto s1 = torch::empty({N, s.C}, x.options()), s2 = torch::empty({N, s.C}, x.options());
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "group_norm_relu_backward", [&] {
      const auto* xp = x.data_ptr<scalar_t>();
      const auto* dyp = dy.data_ptr<scalar_t>();
      auto* dxp = dx.data_ptr<scalar_t>();
      const auto* gp = gamma.data_ptr<scalar_t>();
      const auto* bp = beta.data_ptr<scalar_t>();
      const auto* mp = mean.data_ptr<scalar_t>();
      const auto* rp = rstd.data_ptr<scalar_t>();
      auto* s1p = s1.data_ptr<scalar_t>();
      auto* s2p = s2.data_ptr<scalar_t>();
      at::parallel_for(0, N, 1, [&](int64_t lo, int64_t hi) {
        if (broadcast) {
          backward_examples<scalar_t, true>(xp, dyp, dxp, gp, bp, s, mp, rp, s1p, s2p, lo, hi);
        } else {
          backward_examples<scalar_t, false>(xp, dyp, dxp, gp, bp, s, mp, rp, s1p, s2p, lo, hi);
        }
      });
    });
    // dgamma_c = sum_n r (s2_c - mu s1_c), dbeta_c = sum_n s1_c ([N, C] -> [C]).
    const auto mu_c = mean.repeat_interleave(s.cg, 1), r_c = rstd.repeat_interleave(s.cg, 1);  // [N, C]
    auto dgamma = (r_c * (s2 - mu_c * s1)).sum(0);
    auto dbeta = s1.sum(0);
    return {dx, dgamma, dbeta, torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor group_norm_relu(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                              int64_t groups, double eps) {
  TORCH_CHECK(x.dim() == 4, "group_norm_relu(): argument 'x' must be 4-D [N, C, H, W], but got ", x.sizes());
  TORCH_CHECK(x.device().is_cpu(), "group_norm_relu(): argument 'x' must be on the CPU, but is on ", x.device(),
              " (use torch::group_norm and torch::relu there)");
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kDouble,
              "group_norm_relu(): argument 'x' must be float or double, but is ", x.scalar_type());
  TORCH_CHECK(groups >= 1 && x.size(1) % groups == 0, "group_norm_relu(): argument 'groups' must divide the ",
              x.size(1), " channels of 'x', but got ", groups);
  TORCH_CHECK(eps > 0, "group_norm_relu(): argument 'eps' must be > 0, but got ", eps);
  for (const auto* p : {&weight, &bias}) {
    TORCH_CHECK(p->dim() == 1 && p->size(0) == x.size(1) && p->scalar_type() == x.scalar_type() &&
                    p->device() == x.device(),
                "group_norm_relu(): argument '", p == &weight ? "weight" : "bias", "' must be [", x.size(1), "] of ",
                x.scalar_type(), " on ", x.device(), ", but got ", p->sizes(), " of ", p->scalar_type(), " on ",
                p->device());
  }
  return GroupNormReLUFunction::apply(x, weight, bias, groups, eps);
}

}  // namespace contrax::train
