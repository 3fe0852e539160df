// Encoder, heads and the SimCLR / MoCo v3 modules (see models.h for why the
// normalisation is per example).
#include "contrax/train/image/models.h"

#include "contrax/losses/losses.h"
#include "util/env.h"

namespace contrax::train {

EncoderImpl::EncoderImpl(EncoderOptions options_) : options(std::move(options_)) {
  const auto& ch = options.channels();
  TORCH_CHECK(!ch.empty(), "Encoder(): option 'channels' must not be empty");
  TORCH_CHECK(options.norm() == "group" || options.norm() == "none",
              "Encoder(): option 'norm' must be \"group\" or \"none\", but got \"", options.norm(),
              "\" (BatchNorm would make a rank's activations depend on its shard)");
  TORCH_CHECK(options.dropout() >= 0.0 && options.dropout() < 1.0,
              "Encoder(): option 'dropout' must be in [0, 1), but got ", options.dropout());
  TORCH_CHECK(options.convs_per_stage() >= 1, "Encoder(): option 'convs_per_stage' must be >= 1, but got ",
              options.convs_per_stage());
  TORCH_CHECK(options.strides().size() == ch.size(), "Encoder(): option 'strides' must have one entry per ",
              "stage (", ch.size(), "), but got ", options.strides().size());
  TORCH_CHECK(options.pool_grid() >= 1, "Encoder(): option 'pool_grid' must be >= 1, but got ", options.pool_grid());
  TORCH_CHECK(options.in_channels() >= 1, "Encoder(): option 'in_channels' must be >= 1, but got ",
              options.in_channels());
  torch::nn::Sequential seq;
  int64_t in = options.in_channels();
  for (size_t s = 0; s < ch.size(); ++s) {
    TORCH_CHECK(ch[s] >= 1, "Encoder(): option 'channels' must be positive, but got ", ch[s]);
    if (options.norm() == "group") {
      TORCH_CHECK(ch[s] % options.groups() == 0, "Encoder(): option 'groups' (", options.groups(),
                  ") must divide every stage's channels, but stage ", s, " has ", ch[s]);
    }
    for (int64_t c = 0; c < options.convs_per_stage(); ++c) {
      const int64_t stride = c == 0 ? options.strides()[s] : 1;
      TORCH_CHECK(stride >= 1, "Encoder(): option 'strides' must be positive, but got ", stride);
      // The norm that follows has its own affine shift, so the conv needs no bias.
      const bool bias = options.norm() == "none";
      torch::nn::Conv2d conv(torch::nn::Conv2dOptions(in, ch[s], 3).stride(stride).padding(1).bias(bias));
      seq->push_back(conv);
      convs_.push_back(conv);
      if (options.norm() == "group") {
        torch::nn::GroupNorm norm(torch::nn::GroupNormOptions(options.groups(), ch[s]));
        seq->push_back(norm);
        norms_.push_back(norm);
      }
      seq->push_back(torch::nn::ReLU(torch::nn::ReLUOptions().inplace(true)));
      in = ch[s];
    }
  }
  features_ = register_module("features", seq);
  dropout_ = register_module("dropout", torch::nn::Dropout(options.dropout()));
  fused_ = options.fused_cpu() && options.norm() == "group" && detail::env_on("CONTRAX_FUSED_ENCODER");
  if (fused_) {
    // A channels-last convolution returns its weight's gradient in that
    // layout. Autograd gives an accumulated gradient the parameter's strides
    // but ignores size-1 dimensions, so the gradient of a weight with one input
    // channel, [C, 1, 3, 3], kept strides [9, 1, 3, 1], and c10d's Reducer,
    // which compares every stride with its bucket's, warned on every run. The
    // gradient gets the parameter's (contiguous) strides here, before it is
    // accumulated: the copy autograd would make anyway for the other weights.
    for (auto& conv : convs_) {
      conv->weight.register_hook([](const torch::Tensor& g) {
        int64_t expect = 1;
        for (int64_t d = g.dim() - 1; d >= 0; --d) {
          if (g.stride(d) != expect) return g.clone(at::MemoryFormat::Contiguous);
          expect *= g.size(d);
        }
        return g;
      });
    }
  }
}

// The same layers as features_, on the CPU: the input restrided to
// channels-last (for one channel that is a copy of the same bytes, but it is
// what tells the convolution which layout to run in), so oneDNN runs each
// convolution on it directly, where in the default layout every activation
// and gradient is reordered to a blocked layout and back (~10 ms of a 74 ms
// training step, measured with ONEDNN_VERBOSE=1); group_norm_relu() reads and
// writes that layout too.
torch::Tensor EncoderImpl::fused_features(const torch::Tensor& x) {
  auto h = x.clone(at::MemoryFormat::ChannelsLast);
  for (size_t i = 0; i < convs_.size(); ++i) {
    const auto& c = convs_[i]->options;
    h = torch::conv2d(h, convs_[i]->weight, convs_[i]->bias, c.stride(), /*padding=*/1);  // as built above
    h = group_norm_relu(h, norms_[i]->weight, norms_[i]->bias, options.groups(), norms_[i]->options.eps());
  }
  return h;
}

torch::Tensor EncoderImpl::forward(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 4 && x.size(1) == options.in_channels(), "Encoder: argument 'x' must have shape [b, ",
              options.in_channels(), ", H, W], but got ", x.sizes());
  const bool fused = fused_ && x.device().is_cpu() &&
                     (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kDouble);
  auto f = fused ? fused_features(x) : features_->forward(x);  // [b, C, h, w]
  const int64_t g = options.pool_grid();
  TORCH_CHECK(g == 1 || (f.size(2) >= g && f.size(3) >= g), "Encoder: option 'pool_grid' (", g, ") exceeds the ",
              "last feature map, ", f.size(2), "x", f.size(3));
  // [b, C] or [b, C * g * g]
  // The mean as a sum then a division of the [b, C] result: the sum's backward
  // is the gradient broadcast over the map, which group_norm_relu() takes as
  // it is (the mean's backward would write it out, divided, at full size).
  // A map of exactly g x g cells is its own grid average (the default
  // recipe's 4x4 map): flattened as it is, the same values, without
  // adaptive_avg_pool2d's backward (2.5% of a step of the 32-64-128-256 encoder, 2x2 grid).
  torch::Tensor h;
  if (g == 1) {
    h = f.sum({2, 3}) / static_cast<double>(f.size(2) * f.size(3));
  } else if (f.size(2) == g && f.size(3) == g) {
    h = f.flatten(1);
  } else {
    h = torch::adaptive_avg_pool2d(f, {g, g}).flatten(1);
  }
  if (options.dropout() > 0) h = dropout_->forward(h);
  return h;
}

