// Wire registrations of synthetic models, built field by field (no client
// library in between), for tests and benchmarks that need very many
// parameters or pieces: the registry's lock scope and ExplainPlan's cost
// (tests/daemon/limits_test.cc, bench/daemon/control_bench.cc).
#ifndef FERRY_TESTS_SUPPORT_WIRE_REGISTRATIONS_H_
#define FERRY_TESTS_SUPPORT_WIRE_REGISTRATIONS_H_

#include <cstdint>
#include <string>

#include "proto/ferry/v1/registration.pb.h"
#include "transport/shared_memory.h"

namespace ferry {
namespace testing {

// Every parameter is F32 [2, kCols]: 64 bytes a row.
constexpr int64_t kCols = 16;

// "model.layers.<i/16>.p<i%16>.weight".
std::string ParamName(int i);

// Region 0: all of `m`.
v1::MemoryRegion Region(const SharedMemoryRegion& m);

// Source rank `rank` of 2: `params` parameters, the rank's row of each,
// parameter i at byte i * kCols * 4.
v1::RegisterSourceRequest Source(const std::string& stream, int rank,
                                 int params, const SharedMemoryRegion& m);

// An instance of one rank holding every parameter whole (explicit pieces).
v1::RegisterDestinationRequest Destination(const std::string& stream,
                                           const std::string& instance,
                                           int params,
                                           const SharedMemoryRegion& m);

// One parameter "wide.weight" F32 [2, pieces]: source rank `rank` of 2
// holds row `rank`; the destination holds it in one-column pieces
// (strided, interleaved in memory).
v1::RegisterSourceRequest WideSource(const std::string& stream, int rank,
                                     int pieces, const SharedMemoryRegion& m);
v1::RegisterDestinationRequest WideDestination(const std::string& stream,
                                               const std::string& instance,
                                               int pieces,
                                               const SharedMemoryRegion& m);

}  // namespace testing
}  // namespace ferry

#endif  // FERRY_TESTS_SUPPORT_WIRE_REGISTRATIONS_H_
