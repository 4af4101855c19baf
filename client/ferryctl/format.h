// ferryctl's views: the daemon's Inspection answers as text a person reads
// at a glance. Pure functions of the responses, so tests can check them
// without a daemon; ferryctl.cc only fetches and prints.
#ifndef FERRY_CLIENT_FERRYCTL_FORMAT_H_
#define FERRY_CLIENT_FERRYCTL_FORMAT_H_

#include <cstdint>
#include <string>

#include "proto/ferry/v1/inspection.pb.h"

namespace ferry {

// One line per participant, sources then destinations per stream.
std::string FormatParticipants(const v1::ListParticipantsResponse& response);

// Per stream a header line and one line per instance.
std::string FormatStreams(const v1::ListStreamsResponse& response);

// `ferryctl adapters`: one line per adapter of each instance (only
// `instance` when not empty).
std::string FormatAdapters(const v1::ListStreamsResponse& response,
                           const std::string& instance);

// Totals first (like core/explain.h FormatExplanation), then one line per
// engine parameter and rank; at most `max_rows` of them unless 0 (all).
std::string FormatPlan(const v1::ExplainPlanResponse& response,
                       size_t max_rows);

// Role, uptime, devices, peers, problems.
std::string FormatHealth(const v1::GetHealthResponse& response);

// One line: "policy v3 [#####.....] 52%  912 MiB / 1.73 GiB  4.21 GB/s
// instances 1/2 committed  1.2s". `bar_width` characters of bar.
std::string FormatProgressLine(const v1::GetProgressResponse& progress,
                               int bar_width);

// A peer delivery, one line: "bootstrap b <- a v3 [####......] 40%  640 MiB
// / 1.60 GiB  3.10 GB/s  TRANSFER  0.2s".
std::string FormatDelivery(const v1::PeerDelivery& d, int bar_width);

// Lifecycle.UpdateConfig's answer: "key = value" per line, sorted.
std::string FormatConfig(const std::string& instance,
                         const google::protobuf::Map<std::string, std::string>&
                             options);

// Per instance: state, bytes, and the abort reason or ranks waited on.
std::string FormatProgressInstances(const v1::GetProgressResponse& progress);

// `ferryctl versions`: one row per version, newest first: state, duration
// (begin to settled, or so far), bytes, GB/s, instances committed and
// aborted, and for each aborted instance why.
std::string FormatVersions(const v1::ListVersionsResponse& response);

// ferryctl verify: "instance vllm-0 at version 3: 1234 parameters, 1.60 GiB
// checked, 0 mismatches", one line per mismatch (parameter, tp rank, box,
// node, expected and found checksums), then per reason the bytes not
// verified and up to `max_names` of their parameters (0: all).
std::string FormatVerify(const v1::VerifyInstanceResponse& response,
                         size_t max_names);

// "COMMITTED", "ABORTED (dirty)", ... without the enum prefix.
std::string InstanceStateName(const v1::InstanceStatus& status);
// How an InstanceStatus names what it is about: the instance, or for a LoRA
// adapter attached to one "<instance> adapter <name>" (not its internal id).
std::string InstanceLabel(const v1::InstanceStatus& status);

// "1.2s", "350ms", "2m05s".
std::string HumanDuration(int64_t ms);

}  // namespace ferry

#endif  // FERRY_CLIENT_FERRYCTL_FORMAT_H_
