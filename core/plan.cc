#include "core/plan.h"

namespace ferry {
namespace {

// FNV-1a, 64 bit: stable across runs and platforms, and fast enough to hash
// millions of copies.
class Hasher {
 public:
  void Add(int64_t v) {
    for (int i = 0; i < 8; ++i) {
      h_ ^= static_cast<uint8_t>(v >> (8 * i));
      h_ *= 0x100000001b3ull;
    }
  }
  void Add(const std::string& s) {
    Add(static_cast<int64_t>(s.size()));
    for (unsigned char c : s) {
      h_ ^= c;
      h_ *= 0x100000001b3ull;
    }
  }
  void Add(const Dims& d) {
    Add(static_cast<int64_t>(d.size()));
    for (int64_t v : d) Add(v);
  }
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = 0xcbf29ce484222325ull;
};

}  // namespace

uint64_t PlanDigest(const Plan& plan) {
  Hasher h;
  h.Add(plan.bucket_bytes);
  for (const InstancePlan& ip : plan.instances) {
    h.Add(ip.instance);
    h.Add(ip.relay_from);
    h.Add(ip.stage);
    for (const Route& c : ip.routes) {
      h.Add(c.src_node);
      h.Add(c.dst_node);
    }
    for (const Copy& c : ip.copies) {
      h.Add(c.param);
      h.Add(c.src_rank);
      h.Add(c.src_piece);
      h.Add(c.dst_rank);
      h.Add(c.dst_piece);
      h.Add(c.box);
      if (c.box != Copy::kWholePiece) {
        h.Add(ip.boxes[c.box].offset);
        h.Add(ip.boxes[c.box].extent);
      }
    }
    for (const Bucket& b : ip.buckets) {
      h.Add(b.route);
      h.Add(b.first_copy);
      h.Add(b.num_copies);
    }
  }
  return h.value();
}

}  // namespace ferry
