// Explaining a plan to a person: per parameter how it lands (direct, fused,
// fallback), why, how many bytes and from which trainer ranks; per instance
// the totals an operator checks first (direct byte coverage, bytes per
// source rank, fan-in and fan-out). ferryctl prints this as a table or JSON.
#ifndef FERRY_CORE_EXPLAIN_H_
#define FERRY_CORE_EXPLAIN_H_

#include <cstdint>
#include <string>
#include <vector>

#include "core/layout_resolution.h"
#include "core/plan.h"

namespace ferry {

struct ParamExplanation {
  std::string param;        // checkpoint name
  std::string engine_name;  // engine parameter it lands in ("" if unknown)
  Resolution resolution = Resolution::kDirect;
  std::string reason;
  int64_t param_bytes = 0;     // the checkpoint tensor's size
  int64_t received_bytes = 0;  // bytes this instance receives for it
  std::vector<int32_t> source_ranks;  // trainer ranks it comes from
};

struct InstanceExplanation {
  std::string instance;
  std::string relay_from;  // "" when fed by the trainer
  std::vector<ParamExplanation> params;  // in model order
  int64_t param_bytes = 0;     // checkpoint bytes the instance holds
  int64_t direct_bytes = 0;    // of those, resolved direct or fused
  double direct_coverage = 0;  // direct_bytes / param_bytes
  int64_t received_bytes = 0;  // bytes moved into it, all ranks
  std::vector<std::pair<int32_t, int64_t>> bytes_per_source_rank;
  int32_t max_fan_in = 0;   // most trainer ranks feeding one engine rank
  int32_t max_fan_out = 0;  // most engine ranks fed by one trainer rank
  int64_t copies = 0;
  int64_t buckets = 0;
};

// `resolved` may be null (an instance that registered explicit pieces).
InstanceExplanation ExplainInstance(const ModelSpec& model,
                                    const std::vector<RankLayout>& sources,
                                    const Plan& plan, size_t instance,
                                    const std::vector<RankLayout>& layout,
                                    const ResolvedInstance* resolved);
// The same from one instance's plan alone (`relay_from` left empty).
InstanceExplanation ExplainInstance(const ModelSpec& model,
                                    const std::vector<RankLayout>& sources,
                                    const InstancePlan& ip,
                                    const std::vector<RankLayout>& layout,
                                    const ResolvedInstance* resolved);

// A table for terminals, one line per parameter, totals first.
std::string FormatExplanation(const InstanceExplanation& e,
                              size_t max_params = 0 /* 0: all */);
std::string ExplanationToJson(const InstanceExplanation& e);

// "1.50 GiB", "12.0 MiB", "512 B"
std::string HumanBytes(int64_t bytes);

}  // namespace ferry

#endif  // FERRY_CORE_EXPLAIN_H_
