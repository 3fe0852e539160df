// Tests that reading a checkpoint runs nothing and takes no more memory than
// the file: crafted files of the earlier format (a TorchScript __setstate__,
// a pickle global, a zip bomb) are refused before any byte of them is
// interpreted, with nothing executed; crafted safetensors headers (records
// outside the file, overlapping, oversized, unknown dtypes) are refused by
// name before any record is read; a checkpoint opens in Python with
// safetensors; the earlier format is read only on request, and converted.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>

#include "contrax/train/common/checkpoint.h"
#include "support/cli.h"
#include "support/errors.h"
#include "support/processes.h"

namespace ct = contrax::train;
using contrax::testing::error_of;
using contrax::testing::TempDir;

namespace {

bool exists(const std::string& p) { return std::filesystem::exists(p); }

// The crafted files of crafted_checkpoints.py in `dir`; false (the test
// skips) where the build's Python has no torch.
bool craft(const std::string& dir) {
  const std::string script = std::string(CONTRAX_TEST_SOURCE_DIR) + "/train/crafted_checkpoints.py";
  const auto r = contrax::testing::run_shell(std::string(CONTRAX_TEST_PYTHON) + " " + script + " " + dir + " 2>&1");
  return r.status == 0;
}

// Loads `path` into a checkpoint of one Linear(4, 4) in a child process and
// returns its message ("" when it loaded) and the child's peak resident
// memory in KiB: a fresh process, so that the peak is this load's.
std::pair<std::string, long> load_in_child(const std::string& path, bool legacy = false) {
  int fds[2];
  EXPECT_EQ(::pipe(fds), 0);
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(fds[0]);
    std::string msg;
    try {
      torch::nn::Linear lin(4, 4);
      ct::Checkpoint c;
      c.module("m", *lin);
      if (legacy) {
        c.load_legacy(path);
      } else {
        c.load(path);
      }
    } catch (const std::exception& e) {
      msg = e.what();
      msg = msg.substr(0, msg.find('\n'));
      if (msg.empty()) msg = "(an exception without a message)";
    }
    if (!msg.empty() && ::write(fds[1], msg.data(), msg.size()) < 0) ::_exit(2);
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string msg;
  char buf[4096];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) msg.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  int status = 0;
  rusage ru{};
  ::wait4(child, &status, 0, &ru);
  EXPECT_TRUE(WIFEXITED(status)) << "the child loading " << path << " died (status " << status << ")";
  return {msg, ru.ru_maxrss};
}

// A safetensors file: the 8-byte size, `header`, then `data`.
void write_safetensors(const std::string& path, const std::string& header, const std::string& data,
                       int64_t claimed_size = -1) {
  std::ofstream f(path, std::ios::binary);
  uint64_t n = claimed_size >= 0 ? static_cast<uint64_t>(claimed_size) : header.size();
  for (int i = 0; i < 8; ++i) f.put(static_cast<char>((n >> (8 * i)) & 0xff));
  f << header << data;
}

}  // namespace

TEST(CraftedCheckpoints, RunNothingAndTakeNoMoreMemoryThanTheirSize) {
  TempDir tmp;
  const std::string& dir = tmp.path;
  if (!craft(dir)) GTEST_SKIP() << CONTRAX_TEST_PYTHON << " cannot make the crafted files (no torch there)";
  // The baseline: a child that loads a good checkpoint of the same model.
  {
    torch::nn::Linear lin(4, 4);
    ct::Checkpoint c;
    c.module("m", *lin);
    c.save(dir + "/good.pt");
  }
  const auto [good_msg, good_kib] = load_in_child(dir + "/good.pt");
  ASSERT_EQ(good_msg, "");
  for (const char* name : {"setstate.pt", "pickle_global.pt", "zip_bomb.pt"}) {
    const auto [msg, kib] = load_in_child(dir + "/" + name);
    EXPECT_NE(msg.find("is a checkpoint of Contrax's earlier format (a TorchScript archive), and reading one runs the "
                       "code it holds, so it is not read"),
              std::string::npos)
        << name << ": " << msg;
    EXPECT_NE(msg.find("--trust-legacy-checkpoint"), std::string::npos) << msg;
    // The zip bomb inflates to 512 MiB; refused, it costs what the good
    // checkpoint's load costs (within 16 MiB of allocator noise).
    EXPECT_LT(kib, good_kib + 16 * 1024) << name << ": peak " << kib << " KiB against " << good_kib << " KiB";
  }
  EXPECT_FALSE(exists(dir + "/setstate_ran")) << "the TorchScript payload ran";
  EXPECT_FALSE(exists(dir + "/pickle_ran")) << "the pickle payload ran";
  // The payload is live: the reader of the earlier format, asked to trust
  // the file, runs it. That is what the refusal above prevents.
  load_in_child(dir + "/setstate.pt", /*legacy=*/true);
  EXPECT_TRUE(exists(dir + "/setstate_ran")) << "the crafted __setstate__ should run under the legacy reader";
}

