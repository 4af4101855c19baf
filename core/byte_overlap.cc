#include "core/byte_overlap.h"

#include <algorithm>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "core/checked_math.h"

namespace ferry {
namespace {

// Dimensions of extent > 1, by stride (ascending; ties by dimension).
std::vector<size_t> SortedDims(const StridedLayout& l) {
  std::vector<size_t> dims;
  for (size_t d = 0; d < l.extent.size(); ++d) {
    if (l.extent[d] > 1) dims.push_back(d);
  }
  std::sort(dims.begin(), dims.end(), [&l](size_t a, size_t b) {
    return std::make_pair(l.stride[a], a) < std::make_pair(l.stride[b], b);
  });
  return dims;
}

bool Empty(const StridedLayout& l) {
  for (int64_t e : l.extent) {
    if (e == 0) return true;
  }
  return false;
}

// One byte past the last byte the layout touches. REQUIRES: no overflow
// (the caller validated the layout's end).
int64_t EndByte(const StridedLayout& l) {
  int64_t last = 0;
  for (size_t d = 0; d < l.extent.size(); ++d) {
    last += (l.extent[d] - 1) * l.stride[d];
  }
  return l.offset + (last + 1) * l.unit_bytes;
}

struct Run {
  int64_t begin;
  int64_t end;
  int32_t layout;
};

// Appends the contiguous runs of `l` (index `li`) to `runs`; false, with
// nothing appended, when there are more than `*budget` of them. Consumes
// the budget.
bool AppendRuns(const StridedLayout& l, int32_t li, int64_t* budget,
                std::vector<Run>* runs) {
  const std::vector<size_t> dims = SortedDims(l);
  // The innermost dimensions that are dense together make one run.
  int64_t run_units = 1;
  size_t k = 0;
  if (!dims.empty() && l.stride[dims[0]] == 1) {
    run_units = l.extent[dims[0]];
    k = 1;
    while (k < dims.size() && l.stride[dims[k]] == run_units) {
      if (!CheckedMul(run_units, l.extent[dims[k]], &run_units)) return false;
      ++k;
    }
  }
  const std::vector<size_t> outer(dims.begin() + k, dims.end());
  int64_t count = 1;
  for (size_t d : outer) {
    if (!CheckedMul(count, l.extent[d], &count) || count > *budget) {
      return false;
    }
  }
  if (count > *budget) return false;
  *budget -= count;
  const int64_t run_bytes = run_units * l.unit_bytes;
  std::vector<int64_t> index(outer.size(), 0);
  int64_t start = l.offset;  // bytes of the current run
  for (int64_t n = 0; n < count; ++n) {
    runs->push_back(Run{start, start + run_bytes, li});
    // Odometer over the outer dimensions, keeping `start` in step.
    for (size_t i = 0; i < outer.size(); ++i) {
      const size_t d = outer[i];
      const int64_t step = l.stride[d] * l.unit_bytes;
      if (++index[i] < l.extent[d]) {
        start += step;
        break;
      }
      start -= (l.extent[d] - 1) * step;
      index[i] = 0;
    }
  }
  return true;
}

struct Span {
  uint64_t key;
  int64_t begin;
  int64_t end;
  int32_t layout;
};

OverlapResult Pair(int32_t a, int32_t b, int64_t at) {
  OverlapResult r;
  r.first = std::min(a, b);
  r.second = std::max(a, b);
  r.at_byte = at;
  return r;
}

// Spans [first, last) of `spans` overlap one another in a chain: cut them
// into runs and look for two that overlap.
OverlapResult CheckCluster(const std::vector<StridedLayout>& layouts,
                           const std::vector<Span>& spans, size_t first,
                           size_t last, int64_t* budget) {
  std::vector<Run> runs;
  for (size_t i = first; i < last; ++i) {
    const int32_t li = spans[i].layout;
    if (!AppendRuns(layouts[li], li, budget, &runs)) {
      OverlapResult r = Pair(spans[first].layout, spans[first + 1].layout,
                             spans[first + 1].begin);
      r.budget_exhausted = true;
      return r;
    }
  }
  std::sort(runs.begin(), runs.end(), [](const Run& a, const Run& b) {
    return std::tie(a.begin, a.end, a.layout) <
           std::tie(b.begin, b.end, b.layout);
  });
  int64_t max_end = runs.front().end;
  int32_t max_layout = runs.front().layout;
  for (size_t i = 1; i < runs.size(); ++i) {
    const Run& r = runs[i];
    // The run that reaches furthest is of another layout whenever r starts
    // inside it: a layout's own runs are disjoint (SelfOverlapProblem).
    if (r.begin < max_end && r.layout != max_layout) {
      return Pair(max_layout, r.layout, r.begin);
    }
    if (r.end > max_end) {
      max_end = r.end;
      max_layout = r.layout;
    }
  }
  return OverlapResult();
}

}  // namespace

std::string SelfOverlapProblem(const StridedLayout& l) {
  if (Empty(l)) return "";
  int64_t span = 1;  // units the dimensions inside the current one reach
  for (size_t d : SortedDims(l)) {
    if (l.stride[d] == 0) {
      return absl::StrCat("stride 0 along dim ", d, " (extent ", l.extent[d],
                          ") puts several elements on one byte");
    }
    if (l.stride[d] < span) {
      return absl::StrCat("stride ", l.stride[d], " along dim ", d,
                          " is below the span ", span,
                          " of the dimensions inside it: two elements may "
                          "share a byte");
    }
    int64_t step;
    if (!CheckedMul(l.extent[d] - 1, l.stride[d], &step) ||
        !CheckedAdd(span, step, &span)) {
      return "strides overflow 64 bits";
    }
  }
  return "";
}

OverlapResult FindOverlap(const std::vector<StridedLayout>& layouts,
                          int64_t max_runs) {
  std::vector<Span> spans;
  spans.reserve(layouts.size());
  for (size_t i = 0; i < layouts.size(); ++i) {
    const StridedLayout& l = layouts[i];
    if (Empty(l)) continue;
    spans.push_back(
        Span{l.key, l.offset, EndByte(l), static_cast<int32_t>(i)});
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return std::tie(a.key, a.begin, a.end, a.layout) <
           std::tie(b.key, b.begin, b.end, b.layout);
  });
  int64_t budget = max_runs;
  size_t first = 0;
  while (first < spans.size()) {
    size_t last = first + 1;
    int64_t end = spans[first].end;
    while (last < spans.size() && spans[last].key == spans[first].key &&
           spans[last].begin < end) {
      end = std::max(end, spans[last].end);
      ++last;
    }
    if (last - first > 1) {
      OverlapResult r = CheckCluster(layouts, spans, first, last, &budget);
      if (r.found()) return r;
    }
    first = last;
  }
  return OverlapResult();
}

}  // namespace ferry
