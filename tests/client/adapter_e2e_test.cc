// LoRA adapters end to end with the real ferryd binary and the C++ clients
// (docs/api.md, "LoRA adapters"). The base model (the tiny demo Llama:
// fused qkv_proj and gate_up_proj, row-parallel o_proj and down_proj) goes
// to a TP2 instance and a TP1 instance; adapters are streams of their own,
// published by an in-process adapter trainer whose bytes are
// weight_pattern.h's, so each engine rank checks every byte of the shares
// it receives against the pattern, and each share's box against vLLM's
// LoRA slicing restated here (q rows by TP rank, v rows by kv head, o
// columns by TP rank). The base weights are checked after every adapter
// version: an adapter never writes them.
#include <catch2/catch.hpp>

#include <dirent.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <tuple>
#include <utility>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/connection.h"
#include "examples/demo/demo_model.h"
#include "examples/demo/verifying_engine.h"
#include "examples/demo/weight_pattern.h"
#include "client/destination_client.h"
#include "client/lifecycle_client.h"
#include "client/shared_tensor_arena.h"
#include "client/source_client.h"
#include "core/region_copy.h"
#include "proto/ferry/v1/inspection.pb.h"
#include "tests/client/in_process_trainer.h"
#include "tests/client/process_harness.h"
#include "tests/daemon/test_certs.h"

namespace ferry {
namespace {

constexpr absl::Duration kWait = absl::Seconds(30);
using testing::Eventually;
using testing::InProcessTrainer;

// The tiny demo model's attention: 8 heads of 32 (q: 256 rows), 4 kv
// heads (k, v: 128 rows), hidden 256.
constexpr int64_t kHidden = 256, kQ = 256, kKv = 128, kInter = 512;
const std::string kLayer = "model.layers.0.";

struct Dir {
  std::string path;
  Dir() {
    char t[] = "/tmp/ferry-lora-XXXXXX";  // short: a unix socket path
    REQUIRE(mkdtemp(t) != nullptr);
    path = t;
  }
  ~Dir() { unlink(socket().c_str()); }
  std::string socket() const { return path + "/ferryd.sock"; }
};

// An adapter trainer: one source rank holding every lora_A / lora_B of the
// modules given, rank `r`, F32, in a shared-memory arena.
class AdapterTrainer {
 public:
  AdapterTrainer(const Connection& c, const std::string& stream,
                 const std::vector<std::string>& modules, int64_t r) {
    const ModelSpec base = *Base();
    int64_t offset = 0;
    for (const std::string& m : modules) {
      const Dims& w = base.params[base.Find(kLayer + m + ".weight")].shape;
      for (bool a : {true, false}) {
        ParamSpec p{absl::StrCat("base_model.model.", kLayer, m, ".lora_",
                                 a ? "A" : "B", ".weight"),
                    DType::kF32, a ? Dims{r, w[1]} : Dims{w[0], r}};
        pieces_.push_back(Piece::Contiguous(
            static_cast<int32_t>(model_.params.size()), FullBox(p.shape), 0,
            offset, p.dtype));
        offset += BoxBytes(FullBox(p.shape), p.dtype);
        model_.params.push_back(std::move(p));
      }
    }
    model_.BuildIndex();
    auto arena = SharedTensorArena::Create("lora." + stream, offset, 0);
    REQUIRE(arena.ok());
    arena_ = *std::move(arena);
    SourceOptions o;
    o.stream = stream;
    auto source = SourceClient::Register(
        c, o, SourceLayout{model_, pieces_, {arena_->Describe()}});
    INFO(source.status().ToString());
    REQUIRE(source.ok());
    source_ = *std::move(source);
  }

  PublishOutcome Publish(int64_t v, size_t instances) {
    for (const Piece& p : pieces_) {
      FillPiece(v, model_.params[p.param], p, arena_->data());
    }
    absl::StatusOr<PublishOutcome> out = source_->PublishVersion(v);
    INFO(out.status().ToString());
    REQUIRE(out.ok());
    INFO(out->Summary());
    CHECK(out->instances.size() == instances);
    CHECK(out->all_committed());
    return *out;
  }

