// The local backend against the conformance suite, with the pool at 1, 2
// and 4 threads (1: everything on the caller; 4: more threads than cores).
#include "transport/local/local_copy_engine.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <vector>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "tests/transport/transport_conformance.h"
#include "transport/memory_fault_guard.h"

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

TEST_CASE("local: a large copy into or out of memory that shrank fails, "
          "naming the address, and the process lives") {
  // 32 MiB: the engine streams its stores (and loads with SSE2) at this
  // size; a truncated mapping must still fault into RunGuarded, as the
  // memcpy path does, on whichever side shrank.
  const int64_t bytes = int64_t{32} << 20;
  const bool shrink_destination = GENERATE(true, false);
  INFO((shrink_destination ? "destination" : "source") << " shrank");
  const int fd = ::memfd_create("ferry-shrink-test", 0);
  REQUIRE(fd >= 0);
  REQUIRE(::ftruncate(fd, bytes) == 0);
  void* mapped =
      ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  REQUIRE(mapped != MAP_FAILED);
  auto* shm = static_cast<uint8_t*>(mapped);
  std::vector<uint8_t> heap(bytes, 7);
  REQUIRE(::ftruncate(fd, 0) == 0);  // every page of `shm` is gone
  LocalCopy c;
  c.unit_bytes = 16;
  c.extent = {bytes / 16};
  c.src = RegionView{shrink_destination ? heap.data() : shm, {1}};
  c.dst = RegionView{shrink_destination ? shm : heap.data(), {1}};
  auto engine = CreateLocalCopyEngine(2);
  const absl::Status s = engine->Run({c});
  INFO(s.ToString());
  CHECK(absl::IsFailedPrecondition(s));
  const std::optional<uintptr_t> at = FaultAddress(s);
  REQUIRE(at.has_value());
  CHECK(*at >= reinterpret_cast<uintptr_t>(shm));
  CHECK(*at < reinterpret_cast<uintptr_t>(shm) + bytes);
  ::munmap(mapped, bytes);
  ::close(fd);
}

}  // namespace
}  // namespace ferry
