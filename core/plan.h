// A plan: which bytes go from which rank to which rank, for one version.
//
// Computed once per membership (sources + instances), cached, and replayed
// every version. Deterministic: the same inputs give the same plan and the
// same digest on every daemon, so parties can compare digests instead of
// plans.
//
// Fan-out: instances that share a destination layout (replicas) form a
// layout class. The first instance of a class receives from the trainer
// (`copies`); each other one receives from an earlier replica of its class
// (`relay_from`), rank r from rank r, piece i from piece i: a unique shard
// leaves the trainer side once and replicas relay it on (a binary tree, so
// no instance sends to more than two).
#ifndef FERRY_CORE_PLAN_H_
#define FERRY_CORE_PLAN_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/piece.h"

namespace ferry {

// One strided box moved from a trainer rank to a destination rank. Kept to
// 32 bytes: a Kimi-K2-sized plan holds millions of them, and most copies
// move a whole destination piece, so the box is stored only when it is
// smaller (InstancePlan::BoxOf).
struct Copy {
  int32_t param = -1;
  int32_t src_rank = 0;   // index into the source RankLayout vector
  int32_t src_piece = 0;  // index into that rank's pieces
  int32_t dst_rank = 0;   // index into the instance's rank vector
  int32_t dst_piece = 0;
  int32_t box = kWholePiece;  // index into InstancePlan::boxes
  int64_t bytes = 0;

  static constexpr int32_t kWholePiece = -1;  // the destination piece's box
};

// Copies that travel together over one route: packed into one staging
// bucket of at most the plan's bucket_bytes when the nodes differ, one
// batch of direct copies when not.
struct Bucket {
  int32_t route = 0;  // index into InstancePlan::routes
  int64_t bytes = 0;
  int32_t first_copy = 0;  // copies [first_copy, first_copy + num_copies)
  int32_t num_copies = 0;
};

// A (source node -> destination node) pair and the bytes it carries.
struct Route {
  std::string src_node;
  std::string dst_node;
  int64_t bytes = 0;
};

// A destination layout shared by replicas, and where one replica's ranks run.
struct Instance {
  std::string id;
  std::shared_ptr<const std::vector<RankLayout>> layout;  // ranks' pieces
  std::vector<std::string> nodes;  // per rank; empty: the layout's nodes
  // Whether other instances may relay from this one (its load option
  // serve_as_peer); one that may not is never a relay source.
  bool may_relay = true;
  const std::string& node(size_t rank) const {
    return nodes.empty() ? (*layout)[rank].node : nodes[rank];
  }
};

// An immutable vector that the plans of several instances may hold at once:
// replicas that read the same source boxes (SourcePlanner::ReadAlike)
// share their copies, boxes and buckets and differ only in their routes'
// node names. Kimi-K2's copies are 72 MiB per replica.
template <typename T>
class SharedVector {
 public:
  SharedVector() = default;
  explicit SharedVector(std::vector<T> v)
      : v_(std::make_shared<const std::vector<T>>(std::move(v))) {}

  const std::vector<T>& get() const { return v_ ? *v_ : Empty(); }
  size_t size() const { return get().size(); }
  bool empty() const { return get().empty(); }
  const T& operator[](size_t i) const { return (*v_)[i]; }
  typename std::vector<T>::const_iterator begin() const {
    return get().begin();
  }
  typename std::vector<T>::const_iterator end() const { return get().end(); }
  // Whether both hold the same storage (not merely equal elements).
  bool SharesWith(const SharedVector& other) const { return v_ == other.v_; }

 private:
  static const std::vector<T>& Empty() {
    static const std::vector<T>* const empty = new std::vector<T>();
    return *empty;
  }
  std::shared_ptr<const std::vector<T>> v_;
};

struct InstancePlan {
  std::string instance;
  int32_t layout_class = 0;
  // The instance this one relays from (index into Plan::instances), or -1
  // when it receives from the trainer through `copies`.
  int32_t relay_from = -1;
  int32_t stage = 0;  // 0: from the trainer; k: k relay hops from it
  SharedVector<Copy> copies;  // grouped by route, in destination order
  SharedVector<Box> boxes;    // boxes of copies that move part of a piece
  std::vector<Route> routes;  // this instance's own: node names differ
  SharedVector<Bucket> buckets;  // in copy order
  int64_t bytes = 0;  // bytes this instance receives

  // The box (elements) `copy` moves; `layout` is the instance's layout.
  const Box& BoxOf(const Copy& copy,
                   const std::vector<RankLayout>& layout) const {
    return copy.box == Copy::kWholePiece
               ? layout[copy.dst_rank].pieces[copy.dst_piece].box
               : boxes[copy.box];
  }
};

struct Plan {
  std::vector<InstancePlan> instances;  // in the order of the inputs
  int64_t bucket_bytes = 0;
  int64_t source_bytes = 0;  // bytes that leave the trainer ranks
  std::vector<int64_t> bytes_per_source_rank;  // by source rank index
  uint64_t digest = 0;
};

// Digest of everything that decides which bytes move where; independent of
// pointers and of the order of hash-map iteration.
uint64_t PlanDigest(const Plan& plan);

// The root of instance k's relay tree: k itself when it reads the
// sources, else the first instance up its relay_from chain that does
// (relay_from always names an earlier instance, so the walk ends).
int32_t RelayRoot(const Plan& plan, int32_t k);

}  // namespace ferry

#endif  // FERRY_CORE_PLAN_H_
