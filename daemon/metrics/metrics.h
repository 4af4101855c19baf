// Metrics: counters, gauges and histograms with labels, rendered in the
// Prometheus text exposition format (version 0.0.4). ferry's own small
// registry: the daemon needs a few dozen series, no client library.
//
// A family has a name, a help line and fixed label names; each distinct
// tuple of label values is one series. Label values must come from bounded
// sets (stream, instance, role, outcome: never a version number), so a
// family's size is bounded by what is registered with the daemon.
//
// Threading: every method is thread-safe (one mutex per family); Render
// takes each family's mutex in turn.
#ifndef FERRY_DAEMON_METRICS_METRICS_H_
#define FERRY_DAEMON_METRICS_METRICS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace ferry {

using LabelValues = std::vector<std::string>;

class MetricFamily {
 public:
  enum class Type { kCounter, kGauge, kHistogram };
  MetricFamily(std::string name, std::string help, Type type,
               std::vector<std::string> label_names,
               std::vector<double> buckets = {});

  // Counters: adds `v` (>= 0). Gauges: adds `v` (any sign).
  void Add(const LabelValues& labels, double v) ABSL_LOCKS_EXCLUDED(mu_);
  // Gauges: sets. REQUIRES: a gauge.
  void Set(const LabelValues& labels, double v) ABSL_LOCKS_EXCLUDED(mu_);
  // Histograms: one observation.
  void Observe(const LabelValues& labels, double v) ABSL_LOCKS_EXCLUDED(mu_);
  // Gauges computed at scrape time: drops every series first.
  void Clear() ABSL_LOCKS_EXCLUDED(mu_);
  // The value of a counter or gauge series (0 if absent); for tests.
  double Value(const LabelValues& labels) const ABSL_LOCKS_EXCLUDED(mu_);

  // # HELP, # TYPE and every series.
  void Render(std::string* out) const ABSL_LOCKS_EXCLUDED(mu_);
  const std::string& name() const { return name_; }

 private:
  struct Series {
    double value = 0;               // counter, gauge; histogram sum
    std::vector<uint64_t> buckets;  // histogram: per bucket, not cumulative
    uint64_t count = 0;             // histogram
  };
  Series& SeriesLocked(const LabelValues& labels) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string LabelText(const LabelValues& values, const std::string& extra_name,
                        const std::string& extra_value) const;

  const std::string name_, help_;
  const Type type_;
  const std::vector<std::string> label_names_;
  const std::vector<double> bounds_;  // histogram upper bounds, ascending
  mutable absl::Mutex mu_;
  std::map<LabelValues, Series> series_ ABSL_GUARDED_BY(mu_);
};

// The daemon's families, in registration order.
class MetricRegistry {
 public:
  MetricFamily* Counter(const std::string& name, const std::string& help,
                        std::vector<std::string> labels);
  MetricFamily* Gauge(const std::string& name, const std::string& help,
                      std::vector<std::string> labels);
  MetricFamily* Histogram(const std::string& name, const std::string& help,
                          std::vector<std::string> labels,
                          std::vector<double> buckets);
  std::string Render() const;

 private:
  // Families are registered at construction of their owner, before any
  // thread renders; the vector is not changed afterwards.
  std::vector<std::unique_ptr<MetricFamily>> families_;
};

// Escapes a label value for the text format (\\, \", \n).
std::string EscapeLabelValue(const std::string& v);

}  // namespace ferry

#endif  // FERRY_DAEMON_METRICS_METRICS_H_
