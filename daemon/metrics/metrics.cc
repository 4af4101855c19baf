#include "daemon/metrics/metrics.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "glog/logging.h"

namespace ferry {
namespace {

// Prometheus floats: integers without a fraction, +Inf spelled so.
std::string Number(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (std::isnan(v)) return "NaN";
  if (v == std::floor(v) && std::fabs(v) < 1e15) {
    return absl::StrCat(static_cast<int64_t>(v));
  }
  return absl::StrFormat("%.9g", v);
}

const char* TypeName(MetricFamily::Type t) {
  switch (t) {
    case MetricFamily::Type::kCounter:
      return "counter";
    case MetricFamily::Type::kGauge:
      return "gauge";
    case MetricFamily::Type::kHistogram:
      return "histogram";
  }
  return "untyped";
}

}  // namespace

std::string EscapeLabelValue(const std::string& v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

MetricFamily::MetricFamily(std::string name, std::string help, Type type,
                           std::vector<std::string> label_names,
                           std::vector<double> buckets)
    : name_(std::move(name)),
      help_(std::move(help)),
      type_(type),
      label_names_(std::move(label_names)),
      bounds_(std::move(buckets)) {}

MetricFamily::Series& MetricFamily::SeriesLocked(const LabelValues& labels) {
  // A wrong label count is a bug in ferryd, not input: keep serving.
  DCHECK_EQ(labels.size(), label_names_.size()) << name_;
  Series& s = series_[labels];
  if (type_ == Type::kHistogram && s.buckets.empty()) {
    s.buckets.assign(bounds_.size(), 0);
  }
  return s;
}

void MetricFamily::Add(const LabelValues& labels, double v) {
  absl::MutexLock lock(&mu_);
  SeriesLocked(labels).value += v;
}

void MetricFamily::Set(const LabelValues& labels, double v) {
  absl::MutexLock lock(&mu_);
  SeriesLocked(labels).value = v;
}

void MetricFamily::Observe(const LabelValues& labels, double v) {
  absl::MutexLock lock(&mu_);
  Series& s = SeriesLocked(labels);
  s.value += v;
  ++s.count;
  const auto at = std::lower_bound(bounds_.begin(), bounds_.end(), v);
  if (at != bounds_.end()) ++s.buckets[at - bounds_.begin()];
}

void MetricFamily::Clear() {
  absl::MutexLock lock(&mu_);
  series_.clear();
}

double MetricFamily::Value(const LabelValues& labels) const {
  absl::MutexLock lock(&mu_);
  const auto it = series_.find(labels);
  return it == series_.end() ? 0 : it->second.value;
}

std::string MetricFamily::LabelText(const LabelValues& values,
                                    const std::string& extra_name,
                                    const std::string& extra_value) const {
  std::string out;
  for (size_t i = 0; i < label_names_.size() && i < values.size(); ++i) {
    absl::StrAppend(&out, out.empty() ? "" : ",", label_names_[i], "=\"",
                    EscapeLabelValue(values[i]), "\"");
  }
  if (!extra_name.empty()) {
    absl::StrAppend(&out, out.empty() ? "" : ",", extra_name, "=\"",
                    extra_value, "\"");
  }
  return out.empty() ? "" : absl::StrCat("{", out, "}");
}

void MetricFamily::Render(std::string* out) const {
  absl::StrAppend(out, "# HELP ", name_, " ", help_, "\n# TYPE ", name_, " ",
                  TypeName(type_), "\n");
  absl::MutexLock lock(&mu_);
  for (const auto& [labels, s] : series_) {
    if (type_ != Type::kHistogram) {
      absl::StrAppend(out, name_, LabelText(labels, "", ""), " ",
                      Number(s.value), "\n");
      continue;
    }
    uint64_t cumulative = 0;
    for (size_t b = 0; b < bounds_.size(); ++b) {
      cumulative += s.buckets[b];
      absl::StrAppend(out, name_, "_bucket",
                      LabelText(labels, "le", Number(bounds_[b])), " ",
                      cumulative, "\n");
    }
    absl::StrAppend(out, name_, "_bucket", LabelText(labels, "le", "+Inf"),
                    " ", s.count, "\n");
    absl::StrAppend(out, name_, "_sum", LabelText(labels, "", ""), " ",
                    Number(s.value), "\n");
    absl::StrAppend(out, name_, "_count", LabelText(labels, "", ""), " ",
                    s.count, "\n");
  }
}

MetricFamily* MetricRegistry::Counter(const std::string& name,
                                      const std::string& help,
                                      std::vector<std::string> labels) {
  families_.push_back(std::make_unique<MetricFamily>(
      name, help, MetricFamily::Type::kCounter, std::move(labels)));
  return families_.back().get();
}

MetricFamily* MetricRegistry::Gauge(const std::string& name,
                                    const std::string& help,
                                    std::vector<std::string> labels) {
  families_.push_back(std::make_unique<MetricFamily>(
      name, help, MetricFamily::Type::kGauge, std::move(labels)));
  return families_.back().get();
}

MetricFamily* MetricRegistry::Histogram(const std::string& name,
                                        const std::string& help,
                                        std::vector<std::string> labels,
                                        std::vector<double> buckets) {
  std::sort(buckets.begin(), buckets.end());
  families_.push_back(std::make_unique<MetricFamily>(
      name, help, MetricFamily::Type::kHistogram, std::move(labels),
      std::move(buckets)));
  return families_.back().get();
}

std::string MetricRegistry::Render() const {
  std::string out;
  for (const auto& f : families_) f->Render(&out);
  return out;
}

}  // namespace ferry
