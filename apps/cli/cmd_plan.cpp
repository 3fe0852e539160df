// `contrax plan`: what a loss call will cost before it runs — per path
// (materialised, tiled, ring) the logits and feature bytes a rank holds, the
// GEMM work, the bytes each rank sends forward and backward, the steps of the
// walk (CPU tiles, or CUDA's row panels), its workspace and the kernel
// launches, and which path the losses' automatic routing picks. No process
// group is started.
//
//   contrax plan --loss clip --batch 32768 --width 512 --world 4
//   contrax plan --loss nt_xent --batch 4096 --world 2 --dtype half --json
//   contrax plan --loss grouped --group 8 --batch 4096 --world 4   # 7 hard negatives per query
//   contrax plan --device cuda --dtype bf16 --batch 65536 --width 768      # this GPU's, or an 80 GB one's
//   contrax plan --device cuda --dtype bf16 --batch 65536 --width 768 --gpu-memory 24   # a 24 GB GPU
//   CONTRAX_FUSED_KERNELS=1 contrax plan --device cuda --dtype bf16 --batch 65536 --width 768 --loss siglip
//   contrax plan --batch 4096 --width 768 --matryoshka 64,128,256   # Matryoshka prefixes (and 768)
//   contrax plan --loss maxsim --batch 4096 --width 128 --world 4 --query-tokens 32 --document-tokens 256
#include <algorithm>
#include <iostream>

#include "cli/cli.h"
#include "cli/flags.h"
#include "contrax/check/plan.h"

