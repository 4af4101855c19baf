// fleet_ranks: one node's ranks of a fleet (tests/fleet/fleet_cluster.h),
// as threads of one process talking to that node's ferryd.
//
// It registers its trainer (source) ranks and its engine instances' ranks
// (destinations) all at once, one thread per rank, prints
// "ready <registered> <ms>", then answers commands on stdin, one per line:
//
//   publish V   every source rank here fills its rows with version V's
//               bytes and calls PublishVersion(V), all at once; prints
//               "published V <start_us> <end_us> <committed> <aborted>
//               <aborted ids>" (the first BeginVersion, the last return,
//               Unix microseconds; the instances of the first outcome; the
//               aborted ones comma-separated, "(dirty)" after a dirty one,
//               or "-") or
//               "failed V <message>".
//   check V     every engine rank here whose instance committed V compares
//               each byte of its rows with version V's (an independent
//               oracle: Pattern below, not ferry's plan), after waiting up
//               to 30 s for the ranks' COMMIT of V (it reaches them after
//               the trainer's CommitVersion returned); prints
//               "checked V <ranks at V> <ranks not at V> <bad bytes>".
//   hold        from now on every engine rank here blocks in on_pause
//               (so a fault can land mid-version, deterministically);
//               prints "held".
//   release     lets them go on; prints "released".
//   stats       prints "stats <registrations again> <ranks>": how many
//               times this process's ranks registered again (after a
//               daemon restart or a lost lease), and its ranks.
//   quit / EOF  deregisters everything and exits 0.
//
// The model: --params bf16 parameters [--rows, --cols]; source rank s of
// --sources holds rows [s*rows/S, (s+1)*rows/S) of each; engine rank r of a
// TP --tp instance rows [r*rows/TP, ...). Every rank's rows of all params
// lie back to back in one /dev/shm arena of its own.
//
//   fleet_ranks --socket=PATH --stream=fleet --sources=16 --source_ranks=0,16
//       --instances=fleet-1,fleet-16 --tp=8 [--rows=1024 --cols=16]
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/connection.h"
#include "client/destination_client.h"
#include "client/shared_tensor_arena.h"
#include "client/source_client.h"
#include "common/flags_help.h"
#include "gflags/gflags.h"
#include "glog/logging.h"

DEFINE_string(socket, "", "this node's ferryd unix socket");
DEFINE_string(stream, "fleet", "the stream");
DEFINE_int32(sources, 1, "the trainer's world size");
DEFINE_string(source_ranks, "", "the trainer ranks on this node, e.g. 0,16");
DEFINE_string(instances, "", "engine instances on this node, e.g. fleet-1");
DEFINE_int32(tp, 8, "tensor-parallel size of every engine instance");
DEFINE_int32(params, 2, "parameters of the model");
DEFINE_int64(rows, 1024, "rows of each parameter");
DEFINE_int64(cols, 16, "columns of each parameter (bf16)");

