#include "daemon/transfer/route_sender.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "core/fp8_split.h"
#include "daemon/memory/memory_map.h"
#include "daemon/plans/fp8_quantizer.h"
#include "daemon/transfer/delta_routes.h"
#include "daemon/transfer/quantize_order.h"
#include "daemon/transfer/rail_stripe.h"
#include "daemon/transfer/route_calls.h"
#include "glog/logging.h"
#include "grpcpp/grpcpp.h"
#include "proto/grpc_status.h"

namespace ferry {
namespace {

// Routes this node sends for one instance at once (threads of Execute).
constexpr size_t kMaxRoutesAtOnce = 16;

// Ranks of this node a member's route lands in ("send" calls back this
// node's RunTransfer): expected in RouteMemory while Execute runs.
class ExpectedRanks {
 public:
  ExpectedRanks(RouteMemory* memory, const TransferJob& job,
                const std::string& node, const std::vector<RouteKey>& order)
      : memory_(memory) {
    const PlannedInstance& pi = job.plan->instances[job.instance];
    for (const RouteKey& key : order) {
      if (key.first == node || key.second != node) continue;
      for (size_t r = 0; r < pi.ranks.size(); ++r) {
        if (pi.ranks[r]->node != node || r >= job.destination.size()) {
          continue;
        }
        memory_->Expect(pi.ranks[r]->id, job.destination[r]);
        ids_.push_back(pi.ranks[r]->id);
      }
      break;
    }
  }
  ~ExpectedRanks() {
    for (const std::string& id : ids_) memory_->Unexpect(id);
  }
  ExpectedRanks(const ExpectedRanks&) = delete;
  ExpectedRanks& operator=(const ExpectedRanks&) = delete;

