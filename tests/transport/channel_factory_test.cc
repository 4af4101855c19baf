// ChannelFactory (transport/channel_factory.h): the conformance suite over
// a "tcp" channel the factory listens for and connects (the token on the
// wire, as Peer.OpenChannel uses it), then what the factory itself
// decides: a connection with another token is refused, kinds it has no
// end for are INVALID_ARGUMENT, and the fabric without GPUs is
// FAILED_PRECONDITION. The backends' own cases are in their tests.
#include "transport/channel_factory.h"

#include <memory>
#include <string>
#include <utility>

#include "tests/transport/transport_conformance.h"

namespace ferry {
namespace {

using testing::ChannelPair;
using testing::TestDeadline;

ChannelFactory LoopbackFactory() {
  ChannelFactoryOptions options;
  options.listen_host = "127.0.0.1";
  return ChannelFactory(options);
}

// A "tcp" listener from the factory and one channel to it.
ChannelPair FactoryTcpPair() {
  const ChannelFactory factory = LoopbackFactory();
  const std::string token = "ferry-chan-factory-0001";
  ChannelOffer offer;
  absl::StatusOr<std::unique_ptr<ChannelListener>> listener =
      factory.Listen("tcp", token, "", &offer);
  REQUIRE(listener.ok());
  REQUIRE(offer.port == (*listener)->port());
  CHECK(offer.worker_address.empty());
  // connect() completes against the backlog, so no thread is needed.
  absl::StatusOr<std::unique_ptr<Channel>> sender =
      factory.Connect("tcp", "127.0.0.1", offer, token, TestDeadline());
  REQUIRE(sender.ok());
  absl::StatusOr<std::unique_ptr<Channel>> receiver =
      (*listener)->Accept(TestDeadline());
  REQUIRE(receiver.ok());
  return ChannelPair{*std::move(sender), *std::move(receiver)};
}

FERRY_CHANNEL_CONFORMANCE_TESTS("factory tcp", FactoryTcpPair)

TEST_CASE("factory: a tcp connection with another token is refused") {
  const ChannelFactory factory = LoopbackFactory();
  ChannelOffer offer;
  absl::StatusOr<std::unique_ptr<ChannelListener>> listener =
      factory.Listen("tcp", "right-token-0001", "", &offer);
  REQUIRE(listener.ok());
  absl::StatusOr<std::unique_ptr<Channel>> intruder = factory.Connect(
      "tcp", "127.0.0.1", offer, "wrong-token-0001", TestDeadline());
  REQUIRE(intruder.ok());
  const absl::Status refused = (*listener)->Accept(TestDeadline()).status();
  INFO(refused.ToString());
  CHECK(absl::IsPermissionDenied(refused));
}

TEST_CASE("factory: the host kinds are tcp and ucx; others have no ends") {
  CHECK(ChannelFactory::IsHostKind("tcp"));
  CHECK(ChannelFactory::IsHostKind("ucx"));
  CHECK_FALSE(ChannelFactory::IsHostKind("nccl"));
  CHECK_FALSE(ChannelFactory::IsHostKind(""));
  const ChannelFactory factory = LoopbackFactory();
  for (const char* kind : {"nccl", "rdma", ""}) {
    INFO(kind);
    ChannelOffer offer;
    CHECK(absl::IsInvalidArgument(
        factory.Listen(kind, "token", "", &offer).status()));
    offer.port = 1;
    CHECK(absl::IsInvalidArgument(
        factory.Connect(kind, "127.0.0.1", offer, "token", TestDeadline())
            .status()));
  }
}

TEST_CASE("factory: the fabric without GPUs is FAILED_PRECONDITION") {
  const ChannelFactory factory = LoopbackFactory();  // devices: null
  CHECK(absl::IsFailedPrecondition(factory.OfferFabric().status()));
  CHECK(absl::IsFailedPrecondition(
      factory.JoinFabric(0, "id", /*rank=*/0, /*epoch=*/1, TestDeadline())
          .status()));
}

}  // namespace
}  // namespace ferry
