#include "tests/models/layout_checks.h"

#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"

namespace ferry {
namespace {

std::string Where(const ModelSpec& model, const RankLayout& rank,
                  const Piece& piece) {
  return absl::StrCat("rank ", rank.rank, " param ",
                      model.params[piece.param].name, " box ",
                      BoxToString(piece.box));
}

// Checks one rank; appends each piece's box to `boxes` by parameter.
std::string CheckRank(const ModelSpec& model, const RankLayout& rank,
                      std::vector<std::set<Box>>* boxes) {
  std::vector<std::pair<int64_t, int64_t>> used;  // byte ranges, buffer 0
  for (const Piece& piece : rank.pieces) {
    if (piece.param < 0 || piece.param >= (int32_t)model.params.size()) {
      return absl::StrCat("rank ", rank.rank, " piece of param ", piece.param);
    }
    const ParamSpec& p = model.params[piece.param];
    const std::string where = Where(model, rank, piece);
    if (!ValidateBoxInShape(piece.box, p.shape).ok()) {
      return where + ": box outside the parameter " + DimsToString(p.shape);
    }
    const int64_t block = BlockElems(p.dtype);
    if (!piece.box.offset.empty() && (piece.box.offset.back() % block != 0 ||
                                      piece.box.extent.back() % block != 0)) {
      return where + ": splits a quantization block";
    }
    auto end = PieceEndByte(piece, p.dtype);
    if (!end.ok()) return where + ": " + std::string(end.status().message());
    if (piece.buffer >= rank.buffer_bytes.size() ||
        *end > rank.buffer_bytes[piece.buffer] || piece.byte_offset < 0) {
      return absl::StrCat(where, ": bytes [", piece.byte_offset, ", ", *end,
                          ") outside buffer ", piece.buffer);
    }
    const int64_t bytes =
        Volume(StorageBox(piece.box, p.dtype)) * UnitBytes(p.dtype);
    if (bytes > 0 && *end - piece.byte_offset != bytes) {
      return where + ": not contiguous";
    }
    if (bytes > 0) used.emplace_back(piece.byte_offset, *end);
    (*boxes)[piece.param].insert(piece.box);
  }
  std::sort(used.begin(), used.end());
  for (size_t i = 1; i < used.size(); ++i) {
    if (used[i].first < used[i - 1].second) {
      return absl::StrCat("rank ", rank.rank, ": pieces share bytes at ",
                          used[i].first);
    }
  }
  return "";
}

}  // namespace

std::string CheckTiling(const ModelSpec& model,
                        const std::vector<RankLayout>& ranks) {
  std::vector<std::set<Box>> boxes(model.params.size());
  for (const RankLayout& rank : ranks) {
    std::string problem = CheckRank(model, rank, &boxes);
    if (!problem.empty()) return problem;
  }
  for (size_t i = 0; i < model.params.size(); ++i) {
    const ParamSpec& p = model.params[i];
    const std::vector<Box> distinct(boxes[i].begin(), boxes[i].end());
    int64_t volume = 0;
    for (size_t a = 0; a < distinct.size(); ++a) {
      volume += Volume(distinct[a]);
      for (size_t b = a + 1; b < distinct.size(); ++b) {
        if (Overlaps(distinct[a], distinct[b])) {
          return absl::StrCat(p.name, ": boxes ", BoxToString(distinct[a]),
                              " and ", BoxToString(distinct[b]), " overlap");
        }
      }
    }
    if (volume != Volume(p.shape)) {
      return absl::StrCat(p.name, ": pieces cover ", volume, " of ",
                          Volume(p.shape), " elements (", distinct.size(),
                          " distinct boxes)");
    }
  }
  return "";
}

}  // namespace ferry
