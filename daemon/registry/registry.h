// Registry: who is registered with this daemon, and for how long.
//
// Role: holds every participant (sources per stream, destination ranks per
// instance), hands out ids and tokens, authenticates handles, renews leases
// and removes participants whose lease ran out or whose process exited (the
// reaper thread). Every change bumps the stream's membership epoch, which
// the PlanCache keys plans on. Listeners (the VersionCoordinator) hear of
// every removal, and abort the instances a version of it affects.
//
// Owner: the Server. Threading: thread-safe; one absl::Mutex guards all
// state. Listeners are called with no Registry lock held, after the
// participant's `removed` flag is set; a listener may call back into the
// Registry. Lock order: a caller may hold its own lock while calling the
// Registry (VersionCoordinator does not, by choice), never the reverse.
// Files: registry.cc (membership), registry_{leases,adapters,views}.cc.
#ifndef FERRY_DAEMON_REGISTRY_REGISTRY_H_
#define FERRY_DAEMON_REGISTRY_REGISTRY_H_

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "core/limits.h"
#include "daemon/metrics/daemon_metrics.h"
#include "daemon/registry/declaration_cache.h"
#include "daemon/registry/load_options.h"
#include "daemon/registry/participant.h"
#include "daemon/registry/registry_views.h"
#include "daemon/registry/table_interner.h"
#include "proto/ferry/v1/types.pb.h"

namespace ferry {

class Registry {
 public:
  // Hears of participants leaving (Deregister, lease expiry, process exit)
  // and arriving.
  class Listener {
   public:
    virtual ~Listener() = default;
    // `why`: "deregistered", "lease expired after 10000 ms", ...
    virtual void OnParticipantRemoved(const Participant& participant,
                                      const std::string& why) = 0;
    // After the participant (and whatever it replaced) is in the registry.
    virtual void OnParticipantAdded(const Participant& participant) {}
  };

  // The views it hands out (registry_views.h).
  using InstanceMembers = ::ferry::InstanceMembers;
  using StreamSnapshot = ::ferry::StreamSnapshot;
  using ModelSummary = StreamModelSummary;

  // `lease` is how long a registration lives without a Heartbeat; at most
  // `max_participants` are held at once (Add is RESOURCE_EXHAUSTED past it).
  // Leases are read on `clock` (not owned; null: the real clock).
  Registry(absl::Duration lease, absl::Duration reaper_interval,
           int64_t max_participants = Limits::kMaxParticipantsPerDaemon,
           const Clock* clock = nullptr);
  ~Registry();  // stops the reaper
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // Not owned; must outlive the Registry. Call before Start.
  void AddListener(Listener* listener);
  // Counts lease expiries (not owned; call before StartReaper). Null: none.
  void set_metrics(DaemonMetrics* metrics) { metrics_ = metrics; }
  void StartReaper();
  void StopReaper() ABSL_LOCKS_EXCLUDED(mu_);

