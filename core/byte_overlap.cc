#include "core/byte_overlap.h"

#include <algorithm>
#include <tuple>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "core/checked_math.h"

namespace ferry {
namespace {

// Dimension indices, inline up to the ranks tensors have: validation asks
// for them once per piece, millions of times for a large model, and a heap
// allocation each time showed in the planning profile.
using DimList = absl::InlinedVector<size_t, 6>;

// Dimensions of extent > 1, by stride (ascending; ties by dimension).
DimList SortedDims(const StridedLayout& l) {
  DimList dims;
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
  const DimList dims = SortedDims(l);
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
  // The outer dimensions, innermost first, read through plain pointers:
  // the odometer below runs once per run, up to the budget (millions of
  // times), and under the sanitizers each container access is a call.
  const size_t outer = dims.size() - k;
  absl::InlinedVector<int64_t, 3 * 6> arrays(3 * outer, 0);
  int64_t* const extent = arrays.data();
  int64_t* const step = extent + outer;
  int64_t* const index = step + outer;
  int64_t count = 1;
  for (size_t i = 0; i < outer; ++i) {
    const size_t d = dims[k + i];
    extent[i] = l.extent[d];
    step[i] = l.stride[d] * l.unit_bytes;  // fits: the span was validated
    if (!CheckedMul(count, extent[i], &count) || count > *budget) {
      return false;
    }
  }
  if (count > *budget) return false;
  *budget -= count;
  const int64_t run_bytes = run_units * l.unit_bytes;
  const size_t first = runs->size();
  runs->resize(first + static_cast<size_t>(count));
  Run* out = runs->data() + first;
  int64_t start = l.offset;  // bytes of the current run
  for (int64_t n = 0; n < count; ++n) {
    out[n] = Run{start, start + run_bytes, li};
    // Odometer over the outer dimensions, keeping `start` in step.
    for (size_t i = 0; i < outer; ++i) {
      if (++index[i] < extent[i]) {
        start += step[i];
        break;
      }
      start -= (extent[i] - 1) * step[i];
      index[i] = 0;
    }
  }
  return true;
}

using Span = LayoutSpan;

// Sorts `spans` by `before` (key first). Keys are small integers
// (parameter indices, buffer indices) and most keys have one span, so a
// counting sort by key and a sort of each key's few spans is linear where
// one comparison sort of a rank's ~70,000 spans was not; the order is the
// same (`before` is a total order: layouts are distinct).
template <typename Before>
void SortSpans(std::vector<Span>& spans, const Before& before) {
  uint64_t max_key = 0;
  for (const Span& s : spans) max_key = std::max(max_key, s.key);
  if (max_key > 4 * spans.size() + 1024) {  // sparse keys: sort directly
    std::sort(spans.begin(), spans.end(), before);
    return;
  }
  std::vector<size_t> start(max_key + 2, 0);
  for (const Span& s : spans) ++start[s.key + 1];
  for (size_t k = 1; k < start.size(); ++k) start[k] += start[k - 1];
  std::vector<Span> sorted(spans.size());
  std::vector<size_t> next(start.begin(), start.end() - 1);
  for (const Span& s : spans) sorted[next[s.key]++] = s;
  for (size_t k = 0; k + 1 < start.size(); ++k) {
    if (start[k + 1] - start[k] > 1) {
      std::sort(sorted.begin() + start[k], sorted.begin() + start[k + 1],
                before);
    }
  }
  spans.swap(sorted);
}

OverlapResult Pair(int32_t a, int32_t b, int64_t at) {
  OverlapResult r;
  r.first = std::min(a, b);
  r.second = std::max(a, b);
  r.at_byte = at;
  return r;
}

// Spans [first, last) of `spans` overlap one another in a chain: cut them
// into runs and look for two that overlap.
OverlapResult CheckCluster(absl::FunctionRef<StridedLayout(int32_t)> layout_of,
                           const std::vector<Span>& spans, size_t first,
                           size_t last, int64_t* budget) {
  auto before = [](const Run& a, const Run& b) {
    if (a.begin != b.begin) return a.begin < b.begin;
    if (a.end != b.end) return a.end < b.end;
    return a.layout < b.layout;
  };
  std::vector<Run> runs;
  // Where each layout's runs start. A layout that passed SelfOverlapProblem
  // yields its runs in address order, so the cluster's runs are a few
  // sorted sequences: merged, not sorted, they cost a comparison per run
  // instead of log(runs) (a fuzzed layout of millions of runs spent tens
  // of seconds in the sort under the sanitizers).
  std::vector<size_t> bound = {0};
  bool in_order = true;
  for (size_t i = first; i < last; ++i) {
    const int32_t li = spans[i].layout;
    if (!AppendRuns(layout_of(li), li, budget, &runs)) {
      OverlapResult r = Pair(spans[first].layout, spans[first + 1].layout,
                             spans[first + 1].begin);
      r.budget_exhausted = true;
      return r;
    }
    in_order = in_order && std::is_sorted(runs.begin() + bound.back(),
                                          runs.end(), before);
    bound.push_back(runs.size());
  }
  if (!in_order) {
    std::sort(runs.begin(), runs.end(), before);
  } else {
    const size_t sequences = bound.size() - 1;
    for (size_t width = 1; width < sequences; width *= 2) {
      for (size_t lo = 0; lo + width < sequences; lo += 2 * width) {
        const size_t mid = lo + width;
        const size_t hi = std::min(lo + 2 * width, sequences);
        std::inplace_merge(runs.begin() + bound[lo], runs.begin() + bound[mid],
                           runs.begin() + bound[hi], before);
      }
    }
  }
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

std::optional<LayoutSpan> SpanOf(const StridedLayout& l, int32_t index) {
  if (Empty(l)) return std::nullopt;
  return LayoutSpan{l.key, l.offset, EndByte(l), index};
}

OverlapResult FindOverlap(const std::vector<StridedLayout>& layouts,
                          int64_t max_runs) {
  std::vector<Span> spans;
  spans.reserve(layouts.size());
  for (size_t i = 0; i < layouts.size(); ++i) {
    std::optional<Span> span = SpanOf(layouts[i], static_cast<int32_t>(i));
    if (span) spans.push_back(*span);
  }
  int64_t runs_left = max_runs;
  return FindOverlap(
      spans, [&layouts](int32_t i) { return layouts[i]; }, &runs_left);
}

OverlapResult FindOverlap(
    std::vector<LayoutSpan>& spans,
    absl::FunctionRef<StridedLayout(int32_t)> layout_of, int64_t* runs_left) {
  auto before = [](const Span& a, const Span& b) {
    return std::tie(a.key, a.begin, a.end, a.layout) <
           std::tie(b.key, b.begin, b.end, b.layout);
  };
  // A resolved layout lists its pieces mostly in buffer order already: one
  // pass to see that is much cheaper than the sort.
  if (!std::is_sorted(spans.begin(), spans.end(), before)) {
    SortSpans(spans, before);
  }
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
      OverlapResult r = CheckCluster(layout_of, spans, first, last, runs_left);
      if (r.found()) return r;
    }
    first = last;
  }
  return OverlapResult();
}

}  // namespace ferry