namespace {

c10::ScalarType dtype_of(const std::string& s) {
  if (s == "double") return c10::kDouble;
  if (s == "half") return c10::kHalf;
  if (s == "bf16") return c10::kBFloat16;
  return c10::kFloat;
}

// Late interaction's shape: tokens per query and per document, and the
// budget of one panel of token scores.
void add_maxsim_flags(CLI::App& app, int64_t& query_tokens, int64_t& document_tokens, int64_t& token_panel) {
  namespace cli = contrax::cli;
  cli::add_int(app, "--query-tokens", query_tokens, "maxsim: tokens per query (Lq)", 1, int64_t{1} << 20);
  cli::add_int(app, "--document-tokens", document_tokens, "maxsim: tokens per document (Ld)", 1, int64_t{1} << 20);
  cli::add_int(app, "--token-panel-bytes", token_panel,
               "maxsim: the budget of one panel of token scores (maxsim_loss's panel_bytes)", 1, int64_t{1} << 50);
}

// --matryoshka's widths (none when empty), each in [1, width] and given once.
std::vector<int64_t> matryoshka_widths(const std::string& flag, int64_t width) {
  namespace cli = contrax::cli;
  const auto dims = flag.empty() ? std::vector<int64_t>() : cli::parse_int_list("--matryoshka", flag, 1, width);
  for (const auto m : dims) {
    cli::usage_check(std::count(dims.begin(), dims.end(), m) == 1, "flag '--matryoshka' must not repeat a width, but ",
                     m, " appears more than once");
  }
  return dims;
}

int run_plan(const std::vector<std::string>& args) {
  namespace cli = contrax::cli;
  CLI::App app{"cost of each loss path (memory, GEMMs, bytes) and the automatic choice", "plan"};
  cli::setup_app(app);
  const contrax::PlanOptions defaults;  // the library's defaults, one place
  std::string loss = defaults.loss(), dtype = "float";
  int64_t batch = defaults.batch(), width = defaults.width(), world = defaults.world();
  int64_t tile = defaults.tile_size(), max_logits = defaults.max_logits_bytes();
  bool ring = defaults.ring(), json = false;
  int64_t group = defaults.group();
  cli::add_choice(app, "--loss", loss,
                  "clip (symmetric), infonce, grouped (--group candidates per query), nt_xent, "
                  "moco_v3, siglip or maxsim (late interaction: --query-tokens x --document-tokens of --width)",
                  {"clip", "infonce", "grouped", "nt_xent", "moco_v3", "siglip", "maxsim"});
  cli::add_int(app, "--group", group,
               "grouped, maxsim: candidates per query g (the positive and g - 1 hard negatives)", 1,
               int64_t{1} << 20);
  int64_t query_tokens = defaults.query_tokens(), document_tokens = defaults.document_tokens();
  int64_t token_panel = defaults.token_panel_bytes();
  add_maxsim_flags(app, query_tokens, document_tokens, token_panel);
  cli::add_int(app, "--batch", batch, "global batch B (rows per view)", 1, int64_t{1} << 40);
  cli::add_int(app, "--width", width, "feature width d", 1, int64_t{1} << 20);
  cli::add_int(app, "--world", world, "number of ranks W", 1, int64_t{1} << 20);
  cli::add_choice(app, "--dtype", dtype, "feature dtype", {"float", "double", "half", "bf16"});
  std::string device = "cpu";
  cli::add_device(app, device,
                  "where the features live (the model only, no GPU needed): on cuda, half and bf16 features are "
                  "gathered and multiplied in their own dtype");
  std::string path = "auto";
  cli::add_choice(app, "--path", path, "the losses' memory path", {"auto", "materialised", "tiled"});
  cli::add_int(app, "--tile-size", tile,
               "tile side on the tiled path (0: from the 16 MiB tile budget; > 0 with "
               "--path auto selects tiles)",
               0, int64_t{1} << 30);
  app.add_flag("--ring", ring, "tiled path with key blocks around the ring");
  int64_t panel_bytes = defaults.panel_bytes();
  cli::add_int(app, "--panel-bytes", panel_bytes,
               "with --device cuda: the panel budget to plan with (0: what a loss would take on the GPU planned "
               "for: 1 GiB, 1.5 GiB = 1610612736 from 40 GB)",
               0, int64_t{1} << 50);
  int64_t gpu_gb = 0;
  cli::add_int(app, "--gpu-memory", gpu_gb,
               "with --device cuda: the memory in GB of the GPU to plan for (0: this machine's GPU, or an 80 GB "
               "GPU where none is visible)",
               0, int64_t{1} << 20);
  cli::add_int(app, "--max-logits-bytes", max_logits, "automatic routing threshold", 1, int64_t{1} << 50);
  std::string matryoshka;
  app.add_option("--matryoshka", matryoshka,
                 "Matryoshka prefix widths, comma-separated (e.g. 64,128,256; the full width is always one): each "
                 "prefix runs the loss's block on its cut");
  app.add_flag("--json", json, "print one JSON object instead of the table");
  if (int st = cli::parse(app, args); st >= 0) return st;
  const auto dims = matryoshka_widths(matryoshka, width);
  cli::usage_check(group == 1 || loss == "grouped" || loss == "maxsim",
                   "flag '--group' applies to --loss grouped and maxsim only, but --loss is '", loss, "'");
  auto plan = contrax::plan_loss(contrax::PlanOptions()
                                     .loss(loss)
                                     .group(group)
                                     .query_tokens(query_tokens)
                                     .document_tokens(document_tokens)
                                     .token_panel_bytes(token_panel)
                                     .batch(batch)
                                     .width(width)
                                     .world(world)
                                     .dtype(dtype_of(dtype))
                                     .device(device == "cuda" ? torch::kCUDA : torch::kCPU)
                                     .path(path == "tiled"          ? contrax::MemoryPath::kTiled
                                           : path == "materialised" ? contrax::MemoryPath::kMaterialised
                                                                    : contrax::MemoryPath::kAuto)
                                     .tile_size(tile)
                                     .ring(ring)
                                     .max_logits_bytes(max_logits)
                                     .panel_bytes(panel_bytes)
                                     .gpu_memory(gpu_gb * 1000 * 1000 * 1000)
                                     .matryoshka_dims(dims));
  std::cout << (json ? contrax::to_json(plan) + "\n" : contrax::to_string(plan)) << std::flush;
  return 0;
}

contrax::cli::Command plan_cmd("plan", "cost of each loss path (memory, GEMMs, bytes) and the automatic choice",
                               run_plan);

}  // namespace