TEST(CraftedCheckpoints, SafetensorsHeadersAreCheckedBeforeAnyRecordIsRead) {
  TempDir tmp;
  const std::string p = tmp.path + "/c.pt";
  const std::string four(16, '\0');  // 4 floats
  struct Case {
    const char* what;
    std::string header, data;
    int64_t claimed;
    const char* expected;
  };
  const Case cases[] = {
      {"short file", "", "", -2, "fewer than its 8-byte header size"},
      {"header past the end", "{}", "", 1 << 20, "its header claims 1048576 bytes, but the file has 2"},
      {"header of 2^40 bytes", "{}", "", int64_t{1} << 40, "its header claims 1099511627776 bytes"},
      {"not JSON", "{\"a\": [", "", -1, "its header is not JSON"},
      {"not an object", "[1, 2]", "", -1, "its header is not a JSON object"},
      {"unknown dtype", R"({"w":{"dtype":"F128","shape":[1],"data_offsets":[0,16]}})", four, -1,
       "record 'w' has no known dtype"},
      {"record past the end", R"({"w":{"dtype":"F32","shape":[1099511627776],"data_offsets":[0,4398046511104]}})",
       four, -1, "record 'w' has data_offsets outside the file's 16 bytes of records"},
      {"oversized shape", R"({"w":{"dtype":"F32","shape":[1048576,1048576],"data_offsets":[0,16]}})", four, -1,
       "record 'w' holds 16 bytes, but its shape and dtype need more than the file holds"},
      {"negative dimension", R"({"w":{"dtype":"F32","shape":[-4],"data_offsets":[0,16]}})", four, -1,
       "record 'w' has a dimension that is not a non-negative integer"},
      {"overlap", R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[2],)"
                  R"("data_offsets":[8,16]}})",
       four, -1, "two records overlap"},
      {"hole", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", four, -1,
       "bytes between records belong to none"},
      {"trailing bytes", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", four, -1,
       "8 bytes after the last record belong to none"},
      {"metadata not strings", R"({"__metadata__":{"format":3}})", "", -1, "__metadata__ 'format' is not a string"},
  };
  for (const auto& c : cases) {
    if (c.claimed == -2) {
      std::ofstream(p, std::ios::binary) << "abc";
    } else {
      write_safetensors(p, c.header, c.data, c.claimed);
    }
    const std::string msg = error_of([&] { ct::Checkpoint().load(p); });
    EXPECT_NE(msg.find("Checkpoint::load(): '" + p + "' is not a readable checkpoint (truncated or corrupt;"),
              std::string::npos)
        << c.what << ": " << msg;
    EXPECT_NE(msg.find(c.expected), std::string::npos) << c.what << ": " << msg;
    EXPECT_FALSE(ct::is_valid_checkpoint(p)) << c.what;
  }
  // A well-formed safetensors file that Contrax did not write.
  write_safetensors(p, R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", four);
  std::string msg = error_of([&] { ct::Checkpoint().load(p); });
  EXPECT_NE(msg.find("is not a contrax checkpoint (no format marker)"), std::string::npos) << msg;
  // A Contrax header whose record is larger than the model's parameter: its
  // shape is compared, and nothing is read.
  torch::nn::Linear lin(2, 2);
  write_safetensors(p,
                    R"({"__metadata__":{"format":"contrax.checkpoint","contrax":"{\"version\":3,\"modules\":)"
                    R"({\"m\":{}},\"optimizers\":{}}"},"module.m.bias":{"dtype":"F32","shape":[2],"data_offsets":)"
                    R"([0,8]},"module.m.weight":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})",
                    std::string(24, '\0'));
  const auto before = lin->weight.clone();
  msg = error_of([&] {
    ct::Checkpoint c;
    c.module("m", *lin);
    c.load(p);
  });
  EXPECT_NE(msg.find("module 'm' in '" + p + "' does not match the model: parameter 'weight' has shape [4] in the "
                     "checkpoint but [2, 2] in the model"),
            std::string::npos)
      << msg;
  EXPECT_TRUE(torch::equal(before, lin->weight)) << "a refused checkpoint must change nothing";
}