 private:
  RouteMemory* const memory_;
  std::vector<std::string> ids_;
};

}  // namespace

RouteSender::RouteSender(RouteOptions options, RouteMemory* memory)
    : options_(std::move(options)),
      memory_(memory),
      peers_(options_.credentials),
      router_(options_.engine, options_.devices),
      channels_(options_, &peers_),
      shadows_(options_.delta_shadow_bytes) {}

bool RouteSender::Handles(const TransferJob& job) const {
  return ReachesOtherNodes(job, options_.node);
}

absl::Status RouteSender::Execute(const TransferJob& job) {
  TransferProgress& progress = *job.progress;
  // The routes (transfer_routes.h), refused before any byte moves when
  // one cannot be carried.
  absl::StatusOr<NodeRoutes> built =
      BuildRoutes(job, options_.node, options_.timeout, [this] {
        absl::MutexLock lock(&mu_);
        return next_bucket_++;
      });
  if (!built.ok()) return built.status();
  const absl::Time deadline = absl::Now() + options_.timeout;
  progress.bytes_total.store(JobBytes(job));
  const ExpectedRanks expected(memory_, job, options_.node, built->order);
  // The addresses first, so a node that is gone fails the job before any
  // byte moves.
  absl::StatusOr<Addresses> addresses = AddressesOf(built->order);
  if (!addresses.ok()) return addresses.status();
  std::map<std::string, v1::ParticipantStaging> staging;
  absl::Status s = RunRoutes(*built, *addresses, deadline, progress, &staging);
  if (!s.ok()) return s;
  AddStagingHere(job, options_.node, &staging);
  // APPLY names the staging on the ranks' node.
  if (job.apply != nullptr) *job.apply = ApplyDetailsOf(job, staging);
  return absl::OkStatus();
}

absl::StatusOr<RouteSender::Addresses> RouteSender::AddressesOf(
    const std::vector<RouteKey>& order) const {
  Addresses addresses;
  auto resolve = [&](const std::string& n) -> absl::Status {
    if (addresses.count(n) > 0) return absl::OkStatus();
    const std::string a = options_.address_of ? options_.address_of(n) : "";
    if (a.empty()) {
      return absl::UnavailableError(
          absl::StrCat("node ", n, " is not a live member"));
    }
    addresses[n] = a;
    return absl::OkStatus();
  };
  for (const RouteKey& key : order) {
    if (key.first == options_.node && key.second == options_.node) continue;
    // The receiving node's (this one's too), and the sending node's.
    if (absl::Status s = resolve(key.second); !s.ok()) return s;
    if (key.first == options_.node) continue;
    if (absl::Status s = resolve(key.first); !s.ok()) return s;
  }
  return addresses;
}

absl::Status RouteSender::RunRoutes(
    NodeRoutes& routes, const Addresses& addresses, absl::Time deadline,
    TransferProgress& progress,
    std::map<std::string, v1::ParticipantStaging>* staging) {
  // Every route at once (a route is one channel between two nodes): those
  // another node carries are asked of it, all in flight together
  // (route_calls.h); those this node sends run on threads of this call.
  const std::vector<RouteKey>& order = routes.order;
  absl::Mutex results_mu;
  absl::Status first_error;
  std::atomic<bool> failed{false};
  // Another route failed: the job fails anyway, so the rest stop early.
  auto give_up = [&] { return failed.load() || progress.cancel.load(); };
  auto finish = [&](const RouteKey& key, absl::Status s,
                    const v1::RunTransferResponse& resp) {
    absl::MutexLock lock(&results_mu);
    if (s.ok()) {
      for (const v1::ParticipantStaging& ps : resp.staging()) {
        (*staging)[ps.participant_id()] = ps;
      }
      if (key.first != options_.node) {
        progress.bytes_moved.fetch_add(routes.by_key.at(key).bytes);
      }
      if (resp.has_delta()) {  // a peer's counts: never below zero
        progress.patched_bytes += std::max<int64_t>(0, resp.delta().patched_bytes());
        progress.patch_bytes += std::max<int64_t>(0, resp.delta().patch_bytes());
        progress.changed_bytes += std::max<int64_t>(0, resp.delta().changed_bytes());
      }
      return;
    }
    // The first failure is the cause; those it stopped say "cancelled".
    if (first_error.ok() ||
        (absl::IsCancelled(first_error) && !absl::IsCancelled(s))) {
      first_error = std::move(s);
    }
    failed.store(true);
  };

  RouteCalls calls([&](size_t i, absl::Status s, v1::RunTransferResponse& r) {
    finish(order[i], std::move(s), r);
  });
  std::vector<size_t> here;  // routes whose sources are on this node
  for (size_t i = 0; i < order.size(); ++i) {
    if (order[i].first == options_.node) {
      here.push_back(i);
    } else if (absl::Status s = AskRoute(order[i], routes.by_key.at(order[i]),
                                         addresses, deadline, give_up, calls,
                                         i);
               !s.ok()) {
      finish(order[i], std::move(s), v1::RunTransferResponse());
    }
  }
  std::atomic<size_t> next_route{0};
  auto worker = [&] {
    for (size_t j = next_route++; j < here.size(); j = next_route++) {
      const RouteKey& key = order[here[j]];
      v1::RunTransferResponse resp;
      absl::Status s = RunRoute(key, routes.by_key.at(key), addresses,
                                deadline, give_up, progress, &resp);
      finish(key, std::move(s), resp);
    }
  };
  std::vector<std::thread> threads;
  for (size_t i = 1; i < std::min(here.size(), kMaxRoutesAtOnce); ++i) {
    threads.emplace_back(worker);
  }
  worker();
  for (std::thread& t : threads) t.join();
  calls.Wait(give_up);
  absl::MutexLock lock(&results_mu);
  return first_error;
}

absl::Status RouteSender::RunRoute(const RouteKey& key, NodeRoute& route,
                                   const Addresses& addresses,
                                   absl::Time deadline,
                                   const std::function<bool()>& give_up,
                                   TransferProgress& progress,
                                   v1::RunTransferResponse* resp) {
  const std::string& node = key.second;
  auto on_bytes = [&](int64_t b) { progress.bytes_moved.fetch_add(b); };
  if (node == options_.node) {  // APPLY: this node's staging
    return CopyViews(router_, route.views, route.view_places, route.local,
                     route.local_places, give_up, on_bytes)
        .status();
  }
  if (route.req.has_nccl()) {
    absl::Status s = PinForFabric(route.view_places, options_.devices);
    if (!s.ok()) return s;
  }
  return SendRoute(node, addresses.at(node), route.req, route.views,
                   route.view_places, deadline,
                   give_up, on_bytes, resp);
}

absl::Status RouteSender::AskRoute(const RouteKey& key, NodeRoute& route,
                                   const Addresses& addresses,
                                   absl::Time deadline,
                                   const std::function<bool()>& give_up,
                                   RouteCalls& calls, size_t index) {
  const std::string& src_node = key.first;
  const std::string& node = key.second;
  if (src_node == node) {
    route.req.set_role("local");
  } else {
    route.req.set_role("send");
    route.req.set_peer_node(node);
    route.req.set_peer_address(addresses.at(node));
  }
  const std::string& address = addresses.at(src_node);
  // A slow connection is waited for, not a failed route (peer_channels.h).
  if (absl::Status s = peers_.Connected(src_node, address, deadline, give_up);
      !s.ok()) {
    return s;
  }
  calls.Start(index, src_node, peers_.For(address), &route.req, deadline);
  return absl::OkStatus();
}

absl::Status RouteSender::SendRoute(
    const std::string& node, const std::string& address,
    v1::RunTransferRequest req, const std::vector<BucketView>& views,
    const Places& places, absl::Time deadline,
    const std::function<bool()>& cancelled,
    const std::function<void(int64_t)>& on_bytes,
    v1::RunTransferResponse* resp) {
  req.set_caller_node(options_.node);
  // Delta versions: forms and patches on host routes (delta_routes.h).
  req.set_delta(shadows_.enabled() && !req.has_nccl());
  req.set_role("");
  req.clear_send();
  req.clear_peer_node();
  req.clear_peer_address();
  // The channels to the node (fabric routes have their own): kept, or
  // opened with the next epoch; one route at a time.
  absl::StatusOr<std::unique_ptr<OutgoingChannels::Claim>> claim =
      channels_.ClaimFor(node, req, deadline, cancelled);
  if (!claim.ok()) return claim.status();
  // A slow connection is waited for, not a failed route (peer_channels.h).
  if (absl::Status s = peers_.Connected(node, address, deadline, cancelled);
      !s.ok()) {
    return s;
  }

  // A kept channel may be stale (the receiver's daemon restarted; only the
  // coordinator hears of it; a rail's link went down): a route that fails
  // on kept channels is sent again once, on new ones (on the rails that
  // open). Safe: every byte of the route is written again.
  for (int attempt = 0;; ++attempt) {
    absl::StatusOr<RouteChannels> taken =
        channels_.Take(node, address, req, deadline);
    if (!taken.ok()) return taken.status();
    taken->Describe(&req);
    const bool kept = taken->any_kept();
    const size_t rails = taken->channels.size();
    const Attempt a = SendOnce(node, address, req, views, places, deadline,
                               cancelled, on_bytes, *taken, resp);
    if (a.sent.ok() && a.received.ok()) {
      channels_.Keep(*std::move(taken));
      return absl::OkStatus();
    }
    // Broken for good: the next attempt or transfer opens higher epochs.
    const absl::Status failed = a.Cause();
    if (!kept || attempt > 0 || cancelled() ||
        absl::Now() >= deadline) {
      return failed;
    }
    LOG(INFO) << "channel " << req.channel_id() << " epoch "
              << req.channel_epoch()
              << (rails > 1 ? absl::StrCat(" and ", rails - 1, " more rails")
                            : std::string())
              << " failed (" << failed << "); sending again on new ones";
    on_bytes(-a.sent_bytes);
    *resp = v1::RunTransferResponse();
  }
}

absl::Status RouteSender::Attempt::Cause() const {
  if (sent.ok()) return received;
  if (!absl::IsUnavailable(sent) || received.ok() ||
      absl::IsCancelled(received)) {
    return sent;
  }
  return absl::Status(received.code(), absl::StrCat(received.message(),
                                                    " (and the channel to it "
                                                    "closed: ",
                                                    sent.message(), ")"));
}

absl::StatusOr<std::vector<std::vector<uint32_t>>> RouteSender::PartialAmax(
    const TransferJob& job, const std::string& node,
    const std::vector<size_t>& tensors) {
  const Fp8Quantizer& fp8 = *job.plan->fp8;
  const Participant* quantizer = nullptr;
  for (const auto& rank : fp8.ranks()) {
    if (rank->node == node) quantizer = rank.get();
  }
  const std::string address =
      options_.address_of ? options_.address_of(node) : "";
  if (quantizer == nullptr || address.empty()) {
    return absl::UnavailableError(absl::StrCat(
        "node ", node, " is not a live member with a quantizer rank"));
  }
  const absl::Time deadline = absl::Now() + options_.timeout;
  if (absl::Status s = peers_.Connected(node, address, deadline, nullptr);
      !s.ok()) {
    return s;
  }
  v1::BlockAmaxRequest req;
  *req.mutable_order() = QuantizeOrderOf(
      *job.plan, *quantizer, std::set<size_t>(tensors.begin(), tensors.end()),
      job.run, nullptr);
  auto stub = v1::Peer::NewStub(peers_.For(address));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(deadline));
  v1::BlockAmaxResponse resp;
  absl::Status s = FromGrpcStatus(stub->BlockAmax(&ctx, req, &resp),
                                  absl::StrCat("node ", node, " BlockAmax"));
  if (!s.ok()) return s;
  // By the order's tensors, which follow the set's (sorted) order.
  std::vector<size_t> order(tensors.begin(), tensors.end());
  std::sort(order.begin(), order.end());
  if (resp.max_bits_size() != static_cast<int>(order.size())) {
    return absl::DataLossError(absl::StrCat(
        "node ", node, " BlockAmax answered ", resp.max_bits_size(),
        " grids for ", order.size(), " tensors"));
  }
  std::map<size_t, std::vector<uint32_t>> by_tensor;
  for (size_t k = 0; k < order.size(); ++k) {
    const Dims& grid = job.plan->model.params[fp8.quantized()[order[k]].scale_param].shape;
    absl::StatusOr<std::vector<uint32_t>> bits =
        UnpackMaxBits(resp.max_bits(static_cast<int>(k)), grid[0] * grid[1]);
    if (!bits.ok()) {
      return absl::DataLossError(absl::StrCat("node ", node, " BlockAmax: ",
                                              bits.status().message()));
    }
    by_tensor[order[k]] = *std::move(bits);
  }
  std::vector<std::vector<uint32_t>> out;
  for (size_t t : tensors) out.push_back(std::move(by_tensor[t]));
  return out;
}