namespace ferry {
namespace {

// Version v's byte at byte `index` of parameter `param` (row-major).
uint8_t Pattern(int64_t v, int param, int64_t index) {
  return static_cast<uint8_t>(v * 131 + param * 31 + index * 7 + (index >> 8));
}

struct Rows {
  int64_t begin = 0, count = 0;
};

Rows RowsOf(int rank, int world) {
  const int64_t per = FLAGS_rows / world;
  return Rows{rank * per, per};
}

// A rank's pieces: its rows of every parameter, back to back in region 0.
std::vector<Piece> PiecesOf(Rows rows) {
  std::vector<Piece> pieces;
  const int64_t bytes = rows.count * FLAGS_cols * 2;
  for (int p = 0; p < FLAGS_params; ++p) {
    pieces.push_back(Piece::Contiguous(
        p, Box{{rows.begin, 0}, {rows.count, FLAGS_cols}}, 0, p * bytes,
        DType::kBF16));
  }
  return pieces;
}

ModelSpec Model() {
  ModelSpec m;
  for (int p = 0; p < FLAGS_params; ++p) {
    m.params.push_back(ParamSpec{absl::StrCat("layers.", p, ".weight"),
                                 DType::kBF16, {FLAGS_rows, FLAGS_cols}});
  }
  m.BuildIndex();
  return m;
}

void Fill(uint8_t* data, Rows rows, int64_t v) {
  const int64_t bytes = rows.count * FLAGS_cols * 2;
  const int64_t first = rows.begin * FLAGS_cols * 2;
  for (int p = 0; p < FLAGS_params; ++p) {
    for (int64_t i = 0; i < bytes; ++i) {
      data[p * bytes + i] = Pattern(v, p, first + i);
    }
  }
}

int64_t BadBytes(const uint8_t* data, Rows rows, int64_t v) {
  const int64_t bytes = rows.count * FLAGS_cols * 2;
  const int64_t first = rows.begin * FLAGS_cols * 2;
  int64_t bad = 0;
  for (int p = 0; p < FLAGS_params; ++p) {
    for (int64_t i = 0; i < bytes; ++i) {
      bad += data[p * bytes + i] != Pattern(v, p, first + i);
    }
  }
  return bad;
}

int64_t NowMicros() { return absl::ToUnixMicros(absl::Now()); }

// "hold": engine ranks wait in on_pause while it is set.
absl::Mutex hold_mu;
bool hold ABSL_GUARDED_BY(hold_mu) = false;

struct SourceRank {
  int rank = 0;
  std::unique_ptr<SharedTensorArena> arena;
  std::unique_ptr<SourceClient> client;
};

struct EngineRank {
  std::string instance;
  int tp_rank = 0;
  std::unique_ptr<SharedTensorArena> arena;
  std::unique_ptr<DestinationClient> client;
  std::atomic<int64_t> committed{0};
};

// Runs fn(i) for i in [0, n) on n threads; the first error.
absl::Status ForAll(size_t n, const std::function<absl::Status(size_t)>& fn) {
  std::vector<absl::Status> results(n);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < n; ++i) {
    threads.emplace_back([&, i] { results[i] = fn(i); });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : results) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

int Main() {
  ConnectionOptions co;
  co.address = "unix:" + FLAGS_socket;
  co.rpc_timeout = absl::Minutes(2);
  absl::StatusOr<Connection> connection = Connection::Open(co);
  if (!connection.ok()) {
    std::printf("failed 0 %s\n", connection.status().ToString().c_str());
    return 1;
  }
  const ModelSpec model = Model();
  std::vector<std::unique_ptr<SourceRank>> sources;
  for (absl::string_view r :
       absl::StrSplit(FLAGS_source_ranks, ',', absl::SkipEmpty())) {
    auto s = std::make_unique<SourceRank>();
    CHECK(absl::SimpleAtoi(r, &s->rank)) << "--source_ranks: " << r;
    sources.push_back(std::move(s));
  }
  std::vector<std::unique_ptr<EngineRank>> engines;
  for (absl::string_view i :
       absl::StrSplit(FLAGS_instances, ',', absl::SkipEmpty())) {
    for (int r = 0; r < FLAGS_tp; ++r) {
      auto e = std::make_unique<EngineRank>();
      e->instance = std::string(i);
      e->tp_rank = r;
      engines.push_back(std::move(e));
    }
  }
  const int64_t bytes_per_row = FLAGS_cols * 2 * FLAGS_params;
  const absl::Time start = absl::Now();
  absl::Status registered = ForAll(
      sources.size() + engines.size(), [&](size_t i) -> absl::Status {
        if (i < sources.size()) {
          SourceRank& s = *sources[i];
          const Rows rows = RowsOf(s.rank, FLAGS_sources);
          absl::StatusOr<std::unique_ptr<SharedTensorArena>> arena =
              SharedTensorArena::Create(
                  absl::StrCat(FLAGS_stream, ".src", s.rank),
                  rows.count * bytes_per_row, 0);
          if (!arena.ok()) return arena.status();
          s.arena = *std::move(arena);
          SourceOptions o;
          o.stream = FLAGS_stream;
          o.rank = s.rank;
          o.world_size = FLAGS_sources;
          absl::StatusOr<std::unique_ptr<SourceClient>> c =
              SourceClient::Register(
                  *connection, o,
                  SourceLayout{model, PiecesOf(rows), {s.arena->Describe()}});
          if (!c.ok()) return c.status();
          s.client = *std::move(c);
          return absl::OkStatus();
        }
        EngineRank& e = *engines[i - sources.size()];
        const Rows rows = RowsOf(e.tp_rank, FLAGS_tp);
        absl::StatusOr<std::unique_ptr<SharedTensorArena>> arena =
            SharedTensorArena::Create(
                absl::StrCat(e.instance, ".", e.tp_rank),
                rows.count * bytes_per_row, 0);
        if (!arena.ok()) return arena.status();
        e.arena = *std::move(arena);
        DestinationOptions o;
        o.instance_id = e.instance;
        o.stream = FLAGS_stream;
        o.tp_rank = e.tp_rank;
        o.tp_size = FLAGS_tp;
        DestinationCallbacks callbacks;
        EngineRank* rank = &e;
        callbacks.on_commit = [rank](int64_t v) { rank->committed = v; };
        callbacks.on_pause = [](int64_t) {
          absl::MutexLock lock(&hold_mu);
          hold_mu.Await(absl::Condition(
              +[](bool* held) { return !*held; }, &hold));
          return absl::OkStatus();
        };
        absl::StatusOr<std::unique_ptr<DestinationClient>> c =
            DestinationClient::Register(
                *connection, o,
                DestinationLayout::FromPieces(model, PiecesOf(rows),
                                              {e.arena->Describe()}),
                std::move(callbacks));
        if (!c.ok()) return c.status();
        e.client = *std::move(c);
        return absl::OkStatus();
      });
  if (!registered.ok()) {
    std::printf("failed 0 %s\n", registered.ToString().c_str());
    std::fflush(stdout);
    return 1;
  }
  std::printf("ready %zu %lld\n", sources.size() + engines.size(),
              static_cast<long long>(
                  absl::ToInt64Milliseconds(absl::Now() - start)));
  std::fflush(stdout);

  std::string line;
  while (std::getline(std::cin, line)) {
    std::vector<std::string> words = absl::StrSplit(line, ' ');
    int64_t v = 0;
    if (words.size() == 2 && absl::SimpleAtoi(words[1], &v) &&
        words[0] == "publish") {
      for (auto& s : sources) Fill(s->arena->data(), RowsOf(s->rank, FLAGS_sources), v);
      std::vector<absl::StatusOr<PublishOutcome>> outcomes(
          sources.size(), absl::UnknownError("not run"));
      const int64_t begun = NowMicros();
      ForAll(sources.size(), [&](size_t i) {
        outcomes[i] = sources[i]->client->PublishVersion(v);
        return absl::OkStatus();
      });
      const int64_t end = NowMicros();
      int committed = 0, aborted = 0;
      std::string error;
      for (const auto& o : outcomes) {
        if (!o.ok()) {
          error = o.status().ToString();
          break;
        }
      }
      if (!error.empty()) {
        std::printf("failed %lld %s\n", static_cast<long long>(v), error.c_str());
      } else {
        std::vector<std::string> aborted_ids;
        for (const v1::InstanceStatus& st : outcomes[0]->instances) {
          if (st.state() == v1::INSTANCE_STATE_COMMITTED) {
            ++committed;
          } else {
            ++aborted;
            LOG(WARNING) << "version " << v << ": " << st.instance_id()
                         << " aborted: " << st.abort_reason();
            aborted_ids.push_back(absl::StrCat(st.instance_id(),
                                               st.dirty() ? "(dirty)" : ""));
          }
        }
        std::printf("published %lld %lld %lld %d %d %s\n",
                    static_cast<long long>(v), static_cast<long long>(begun),
                    static_cast<long long>(end), committed, aborted,
                    aborted_ids.empty() ? "-"
                                        : absl::StrJoin(aborted_ids, ",").c_str());
      }
      std::fflush(stdout);
    } else if (words.size() == 2 && absl::SimpleAtoi(words[1], &v) &&
               words[0] == "check") {
      int at = 0, not_at = 0;
      int64_t bad = 0;
      // COMMIT reaches the engine ranks after the trainer's CommitVersion
      // returned: wait for it a while.
      const absl::Time deadline = absl::Now() + absl::Seconds(30);
      for (auto& e : engines) {
        while (e->committed.load() < v && absl::Now() < deadline) {
          absl::SleepFor(absl::Milliseconds(5));
        }
        if (e->committed.load() != v) {
          ++not_at;
          continue;
        }
        ++at;
        bad += BadBytes(e->arena->data(), RowsOf(e->tp_rank, FLAGS_tp), v);
      }
      std::printf("checked %lld %d %d %lld\n", static_cast<long long>(v), at,
                  not_at, static_cast<long long>(bad));
      std::fflush(stdout);
    } else if (line == "hold" || line == "release") {
      {
        absl::MutexLock lock(&hold_mu);
        hold = line == "hold";
      }
      std::printf("%s\n", line == "hold" ? "held" : "released");
      std::fflush(stdout);
    } else if (line == "stats") {
      int again = 0;
      for (auto& s : sources) again += s->client->reregistrations();
      for (auto& e : engines) again += e->client->reregistrations();
      std::printf("stats %d %zu\n", again, sources.size() + engines.size());
      std::fflush(stdout);
    } else if (line == "quit") {
      break;
    } else {
      std::printf("failed 0 unknown command \"%s\"\n", line.c_str());
      std::fflush(stdout);
    }
  }
  {
    absl::MutexLock lock(&hold_mu);
    hold = false;
  }
  engines.clear();
  sources.clear();
  return 0;
}

}  // namespace
}  // namespace ferry

int main(int argc, char** argv) {
  gflags::SetUsageMessage(
      "one node's trainer and engine ranks of a fleet, as threads, driven "
      "over stdin (tests/fleet/fleet_cluster.h)");
  ferry::ParseFlagsWithOwnHelp(&argc, &argv, __FILE__);
  FLAGS_logtostderr = true;  // into the log file the fleet gave it
  google::InitGoogleLogging(argv[0]);
  return ferry::Main();
}
