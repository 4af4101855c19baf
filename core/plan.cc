#include "core/plan.h"

namespace ferry {
namespace {

// A word at a time: xor the word in, multiply by an odd constant, fold the
// high bits down. Stable across runs and platforms (fixed-width integer
// arithmetic only). Not FNV-1a byte by byte, as it was: that is eight
// dependent multiplies per integer, and a Kimi-K2 plan's 2.2 million
// copies took 128 ms to digest that way (docs/benchmarks.md), against
// about 15 ms now. Not cryptographic: daemons compare digests to find
// plans that differ, not to resist an adversary.
class Hasher {
 public:
  void Add(uint64_t v) {
    h_ = (h_ ^ v) * 0x9E3779B97F4A7C15ull;
    h_ ^= h_ >> 29;
  }
  void Add(int64_t v) { Add(static_cast<uint64_t>(v)); }
  // Two 32-bit values as one word.
  void Add(int32_t a, int32_t b) {
    Add((static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) |
        static_cast<uint32_t>(b));
  }
  void Add(const std::string& s) {
    Add(static_cast<uint64_t>(s.size()));
    uint64_t word = 0;
    int filled = 0;
    for (unsigned char c : s) {
      word |= static_cast<uint64_t>(c) << (8 * filled);
      if (++filled == 8) {
        Add(word);
        word = 0;
        filled = 0;
      }
    }
    if (filled > 0) Add(word);
  }
  void Add(const Dims& d) {
    Add(static_cast<uint64_t>(d.size()));
    for (int64_t v : d) Add(v);
  }
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = 0xcbf29ce484222325ull;
};

// The copies, their boxes and their buckets (never 0).
uint64_t CopiesDigest(const InstancePlan& ip) {
  Hasher h;
  for (const Copy& c : ip.copies) {
    h.Add(c.param, c.src_rank);
    h.Add(c.src_piece, c.dst_rank);
    h.Add(c.dst_piece, c.box);
    if (c.box != Copy::kWholePiece) {
      h.Add(ip.boxes[c.box].offset);
      h.Add(ip.boxes[c.box].extent);
    }
  }
  for (const Bucket& b : ip.buckets) {
    h.Add(b.route, b.first_copy);
    h.Add(b.num_copies, 0);
  }
  return h.value() == 0 ? 1 : h.value();
}

}  // namespace

int32_t RelayRoot(const Plan& plan, int32_t k) {
  while (plan.instances[k].relay_from >= 0) k = plan.instances[k].relay_from;
  return k;
}

uint64_t PlanDigest(const Plan& plan) {
  std::vector<std::pair<const InstancePlan*, uint64_t>> copies_digests;
  Hasher h;
  h.Add(plan.bucket_bytes);
  for (const InstancePlan& ip : plan.instances) {
    h.Add(ip.instance);
    h.Add(ip.relay_from, ip.stage);
    for (const Route& c : ip.routes) {
      h.Add(c.src_node);
      h.Add(c.dst_node);
    }
    // Replicas that read alike share their copies: digest them once.
    uint64_t copies_digest = 0;
    for (const auto& [shared, digest] : copies_digests) {
      if (shared->copies.SharesWith(ip.copies) &&
          shared->boxes.SharesWith(ip.boxes) &&
          shared->buckets.SharesWith(ip.buckets)) {
        copies_digest = digest;
        break;
      }
    }
    if (copies_digest == 0) {
      copies_digest = CopiesDigest(ip);
      copies_digests.emplace_back(&ip, copies_digest);
    }
    h.Add(copies_digest);
  }
  return h.value();
}

}  // namespace ferry
