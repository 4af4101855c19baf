// ucx_channel_test's other process: connects a ucx channel (transports
// "tcp") to 127.0.0.1:<port>, whose worker address is ADDRESS (hex), and
// sends.
//   ucx_peer PORT ADDRESS send    buckets of seeds 200..219 (every fifth large),
//                         (the suite's recipes); exit 0 when flushed
//   ucx_peer PORT ADDRESS flood   large buckets of seed 300 until killed
// Exit codes: 1 connect failed, 2 a send failed, 3 the flush failed.
#include <cstdlib>
#include <string>

#include "absl/strings/escaping.h"
#include "tests/transport/transport_conformance.h"
#include "transport/ucx/ucx_channel.h"

int main(int argc, char** argv) {
  if (argc != 4) return 64;
  ferry::UcxChannelOptions options;
  options.transports = "tcp";
  absl::StatusOr<std::unique_ptr<ferry::Channel>> ch =
      ferry::ConnectUcxChannel("127.0.0.1", std::atoi(argv[1]),
                               absl::HexStringToBytes(argv[2]),
                               ferry::testing::TestDeadline(), options);
  if (!ch.ok()) return 1;
  const std::string mode = argv[3];
  if (mode == "send") {
    for (uint64_t seed = 200; seed < 220; ++seed) {
      ferry::testing::TestBucket b = seed % 5 == 0
                                         ? ferry::testing::LargeBucket(seed)
                                         : ferry::testing::RandomBucket(seed);
      if (!(*ch)->Send(b.SourceView(), ferry::testing::TestDeadline()).ok()) {
        return 2;
      }
    }
    return (*ch)->Flush(ferry::testing::TestDeadline()).ok() ? 0 : 3;
  }
  ferry::testing::TestBucket b = ferry::testing::LargeBucket(300);
  while ((*ch)->Send(b.SourceView(), ferry::testing::TestDeadline()).ok()) {
  }
  return 2;
}