  static const ModelSpec* Base() {
    static const ModelSpec* spec = [] {
      auto s = LoadDemoModel("llama-3.1-8b", "tiny");
      return new ModelSpec(s->spec);
    }();
    return spec;
  }

 private:
  ModelSpec model_;
  std::vector<Piece> pieces_;
  std::unique_ptr<SharedTensorArena> arena_;
  std::unique_ptr<SourceClient> source_;
};

// What one engine rank's adapter manager saw, per adapter name.
struct AdapterState {
  int64_t applied = 0;    // the version of the latest APPLY
  int64_t committed = 0;  // the latest COMMIT
  std::string config;
  std::map<std::string, Box> boxes;  // parameter -> share
  bool unloaded = false;
  int applies = 0;
};

struct AdapterBook {
  absl::Mutex mu;
  std::map<std::string, AdapterState> adapters;
  std::vector<std::string> errors;
  AdapterState Get(const std::string& name) {
    absl::MutexLock l(&mu);
    return adapters[name];
  }
};

// A rank of the tiny demo model (VerifyingEngine for the base weights)
// that also serves adapters: each share's bytes are checked against the
// pattern of the version the APPLY carries.
struct Rank {
  std::unique_ptr<VerifyingEngine> engine;
  std::unique_ptr<AdapterBook> book;
  std::unique_ptr<DestinationClient> client;
};

DestinationCallbacks WithAdapters(VerifyingEngine& engine, AdapterBook* book) {
  DestinationCallbacks cb = engine.Callbacks();
  cb.on_adapter_apply = [book](const std::string& name, int64_t v,
                               const std::string& config,
                               const std::vector<FallbackTensorView>& shares)
      -> absl::Status {
    absl::MutexLock l(&book->mu);
    AdapterState& s = book->adapters[name];
    s.applied = v;
    s.config = config;
    s.unloaded = false;
    ++s.applies;
    s.boxes.clear();
    for (const FallbackTensorView& t : shares) {
      const Box box = t.share.has_value() ? *t.share : FullBox(t.shape);
      s.boxes[t.parameter] = box;
      absl::Status ok = CheckPiece(
          v, ParamSpec{t.parameter, t.dtype, t.shape},
          Piece::Contiguous(0, box, 0, 0, t.dtype), t.bytes.data());
      if (!ok.ok()) book->errors.push_back(std::string(ok.message()));
    }
    return absl::OkStatus();
  };
  cb.on_adapter_commit = [book](const std::string& name, int64_t v) {
    absl::MutexLock l(&book->mu);
    book->adapters[name].committed = v;
  };
  cb.on_adapter_unload = [book](const std::string& name) {
    absl::MutexLock l(&book->mu);
    book->adapters[name].unloaded = true;
    return absl::OkStatus();
  };
  return cb;
}

struct Fleet {
  Fleet()
      : ferryd(testing::StartFerryd(
            {"--socket=" + dir.socket(), "--listen=", "--node=lora",
             "--lease_ms=3000", "--ack_timeout_ms=20000",
             "--version_timeout_ms=30000", "--logtostderr"},
            dir.path + "/ferryd.log")) {
    ConnectionOptions o;
    o.address = "unix:" + dir.socket();
    o.rpc_timeout = absl::Seconds(15);
    auto conn = Connection::Open(o);
    REQUIRE(conn.ok());
    REQUIRE(conn->WaitForReady(kWait).ok());
    c = std::make_unique<Connection>(*std::move(conn));
    auto s = LoadDemoModel("llama-3.1-8b", "tiny");
    REQUIRE(s.ok());
    schema = *std::move(s);
  }
  std::vector<Rank>& Add(const std::string& id, int tp) {
    std::vector<Rank>& ranks = instances[id];
    for (int r = 0; r < tp; ++r) {
      auto engine = VerifyingEngine::Create(schema, tp, r, {},
                                            absl::StrCat("lora.", id, ".", r));
      REQUIRE(engine.ok());
      auto book = std::make_unique<AdapterBook>();
      DestinationOptions o;
      o.instance_id = id;
      o.stream = "policy";
      o.tp_rank = r;
      o.tp_size = tp;
      auto client = DestinationClient::Register(
          *c, o,
          DestinationLayout::FromEngineTable((*engine)->table(),
                                             {(*engine)->arena().Describe()}),
          WithAdapters(**engine, book.get()));
      INFO(client.status().ToString());
      REQUIRE(client.ok());
      ranks.push_back(
          Rank{*std::move(engine), std::move(book), *std::move(client)});
    }
    return ranks;
  }
  // Every rank of `id` committed adapter `name` at v, with bytes that
  // matched the pattern, and still holds base version `base`.
  void ExpectAdapter(const std::string& id, const std::string& name,
                     int64_t v, int64_t base) {
    for (Rank& r : instances[id]) {
      INFO(r.client->who() << " adapter " << name << " version " << v);
      CHECK(Eventually([&] { return r.book->Get(name).committed == v; },
                       kWait));
      {
        absl::MutexLock l(&r.book->mu);
        CHECK(r.book->errors.empty());
        for (const std::string& e : r.book->errors) UNSCOPED_INFO(e);
      }
      const absl::Status live = r.engine->VerifyLive(base);
      INFO(live.ToString());
      CHECK(live.ok());
    }
  }
  ~Fleet() {
    instances.clear();
  }