RouteSender::Attempt RouteSender::SendOnce(
    const std::string& node, const std::string& address,
    const v1::RunTransferRequest& req, const std::vector<BucketView>& views,
    const Places& places, absl::Time deadline,
    const std::function<bool()>& cancelled,
    const std::function<void(int64_t)>& on_bytes, RouteChannels& channels,
    v1::RunTransferResponse* resp) {
  // The receiver's RunTransfer runs while this thread sends.
  auto stub = v1::Peer::NewStub(peers_.For(address));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(deadline));
  grpc::Status rpc_status;
  absl::Notification received;
  stub->async()->RunTransfer(&ctx, &req, resp, [&](grpc::Status s) {
    rpc_status = std::move(s);
    received.Notify();
  });

  Attempt a;
  if (req.delta()) {
    DeltaCounts counts;  // the receiver's, in its answer, are reported
    const DeltaSender delta(&shadows_, req, views, places, &counts);
    a.sent = RunStriped(
        channels.raw(), views, cancelled,
        [&](Channel& c, size_t i) { return delta.Send(c, i, deadline); },
        [deadline](Channel& c) { return c.Flush(deadline); }, on_bytes,
        &a.sent_bytes);
  } else {
    a.sent = SendStriped(channels.raw(), views, deadline, cancelled, on_bytes,
                         &a.sent_bytes);
  }
  if (!a.sent.ok()) {
    channels.channels.clear();  // the receiver sees the connections close
    // The receiver closed one (UNAVAILABLE: reset, broken pipe): its
    // answer, on its way, says why (Attempt::Cause).
    if (absl::IsUnavailable(a.sent)) {
      received.WaitForNotificationWithTimeout(
          std::min(kAnswerAfterCloseWait, deadline - absl::Now()));
    }
    ctx.TryCancel();
  }
  received.WaitForNotification();
  a.received =
      FromGrpcStatus(rpc_status, absl::StrCat("node ", node, " RunTransfer"));
  return a;
}

}  // namespace ferry
