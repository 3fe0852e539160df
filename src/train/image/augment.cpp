// Batched SimCLR augmentations with per-example generators (see augment.h for
// why the randomness is per example).
#include "contrax/train/image/augment.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <vector>

#include "contrax/train/common/sampler.h"

namespace contrax::train {
namespace {

// Uniform double in [0, 1) from the top 53 bits of the generator's next word.
double uniform(at::CPUGeneratorImpl* gen, double lo = 0.0, double hi = 1.0) {
  const double u = static_cast<double>(gen->random64() >> 11) * 0x1.0p-53;
  return lo + (hi - lo) * u;
}

// Per-example parameters, drawn in a fixed order so that options only change
// how draws are used, never which draw feeds what.
struct ViewParams {
  double sx = 1, sy = 1, cx = 0, cy = 0;  // affine: x_in = sx * x_out + cx
  double brightness = 1, contrast = 1;
  double blur_sigma = 0;  // 0: no blur
  bool noise = false;
};

ViewParams draw_params(at::CPUGeneratorImpl* gen, const AugmentOptions& o) {
  ViewParams p;
  // Random resized crop, as torchvision draws it: up to ten tries at an area
  // and log-uniform aspect ratio that fit, else the whole image.
  double cw = 1, ch = 1;
  const double log_rmin = std::log(o.ratio_min()), log_rmax = std::log(o.ratio_max());
  for (int attempt = 0; attempt < 10; ++attempt) {
    const double area = uniform(gen, o.scale_min(), o.scale_max());
    const double ratio = std::exp(uniform(gen, log_rmin, log_rmax));
    const double w = std::sqrt(area * ratio), h = std::sqrt(area / ratio);
    if (w <= 1.0 && h <= 1.0) {
      cw = w;
      ch = h;
      break;
    }
  }
  // Crop centre in normalised coordinates [-1, 1], keeping the crop inside.
  p.cx = uniform(gen, -1.0, 1.0) * (1.0 - cw);
  p.cy = uniform(gen, -1.0, 1.0) * (1.0 - ch);
  const bool flip = uniform(gen) < o.flip_prob();
  p.sx = flip ? -cw : cw;  // a flip is a negative horizontal scale
  p.sy = ch;
  const bool jitter = uniform(gen) < o.jitter_prob();
  const double b = uniform(gen, 1.0 - o.brightness(), 1.0 + o.brightness());
  const double c = uniform(gen, 1.0 - o.contrast(), 1.0 + o.contrast());
  if (jitter) {
    p.brightness = b;
    p.contrast = c;
  }
  const bool blur = uniform(gen) < o.blur_prob();
  const double sigma = uniform(gen, 0.1, std::max(0.1, o.blur_sigma_max()));
  if (blur) p.blur_sigma = sigma;
  p.noise = uniform(gen) < o.noise_prob();
  return p;
}

void check_probability(double p, const char* name) {
  TORCH_CHECK(p >= 0.0 && p <= 1.0, "augment(): option '", name, "' must be in [0, 1], but got ", p);
}

}  // namespace

uint64_t augment_seed(const AugmentKey& key, int64_t index) {
  uint64_t h = splitmix64(key.seed);
  h = splitmix64(h ^ static_cast<uint64_t>(key.epoch));
  h = splitmix64(h ^ static_cast<uint64_t>(key.step));
  h = splitmix64(h ^ static_cast<uint64_t>(key.view));
  return splitmix64(h ^ static_cast<uint64_t>(index));
}

torch::Tensor normalize_images(const torch::Tensor& images, double mean, double std, torch::Dtype dtype) {
  TORCH_CHECK(images.dim() == 4 && images.size(1) == 1, "normalize_images(): argument 'images' must have ",
              "shape [b, 1, H, W], but got ", images.sizes());
  TORCH_CHECK(std > 0, "normalize_images(): argument 'std' must be > 0, but got ", std);
  return (images.to(dtype) / 255.0 - mean) / std;
}

torch::Tensor augment(const torch::Tensor& images_in, const torch::Tensor& indices, const AugmentKey& key,
                      const AugmentOptions& o) {
  auto images = images_in.dim() == 3 ? images_in.unsqueeze(1) : images_in;
  TORCH_CHECK(images.dim() == 4 && images.size(1) == 1, "augment(): argument 'images' must have shape ",
              "[b, 1, H, W] or [b, H, W], but got ", images_in.sizes());
  TORCH_CHECK(images.scalar_type() == torch::kUInt8, "augment(): argument 'images' must be uint8, but got ",
              images.scalar_type());
  TORCH_CHECK(indices.dim() == 1 && indices.size(0) == images.size(0), "augment(): argument 'indices' must ",
              "have shape [", images.size(0), "] (one global index per image), but got ", indices.sizes());
  TORCH_CHECK(o.scale_min() > 0 && o.scale_min() <= o.scale_max() && o.scale_max() <= 1.0,
              "augment(): options 'scale_min'/'scale_max' must satisfy 0 < min <= max <= 1, but got (",
              o.scale_min(), ", ", o.scale_max(), ")");
  TORCH_CHECK(o.ratio_min() > 0 && o.ratio_min() <= o.ratio_max(), "augment(): options ",
              "'ratio_min'/'ratio_max' must satisfy 0 < min <= max, but got (", o.ratio_min(), ", ",
              o.ratio_max(), ")");
  check_probability(o.flip_prob(), "flip_prob");
  check_probability(o.jitter_prob(), "jitter_prob");
  check_probability(o.blur_prob(), "blur_prob");
  check_probability(o.noise_prob(), "noise_prob");
  TORCH_CHECK(o.std() > 0, "augment(): option 'std' must be > 0, but got ", o.std());
  TORCH_CHECK(o.dtype() == torch::kFloat || o.dtype() == torch::kDouble,
              "augment(): option 'dtype' must be kFloat or kDouble, but got ", o.dtype());

  const int64_t b = images.size(0), H = images.size(2), W = images.size(3);
  const auto dt = o.dtype();
  if (b == 0) return torch::empty({0, 1, H, W}, dt);
  const auto idx = indices.to(torch::kInt64).contiguous();
  const auto* idx_p = idx.data_ptr<int64_t>();

  std::vector<at::Generator> gens;
  gens.reserve(b);
  std::vector<ViewParams> params(b);
  std::vector<double> affine(b * 4), jitter(b * 2);
  bool any_blur = false, any_noise = false;
  for (int64_t i = 0; i < b; ++i) {
    gens.push_back(at::detail::createCPUGenerator(augment_seed(key, idx_p[i])));
    params[i] = draw_params(gens.back().get<at::CPUGeneratorImpl>(), o);
    affine[4 * i + 0] = params[i].sx;
    affine[4 * i + 1] = params[i].cx;
    affine[4 * i + 2] = params[i].sy;
    affine[4 * i + 3] = params[i].cy;
    jitter[2 * i + 0] = params[i].brightness;
    jitter[2 * i + 1] = params[i].contrast;
    any_blur |= params[i].blur_sigma > 0;
    any_noise |= params[i].noise;
  }
  const auto f64 = torch::TensorOptions().dtype(torch::kDouble);
  auto aff = torch::from_blob(affine.data(), {b, 4}, f64).to(dt);

  // The sampling grid of affine_grid for theta = [[sx, 0, cx], [0, sy, cy]]
  // (align_corners=false), written as a broadcast instead of affine_grid's
  // batched matmul so that no BLAS blocking can make an example's grid depend
  // on the batch it sits in.
  auto xs = (torch::arange(W, dt) * 2 + 1) / W - 1;  // [W] pixel centres
  auto ys = (torch::arange(H, dt) * 2 + 1) / H - 1;  // [H]
  auto gx = aff.select(1, 0).view({b, 1, 1}) * xs.view({1, 1, W}) + aff.select(1, 1).view({b, 1, 1});
  auto gy = aff.select(1, 2).view({b, 1, 1}) * ys.view({1, H, 1}) + aff.select(1, 3).view({b, 1, 1});
  auto grid = torch::stack({gx.expand({b, H, W}), gy.expand({b, H, W})}, 3);  // [b, H, W, 2]
  namespace F = torch::nn::functional;
  auto x = F::grid_sample(images.to(dt) / 255.0, grid,
                          F::GridSampleFuncOptions().mode(torch::kBilinear).padding_mode(torch::kZeros)
                              .align_corners(false));  // [b, 1, H, W] in [0, 1]

  // Brightness then contrast (around each image's mean, as torchvision does).
  // The mean is summed in a plain loop: a library reduction may split the sum
  // differently depending on the batch size and so round differently.
  auto jit = torch::from_blob(jitter.data(), {b, 2}, f64).to(dt);
  x = (x * jit.select(1, 0).view({b, 1, 1, 1})).clamp(0.0, 1.0).contiguous();
  std::vector<double> means(b);
  {
    auto xd = x.to(torch::kDouble).contiguous();
    const auto* p = xd.data_ptr<double>();
    const int64_t n = H * W;
    for (int64_t i = 0; i < b; ++i) {
      double s = 0;
      for (int64_t j = 0; j < n; ++j) s += p[i * n + j];
      means[i] = s / n;
    }
  }
  auto mean = torch::from_blob(means.data(), {b, 1, 1, 1}, f64).to(dt);
  x = ((x - mean) * jit.select(1, 1).view({b, 1, 1, 1}) + mean).clamp(0.0, 1.0);

  if (any_blur) {
    // Separable 5-tap Gaussian; examples without blur get the identity kernel.
    std::vector<double> taps(b * 5, 0.0);
    for (int64_t i = 0; i < b; ++i) {
      const double s = params[i].blur_sigma;
      if (s <= 0) {
        taps[5 * i + 2] = 1.0;
        continue;
      }
      double total = 0;
      for (int k = -2; k <= 2; ++k) total += taps[5 * i + k + 2] = std::exp(-(k * k) / (2 * s * s));
      for (int k = 0; k < 5; ++k) taps[5 * i + k] /= total;
    }
    auto w = torch::from_blob(taps.data(), {b, 5}, f64).to(dt);
    auto xp = F::pad(x, F::PadFuncOptions({2, 2, 2, 2}).mode(torch::kReflect));  // [b, 1, H+4, W+4]
    auto h = torch::zeros({b, 1, H + 4, W}, dt);
    for (int k = 0; k < 5; ++k) h = h + w.select(1, k).view({b, 1, 1, 1}) * xp.narrow(3, k, W);
    auto v = torch::zeros({b, 1, H, W}, dt);
    for (int k = 0; k < 5; ++k) v = v + w.select(1, k).view({b, 1, 1, 1}) * h.narrow(2, k, H);
    x = v;
  }
  if (any_noise) {
    std::vector<torch::Tensor> noise;
    noise.reserve(b);
    for (int64_t i = 0; i < b; ++i) {
      noise.push_back(params[i].noise ? torch::randn({1, H, W}, gens[i], torch::TensorOptions().dtype(dt)) *
                                            o.noise_std()
                                      : torch::zeros({1, H, W}, dt));
    }
    x = (x + torch::stack(noise)).clamp(0.0, 1.0);
  }
  return ((x - o.mean()) / o.std()).contiguous();
}

}  // namespace contrax::train