  Dir dir;
  std::unique_ptr<testing::Process> ferryd;
  std::unique_ptr<Connection> c;
  ModelSchema schema;
  std::map<std::string, std::vector<Rank>> instances;
};

v1::InstanceInfo Instance(const Connection& c, const std::string& id) {
  v1::ListStreamsRequest request;
  request.set_stream("policy");
  v1::ListStreamsResponse response;
  auto context = c.NewContext(absl::Seconds(5));
  REQUIRE(c.inspection().ListStreams(context.get(), request, &response).ok());
  for (const v1::InstanceInfo& i : response.streams(0).instances()) {
    if (i.instance_id() == id) return i;
  }
  return v1::InstanceInfo();
}

// `ferryctl args` against the fleet's ferryd: exit code and output.
std::pair<int, std::string> Ferryctl(const Fleet& f, const std::string& args) {
  const std::string cmd = testing::Runfile("client/ferryctl/ferryctl") +
                          " --daemon=unix:" + f.dir.socket() + " " + args +
                          " 2>&1";
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

Box Rows(int64_t begin, int64_t end, int64_t cols) {
  return Box{{begin, 0}, {end - begin, cols}};
}
Box Cols(int64_t rows, int64_t begin, int64_t end) {
  return Box{{0, begin}, {rows, end - begin}};
}
std::string Lora(const std::string& module, char m) {
  return absl::StrCat("base_model.model.", kLayer, module, ".lora_", std::string(1, m),
                      ".weight");
}

const char kSqlConfig[] =
    R"({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
        "target_modules": ["q_proj", "v_proj", "o_proj"]})";

TEST_CASE("a LoRA adapter follows its stream on a TP2 and a TP1 instance: "
          "shares as vLLM slices them, every byte checked, base untouched") {
  Fleet f;
  InProcessTrainer base(*f.c, "lora.base");
  f.Add("a", 2);
  f.Add("b", 1);
  absl::StatusOr<PublishOutcome> out = base.Publish(1);
  REQUIRE(out.ok());
  REQUIRE(out->all_committed());

  AdapterTrainer sql(*f.c, "lora-sql",
                     {"self_attn.q_proj", "self_attn.v_proj",
                      "self_attn.o_proj"},
                     8);
  // Loaded before the adapter's first version: it waits for it.
  for (const char* id : {"a", "b"}) {
    absl::StatusOr<v1::InstanceStatus> st =
        LoadAdapter(*f.c, id, "sql", "lora-sql", kSqlConfig);
    INFO(st.status().ToString());
    REQUIRE(st.ok());
    CHECK(st->state() == v1::INSTANCE_STATE_IDLE);
    CHECK(st->waiting_reason().find("no committed version") !=
          std::string::npos);
  }
  for (int64_t v = 1; v <= 2; ++v) {
    const PublishOutcome out = sql.Publish(v, 2);
    // Each attachment names its instance and the adapter apart (its
    // instance_id is the internal "a:sql:<n>").
    std::set<std::string> landed;
    for (const v1::InstanceStatus& s : out.instances) {
      CHECK(s.adapter_name() == "sql");
      CHECK(absl::StartsWith(s.instance_id(),
                             absl::StrCat(s.base_instance_id(), ":sql:")));
      landed.insert(s.base_instance_id());
    }
    CHECK(landed == std::set<std::string>{"a", "b"});
    f.ExpectAdapter("a", "sql", v, 1);
    f.ExpectAdapter("b", "sql", v, 1);
  }
  // The shares: vLLM's slicing of a column-parallel layer (lora_B rows),
  // of GQA kv heads (4 heads over 2 ranks: 2 each), of a row-parallel
  // layer (lora_A columns); TP1 holds everything.
  for (int r = 0; r < 2; ++r) {
    const AdapterState s = f.instances["a"][r].book->Get("sql");
    INFO("a tp rank " << r);
    CHECK(s.config == kSqlConfig);
    CHECK(s.boxes.size() == 6);
    CHECK(s.boxes.at(Lora("self_attn.q_proj", 'A')) == Cols(8, 0, kHidden));
    CHECK(s.boxes.at(Lora("self_attn.q_proj", 'B')) ==
          Rows(r * kQ / 2, (r + 1) * kQ / 2, 8));
    CHECK(s.boxes.at(Lora("self_attn.v_proj", 'B')) ==
          Rows(r * kKv / 2, (r + 1) * kKv / 2, 8));
    CHECK(s.boxes.at(Lora("self_attn.o_proj", 'A')) ==
          Cols(8, r * kQ / 2, (r + 1) * kQ / 2));
    CHECK(s.boxes.at(Lora("self_attn.o_proj", 'B')) == Rows(0, kHidden, 8));
  }
  const AdapterState whole = f.instances["b"][0].book->Get("sql");
  CHECK(whole.boxes.at(Lora("self_attn.q_proj", 'B')) == Rows(0, kQ, 8));

  // The base model's next version does not disturb the adapter.
  out = base.Publish(2);
  REQUIRE(out.ok());
  CHECK(out->all_committed());
  CHECK(out->instances.size() == 2);  // a and b: adapters are not in it
  f.ExpectAdapter("a", "sql", 2, 2);

  // Inspection: the adapter on each instance, its stream, version, bytes.
  const v1::InstanceInfo info = Instance(*f.c, "a");
  REQUIRE(info.adapters_size() == 1);
  CHECK(info.adapter_names(0) == "sql");
  CHECK(info.adapters(0).stream() == "lora-sql");
  CHECK(info.adapters(0).status().committed_version() == 2);
  CHECK(info.adapters(0).bytes() > 0);

  // A late instance loads the adapter: filled now, from a peer.
  f.Add("c", 2);
  CHECK(Eventually(
      [&] {
        for (Rank& r : f.instances["c"]) {
          if (!r.client->AwaitCommitted(2, absl::Milliseconds(10)).ok()) {
            return false;
          }
        }
        return true;
      },
      kWait));
  absl::StatusOr<v1::InstanceStatus> st =
      LoadAdapter(*f.c, "c", "sql", "lora-sql", kSqlConfig);
  INFO(st.status().ToString());
  REQUIRE(st.ok());
  CHECK(st->state() == v1::INSTANCE_STATE_COMMITTED);
  CHECK(st->committed_version() == 2);
  f.ExpectAdapter("c", "sql", 2, 2);
  sql.Publish(3, 3);
  for (const char* id : {"a", "b", "c"}) f.ExpectAdapter(id, "sql", 3, 2);

  // The operator's view.
  auto [code, text] = Ferryctl(f, "adapters");
  INFO(text);
  CHECK(code == 0);
  CHECK(text.find("INSTANCE         ADAPTER      STREAM") != std::string::npos);
  CHECK(text.find("a                sql          lora-sql                   3 "
                 "COMMITTED") != std::string::npos);
  CHECK(text.find("c                sql") != std::string::npos);
  std::tie(code, text) = Ferryctl(f, "adapters --instance=b --json");
  CHECK(code == 0);
  CHECK(text.find("\"stream_instance_id\": \"b:sql:") != std::string::npos);
  // watch follows the adapter stream's versions: each attachment is an
  // instance of it, named by its engine instance and the adapter (not by
  // its internal id <instance>:<name>:<n>).
  std::tie(code, text) = Ferryctl(f, "watch --stream=lora-sql --watch_version=3");
  INFO(text);
  CHECK(code == 0);
  CHECK(text.find("instances 3/3 committed") != std::string::npos);
  for (const char* label : {"a adapter sql", "b adapter sql", "c adapter sql"}) {
    CHECK(text.find(label) != std::string::npos);
  }
}

TEST_CASE("a second adapter is loaded, updated and unloaded without "
          "disturbing the first; bad input is refused by name") {
  Fleet f;
  InProcessTrainer base(*f.c, "lora.base2");
  f.Add("a", 2);
  REQUIRE(base.Publish(1).ok());
  AdapterTrainer sql(*f.c, "lora-sql", {"self_attn.q_proj"}, 4);
  AdapterTrainer chat(*f.c, "lora-chat", {"mlp.up_proj", "mlp.down_proj"}, 16);
  REQUIRE(LoadAdapter(*f.c, "a", "sql", "lora-sql", R"({"r": 4})").ok());
  REQUIRE(LoadAdapter(*f.c, "a", "chat", "lora-chat", R"({"r": 16})").ok());
  sql.Publish(1, 1);
  chat.Publish(1, 1);
  f.ExpectAdapter("a", "sql", 1, 1);
  f.ExpectAdapter("a", "chat", 1, 1);
  for (int r = 0; r < 2; ++r) {
    const AdapterState s = f.instances["a"][r].book->Get("chat");
    CHECK(s.boxes.at(Lora("mlp.up_proj", 'B')) ==
          Rows(r * kInter / 2, (r + 1) * kInter / 2, 16));
    CHECK(s.boxes.at(Lora("mlp.down_proj", 'A')) ==
          Cols(16, r * kInter / 2, (r + 1) * kInter / 2));
  }

  // A new configuration: re-delivered now (from the old attachment), the
  // name never missing.
  const int sql_applies = f.instances["a"][0].book->Get("sql").applies;
  absl::StatusOr<v1::InstanceStatus> st =
      UpdateAdapter(*f.c, "a", "chat", "", R"({"r": 16, "lora_alpha": 32})");
  INFO(st.status().ToString());
  REQUIRE(st.ok());
  CHECK(st->state() == v1::INSTANCE_STATE_COMMITTED);
  CHECK(st->committed_version() == 1);
  for (Rank& r : f.instances["a"]) {
    CHECK(Eventually(
        [&] {
          return r.book->Get("chat").config ==
                 R"({"r": 16, "lora_alpha": 32})";
        },
        kWait));
  }
  chat.Publish(2, 1);
  f.ExpectAdapter("a", "chat", 2, 1);

  auto [code, out] = Ferryctl(f, "unload-adapter --instance=a --adapter=chat");
  INFO(out);
  CHECK(code == 0);
  CHECK(out == "adapter chat unloaded from instance a\n");
  for (Rank& r : f.instances["a"]) CHECK(r.book->Get("chat").unloaded);
  const v1::InstanceInfo info = Instance(*f.c, "a");
  REQUIRE(info.adapters_size() == 1);
  CHECK(info.adapters(0).name() == "sql");
  // The first adapter never saw an event meanwhile, and still follows.
  CHECK(f.instances["a"][0].book->Get("sql").applies == sql_applies);
  sql.Publish(2, 1);
  f.ExpectAdapter("a", "sql", 2, 1);
  chat.Publish(3, 0);  // nobody follows it now

  // Bad input: a clear error naming the adapter and the tensor; nothing
  // changes.
  absl::Status s =
      LoadAdapter(*f.c, "a", "sql", "lora-sql", R"({"r": 4})").status();
  CHECK(s.code() == absl::StatusCode::kAlreadyExists);
  s = UnloadAdapter(*f.c, "a", "nope");
  CHECK(s.code() == absl::StatusCode::kNotFound);
  CHECK(s.message().find("adapter nope is not loaded on instance a") !=
        std::string::npos);
  s = LoadAdapter(*f.c, "a", "x", "lora-sql",
                  R"({"r": 4, "target_modules": ["v_proj"]})")
          .status();
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK(s.message().find("adapter x: tensor "
                         "base_model.model.model.layers.0.self_attn.q_proj."
                         "lora_A.weight targets module q_proj, which "
                         "target_modules [v_proj]") != std::string::npos);
  AdapterTrainer big(*f.c, "lora-big", {"self_attn.v_proj"}, 200);
  s = LoadAdapter(*f.c, "a", "big", "lora-big", R"({"r": 200})").status();
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK(s.message().find("rank 200, which is larger than the smaller dim") !=
        std::string::npos);
  s = LoadAdapter(*f.c, "a", "y", "no-such-stream", "{}").status();
  CHECK(s.code() == absl::StatusCode::kNotFound);
  s = LoadAdapter(*f.c, "a", "y", "lora-sql", "not json").status();
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  s = LoadAdapter(*f.c, "a", "y", "policy", "{}").status();
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  std::tie(code, out) = Ferryctl(f, "load-adapter --instance=a --adapter=z");
  CHECK(code == 2);
  CHECK(out.find("--adapter_stream and --adapter_config are required") !=
        std::string::npos);
  std::tie(code, out) =
      Ferryctl(f, "load-adapter --instance=a --adapter=z "
                  "--adapter_stream=lora-sql --adapter_config=/no/such.json");
  CHECK(code == 1);
  CHECK(out.find("cannot read /no/such.json") != std::string::npos);
  CHECK(Instance(*f.c, "a").adapters_size() == 1);
  s = Offload(*f.c, "a", false).status();
  CHECK(s.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(s.message().find("adapters sql are loaded on the instance") !=
        std::string::npos);
  // The adapter's ranks, as the operator sees them: on the adapter stream,
  // sharing their engine rank's stream and lease.
  std::tie(code, out) = Ferryctl(f, "participants --stream=lora-sql");
  INFO(out);
  CHECK(code == 0);
  CHECK(out.find("lora-sql     adapter     a:sql:") != std::string::npos);
  // The base weights and the remaining adapter were not touched.
  REQUIRE(base.Publish(2).ok());
  sql.Publish(3, 1);
  f.ExpectAdapter("a", "sql", 3, 2);
}

// Files in /dev/shm holding the staging a member made for adapter "sql" of
// instance "m" (named after the adapter rank: "adp.m:sql:<n>.<k>").
int MemberAdapterStaging() {
  int n = 0;
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return -1;
  while (dirent* e = readdir(dir)) {
    const std::string name = e->d_name;
    if (name.find("adp.m") != std::string::npos &&
        name.find("sql") != std::string::npos) {
      ++n;
    }
  }
  closedir(dir);
  return n;
}

TEST_CASE("an adapter on an instance whose ranks are on a member's node: "
          "the member stages the shares, bytes checked, released on unload") {
  Dir dir;
  auto start = [&](const std::string& node, const std::string& coordinator,
                   int* port) {
    const std::string port_file = dir.path + "/" + node + ".port";
    std::vector<std::string> args = {
        "--node=" + node, "--socket=" + dir.path + "/" + node + ".sock",
        "--listen=127.0.0.1:0", "--port_file=" + port_file,
        "--peer_lease_ms=1500", "--lease_ms=3000", "--ack_timeout_ms=20000",
        "--version_timeout_ms=30000", "--logtostderr"};
    for (const std::string& f : testing::TlsFlags(node)) args.push_back(f);
    if (!coordinator.empty()) args.push_back("--coordinator=" + coordinator);
    auto process = testing::StartFerryd(args, dir.path + "/" + node + ".log");
    REQUIRE(Eventually(
        [&] {
          std::ifstream in(port_file);
          return static_cast<bool>(in >> *port) && *port > 0;
        },
        kWait));
    return process;
  };
  auto connect = [&](const std::string& node) {
    ConnectionOptions o;
    o.address = "unix:" + dir.path + "/" + node + ".sock";
    o.rpc_timeout = absl::Seconds(15);
    auto conn = Connection::Open(o);
    REQUIRE(conn.ok());
    REQUIRE(conn->WaitForReady(kWait).ok());
    return std::make_unique<Connection>(*std::move(conn));
  };
  int a_port = 0, b_port = 0;
  auto a = start("node-a", "", &a_port);
  auto b = start("node-b", absl::StrCat("127.0.0.1:", a_port), &b_port);
  std::unique_ptr<Connection> on_a = connect("node-a");
  std::unique_ptr<Connection> on_b = connect("node-b");
  auto schema = LoadDemoModel("llama-3.1-8b", "tiny");
  REQUIRE(schema.ok());

  // Trainers on the coordinator's node; a TP2 engine through the member.
  InProcessTrainer base(*on_a, "lora.member.base");
  std::vector<Rank> m;
  for (int r = 0; r < 2; ++r) {
    auto engine = VerifyingEngine::Create(*schema, 2, r, {},
                                          absl::StrCat("lora.member.", r));
    REQUIRE(engine.ok());
    auto book = std::make_unique<AdapterBook>();
    DestinationOptions o;
    o.instance_id = "m";
    o.stream = "policy";
    o.tp_rank = r;
    o.tp_size = 2;
    absl::StatusOr<std::unique_ptr<DestinationClient>> client;
    REQUIRE(Eventually(
        [&] {
          client = DestinationClient::Register(
              *on_b, o,
              DestinationLayout::FromEngineTable(
                  (*engine)->table(), {(*engine)->arena().Describe()}),
              WithAdapters(**engine, book.get()));
          return client.ok();  // UNAVAILABLE until the member joined
        },
        kWait));
    m.push_back(Rank{*std::move(engine), std::move(book), *std::move(client)});
  }
  REQUIRE(base.Publish(1).ok());
  AdapterTrainer sql(*on_a, "lora-sql",
                     {"self_attn.q_proj", "self_attn.o_proj"}, 8);
  absl::StatusOr<v1::InstanceStatus> st =
      LoadAdapter(*on_a, "m", "sql", "lora-sql", R"({"r": 8})");
  INFO(st.status().ToString());
  REQUIRE(st.ok());
  CHECK(MemberAdapterStaging() == 2);  // one per engine rank, on node-b
  for (int64_t v = 1; v <= 2; ++v) {
    sql.Publish(v, 1);
    for (Rank& r : m) {
      INFO(r.client->who() << " adapter version " << v);
      CHECK(Eventually([&] { return r.book->Get("sql").committed == v; },
                       kWait));
      absl::MutexLock l(&r.book->mu);
      CHECK(r.book->errors.empty());
    }
  }
  for (int r = 0; r < 2; ++r) {
    const AdapterState s = m[r].book->Get("sql");
    CHECK(s.boxes.at(Lora("self_attn.q_proj", 'B')) ==
          Rows(r * kQ / 2, (r + 1) * kQ / 2, 8));
    CHECK(s.boxes.at(Lora("self_attn.o_proj", 'A')) ==
          Cols(8, r * kQ / 2, (r + 1) * kQ / 2));
    CHECK(m[r].engine->VerifyLive(1).ok());
  }
  REQUIRE(UnloadAdapter(*on_a, "m", "sql").ok());
  for (Rank& r : m) CHECK(r.book->Get("sql").unloaded);
  CHECK(MemberAdapterStaging() == 0);  // released on the member
  m.clear();
}


// The other way an engine can take an adapter: it keeps its own LoRA
// buffers (as vLLM's punica wrapper keeps its stacked lora_a / lora_b) and
// registers their shares as a destination instance of the adapter's
// stream, with explicit pieces. ferry then writes each version straight
// into those buffers like any live parameter, with no APPLY copy from
// staging (docs/api.md, "LoRA adapters").
TEST_CASE("an engine that keeps its own adapter buffers registers them on "
          "the adapter stream: ferry writes the shares straight into them") {
  Fleet f;
  InProcessTrainer base(*f.c, "lora.base4");
  f.Add("a", 2);
  REQUIRE(base.Publish(1).ok());
  AdapterTrainer sql(*f.c, "lora-sql", {"self_attn.q_proj", "self_attn.o_proj"},
                     8);
  // The same adapter also loaded by name on "a" (shares through APPLY).
  REQUIRE(LoadAdapter(*f.c, "a", "sql", "lora-sql", R"({"r": 8})").ok());

  ModelSpec lora;
  for (const char* m : {"self_attn.q_proj", "self_attn.o_proj"}) {
    lora.params.push_back(ParamSpec{Lora(m, 'A'), DType::kF32, {8, kHidden}});
    lora.params.push_back(ParamSpec{Lora(m, 'B'), DType::kF32, {kHidden, 8}});
  }
  lora.BuildIndex();
  struct Buffers {
    std::unique_ptr<SharedTensorArena> arena;
    std::vector<Piece> pieces;
    std::unique_ptr<DestinationClient> client;
  };
  std::vector<Buffers> ranks(2);
  for (int r = 0; r < 2; ++r) {
    // vLLM's slicing: q_proj is column-parallel (lora_B rows split),
    // o_proj row-parallel (lora_A columns split).
    const std::vector<Box> shares = {
        Cols(8, 0, kHidden), Rows(r * kQ / 2, (r + 1) * kQ / 2, 8),
        Cols(8, r * kQ / 2, (r + 1) * kQ / 2), Rows(0, kHidden, 8)};
    int64_t offset = 0;
    for (size_t i = 0; i < shares.size(); ++i) {
      ranks[r].pieces.push_back(Piece::Contiguous(
          static_cast<int32_t>(i), shares[i], 0, offset, DType::kF32));
      offset += BoxBytes(shares[i], DType::kF32);
    }
    auto arena = SharedTensorArena::Create(
        absl::StrCat("lora.direct.", r), offset, 0);
    REQUIRE(arena.ok());
    ranks[r].arena = *std::move(arena);
    DestinationOptions o;
    o.instance_id = "a-lora";
    o.stream = "lora-sql";
    o.tp_rank = r;
    o.tp_size = 2;
    auto client = DestinationClient::Register(
        *f.c, o,
        DestinationLayout::FromPieces(lora, ranks[r].pieces,
                                      {ranks[r].arena->Describe()}),
        DestinationCallbacks{});
    INFO(client.status().ToString());
    REQUIRE(client.ok());
    ranks[r].client = *std::move(client);
  }
  for (int64_t v = 1; v <= 2; ++v) {
    const PublishOutcome out = sql.Publish(v, 2);  // a-lora and a's "sql"
    for (int r = 0; r < 2; ++r) {
      INFO("a-lora tp rank " << r << " version " << v);
      REQUIRE(ranks[r].client->AwaitCommitted(v, kWait).ok());
      for (const Piece& p : ranks[r].pieces) {
        const absl::Status ok =
            CheckPiece(v, lora.params[p.param], p, ranks[r].arena->data());
        INFO(ok.ToString());
        CHECK(ok.ok());
      }
    }
    f.ExpectAdapter("a", "sql", v, 1);
  }
  ranks.clear();
}

}  // namespace
}  // namespace ferry
