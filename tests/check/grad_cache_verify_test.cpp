// `contrax verify`'s gradient-cache cases pass at every world size, and their
// check can fail: a wrong gradient in any parameter on any rank, ranks that
// disagree around the right mean.

#include <gtest/gtest.h>

#include "contrax/check/verify.h"
#include "contrax/parallel/data_parallel.h"
#include "contrax/parallel/grad_cache.h"
#include "support/ranks.h"

using contrax::CommunicatorPtr;
using contrax::testing::run_ranks;

namespace {

// ---- `contrax verify`'s gradient-cache cases

constexpr const char* kVerifyCases[] = {"grad_cache_clip", "grad_cache_tiled_ring"};

// Runs `c` on W thread ranks with verify's default rows (an empty rank from
// W = 3 on); one result per rank.
std::vector<contrax::VerifyResult> verify_on_ranks(const contrax::VerifyCase& c, int64_t W) {
  std::vector<contrax::VerifyResult> results(W);
  run_ranks(W, [&](const CommunicatorPtr& comm) {
    results[comm->rank()] = contrax::verify_case(c, comm, contrax::VerifyOptions());
  }, std::chrono::seconds(15));
  return results;
}

const contrax::VerifyCase& registered_case(const std::string& name) {
  for (const auto& c : contrax::verify_cases()) {
    if (c.name == name) return c;
  }
  throw std::runtime_error("no verify case " + name);
}

TEST(GradCacheVerify, CasesPassAtEveryWorldSize) {
  for (int64_t W = 1; W <= 4; ++W) {
    for (const char* name : kVerifyCases) {
      auto results = verify_on_ranks(registered_case(name), W);
      for (const auto& r : results) {
        EXPECT_TRUE(r.passed) << name << " W=" << W << ": " << contrax::to_json(r);
        EXPECT_LE(r.max_rel_err, 1e-10) << name << " W=" << W;
        EXPECT_EQ(contrax::to_json(r), contrax::to_json(results[0])) << "ranks disagree on the verdict";
      }
    }
  }
}

// The check must be able to fail. The case is wrapped so that after the real
// step one parameter's gradient is off by a relative 1e-6 on one rank only
// (the last, which is the empty one at W = 3): every parameter in turn, for
// both cases. Each time the case fails on every rank and names the parameter.
TEST(GradCacheVerify, CheckCatchesAWrongGradientInAnyParameterOnAnyRank) {
  for (const char* name : kVerifyCases) {
    const auto& good = registered_case(name);
    const auto names = good.parameters(4, at::detail::createCPUGenerator(0)).keys();
    ASSERT_EQ(names.size(), 9u);  // two towers of 4 tensors and the logit scale
    for (size_t k = 0; k < names.size(); ++k) {
      contrax::VerifyCase wrong = good;
      wrong.distributed = [&good, k](const std::vector<torch::Tensor>& x, const std::vector<torch::Tensor>& s,
                                     const CommunicatorPtr& comm) {
        auto loss = good.distributed(x, s, comm);
        if (comm->rank() == comm->world_size() - 1) s[k].grad().mul_(1 + 1e-6);
        return loss;
      };
      for (int64_t W : {1, 3}) {
        for (const auto& r : verify_on_ranks(wrong, W)) {
          EXPECT_FALSE(r.passed) << name << " parameter " << names[k] << " W=" << W;
          EXPECT_EQ(r.worst, "grad " + names[k]) << name << " W=" << W;
          EXPECT_GT(r.max_rel_err, 1e-7);
        }
      }
    }
  }
}

// Ranks whose gradients disagree fail even when their mean is right: what a
// missing loss-side DataParallel does to the logit scale (each rank keeps its
// own dL_r/ds, whose mean is dL/ds). Comparing the rank mean would pass this.
TEST(GradCacheVerify, CheckCatchesRanksThatDisagreeAroundTheRightMean) {
  const auto& good = registered_case("grad_cache_clip");
  contrax::VerifyCase wrong = good;
  wrong.distributed = [&good](const std::vector<torch::Tensor>& x, const std::vector<torch::Tensor>& s,
                              const CommunicatorPtr& comm) {
    auto loss = good.distributed(x, s, comm);
    auto& g = s.back().grad();  // the logit scale's
    g.add_(g.abs() * (comm->rank() == 0 ? 1e-3 : -1e-3));
    return loss;
  };
  for (const auto& r : verify_on_ranks(wrong, 2)) {
    EXPECT_FALSE(r.passed);
    EXPECT_EQ(r.worst, "grad logit_scale");
  }
}

}  // namespace