MLPHeadImpl::MLPHeadImpl(MLPHeadOptions options_) : options(std::move(options_)) {
  TORCH_CHECK(options.num_layers() >= 1, "MLPHead(): option 'num_layers' must be >= 1, but got ",
              options.num_layers());
  TORCH_CHECK(options.in_dim() >= 1 && options.hidden_dim() >= 1 && options.out_dim() >= 1,
              "MLPHead(): options 'in_dim', 'hidden_dim', 'out_dim' must be >= 1, but got ", options.in_dim(),
              ", ", options.hidden_dim(), ", ", options.out_dim());
  torch::nn::Sequential seq;
  int64_t in = options.in_dim();
  for (int64_t l = 0; l < options.num_layers(); ++l) {
    const bool last = l + 1 == options.num_layers();
    const int64_t out = last ? options.out_dim() : options.hidden_dim();
    seq->push_back(torch::nn::Linear(in, out));
    if (!last) {
      if (options.layer_norm()) seq->push_back(torch::nn::LayerNorm(torch::nn::LayerNormOptions({out})));
      seq->push_back(torch::nn::ReLU(torch::nn::ReLUOptions().inplace(true)));
    }
    in = out;
  }
  layers_ = register_module("layers", seq);
}

torch::Tensor MLPHeadImpl::forward(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == options.in_dim(), "MLPHead: argument 'x' must have shape [b, ",
              options.in_dim(), "], but got ", x.sizes());
  return layers_->forward(x);
}

SimCLRModelImpl::SimCLRModelImpl(ContrastiveModelOptions options_) : options(std::move(options_)) {
  encoder = register_module("encoder", Encoder(options.encoder()));
  projector = register_module("projector", MLPHead(MLPHeadOptions(encoder->output_dim())
                                                       .hidden_dim(options.proj_hidden_dim())
                                                       .out_dim(options.proj_dim())
                                                       .num_layers(options.proj_layers())
                                                       .layer_norm(options.head_layer_norm())));
}

torch::Tensor SimCLRModelImpl::forward(const torch::Tensor& x) { return projector->forward(encoder->forward(x)); }

MocoV3ModelImpl::MocoV3ModelImpl(ContrastiveModelOptions options_) : options(std::move(options_)) {
  online = register_module("online", SimCLRModel(options));
  predictor = register_module("predictor", MLPHead(MLPHeadOptions(options.proj_dim())
                                                       .hidden_dim(options.pred_hidden_dim())
                                                       .out_dim(options.proj_dim())
                                                       .num_layers(2)
                                                       .layer_norm(options.head_layer_norm())));
  momentum = register_module("momentum", SimCLRModel(options));
  // The momentum branch starts as an exact copy of the online branch (MoCo's
  // initialisation) and is never trained by gradient.
  contrax::momentum_update(*momentum, *online, 0.0);
  for (auto& p : momentum->parameters()) p.set_requires_grad(false);
}

torch::Tensor MocoV3ModelImpl::query(const torch::Tensor& x) { return predictor->forward(online->forward(x)); }

torch::Tensor MocoV3ModelImpl::key(const torch::Tensor& x) {
  torch::NoGradGuard no_grad;
  return momentum->forward(x);
}

void MocoV3ModelImpl::update_momentum(double m) {
  TORCH_CHECK(m >= 0.0 && m <= 1.0, "MocoV3Model::update_momentum(): argument 'm' must be in [0, 1], but got ",
              m);
  contrax::momentum_update(*momentum, *online, m);
}

std::vector<torch::Tensor> MocoV3ModelImpl::trainable_parameters() const {
  auto params = online->parameters();
  for (auto& p : predictor->parameters()) params.push_back(p);
  return params;
}

int64_t count_parameters(const std::vector<torch::Tensor>& parameters) {
  int64_t n = 0;
  for (const auto& p : parameters) n += p.numel();
  return n;
}

}  // namespace contrax::train
