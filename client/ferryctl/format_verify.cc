// ferryctl verify's view of Inspection.VerifyInstance (format.h).
#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/ferryctl/format.h"
#include "core/explain.h"

namespace ferry {
namespace {

std::string BoxText(const v1::Box& box) {
  std::vector<std::string> dims;
  for (int d = 0; d < box.offset_size() && d < box.extent_size(); ++d) {
    dims.push_back(
        absl::StrCat(box.offset(d), ":", box.offset(d) + box.extent(d)));
  }
  return absl::StrCat("[", absl::StrJoin(dims, ", "), "]");
}

std::string Hex(uint64_t h) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

std::string Plural(int64_t n, const char* one, const char* many) {
  return absl::StrCat(n, " ", n == 1 ? one : many);
}

}  // namespace

std::string FormatVerify(const v1::VerifyInstanceResponse& r,
                         size_t max_names) {
  std::string out = absl::StrCat(
      "instance ", r.instance_id(), " at version ", r.version(), ": ",
      Plural(r.parameters_checked(), "parameter", "parameters"), ", ",
      HumanBytes(r.bytes_checked()), " checked, ",
      Plural(r.mismatches_size(), "mismatch", "mismatches"));
  if (r.bytes_unverifiable() > 0) {
    absl::StrAppend(&out, ", ", HumanBytes(r.bytes_unverifiable()),
                    " not verified");
  }
  if (!r.relayed_from().empty()) {
    absl::StrAppend(&out, " (relayed from ", r.relayed_from(), ")");
  }
  absl::StrAppend(&out, "\n");
  for (const v1::ChecksumMismatch& m : r.mismatches()) {
    absl::StrAppend(&out, "  MISMATCH ", m.parameter(), " tp rank ",
                    m.tp_rank(), " box ", BoxText(m.box()),
                    m.node().empty() ? "" : absl::StrCat(" on ", m.node()),
                    ": expected ", Hex(m.expected()), ", found ",
                    Hex(m.actual()), "\n");
  }
  // Not verified: one line per reason, with the parameters it covers.
  struct Group {
    int64_t bytes = 0;
    std::set<std::string> params;
    std::set<int32_t> ranks;
  };
  std::map<std::string, Group> by_reason;
  for (const v1::UnverifiedParameter& u : r.unverifiable()) {
    Group& g = by_reason[u.reason()];
    g.bytes += u.bytes();
    g.params.insert(u.parameter());
    g.ranks.insert(u.tp_rank());
  }
  for (const auto& [reason, g] : by_reason) {
    std::vector<std::string> names;
    for (const std::string& p : g.params) {
      if (max_names > 0 && names.size() == max_names) {
        names.push_back("...");
        break;
      }
      names.push_back(p);
    }
    absl::StrAppend(
        &out, "  ", HumanBytes(g.bytes), " of ",
        Plural(static_cast<int64_t>(g.params.size()), "parameter",
               "parameters"),
        " on ", Plural(static_cast<int64_t>(g.ranks.size()), "rank", "ranks"),
        " (", absl::StrJoin(names, ", "), "): ", reason, "\n");
  }
  return out;
}

}  // namespace ferry
