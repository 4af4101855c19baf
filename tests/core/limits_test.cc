// core/limits.h: bounded quoting of user strings, and the limits' values
// against the largest model ferry is sized for.
#include "core/limits.h"

#include <string>

#include "catch2/catch.hpp"

namespace ferry {
namespace {

TEST_CASE("Quote keeps short strings and bounds long ones", "[limits]") {
  CHECK(Quote("policy") == "'policy'");
  CHECK(Quote("") == "''");
  // Control characters and quotes are escaped, not passed to logs raw.
  CHECK(Quote("a\nb'") == "'a\\nb\\''");
  const std::string huge(10 << 20, 'x');
  const std::string q = Quote(huge);
  CHECK(q == "'" + std::string(Limits::kMaxQuotedBytes, 'x') +
                 "'...(10485760 bytes)");
  CHECK(q.size() < 100);
  // Exactly at the bound: no ellipsis.
  const std::string edge(Limits::kMaxQuotedBytes, 'y');
  CHECK(Quote(edge) == "'" + edge + "'");
}

TEST_CASE("Limits leave room for a Kimi-K2-sized registration", "[limits]") {
  // 139,583 checkpoint tensors, every one declared by one rank; flat
  // shards of them at most 5 pieces each (2 x ndim - 1, ndim <= 3).
  CHECK(139583 <= Limits::kMaxParamsPerRegistration);
  CHECK(139583 * 5 <= Limits::kMaxPiecesPerRegistration);
  // 256 trainer ranks, TP16 instances, a 163840 x 7168 embedding, MoE w13
  // of 384 experts (768 fused parts).
  CHECK(256 <= Limits::kMaxWorldSize);
  CHECK(16 <= Limits::kMaxTpSize);
  CHECK(int64_t{163840} * 7168 <= Limits::kMaxParamElements);
  CHECK(768 <= Limits::kMaxPartsPerEngineParam);
  // Sizes that overflow arithmetic elsewhere stay out.
  CHECK(Limits::kMaxExtent < (int64_t{1} << 62));
  CHECK(Limits::kMaxTpSize < (1 << 30));
}

}  // namespace
}  // namespace ferry
