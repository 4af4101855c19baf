#include "transport/shared_memory.h"

#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <string>

namespace ferry {
namespace {

std::string ShmPath(const std::string& name) { return "/dev/shm" + name; }

bool Exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

// Runs `child` in a forked process; returns its exit code (or 128 +
// signal). The child must not touch Catch2: it reports through the code.
template <typename Fn>
int RunInChild(Fn child) {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(child());
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

TEST_CASE("a created region is /dev/shm/<name>, mode 0600, of the size asked") {
  absl::StatusOr<SharedMemoryRegion> r =
      SharedMemoryRegion::Create("test/with spaces", 12345);
  REQUIRE(r.ok());
  CHECK(r->size() == 12345);
  CHECK(r->owner());
  CHECK(r->name().rfind("/ferry-test_with_spaces-", 0) == 0);
  struct stat st;
  REQUIRE(::stat(ShmPath(r->name()).c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  CHECK(st.st_size == 12345);
  std::memset(r->data(), 0x5A, 12345);  // writable end to end
  CHECK(r->data()[12344] == 0x5A);
}

TEST_CASE("a region is shared both ways with a forked process") {
  absl::StatusOr<SharedMemoryRegion> r =
      SharedMemoryRegion::Create("fork", 1 << 20);
  REQUIRE(r.ok());
  for (int i = 0; i < (1 << 20); ++i) r->data()[i] = static_cast<uint8_t>(i);
  const std::string name = r->name();
  const int code = RunInChild([&name]() {
    absl::StatusOr<SharedMemoryRegion> child =
        SharedMemoryRegion::Open(name, 1 << 20);
    if (!child.ok()) return 1;
    if (child->owner()) return 2;
    for (int i = 0; i < (1 << 20); ++i) {
      if (child->data()[i] != static_cast<uint8_t>(i)) return 3;
    }
    for (int i = 0; i < (1 << 20); ++i) {
      child->data()[i] = static_cast<uint8_t>(255 - i);
    }
    return 0;  // the child's region unmaps without unlinking
  });
  REQUIRE(code == 0);
  for (int i = 0; i < (1 << 20); i += 4099) {
    INFO("byte " << i);
    CHECK(r->data()[i] == static_cast<uint8_t>(255 - i));
  }
  CHECK(Exists(ShmPath(name)));  // the child did not unlink it
}

TEST_CASE("opening more bytes than the region holds is INVALID_ARGUMENT") {
  absl::StatusOr<SharedMemoryRegion> r =
      SharedMemoryRegion::Create("small", 4096);
  REQUIRE(r.ok());
  absl::StatusOr<SharedMemoryRegion> big =
      SharedMemoryRegion::Open(r->name(), 4097);
  INFO(big.status().ToString());
  CHECK(absl::IsInvalidArgument(big.status()));
  CHECK(big.status().message().find(r->name()) != std::string::npos);
  CHECK(big.status().message().find("4096") != std::string::npos);
  // A prefix is fine.
  CHECK(SharedMemoryRegion::Open(r->name(), 100).ok());
}

TEST_CASE("bad names and sizes are refused, missing regions are NOT_FOUND") {
  CHECK(absl::IsInvalidArgument(SharedMemoryRegion::Create("x", 0).status()));
  CHECK(absl::IsInvalidArgument(SharedMemoryRegion::Create("x", -1).status()));
  CHECK(absl::IsInvalidArgument(
      SharedMemoryRegion::Open("../etc/passwd", 10).status()));
  CHECK(absl::IsInvalidArgument(
      SharedMemoryRegion::Open("/a/b", 10).status()));
  const absl::Status missing =
      SharedMemoryRegion::Open("/ferry-no-such-region-xyz", 10).status();
  INFO(missing.ToString());
  CHECK(absl::IsNotFound(missing));
  CHECK(missing.message().find("shm_open(/ferry-no-such-region-xyz)") !=
        std::string::npos);
}

TEST_CASE("the creator unlinks on destruction; an opener does not") {
  std::string name;
  {
    absl::StatusOr<SharedMemoryRegion> r =
        SharedMemoryRegion::Create("dtor", 4096);
    REQUIRE(r.ok());
    name = r->name();
    {
      absl::StatusOr<SharedMemoryRegion> other =
          SharedMemoryRegion::Open(name, 4096);
      REQUIRE(other.ok());
    }
    CHECK(Exists(ShmPath(name)));
  }
  CHECK_FALSE(Exists(ShmPath(name)));
  CHECK(absl::IsNotFound(SharedMemoryRegion::Open(name, 4096).status()));
}

TEST_CASE("Unlink removes the name but keeps the mapping") {
  absl::StatusOr<SharedMemoryRegion> r =
      SharedMemoryRegion::Create("unlink", 4096);
  REQUIRE(r.ok());
  absl::StatusOr<SharedMemoryRegion> other =
      SharedMemoryRegion::Open(r->name(), 4096);
  REQUIRE(other.ok());
  REQUIRE(r->Unlink().ok());
  CHECK_FALSE(Exists(ShmPath(r->name())));
  CHECK(r->Unlink().ok());  // idempotent
  r->data()[10] = 42;
  CHECK(other->data()[10] == 42);
}

TEST_CASE("a moved region owns the mapping once") {
  absl::StatusOr<SharedMemoryRegion> r =
      SharedMemoryRegion::Create("move", 4096);
  REQUIRE(r.ok());
  const std::string name = r->name();
  SharedMemoryRegion a = *std::move(r);
  SharedMemoryRegion b = std::move(a);
  CHECK(a.data() == nullptr);  // NOLINT: checking the moved-from state
  CHECK(b.data() != nullptr);
  b.data()[0] = 1;
  absl::StatusOr<SharedMemoryRegion> c =
      SharedMemoryRegion::Create("move2", 4096);
  REQUIRE(c.ok());
  const std::string name2 = c->name();
  b = *std::move(c);  // releases (and unlinks) the first region
  CHECK_FALSE(Exists(ShmPath(name)));
  CHECK(Exists(ShmPath(name2)));
}

TEST_CASE("a memfd is mapped by another process through /proc/<pid>/fd") {
  absl::StatusOr<SharedMemoryRegion> r = SharedMemoryRegion::CreateMemfd(8192);
  REQUIRE(r.ok());
  CHECK(r->name().rfind("/proc/" + std::to_string(::getpid()) + "/fd/", 0) ==
        0);
  std::memset(r->data(), 7, 8192);
  const std::string path = r->name();
  const int code = RunInChild([&path]() {
    absl::StatusOr<SharedMemoryRegion> child =
        SharedMemoryRegion::OpenByPath(path, 8192);
    if (!child.ok()) return 1;
    if (child->data()[8191] != 7) return 2;
    child->data()[100] = 99;
    // Larger than the memfd: refused, not mapped past its end.
    if (!absl::IsInvalidArgument(
            SharedMemoryRegion::OpenByPath(path, 8193).status())) {
      return 3;
    }
    return 0;
  });
  CHECK(code == 0);
  CHECK(r->data()[100] == 99);
}

TEST_CASE("OpenByPath accepts only sealed memfds under /proc/<pid>/fd") {
  CHECK(absl::IsInvalidArgument(
      SharedMemoryRegion::OpenByPath("/etc/passwd", 1).status()));
  CHECK(absl::IsInvalidArgument(
      SharedMemoryRegion::OpenByPath("/proc/1/fd/../../etc", 1).status()));
  // A disk file behind a proc fd path.
  char tmpl[] = "/tmp/ferry-shm-test-XXXXXX";
  const int file = ::mkstemp(tmpl);
  REQUIRE(file >= 0);
  ::unlink(tmpl);
  REQUIRE(::ftruncate(file, 4096) == 0);
  const absl::Status disk =
      SharedMemoryRegion::OpenByPath(
          "/proc/self/fd/" + std::to_string(file), 4096)
          .status();
  INFO(disk.ToString());
  CHECK(absl::IsInvalidArgument(disk));
  ::close(file);
  // A memfd a client could still shrink under the daemon.
  const int unsealed = ::memfd_create("unsealed", MFD_CLOEXEC);
  REQUIRE(unsealed >= 0);
  REQUIRE(::ftruncate(unsealed, 4096) == 0);
  const absl::Status shrinkable =
      SharedMemoryRegion::OpenByPath(
          "/proc/self/fd/" + std::to_string(unsealed), 4096)
          .status();
  INFO(shrinkable.ToString());
  CHECK(absl::IsInvalidArgument(shrinkable));
  CHECK(shrinkable.message().find("sealed") != std::string::npos);
  ::close(unsealed);
}

}  // namespace
}  // namespace ferry
