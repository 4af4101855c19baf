// The local backend against the conformance suite, with the pool at 1, 2
// and 4 threads (1: everything on the caller; 4: more threads than cores).
#include "transport/local/local_copy_engine.h"

#include <algorithm>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "tests/transport/transport_conformance.h"

namespace ferry {
namespace {

FERRY_COPY_ENGINE_CONFORMANCE_TESTS("local, 1 thread",
                                    [] { return CreateLocalCopyEngine(1); })
FERRY_COPY_ENGINE_CONFORMANCE_TESTS("local, 2 threads",
                                    [] { return CreateLocalCopyEngine(2); })
FERRY_COPY_ENGINE_CONFORMANCE_TESTS("local, 4 threads",
                                    [] { return CreateLocalCopyEngine(4); })
FERRY_COPY_ENGINE_CONFORMANCE_TESTS("local, default threads",
                                    [] { return CreateLocalCopyEngine(); })

TEST_CASE("local: the default pool is min(4, cores) threads") {
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  const std::string expected =
      absl::StrCat("local(", std::max(1, std::min(4, cores)), " threads)");
  CHECK(CreateLocalCopyEngine()->name() == expected);
}

TEST_CASE("local: one huge box is shared by the workers and lands exactly") {
  // A single 32 MiB row shard: the engine must cut it, not hand it to one
  // thread; the oracle checks the cuts leave no gap or overlap. At 32 MiB
  // the engine writes with streaming stores (rows of 8 KiB, above
  // kStreamingMinRun), so this also checks that path lands every byte.
  auto engine = CreateLocalCopyEngine(4);
  testing::TestBucketBuilder builder(3);
  builder.AddRowShard(/*rows=*/4096, /*cols=*/16384, /*shards=*/4,
                      /*shard=*/1, /*unit=*/2);
  testing::TestBucket b = builder.Build(1, 3);
  testing::ExpectCopies(*engine, b, testing::HostMemory());
}

}  // namespace
}  // namespace ferry