  // Adds a parsed participant; fills its id and token. ALREADY_EXISTS for a
  // rank already registered (unless `replace_existing`: the earlier one is
  // removed first) or an instance id used by another stream;
  // RESOURCE_EXHAUSTED when the daemon holds max_participants already;
  // INVALID_ARGUMENT for world_size, tp_size or parameter
  // declarations that disagree with the other ranks', or (destinations) a
  // checkpoint name the stream's complete sources do not declare.
  absl::StatusOr<std::shared_ptr<const Participant>> Add(
      std::unique_ptr<Participant> participant, bool replace_existing)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Lifecycle.SwapModel: replaces every rank of an instance with `ranks`
  // (parsed and mapped; one per tp rank, same instance id and tp_size,
  // possibly another stream) in one step: all or nothing. The old ranks are
  // removed ("swapped to a new registration"), the new ones added with new
  // handles; the instance's load options stay. NOT_FOUND when the instance
  // is not registered; the errors of Add for a new rank.
  absl::StatusOr<std::vector<std::shared_ptr<const Participant>>>
  ReplaceInstance(const std::string& instance_id,
                  std::vector<std::unique_ptr<Participant>> ranks)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Lifecycle.LoadAdapter (adapters.h): adds an adapter's destination
  // ranks (each with `adapter` set, one per rank of the base instance, on
  // the adapter stream, under a new instance id) in one step: all or
  // nothing. They have no lease of their own: they leave with their base
  // rank (whatever removes it removes them, with the reason "its engine
  // rank left: ..."). Keeps an id a rank already has (unique: ALREADY_EXISTS
  // otherwise). ALREADY_EXISTS for an instance id in use; NOT_FOUND
  // when a base rank left; the errors of Add's destination checks.
  absl::StatusOr<std::vector<std::shared_ptr<const Participant>>>
  AttachAdapter(std::vector<std::unique_ptr<Participant>> ranks)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Removes the adapter ranks of `instance_id` (an adapter's instance id),
  // telling the listeners `why`; returns how many.
  int DetachAdapter(const std::string& instance_id, const std::string& why)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Registry.UpdateRegions: `old` is now `updated` (the same participant
  // with new memory, Participant::WithMemory), under the same handle and
  // lease. NOT_FOUND when `old` is no longer the registered participant
  // (removed, or updated meanwhile). Moves the stream's epoch, so the next
  // plan copies into the new memory.
  absl::StatusOr<std::shared_ptr<const Participant>> ReplaceMemory(
      const std::shared_ptr<const Participant>& old,
      std::unique_ptr<Participant> updated) ABSL_LOCKS_EXCLUDED(mu_);

  // The participant a handle names. INVALID_ARGUMENT (no id), NOT_FOUND,
  // PERMISSION_DENIED (token).
  absl::StatusOr<std::shared_ptr<const Participant>> Authenticate(
      const v1::ParticipantHandle& handle) const ABSL_LOCKS_EXCLUDED(mu_);

  // Removes a participant (Deregister). NOT_FOUND / PERMISSION_DENIED.
  absl::Status Remove(const v1::ParticipantHandle& handle)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Removes every participant of `node` (a member daemon that was lost, left
  // or rejoined with replace_existing); returns how many. `why` is what the
  // listeners hear.
  int RemoveNode(const std::string& node, const std::string& why)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Renews the lease. NOT_FOUND / PERMISSION_DENIED.
  absl::Status Heartbeat(const v1::ParticipantHandle& handle)
      ABSL_LOCKS_EXCLUDED(mu_);

  absl::Duration lease() const { return lease_; }

  // The declarations sources registered lately, parsed: 256 ranks
  // declaring one model parse it once and hold one list.
  DeclarationCache* declaration_cache() { return &declaration_cache_; }
  // Time left on a participant's lease (zero if gone).
  absl::Duration LeaseRemaining(const std::string& participant_id) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // NOT_FOUND when no source ever registered for the stream and no
  // destination follows it.
  absl::StatusOr<StreamSnapshot> Snapshot(const std::string& stream) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Snapshot's epoch alone (is a cached plan current?). NOT_FOUND alike.
  absl::StatusOr<uint64_t> EpochOf(const std::string& stream) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Every stream name, sorted. A stream exists while a source or a
  // destination of it is registered: the last one leaving removes it.
  std::vector<std::string> StreamNames() const ABSL_LOCKS_EXCLUDED(mu_);
  // The stream's model in sum (registry_views.h). O(1): kept up to date by
  // Add and removals. NOT_FOUND for an unknown stream.
  absl::StatusOr<ModelSummary> ModelOf(const std::string& stream) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Every participant, sorted by (stream, role, rank / instance, tp rank).
  std::vector<std::shared_ptr<const Participant>> List() const
      ABSL_LOCKS_EXCLUDED(mu_);
  // The stream an instance follows, or NOT_FOUND.
  absl::StatusOr<std::string> StreamOfInstance(
      const std::string& instance_id) const ABSL_LOCKS_EXCLUDED(mu_);
  // An instance's load options (load_options.h), defaults until set; they
  // last while any rank of the instance is registered. NOT_FOUND for an
  // instance with no rank registered. SetInstanceOptions moves the stream's
  // epoch, so the next plan (and delivery) uses them.
  absl::StatusOr<LoadOptions> InstanceOptions(
      const std::string& instance_id) const ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status SetInstanceOptions(const std::string& instance_id,
                                  const LoadOptions& options)
      ABSL_LOCKS_EXCLUDED(mu_);
  size_t participant_count() const ABSL_LOCKS_EXCLUDED(mu_);

  // The reaper's sweep, now: expired leases, exited processes (tests).
  void ReapExpired() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // A new participant's token: 128 random bits, in hex.
  static std::string RandomToken();
  struct Entry {
    std::shared_ptr<Participant> participant;
    absl::Time lease_deadline;
  };
  // A parameter as the stream's registered sources declare it (they all
  // agree: Add refuses a disagreeing declaration).
  struct Declared {
    DType dtype = DType::kInvalid;
    Dims shape;
    // Declaration lists (Stream.lists) that name it: ranks sharing a list
    // count once, so a rank adding a list the stream holds touches no name.
    int32_t lists = 0;
  };
  struct Stream {
    uint64_t epoch = 0;
    int32_t world_size = 0;
    std::map<int32_t, std::string> sources;  // rank -> participant id
    // instance id -> tp rank -> participant id
    std::map<std::string, std::map<int32_t, std::string>> instances;
    // Every parameter the sources declare, by name, and their bytes in
    // all: checks against the other ranks cost one lookup per parameter
    // (comparing with every other rank's list held the lock for tens of
    // seconds with 50,000 parameters).
    absl::flat_hash_map<std::string, Declared> declared;
    // The declaration lists its sources hold (shared between ranks that
    // declared equal ones: table_interner.h), with how many hold each. A
    // rank whose list is already here agrees with the stream on every
    // name in it, so its check is one lookup.
    absl::flat_hash_map<const std::vector<ParamSpec>*, int32_t> lists;
    int64_t model_bytes = 0;
    // The parameters of the last complete set of sources, kept after they
    // leave: instances registered between training runs still resolve
    // against the model, and are bootstrapped from a peer.
    std::shared_ptr<const std::vector<ParamSpec>> last_model;
  };

  // `replaced`: the participant id `p` takes over, or empty.
  absl::Status CheckSourceLocked(const Participant& p, const Stream& s,
                                 const std::string& replaced) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckDestinationLocked(const Participant& p, const Stream* s,
                                      const std::vector<std::string>& needed)
      const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The stream, or NOT_FOUND naming it.
  absl::StatusOr<const Stream*> FindStreamLocked(
      const std::string& stream) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds or removes a source's declarations to / from its stream's (`s`
  // is one of streams_, hence the lock).
  void DeclareLocked(const Participant& p, Stream* s)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UndeclareLocked(const Participant& p, Stream* s)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The next membership epoch: one counter for every stream, so that a
  // stream removed and registered again never repeats an epoch the
  // PlanCache may still hold a plan for.
  uint64_t NextEpochLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return ++epochs_;
  }
  absl::StatusOr<Entry*> FindLocked(const v1::ParticipantHandle& handle)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Unlinks a participant from its stream; returns it for the listeners.
  std::shared_ptr<Participant> EraseLocked(const std::string& id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // EraseLocked of `id` (if still registered) and of the adapter ranks
  // attached to it, appended to `removed` for the listeners.
  using Removed =
      std::vector<std::pair<std::shared_ptr<Participant>, std::string>>;
  void EraseWithAdaptersLocked(const std::string& id, const std::string& why,
                               Removed* removed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Calls the listeners, which call back into the daemon (the
  // VersionCoordinator reads the registry): never with mu_ held.
  void NotifyRemoved(const std::vector<std::pair<
                         std::shared_ptr<Participant>, std::string>>& removed)
      ABSL_LOCKS_EXCLUDED(mu_);
  void ReaperLoop() ABSL_LOCKS_EXCLUDED(mu_);

  const absl::Duration lease_;
  const int64_t max_participants_;
  const Clock* const clock_;
  const absl::Duration reaper_interval_;
  DaemonMetrics* metrics_ = nullptr;
  std::vector<Listener*> listeners_;  // set before StartReaper; then read-only

  // Equal engine tables, fused parts lists and declaration lists held once
  // (their own locks).
  TableInterner tables_;
  PartsInterner parts_;
  DeclarationInterner declarations_;
  DeclarationCache declaration_cache_;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> participants_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Stream> streams_ ABSL_GUARDED_BY(mu_);
  // instance id -> stream
  std::map<std::string, std::string> instance_stream_ ABSL_GUARDED_BY(mu_);
  // base rank's participant id -> the adapter ranks attached to it
  std::map<std::string, std::set<std::string>> adapters_ ABSL_GUARDED_BY(mu_);
  // instance id -> its options, for instances that set any.
  std::map<std::string, LoadOptions> instance_options_ ABSL_GUARDED_BY(mu_);
  uint64_t next_serial_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t epochs_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread reaper_;
};

}  // namespace ferry

#endif  // FERRY_DAEMON_REGISTRY_REGISTRY_H_
