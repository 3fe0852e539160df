// `contrax train simclr|moco-v3`: the image recipes on Fashion-MNIST
// (contrax/train/image/trainer.h), then the evaluation table: a linear probe
// and kNN on the frozen features of the trained encoder, a random-init
// encoder and the raw pixels, one protocol for all three.
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <future>
#include <iomanip>
#include <limits>
#include <mutex>
#include <ostream>

#include "cli/cli.h"
#include "cli/flags.h"
#include "contrax/train/image/eval.h"
#include "contrax/train/image/idx.h"
#include "contrax/launch/launcher.h"
#include "contrax/train/image/memory_estimate.h"
#include "contrax/train/image/trainer.h"
#include "contrax/util/memory.h"
#include "train/train_errors.h"
#include "train/train_image.h"

namespace contrax::cli {

namespace {

namespace ct = contrax::train;

std::string join_ints(const std::vector<int64_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) {
    if (i > 0) s += ',';
    s += std::to_string(v[i]);
  }
  return s;
}

Json eval_json(const ct::EvalResult& e) {
  Json j;
  put_number(j, "linear_probe_acc", e.linear_probe_acc);
  put_number(j, "knn_acc", e.knn_acc);
  put_number(j, "linear_probe_l2", e.probe.l2);
  j["probe_converged"] = e.probe.converged;
  put_number(j, "seconds", e.seconds);
  return j;
}

class ImageRecipe : public TrainRecipe {
 public:
  ImageRecipe(const std::string& name, const std::string& variant)
      : o_(variant == "peer" ? ct::peer_recipe() : ct::TrainOptions()), variant_(variant) {
    o_.recipe(name);
    channels_ = join_ints(o_.model().encoder().channels());
    strides_ = join_ints(o_.model().encoder().strides());
  }

  ct::RunOptions& run() override { return o_.run(); }
  double temperature() const override { return o_.temperature(); }

  void add_flags(CLI::App& app) override {
    add_choice(app, "--recipe-variant", variant_,
               "default, or peer: the smaller recipe of simclr_torch_ddp.py (flags given explicitly still apply)",
               {"default", "peer"});
    app.add_option("--data", data_dir_, "directory of the MNIST-format IDX files");
    add_int(app, "--chunk-size", o_.chunk_size(), "> 0: gradient cache with chunks of this many rows", 0, kMaxBatch);
    add_double(app, "--temperature", o_.temperature(), "temperature of NT-Xent / MoCo v3", 0,
               std::numeric_limits<double>::max(), true);
    add_double(app, "--moco-momentum", o_.moco_momentum(), "MoCo v3 base momentum (cosine to 1)", 0, 1);
    app.add_option("--encoder-channels", channels_, "output channels of the encoder's conv stages (comma-separated)");
    app.add_option("--encoder-strides", strides_, "stride of each conv stage (comma-separated, one per stage)");
    add_int(app, "--encoder-pool-grid", o_.model().encoder().pool_grid(),
            "1: global average pooling; g: average over a g x g grid of cells, flattened", 1, 16);
    add_double(app, "--crop-scale-min", o_.augment().scale_min(),
               "smallest crop area of the augmentation (fraction of the image)", 0, 1, true);
    add_int(app, "--probe-limit", probe_limit_, "fit the linear probe on the first N of those train examples (-1: all)",
            -1);
  }

  bool trains_on_gpu() const override { return true; }
  void check_flags() override {
    usage_check(probe_limit_ != 0, "flag '--probe-limit' must be -1 (all) or >= 1, but got 0");
    auto& enc = o_.model().encoder();
    enc.channels(parse_int_list("--encoder-channels", channels_, 1, 1 << 16));
    enc.strides(parse_int_list("--encoder-strides", strides_, 1, 64));
    usage_check(enc.strides().size() == enc.channels().size(),
                "flags '--encoder-channels' and '--encoder-strides' must have as many entries, but got ", channels_,
                " and ", strides_);
  }

  void settings(Json& s) const override {
    s["data"] = data_dir_;
    s["chunk_size"] = o_.chunk_size();
    s["temperature"] = o_.temperature();
    s["recipe_variant"] = variant_;
    s["encoder_channels"] = channels_;
    s["encoder_strides"] = strides_;
    s["crop_scale_min"] = o_.augment().scale_min();
    s["encoder_pool_grid"] = o_.model().encoder().pool_grid();
    s["moco_momentum"] = o_.moco_momentum();
    s["probe_limit"] = probe_limit_;
  }

  int64_t load(const TrainToolFlags& f) override {
    // Every file the run will read, before it trains: a missing or unreadable
    // test split must not surface only after the training.
    ct::check_dataset_files(data_dir_, f.no_eval ? std::vector<std::string>{"train"}
                                                 : std::vector<std::string>{"train", "test"});
    data_ = ct::load_dataset(data_dir_, "train", f.train_limit);
    check_data(f);
    return data_.size();
  }

