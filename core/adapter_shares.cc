#include "core/adapter_shares.h"

#include <algorithm>
#include <map>
#include <unordered_map>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace ferry {

namespace {

// One base module the adapter targets: its two matrices and the base weight.
struct Module {
  std::string name;
  int32_t a = -1;
  int32_t b = -1;
  int32_t base = -1;
};

std::string LastComponent(const std::string& module) {
  const size_t dot = module.rfind('.');
  return dot == std::string::npos ? module : module.substr(dot + 1);
}

// The box one rank holds of a base weight, if it holds it as exactly one
// box written in place (direct pieces that tile their bounding box).
bool OneBox(const std::vector<Box>& boxes, Box* out) {
  if (boxes.empty()) return false;
  Box bb = boxes[0];
  int64_t volume = 0;
  for (const Box& b : boxes) {
    volume += Volume(b);
    for (size_t d = 0; d < bb.offset.size(); ++d) {
      const int64_t lo = std::min(bb.offset[d], b.offset[d]);
      const int64_t hi = std::max(bb.offset[d] + bb.extent[d],
                                  b.offset[d] + b.extent[d]);
      bb.offset[d] = lo;
      bb.extent[d] = hi - lo;
    }
  }
  if (volume != Volume(bb)) return false;
  *out = std::move(bb);
  return true;
}

}  // namespace

bool ParseLoraName(const std::string& name, std::string* module, bool* is_a) {
  std::string rest = name;
  constexpr char kPrefix[] = "base_model.model.";
  if (absl::StartsWith(rest, kPrefix)) rest = rest.substr(sizeof(kPrefix) - 1);
  for (const char* matrix : {".lora_A.", ".lora_B."}) {
    const size_t at = rest.rfind(matrix);
    if (at == std::string::npos || at == 0) continue;
    // "weight", or "<adapter>.weight" as PEFT's in-memory state dict has it.
    const std::string tail = rest.substr(at + 8);
    const size_t dot = tail.find('.');
    if (tail != "weight" &&
        (dot == std::string::npos || dot == 0 ||
         tail.substr(dot + 1) != "weight")) {
      continue;
    }
    *module = rest.substr(0, at);
    *is_a = matrix[6] == 'A';
    return true;
  }
  return false;
}

