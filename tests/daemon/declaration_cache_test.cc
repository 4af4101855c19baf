// DeclarationCache (daemon/registry/declaration_cache.h): a declaration equal to one
// parsed before is that one, anything else is parsed and validated as
// before, invalid declarations are never held, and entries live only as
// long as someone holds the list. Through ParseSourceRegistration and the
// Registry: two trainer ranks of one model hold one list.
#include "daemon/registry/declaration_cache.h"

#include <memory>
#include <string>

#include "catch2/catch.hpp"
#include "daemon/registry/registration_parser.h"
#include "daemon/registry/registry.h"
#include "tests/daemon/daemon_test_support.h"

namespace ferry {
namespace testing {
namespace {

DeclaredParameters Declaration() {
  DeclaredParameters out;
  for (const TestParam& t : TestModel()) {
    v1::ParameterSpec* p = out.Add();
    p->set_name(t.name);
    p->set_dtype(v1::DTYPE_F32);
    for (int64_t d : t.shape) p->add_shape(d);
  }
  return out;
}

TEST_CASE("an equal declaration is the one parsed before") {
  DeclarationCache cache;
  const DeclaredParameters decl = Declaration();
  absl::StatusOr<std::shared_ptr<const ModelSpec>> a = cache.Parse(decl, "r0");
  absl::StatusOr<std::shared_ptr<const ModelSpec>> b = cache.Parse(decl, "r1");
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK(*a == *b);
  CHECK(cache.parsed() == 1);
  CHECK(cache.hits() == 1);
  REQUIRE((*a)->params.size() == TestModel().size());
  for (size_t i = 0; i < TestModel().size(); ++i) {
    CHECK((*a)->Find(TestModel()[i].name) == static_cast<int32_t>(i));
  }
}

TEST_CASE("a declaration that differs in anything is parsed on its own") {
  DeclarationCache cache;
  const DeclaredParameters decl = Declaration();
  absl::StatusOr<std::shared_ptr<const ModelSpec>> held = cache.Parse(decl, "r0");
  REQUIRE(held.ok());
  DeclaredParameters shape = decl, dtype = decl, name = decl, order = decl,
                     longer = decl, shorter = decl;
  shape.Mutable(0)->set_shape(0, shape.Get(0).shape(0) + 1);
  dtype.Mutable(1)->set_dtype(v1::DTYPE_BF16);
  name.Mutable(2)->set_name("model.other");
  order.SwapElements(0, 1);
  *longer.Add() = decl.Get(0);
  longer.Mutable(longer.size() - 1)->set_name("extra");
  shorter.RemoveLast();
  for (const DeclaredParameters* d :
       {&shape, &dtype, &name, &order, &longer, &shorter}) {
    absl::StatusOr<std::shared_ptr<const ModelSpec>> other =
        cache.Parse(*d, "r1");
    INFO(other.status().ToString());
    REQUIRE(other.ok());
    CHECK(*other != *held);
    CHECK(!DeclaresExactly(*d, **held));
  }
  CHECK(cache.hits() == 0);
  CHECK(DeclaresExactly(decl, **held));
}

TEST_CASE("an invalid declaration is refused, naming the parameter, and "
          "never held") {
  DeclarationCache cache;
  DeclaredParameters twice = Declaration();
  *twice.Add() = twice.Get(0);
  for (int round = 0; round < 2; ++round) {
    absl::StatusOr<std::shared_ptr<const ModelSpec>> s =
        cache.Parse(twice, "source policy rank 3");
    REQUIRE(!s.ok());
    CHECK(s.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(s.status().message().find(TestModel()[0].name) != std::string::npos);
    CHECK(s.status().message().find("rank 3") != std::string::npos);
  }
  DeclaredParameters bad_dtype = Declaration();
  bad_dtype.Mutable(0)->set_dtype(v1::DTYPE_UNSPECIFIED);
  CHECK(!cache.Parse(bad_dtype, "r0").ok());
  CHECK(cache.parsed() == 0);
  CHECK(cache.hits() == 0);
}

TEST_CASE("a declaration nobody holds any more is parsed again") {
  DeclarationCache cache;
  const DeclaredParameters decl = Declaration();
  {
    absl::StatusOr<std::shared_ptr<const ModelSpec>> a = cache.Parse(decl, "r0");
    REQUIRE(a.ok());
  }
  REQUIRE(cache.Parse(decl, "r1").ok());
  CHECK(cache.parsed() == 2);
  CHECK(cache.hits() == 0);
}

TEST_CASE("two trainer ranks registered through the registry's cache hold "
          "one list") {
  const MapOptions no_mapping{/*map_memory=*/false};
  Registry registry(absl::Hours(1), absl::Hours(1));
  TrainerRank r0(0, "policy"), r1(1, "policy");
  std::shared_ptr<const Participant> added[2];
  int k = 0;
  for (const TrainerRank* r : {&r0, &r1}) {
    absl::StatusOr<std::unique_ptr<Participant>> p = ParseSourceRegistration(
        r->Registration().source(), "node-t", no_mapping,
        registry.declaration_cache());
    INFO(p.status().ToString());
    REQUIRE(p.ok());
    absl::StatusOr<std::shared_ptr<const Participant>> a =
        registry.Add(*std::move(p), false);
    INFO(a.status().ToString());
    REQUIRE(a.ok());
    added[k++] = *a;
  }
  CHECK(added[0]->params == added[1]->params);
  CHECK(added[0]->params->size() == TestModel().size());
  CHECK(registry.declaration_cache()->parsed() == 1);
  CHECK(registry.declaration_cache()->hits() == 1);
}

}  // namespace
}  // namespace testing
}  // namespace ferry