  std::string data_hint() const override {
    return " (install Fashion-MNIST with `apt-get install dataset-fashion-mnist`, or pass --data DIR with a directory "
           "holding MNIST-format IDX files)";
  }

  // What the data set can make impossible, said in its terms (the flag
  // --data and the file) before an internal check of the trainer, the
  // memory estimate or the encoder fires: no training example, images too
  // small for the encoder's strides and pool grid, an empty test split.
  void check_data(const TrainToolFlags& f) const {
    const std::string images = ct::idx_file_path(data_dir_, "train", "images");
    TORCH_CHECK(data_.size() > 0, "the training set is empty: --data ", data_dir_, " holds 0 examples in '", images,
                "'; a run needs at least one");
    const auto size = data_.images.sizes();  // [N, C, H, W]
    const auto& enc = o_.model().encoder();
    int64_t h = size[2], w = size[3];
    for (const int64_t stride : enc.strides()) {  // a 3x3 convolution with padding 1
      h = (h - 1) / stride + 1;
      w = (w - 1) / stride + 1;
    }
    const int64_t g = enc.pool_grid();
    usage_check(g == 1 || (h >= g && w >= g), "the images of --data ", data_dir_, " are ", size[2], "x", size[3],
                " pixels: the encoder's strides (--encoder-strides ", strides_, ") leave a ", h, "x", w,
                " feature map, smaller than --encoder-pool-grid ", g,
                "; use larger images, a smaller --encoder-pool-grid or smaller --encoder-strides");
    if (!f.no_eval) {
      TORCH_CHECK(ct::load_dataset(data_dir_, "test", 1).size() > 0, "the test split is empty: --data ", data_dir_,
                  " holds 0 examples in '", ct::idx_file_path(data_dir_, "test", "images"),
                  "'; the evaluation needs at least one (or skip it with --no-eval)");
    }
  }

  std::string what() const override {
    return c10::str(o_.recipe(), " on ", data_.size(), " examples of ", data_dir_);
  }

  std::string batch() const override {
    return c10::str(o_.run().batch_size(),
                    o_.chunk_size() > 0 ? ", gradient cache chunks of " + std::to_string(o_.chunk_size()) : "");
  }

  train::RunResult train(const CommunicatorPtr& comm) override {
    // A step that cannot fit is refused before the model is built: against
    // the memory this node's processes share, or on a GPU against its own
    // free memory (one process per GPU).
    const int64_t world = comm->world_size(), rows = std::min(o_.run().batch_size(), data_.size());
    const auto size = data_.images.sizes();  // [N, C, H, W]
    const char* local = std::getenv("LOCAL_WORLD_SIZE");
    const auto device = comm->device();
    const int64_t here = device.is_cpu() ? std::clamp<int64_t>(local != nullptr ? std::atoll(local) : 1, 1, world) : 1;
    const auto need = ct::estimate_step_memory(o_, size[1], size[2], size[3], rows, world);
    const auto fit = ct::step_memory_fit(need, rows, world, here, contrax::available_device_memory_bytes(device),
                                         device.is_cpu() ? "this machine (or its memory limit)" : "GPU " + device.str());
    usage_check(fit.fits, step_memory_message(fit));
    contrax::note_worker_memory(c10::str("training: a step needs about ", format_bytes(static_cast<double>(need.total())),
                                         " per process (", ct::to_string(need), ") besides the data set's ",
                                         format_bytes(static_cast<double>(data_.images.nbytes()))));
    result_ = ct::train_contrastive(comm, data_, o_);
    return result_;
  }

  void summarize(Json& s) const override { s["chunk_size"] = o_.chunk_size(); }