absl::StatusOr<AdapterSharePlan> PlanAdapterShares(
    const std::string& adapter_name, const std::vector<ParamSpec>& adapter,
    const ModelSpec& base, const std::vector<RankLayout>& base_ranks,
    const AdapterConfig& config) {
  const std::string who = absl::StrCat("adapter ", adapter_name);
  if (adapter.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": its stream declares no tensors"));
  }
  std::vector<Module> modules;
  std::map<std::string, size_t> by_name;
  std::vector<size_t> module_of(adapter.size());
  for (size_t i = 0; i < adapter.size(); ++i) {
    const ParamSpec& t = adapter[i];
    std::string module;
    bool is_a = false;
    if (!ParseLoraName(t.name, &module, &is_a)) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": tensor ", t.name, " is not a LoRA tensor (PEFT names end in "
          "lora_A.weight or lora_B.weight)"));
    }
    auto [it, added] = by_name.emplace(module, modules.size());
    if (added) {
      Module m;
      m.name = module;
      modules.push_back(std::move(m));
    }
    Module& m = modules[it->second];
    int32_t& slot = is_a ? m.a : m.b;
    if (slot >= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": tensors ", adapter[slot].name, " and ", t.name,
          " are both lora_", is_a ? "A" : "B", " of module ", module));
    }
    slot = static_cast<int32_t>(i);
    module_of[i] = it->second;
  }

  AdapterSharePlan out;
  int64_t r = config.rank;
  std::map<std::string, bool> targeted;
  for (const std::string& t : config.target_modules) targeted[t] = false;
  for (Module& m : modules) {
    const std::string base_name = absl::StrCat(m.name, ".weight");
    const ParamSpec& any = adapter[m.a >= 0 ? m.a : m.b];
    m.base = base.Find(base_name);
    if (m.base < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": tensor ", any.name, " targets base layer ", base_name,
          ", which the base model does not have"));
    }
    const Dims& w = base.params[m.base].shape;
    if (w.size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": tensor ", any.name, " targets ", base_name, " of shape ",
          DimsToString(w), "; LoRA is supported on 2-D weights only"));
    }
    if (m.a < 0 || m.b < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": module ", m.name, " has ", any.name, " but no lora_",
          m.a < 0 ? "A" : "B"));
    }
    if (!targeted.empty()) {
      auto t = targeted.find(LastComponent(m.name));
      if (t == targeted.end()) {
        std::vector<std::string> names;
        for (const auto& [n, seen] : targeted) names.push_back(n);
        return absl::InvalidArgumentError(absl::StrCat(
            who, ": tensor ", any.name, " targets module ",
            LastComponent(m.name), ", which target_modules [",
            absl::StrJoin(names, ", "), "] of its config does not name"));
      }
      t->second = true;
    }
    const ParamSpec& a = adapter[m.a];
    const ParamSpec& b = adapter[m.b];
    if (a.shape.size() != 2 || a.shape[1] != w[1]) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": tensor ", a.name, " has shape ", DimsToString(a.shape),
          "; lora_A of ", base_name, " ", DimsToString(w), " must be [r, ",
          w[1], "]"));
    }
    if (b.shape.size() != 2 || b.shape[0] != w[0]) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": tensor ", b.name, " has shape ", DimsToString(b.shape),
          "; lora_B of ", base_name, " ", DimsToString(w), " must be [",
          w[0], ", r]"));
    }
    if (a.shape[0] != b.shape[1]) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": tensors ", a.name, " and ", b.name, " disagree on the rank (",
          a.shape[0], " and ", b.shape[1], ")"));
    }
    const int64_t mine = a.shape[0];
    if (mine < 1 || mine > std::min(w[0], w[1])) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": tensor ", a.name, " has rank ", mine, ", which is ",
          mine < 1 ? "empty" : "larger than the smaller dim of ", base_name,
          mine < 1 ? "" : absl::StrCat(" ", DimsToString(w))));
    }
    if (r == 0) r = mine;
    if (mine != r) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": tensor ", a.name, " has rank ", mine, " but ",
          config.rank > 0 ? "the config's r is " : "other tensors have ",
          r));
    }
  }
  for (const auto& [name, seen] : targeted) {
    if (!seen) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": its config targets module ", name,
          " but no tensor of the adapter stream does"));
    }
  }
  out.rank = r;

  std::unordered_map<int32_t, size_t> wanted;  // base param -> module
  for (size_t i = 0; i < modules.size(); ++i) wanted[modules[i].base] = i;
  out.ranks.resize(base_ranks.size());
  for (size_t k = 0; k < base_ranks.size(); ++k) {
    std::vector<std::vector<Box>> boxes(modules.size());
    std::vector<bool> staged(modules.size(), false);
    for (const Piece& p : base_ranks[k].pieces) {
      auto it = wanted.find(p.param);
      if (it == wanted.end()) continue;
      if (p.buffer & kStagingBufferBit) {
        staged[it->second] = true;
      } else {
        boxes[it->second].push_back(p.box);
      }
    }
    for (size_t i = 0; i < adapter.size(); ++i) {
      const size_t m = module_of[i];
      const bool is_a = static_cast<int32_t>(i) == modules[m].a;
      AdapterShare s;
      s.tensor = static_cast<int32_t>(i);
      Box held;
      if (staged[m] || !OneBox(boxes[m], &held)) {
        s.whole = true;
        s.box = FullBox(adapter[i].shape);
      } else if (is_a) {  // [r, in]: the columns of the base box
        s.box.offset = {0, held.offset[1]};
        s.box.extent = {r, held.extent[1]};
      } else {  // [out, r]: the rows of the base box
        s.box.offset = {held.offset[0], 0};
        s.box.extent = {held.extent[0], r};
      }
      out.ranks[k].push_back(std::move(s));
    }
  }
  return out;
}

}  // namespace ferry