TEST(Checkpoint, OpensInPythonWithSafetensors) {
  TempDir tmp;
  const std::string p = tmp.path + "/checkpoint.pt";
  torch::manual_seed(3);
  torch::nn::Linear lin(3, 2);
  torch::optim::AdamW adam(lin->parameters(), torch::optim::AdamWOptions(0.1));
  lin(torch::randn({5, 3})).sum().backward();
  adam.step();
  ct::Checkpoint c;
  c.module("model", *lin).optimizer("adamw", adam);
  c.ints["step"] = 1;
  c.save(p);
  const auto probe = contrax::testing::run_shell(std::string(CONTRAX_TEST_PYTHON) +
                                                 " -c 'import safetensors' 2>&1");
  if (probe.status != 0) GTEST_SKIP() << CONTRAX_TEST_PYTHON << " has no safetensors package";
  const auto r = contrax::testing::run_shell(
      std::string(CONTRAX_TEST_PYTHON) + " -c '\nimport json, sys\nfrom safetensors import safe_open\n"
      "f = safe_open(sys.argv[1], \"pt\")\nm = f.metadata()\n"
      "print(m[\"format\"], json.loads(m[\"contrax\"])[\"ints\"][\"step\"])\n"
      "for k in sorted(f.keys()): print(k, list(f.get_tensor(k).shape), \"%.17g\" % f.get_tensor(k).double().sum())\n' " +
      p + " 2>&1");
  ASSERT_EQ(r.status, 0) << r.out;
  std::ostringstream want;
  want.precision(17);
  want << "contrax.checkpoint 1\n";
  want << "module.model.bias [2] " << lin->bias.to(torch::kDouble).sum().item<double>() << "\n";
  want << "module.model.weight [2, 3] " << lin->weight.to(torch::kDouble).sum().item<double>() << "\n";
  for (const auto& [i, t] : {std::make_pair(0, lin->weight), std::make_pair(1, lin->bias)}) {
    const auto& st = static_cast<torch::optim::AdamWParamState&>(*adam.state().at(t.unsafeGetTensorImpl()));
    for (const auto& [name, v] : {std::make_pair("exp_avg", st.exp_avg()), std::make_pair("exp_avg_sq", st.exp_avg_sq())}) {
      want << "optimizer.adamw.0." << i << "." << name << " " << (t.dim() == 1 ? "[2]" : "[2, 3]") << " "
           << v.to(torch::kDouble).sum().item<double>() << "\n";
    }
  }
  // Python prints its sums with %.17g, as this stream does; the records in
  // sorted order.
  EXPECT_EQ(r.out, want.str());
}

TEST(Checkpoint, TheEarlierFormatIsReadOnlyOnRequestAndConverted) {
  TempDir tmp;
  const std::string p = tmp.path + "/checkpoint.pt";
  torch::manual_seed(5);
  torch::nn::Linear saved(4, 3);
  // A checkpoint as the earlier Checkpoint::save wrote it (format 2).
  {
    torch::serialize::OutputArchive ar, sub;
    ar.write("contrax_checkpoint_format", c10::IValue(int64_t{2}));
    saved->save(sub);
    ar.write("module.m", sub);
    ar.write("ints.keys", c10::IValue(c10::List<std::string>({"step"})));
    ar.write("ints.values", c10::IValue(c10::List<int64_t>({41})));
    ar.write("doubles.keys", c10::IValue(c10::List<std::string>()));
    ar.write("doubles.values", c10::IValue(c10::List<double>()));
    ar.write("strings.keys", c10::IValue(c10::List<std::string>()));
    ar.write("strings.values", c10::IValue(c10::List<std::string>()));
    ar.write("metadata", c10::IValue(std::string("{}")));
    ar.save_to(p);
  }
  EXPECT_TRUE(ct::is_legacy_checkpoint(p));
  EXPECT_FALSE(ct::is_valid_checkpoint(p));
  torch::nn::Linear restored(4, 3);
  ct::Checkpoint c;
  c.module("m", *restored);
  const std::string msg = error_of([&] { c.load(p); });
  EXPECT_NE(msg.find("Checkpoint::load(): '" + p + "' is a checkpoint of Contrax's earlier format"), std::string::npos)
      << msg;
  c.load_legacy(p);
  EXPECT_EQ(c.ints.at("step"), 41);
  EXPECT_TRUE(torch::equal(restored->weight, saved->weight));
  c.save(p);  // converted
  EXPECT_FALSE(ct::is_legacy_checkpoint(p));
  EXPECT_TRUE(ct::is_valid_checkpoint(p));
  torch::nn::Linear again(4, 3);
  ct::Checkpoint d;
  d.module("m", *again);
  d.load(p);
  EXPECT_EQ(d.ints.at("step"), 41);
  EXPECT_TRUE(torch::equal(again->weight, saved->weight));
}