  double evaluate(const TrainToolFlags& f, Json& s, std::ostream& out, const EvalProgress& progress) override {
    const auto eopts = ct::EvalOptions().probe_train_limit(probe_limit_);
    progress("loading the evaluation splits");
    const auto t0 = std::chrono::steady_clock::now();
    const auto eval_train = ct::load_dataset(data_dir_, "train", f.eval_limit);
    const auto eval_test = ct::load_dataset(data_dir_, "test", f.eval_limit);
    auto enc = result_.encoder;
    enc->to(torch::kFloat);
    // One protocol for all three representations, so that they compare. With
    // the cores of the finished ranks at hand (f.eval_threads > 1) the three
    // run at once, one thread each: each is mostly its probe's L-BFGS, whose
    // small GEMMs gain little from a second thread (7.5 -> 6.9 ms), so parts
    // side by side beat threads within a part. The display shows every part's
    // stage on one line.
    const bool side_by_side = f.eval_threads > 1;
    const int caller_threads = at::get_num_threads();
    std::mutex shown;
    std::array<std::string, 3> stages = {"starting", "starting", "starting"};
    const std::array<std::string, 3> names = {"trained encoder", "random init", "raw pixels"};
    const auto part = [&](int i) {
      return ct::EvalOptions(eopts).progress([&, i](const std::string& stage, int64_t done, int64_t total) {
        const std::string now = stage + (total > 1 ? c10::str(" ", done, "/", total) : "");
        if (!side_by_side) return progress(c10::str(names[i], " (", i + 1, "/3): ", now));
        const std::lock_guard<std::mutex> lock(shown);
        stages[i] = now;
        std::string line = "3 parts at once:";
        for (int k = 0; k < 3; ++k) line += c10::str(k > 0 ? ";" : "", " ", names[k], ": ", stages[k]);
        progress(line);
      });
    };
    const auto run = [&](const std::function<ct::EvalResult()>& evaluate_part) {
      return std::async(side_by_side ? std::launch::async : std::launch::deferred, [&, evaluate_part] {
        if (side_by_side) at::set_num_threads(1);
        return evaluate_part();
      });
    };
    auto trained_f = run([&] { return ct::evaluate_encoder(enc, eval_train, eval_test, part(0)); });
    auto random_init_f = run([&] {
      return ct::evaluate_random_init(enc->options, o_.run().seed() + 1000003, eval_train, eval_test, part(1));
    });
    auto raw_f = run([&] { return ct::evaluate_raw_pixels(eval_train, eval_test, part(2)); });
    const auto trained = trained_f.get();
    const auto random_init = random_init_f.get();
    const auto raw = raw_f.get();
    at::set_num_threads(caller_threads);
    const int64_t n_probe = probe_limit_ > 0 ? std::min(probe_limit_, eval_train.size()) : eval_train.size();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // The flat keys of earlier versions, and the table as one object per row.
    put_number(s, "linear_probe_acc", trained.linear_probe_acc);
    put_number(s, "knn_acc", trained.knn_acc);
    put_number(s, "random_init_linear_probe_acc", random_init.linear_probe_acc);
    put_number(s, "random_init_knn_acc", random_init.knn_acc);
    put_number(s, "raw_pixel_linear_probe_acc", raw.linear_probe_acc);
    put_number(s, "raw_pixel_knn_acc", raw.knn_acc);
    put_number(s, "linear_probe_l2", trained.probe.l2);
    put_number(s, "random_init_linear_probe_l2", random_init.probe.l2);
    put_number(s, "raw_pixel_linear_probe_l2", raw.probe.l2);
    put_number(s, "eval_s", seconds);
    s["evaluation"] = {{"test_images", eval_test.size()},
                       {"knn_bank_images", eval_train.size()},
                       {"probe_train_images", n_probe},
                       {"knn_k", eopts.knn().k()},
                       {"trained_encoder", eval_json(trained)},
                       {"random_init_encoder", eval_json(random_init)},
                       {"raw_pixels", eval_json(raw)}};
    out << "\nevaluation of frozen features on " << eval_test.size() << " test images (backbone output, not the "
        << "projection head):\n"
        << "  linear probe: logistic regression (L-BFGS to convergence) on standardised features of " << n_probe
        << " train images, L2 chosen on " << eopts.probe().val_fraction() * 100 << "% of them\n"
        << "  kNN: cosine similarity to " << eval_train.size() << " train images, " << eopts.knn().k()
        << " neighbours voting with weight exp(sim / " << eopts.knn().temperature() << ")\n";
    out << std::left << std::setw(22) << "representation" << std::setw(20) << "linear probe acc" << std::setw(16)
        << "kNN acc (k=" + std::to_string(eopts.knn().k()) + ")" << "probe L2\n";
    auto row = [&out](const std::string& name, const ct::EvalResult& e) {
      out << std::left << std::setw(22) << name << std::setw(20) << std::fixed << std::setprecision(4)
          << e.linear_probe_acc << std::setw(16) << e.knn_acc << std::scientific << std::setprecision(0)
          << e.probe.l2 << (e.probe.converged ? "" : " (probe not converged)") << std::fixed << "\n";
    };
    row("trained encoder", trained);
    row("random-init encoder", random_init);
    row("raw pixels", raw);
    return seconds;
  }

  std::string rate_note() const override { return "examples/s; "; }

 private:
  ct::TrainOptions o_;
  std::string variant_;
  std::string channels_, strides_;  // the flags' text (parsed by check_flags)
  std::string data_dir_ = ct::kDefaultDataDir;
  int64_t probe_limit_ = 10000;
  ct::Dataset data_;
  ct::TrainResult result_;
};

}  // namespace

std::unique_ptr<TrainRecipe> make_image_recipe(const std::string& name, const std::string& variant) {
  return std::make_unique<ImageRecipe>(name, variant);
}

}  // namespace contrax::cli
