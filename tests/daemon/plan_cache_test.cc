// BuildStreamPlan (daemon/plans/plan_cache.h) on registrations parsed as
// RegistryService parses them (memory not mapped): replicas that register
// the same engine tables share one resolution (and one copy of each table:
// table_interner.h), each keeps its own nodes in the plan, an instance with
// other tables gets its own, and the model is the sources' declared
// parameters, sorted by name.
#include "daemon/plans/plan_cache.h"

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "daemon/registry/registration_parser.h"
#include "daemon/registry/registry.h"
#include "daemon/registry/table_interner.h"
#include "tests/daemon/daemon_test_support.h"

namespace ferry {
namespace testing {
namespace {

void Add(Registry& registry, absl::StatusOr<std::unique_ptr<Participant>> p) {
  INFO(p.status().ToString());
  REQUIRE(p.ok());
  absl::StatusOr<std::shared_ptr<const Participant>> added =
      registry.Add(*std::move(p), false);
  INFO(added.status().ToString());
  REQUIRE(added.ok());
}

TEST_CASE("replicas with the same engine tables share one resolution; each "
          "keeps its own nodes") {
  const MapOptions no_mapping{/*map_memory=*/false};
  Registry registry(absl::Hours(1), absl::Hours(1));
  std::vector<std::unique_ptr<TrainerRank>> trainers;
  for (int r = 0; r < 2; ++r) {
    trainers.push_back(std::make_unique<TrainerRank>(r, "policy"));
    Add(registry, ParseSourceRegistration(trainers.back()->Registration().source(),
                                          "node-t", no_mapping));
  }
  // a and b: TP4, the same tables, on different nodes; c: TP2.
  std::vector<std::unique_ptr<EngineRank>> engines;
  for (const auto& [instance, node, tp] :
       std::vector<std::tuple<std::string, std::string, int>>{
           {"a", "node-a", 4}, {"b", "node-b", 4}, {"c", "node-c", 2}}) {
    for (int r = 0; r < tp; ++r) {
      engines.push_back(std::make_unique<EngineRank>(instance, r, "policy"));
      engines.back()->tp_size = tp;
      Add(registry,
          ParseDestinationRegistration(
              engines.back()->Registration().destination(), node, no_mapping));
    }
  }
  absl::StatusOr<Registry::StreamSnapshot> snapshot = registry.Snapshot("policy");
  REQUIRE(snapshot.ok());
  std::shared_ptr<const StreamPlan> sp = BuildStreamPlan(*snapshot);
  REQUIRE(sp != nullptr);
  INFO(sp->source_error);
  REQUIRE(sp->source_error.empty());
  REQUIRE(sp->instances.size() == 3);
  for (const PlannedInstance& i : sp->instances) {
    INFO(i.id << ": " << i.error);
    CHECK(i.error.empty());
  }
  const PlannedInstance& a = sp->instances[sp->FindInstance("a")];
  const PlannedInstance& b = sp->instances[sp->FindInstance("b")];
  const PlannedInstance& c = sp->instances[sp->FindInstance("c")];
  CHECK(a.resolved != nullptr);
  CHECK(a.resolved == b.resolved);  // one resolution for both
  CHECK(a.layout == b.layout);
  CHECK(c.resolved != a.resolved);
  // Equal tables are held once: rank r of b is rank r of a's table.
  REQUIRE(a.ranks.size() == 4);
  REQUIRE(b.ranks.size() == 4);
  for (size_t r = 0; r < 4; ++r) {
    CHECK(a.ranks[r]->engine_params == b.ranks[r]->engine_params);
  }
  CHECK(c.ranks[0]->engine_params != a.ranks[0]->engine_params);
  CHECK(*c.ranks[0]->engine_params != *a.ranks[0]->engine_params);
  // The fused qkv's parts, which every rank of every instance declares,
  // are held once, TP4 and TP2 alike (c's tables are not a's); each
  // registration parsed its own list.
  auto qkv_parts = [](const PlannedInstance& i, size_t r) -> const FusedParts& {
    for (const EngineParam& p : *i.ranks[r]->engine_params) {
      if (!p.parts.empty()) return p.parts;
    }
    FAIL("no fused parameter on rank " << r << " of " << i.id);
    static const FusedParts none;
    return none;
  };
  REQUIRE(qkv_parts(a, 0).size() == 3);
  for (const PlannedInstance* i : {&a, &b, &c}) {
    for (size_t r = 0; r < i->ranks.size(); ++r) {
      INFO(i->id << " rank " << r);
      CHECK(qkv_parts(*i, r).SharesWith(qkv_parts(a, 0)));
    }
  }
  // The two trainer ranks declared the same model: one list.
  REQUIRE(snapshot->sources.size() == 2);
  CHECK(snapshot->sources[0]->params == snapshot->sources[1]->params);
  CHECK(snapshot->sources[0]->params->size() == TestModel().size());
  // Each instance's routes end on its own node, the shared layout's nodes
  // notwithstanding (it carries a's).
  for (const PlannedInstance* i : {&a, &b, &c}) {
    const std::string node = "node-" + i->id;
    for (const InstancePlan* plan :
         {&sp->plan.instances[i->plan_index], &sp->DirectPlan(i->plan_index)}) {
      const InstancePlan& ip = *plan;
      REQUIRE(!ip.routes.empty());
      for (const Route& route : ip.routes) {
        INFO(i->id << " route " << route.src_node << " -> " << route.dst_node);
        CHECK(route.dst_node == node);
      }
    }
  }
  // The model: every parameter the sources declare, sorted by name.
  REQUIRE(sp->model.params.size() == TestModel().size());
  CHECK(std::is_sorted(sp->model.params.begin(), sp->model.params.end(),
                       [](const ParamSpec& x, const ParamSpec& y) {
                         return x.name < y.name;
                       }));
  // The registry hands it over in that order already (sorted once when
  // the world completed), so a plan does not sort 140,000 names again.
  REQUIRE(snapshot->declared_model != nullptr);
  CHECK(std::is_sorted(snapshot->declared_model->begin(),
                       snapshot->declared_model->end(),
                       [](const ParamSpec& x, const ParamSpec& y) {
                         return x.name < y.name;
                       }));
}

// Two trainer ranks of "policy", each declaring `extra` more parameters
// (without pieces) than the test model, and instances added later.
struct Stream {
  explicit Stream(int extra) {
    for (int r = 0; r < 2; ++r) {
      trainers.push_back(std::make_unique<TrainerRank>(r, "policy"));
      v1::SourceRegistration s = trainers.back()->Registration().source();
      for (int k = 0; k < extra; ++k) {
        v1::ParameterSpec* p = s.add_parameters();
        p->set_name("aa.extra." + std::to_string(k));
        p->set_dtype(v1::DTYPE_F32);
        p->add_shape(4);
      }
      Add(registry, ParseSourceRegistration(s, "node-t", no_mapping));
    }
  }
  void AddInstance(const std::string& id, int tp) {
    for (int r = 0; r < tp; ++r) {
      engines.push_back(std::make_unique<EngineRank>(id, r, "policy"));
      engines.back()->tp_size = tp;
      Add(registry, ParseDestinationRegistration(
                        engines.back()->Registration().destination(),
                        "node-" + id, no_mapping));
    }
  }
  Registry::StreamSnapshot Snapshot() {
    absl::StatusOr<Registry::StreamSnapshot> s = registry.Snapshot("policy");
    REQUIRE(s.ok());
    return *s;
  }
  const MapOptions no_mapping{/*map_memory=*/false};
  Registry registry{absl::Hours(1), absl::Hours(1)};
  std::vector<std::unique_ptr<TrainerRank>> trainers;
  std::vector<std::unique_ptr<EngineRank>> engines;
};

const PlannedInstance& Instance(const StreamPlan& sp, const std::string& id) {
  const int32_t k = sp.FindInstance(id);
  REQUIRE(k >= 0);
  INFO(sp.instances[k].error);
  REQUIRE(sp.instances[k].error.empty());
  return sp.instances[k];
}

TEST_CASE("a re-plan resolves only the tables it brings, when the model is "
          "the same; its plan is the plan made from scratch") {
  Stream stream(/*extra=*/0);
  stream.AddInstance("a", 4);
  stream.AddInstance("c", 2);
  std::shared_ptr<const StreamPlan> before = BuildStreamPlan(stream.Snapshot());
  REQUIRE(before->source_error.empty());
  // b joins with a's tables.
  stream.AddInstance("b", 4);
  const Registry::StreamSnapshot snapshot = stream.Snapshot();
  std::shared_ptr<const StreamPlan> after =
      BuildStreamPlan(snapshot, before.get());
  std::shared_ptr<const StreamPlan> scratch = BuildStreamPlan(snapshot);
  REQUIRE(after->source_error.empty());
  CHECK(Instance(*after, "a").resolved == Instance(*before, "a").resolved);
  CHECK(Instance(*after, "b").resolved == Instance(*before, "a").resolved);
  CHECK(Instance(*after, "c").resolved == Instance(*before, "c").resolved);
  CHECK(Instance(*after, "b").layout == Instance(*before, "a").layout);
  CHECK(Instance(*scratch, "b").resolved != Instance(*before, "a").resolved);
  CHECK(after->plan.digest == scratch->plan.digest);

  SECTION("another model: nothing is taken from the plan before") {
    // The same instances over a model with one more parameter, which
    // sorts first and moves every index.
    Stream other(/*extra=*/1);
    other.AddInstance("a", 4);
    other.AddInstance("b", 4);
    other.AddInstance("c", 2);
    const Registry::StreamSnapshot s = other.Snapshot();
    std::shared_ptr<const StreamPlan> replanned = BuildStreamPlan(s, after.get());
    std::shared_ptr<const StreamPlan> fresh = BuildStreamPlan(s);
    for (const char* id : {"a", "b", "c"}) {
      INFO(id);
      const int32_t k = replanned->FindInstance(id);
      REQUIRE(k >= 0);
      CHECK(replanned->instances[k].resolved !=
            Instance(*after, id).resolved);
      const int32_t f = fresh->FindInstance(id);
      REQUIRE(f >= 0);
      CHECK(replanned->instances[k].error == fresh->instances[f].error);
    }
    CHECK(replanned->source_error == fresh->source_error);
    CHECK(replanned->plan.digest == fresh->plan.digest);
  }
}

TEST_CASE("ranks that declare the same model share one list; a rank that "
          "declares a parameter otherwise is refused, naming both") {
  const MapOptions no_mapping{/*map_memory=*/false};
  Registry registry(absl::Hours(1), absl::Hours(1));
  TrainerRank r0(0, "policy"), r1(1, "policy");
  absl::StatusOr<std::unique_ptr<Participant>> p0 = ParseSourceRegistration(
      r0.Registration().source(), "node-t", no_mapping);
  REQUIRE(p0.ok());
  absl::StatusOr<std::shared_ptr<const Participant>> a =
      registry.Add(*std::move(p0), false);
  REQUIRE(a.ok());

  // Rank 1 with the first parameter's shape changed: refused, though a
  // list equal to rank 0's would be accepted on one lookup.
  v1::SourceRegistration bad = r1.Registration().source();
  REQUIRE(bad.parameters_size() > 0);
  const std::string name = bad.parameters(0).name();
  bad.mutable_parameters(0)->set_shape(0, bad.parameters(0).shape(0) * 2);
  absl::StatusOr<std::unique_ptr<Participant>> p1 =
      ParseSourceRegistration(bad, "node-t", no_mapping);
  INFO(p1.status().ToString());
  REQUIRE(p1.ok());  // a doubled shape still holds rank 1's pieces
  absl::StatusOr<std::shared_ptr<const Participant>> refused =
      registry.Add(*std::move(p1), false);
  INFO(refused.status().ToString());
  REQUIRE(absl::IsInvalidArgument(refused.status()));
  CHECK(refused.status().message().find("parameter " + name +
                                        " declared as") != std::string::npos);
  CHECK(refused.status().message().find("but rank 0 declares it as") !=
        std::string::npos);

  absl::StatusOr<std::unique_ptr<Participant>> good = ParseSourceRegistration(
      r1.Registration().source(), "node-t", no_mapping);
  REQUIRE(good.ok());
  absl::StatusOr<std::shared_ptr<const Participant>> b =
      registry.Add(*std::move(good), false);
  INFO(b.status().ToString());
  REQUIRE(b.ok());
  CHECK((*a)->params == (*b)->params);

  // Rank 1 taking its own place with the changed shape: still refused,
  // since rank 0 declares the parameter too (the list they share).
  absl::StatusOr<std::unique_ptr<Participant>> again =
      ParseSourceRegistration(bad, "node-t", no_mapping);
  REQUIRE(again.ok());
  CHECK(absl::IsInvalidArgument(
      registry.Add(*std::move(again), /*replace_existing=*/true).status()));

  // A one-rank stream: its rank alone declares the parameter, so taking
  // its own place with another shape changes the stream's model.
  v1::SourceRegistration solo = r0.Registration().source();
  solo.set_stream("solo");
  solo.set_world_size(1);
  absl::StatusOr<std::unique_ptr<Participant>> s1 =
      ParseSourceRegistration(solo, "node-t", no_mapping);
  REQUIRE(s1.ok());
  REQUIRE(registry.Add(*std::move(s1), false).ok());
  solo.mutable_parameters(0)->set_shape(0, solo.parameters(0).shape(0) * 2);
  absl::StatusOr<std::unique_ptr<Participant>> s2 =
      ParseSourceRegistration(solo, "node-t", no_mapping);
  REQUIRE(s2.ok());
  absl::StatusOr<std::shared_ptr<const Participant>> replaced =
      registry.Add(*std::move(s2), /*replace_existing=*/true);
  INFO(replaced.status().ToString());
  REQUIRE(replaced.ok());
  absl::StatusOr<Registry::StreamSnapshot> snap = registry.Snapshot("solo");
  REQUIRE(snap.ok());
  REQUIRE(snap->declared_model != nullptr);
  bool found = false;
  for (const ParamSpec& spec : *snap->declared_model) {
    if (spec.name != name) continue;
    found = true;
    CHECK(spec.shape[0] == solo.parameters(0).shape(0));
  }
  CHECK(found);
}

TEST_CASE("the table interner holds equal tables once, and only while "
          "someone does") {
  auto table = [](int64_t offset) {
    EngineParam p;
    p.name = "model.layers.0.self_attn.qkv_proj.weight";
    p.dtype = DType::kBF16;
    p.local_shape = {96, 64};
    p.byte_offset = offset;
    p.loader = LoaderKind::kFused;
    p.parts = {{"model.layers.0.self_attn.q_proj.weight", {}},
               {"model.layers.0.self_attn.k_proj.weight", {}},
               {"model.layers.0.self_attn.v_proj.weight", {}}};
    return std::make_shared<const EngineParams>(EngineParams{p});
  };
  TableInterner interner;
  auto a = interner.Intern(table(0));
  auto b = interner.Intern(table(0));  // equal, built apart
  auto c = interner.Intern(table(4096));  // another offset: another table
  CHECK(a == b);
  CHECK(a != c);
  CHECK(DigestOf(*a) != DigestOf(*c));
  CHECK(interner.Live() == 2);
  CHECK(interner.Intern(a) == a);  // held: found by its address

  // Parts lists: tables a and c (other offsets) declare equal parts, held
  // once after ShareParts; a list with another name is its own; a table
  // whose lists are all held comes back as itself.
  PartsInterner parts;
  auto shared_a = ShareParts(a, &parts);
  CHECK(shared_a == a);  // its lists were new: held from now on
  auto shared_c = ShareParts(c, &parts);
  REQUIRE(shared_c != c);  // a copy whose list is a's
  CHECK((*shared_c)[0].parts.SharesWith((*a)[0].parts));
  CHECK(*shared_c == *c);
  CHECK(ShareParts(shared_c, &parts) == shared_c);
  EngineParams other = *c;
  other[0].parts = {{"model.layers.1.self_attn.q_proj.weight", {}}};
  auto shared_other = ShareParts(
      std::make_shared<const EngineParams>(other), &parts);
  CHECK(!(*shared_other)[0].parts.SharesWith((*a)[0].parts));
  CHECK(parts.Live() == 2);
  shared_a.reset();
  shared_c.reset();
  shared_other.reset();
  CHECK(interner.Intern(nullptr) == nullptr);
  a.reset();
  CHECK(interner.Live() == 2);  // b still holds it
  b.reset();
  c.reset();
  CHECK(interner.Live() == 0);

  // Declaration lists the same way; a differing shape is another list.
  auto specs = [](int64_t rows) {
    return std::make_shared<const ParamSpecs>(ParamSpecs{
        {"model.embed_tokens.weight", DType::kBF16, {rows, 64}},
        {"lm_head.weight", DType::kBF16, {rows, 64}}});
  };
  DeclarationInterner declarations;
  auto d1 = declarations.Intern(specs(128));
  auto d2 = declarations.Intern(specs(128));
  auto d3 = declarations.Intern(specs(256));
  CHECK(d1 == d2);
  CHECK(d1 != d3);
  CHECK(declarations.Live() == 2);
}

}  // namespace
}  // namespace testing
}  // namespace ferry
