// ferryctl: the operator's view of ferryd.
//
//   ferryctl [--daemon=unix:PATH|host:port] COMMAND [flags]
//
// Every command but `reload`, `offload`, `onload`, the adapter verbs and
// `config --set/--clear` is read-only (Inspection service); those are
// Lifecycle calls. Errors print the
// daemon's message and exit non-zero: 1 for an error from the daemon (or
// no daemon), 2 for a usage error. `health` exits 1 when the daemon reports
// problems; `watch`, `reload`, `offload` and `onload` exit 1 when an
// instance aborted. `verify`
// exits 0 clean, 1 on mismatches, 2 on any error (so a script can tell a
// corrupt engine from a check that could not run).
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/strings/str_split.h"
#include "client/connection.h"
#include "client/ferryctl/format.h"
#include "client/lifecycle_client.h"
#include "gflags/gflags.h"
#include "google/protobuf/util/json_util.h"
#include "proto/grpc/health/v1/health.grpc.pb.h"

DEFINE_string(daemon, "",
              "ferryd address: unix:PATH or host:port. Default: $FERRY_SOCKET, "
              "else $XDG_RUNTIME_DIR/ferry/ferryd.sock, else "
              "/tmp/ferry-$UID/ferryd.sock");
DEFINE_string(stream, "",
              "participants, streams, watch: only this stream; versions: the "
              "stream (required)");
DEFINE_string(node, "", "participants: only this node");
DEFINE_string(instance, "",
              "plan, verify, reload, offload, onload, config, the adapter "
              "verbs: the instance (required; adapters: only this one)");
DEFINE_string(adapter, "",
              "load-adapter, update-adapter, unload-adapter: the adapter name "
              "(required)");
DEFINE_string(adapter_stream, "",
              "load-adapter: the stream of the adapter's tensors (required); "
              "update-adapter: a stream to follow instead");
DEFINE_string(adapter_config, "",
              "load-adapter (required), update-adapter: the adapter's PEFT "
              "adapter_config.json, as a path or as JSON text");
DEFINE_bool(keep_host_copy, false,
            "offload: copy the weights into ferryd's memory first, so that "
            "onload restores them without the trainer or a peer");
DEFINE_string(set, "",
              "config: options to set, KEY=VALUE[,KEY=VALUE...] (keys: "
              "load_format, serve_as_peer; docs/api.md \"Load options\")");
DEFINE_string(clear, "", "config: options back to their defaults, KEY[,KEY...]");
DEFINE_int32(tp_rank, -1, "plan: list this TP rank's parameters only");
DEFINE_bool(all, false, "plan: list every parameter (default: the first 40)");
DEFINE_bool(json, false, "print the answer as JSON (every command)");
DEFINE_int64(watch_version, 0,
             "watch: the version to watch (default: the one in progress, or "
             "the next to begin)");
DEFINE_int32(interval_ms, 250, "watch: refresh period");
DECLARE_bool(help);
DECLARE_bool(helpshort);

DEFINE_int32(timeout_s, 10, "deadline of each call to the daemon, seconds");
DEFINE_string(tls_cert, "",
              "--daemon=host:port: this client's certificate (PEM), signed "
              "by the cluster CA; ferryd's TCP port serves only mutual TLS");
DEFINE_string(tls_key, "", "--daemon=host:port: the certificate's key (PEM)");
DEFINE_string(tls_ca, "", "--daemon=host:port: the cluster CA (PEM)");

namespace ferry {
namespace {

volatile std::sig_atomic_t g_interrupted = 0;
void OnSignal(int) { g_interrupted = 1; }

int Fail(const absl::Status& status) {
  std::cerr << "ferryctl: " << status.message() << " ["
            << absl::StatusCodeToString(status.code()) << "]\n";
  return 1;
}

template <typename Message>
void PrintJson(const Message& message) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(message, &json, options);
  std::cout << json;
}

absl::Duration Timeout() { return absl::Seconds(FLAGS_timeout_s); }

int Participants(const Connection& c) {
  v1::ListParticipantsRequest request;
  request.set_stream(FLAGS_stream);
  request.set_node(FLAGS_node);
  v1::ListParticipantsResponse response;
  auto context = c.NewContext(Timeout());
  grpc::Status s = c.inspection().ListParticipants(context.get(), request, &response);
  if (!s.ok()) return Fail(FromGrpcStatus(s, "ListParticipants"));
  if (FLAGS_json) {
    PrintJson(response);
  } else {
    std::cout << FormatParticipants(response);
  }
  return 0;
}

absl::StatusOr<v1::ListStreamsResponse> ListStreams(const Connection& c,
                                                    const std::string& stream) {
  v1::ListStreamsRequest request;
  request.set_stream(stream);
  v1::ListStreamsResponse response;
  auto context = c.NewContext(Timeout());
  grpc::Status s = c.inspection().ListStreams(context.get(), request, &response);
  if (!s.ok()) return FromGrpcStatus(s, "ListStreams");
  return response;
}

int Streams(const Connection& c) {
  absl::StatusOr<v1::ListStreamsResponse> response = ListStreams(c, FLAGS_stream);
  if (!response.ok()) return Fail(response.status());
  if (FLAGS_json) {
    PrintJson(*response);
  } else {
    std::cout << FormatStreams(*response);
  }
  return 0;
}

int Plan(const Connection& c) {
  if (FLAGS_instance.empty()) {
    std::cerr << "ferryctl plan: --instance=ID is required (see `ferryctl "
                 "streams` for the instances)\n";
    return 2;
  }
  v1::ExplainPlanRequest request;
  request.set_instance_id(FLAGS_instance);
  if (FLAGS_tp_rank >= 0) request.set_tp_rank(FLAGS_tp_rank);
  v1::ExplainPlanResponse response;
  auto context = c.NewContext(Timeout());
  grpc::Status s = c.inspection().ExplainPlan(context.get(), request, &response);
  if (!s.ok()) return Fail(FromGrpcStatus(s, "ExplainPlan"));
  if (FLAGS_json) {
    PrintJson(response);
  } else {
    std::cout << FormatPlan(response, FLAGS_all ? 0 : 40);
  }
  return 0;
}

// Exit 0 clean, 1 mismatches, 2 errors.
int Verify(const Connection& c) {
  if (FLAGS_instance.empty()) {
    std::cerr << "ferryctl verify: --instance=ID is required (see `ferryctl "
                 "streams` for the instances)\n";
    return 2;
  }
  v1::VerifyInstanceRequest request;
  request.set_instance_id(FLAGS_instance);
  v1::VerifyInstanceResponse response;
  // The daemon reads every verified byte: without --timeout_s, give it
  // minutes rather than the other commands' seconds.
  gflags::CommandLineFlagInfo timeout_flag;
  const bool timeout_given =
      gflags::GetCommandLineFlagInfo("timeout_s", &timeout_flag) &&
      !timeout_flag.is_default;
  auto context =
      c.NewContext(timeout_given ? Timeout() : absl::Minutes(10));
  grpc::Status s =
      c.inspection().VerifyInstance(context.get(), request, &response);
  if (!s.ok()) {
    Fail(FromGrpcStatus(s, "VerifyInstance"));
    return 2;
  }
  if (FLAGS_json) {
    PrintJson(response);
  } else {
    std::cout << FormatVerify(response, 3);
  }
  return response.mismatches().empty() ? 0 : 1;
}

// The timeout of a call that moves a whole model: minutes unless
// --timeout_s says.
absl::Duration LongTimeout() {
  gflags::CommandLineFlagInfo timeout_flag;
  const bool given = gflags::GetCommandLineFlagInfo("timeout_s", &timeout_flag) &&
                     !timeout_flag.is_default;
  return given ? Timeout() : absl::Minutes(10);
}

// Exit 0 committed, 1 aborted or an error, 2 usage.
int Reload(const Connection& c) {
  if (FLAGS_instance.empty()) {
    std::cerr << "ferryctl reload: --instance=ID is required\n";
    return 2;
  }
  absl::StatusOr<v1::InstanceStatus> status =
      ReloadInPlace(c, FLAGS_instance, LongTimeout());
  if (!status.ok()) return Fail(status.status());
  if (FLAGS_json) {
    PrintJson(*status);
    return status->state() == v1::INSTANCE_STATE_COMMITTED ? 0 : 1;
  }
  std::cout << "instance " << FLAGS_instance << " reloaded at version "
            << status->version() << ": " << InstanceStateName(*status);
  if (status->state() == v1::INSTANCE_STATE_ABORTED) {
    std::cout << ": " << status->abort_reason();
  }
  std::cout << "\n";
  return status->state() == v1::INSTANCE_STATE_COMMITTED ? 0 : 1;
}

// offload / onload: print the outcome. Exit 0 when it reached `wanted`.
int PrintLifecycleOutcome(const std::string& verb,
                          const absl::StatusOr<v1::InstanceStatus>& status,
                          v1::InstanceState wanted) {
  if (!status.ok()) return Fail(status.status());
  const int code = status->state() == wanted ? 0 : 1;
  if (FLAGS_json) {
    PrintJson(*status);
    return code;
  }
  std::cout << "instance " << FLAGS_instance << " " << verb << ": "
            << InstanceStateName(*status);
  if (status->state() == v1::INSTANCE_STATE_COMMITTED ||
      status->state() == v1::INSTANCE_STATE_OFFLOADED) {
    std::cout << " at version " << status->committed_version();
  }
  if (status->state() == v1::INSTANCE_STATE_ABORTED) {
    std::cout << (status->dirty() ? " (dirty)" : "") << ": "
              << status->abort_reason();
  }
  std::cout << "\n";
  return code;
}

int OffloadVerb(const Connection& c) {
  if (FLAGS_instance.empty()) {
    std::cerr << "ferryctl offload: --instance=ID is required\n";
    return 2;
  }
  return PrintLifecycleOutcome(
      "offloaded",
      Offload(c, FLAGS_instance, FLAGS_keep_host_copy, LongTimeout()),
      v1::INSTANCE_STATE_OFFLOADED);
}

int OnloadVerb(const Connection& c) {
  if (FLAGS_instance.empty()) {
    std::cerr << "ferryctl onload: --instance=ID is required\n";
    return 2;
  }
  return PrintLifecycleOutcome("onloaded",
                               Onload(c, FLAGS_instance, LongTimeout()),
                               v1::INSTANCE_STATE_COMMITTED);
}

// adapters: every adapter attached to an instance, from ListStreams.
int Adapters(const Connection& c) {
  absl::StatusOr<v1::ListStreamsResponse> response = ListStreams(c, "");
  if (!response.ok()) return Fail(response.status());
  if (FLAGS_json) {
    v1::ListStreamsResponse only;
    for (const v1::StreamInfo& s : response->streams()) {
      v1::StreamInfo* kept = nullptr;
      for (const v1::InstanceInfo& i : s.instances()) {
        if (i.adapters().empty() ||
            (!FLAGS_instance.empty() && i.instance_id() != FLAGS_instance)) {
          continue;
        }
        if (kept == nullptr) {
          kept = only.add_streams();
          kept->set_name(s.name());
        }
        *kept->add_instances() = i;
      }
    }
    PrintJson(only);
  } else {
    std::cout << FormatAdapters(*response, FLAGS_instance);
  }
  return 0;
}

// The --adapter_config flag's text: JSON as given, or a file's contents.
absl::StatusOr<std::string> AdapterConfig() {
  const std::string& v = FLAGS_adapter_config;
  if (v.empty() || v[0] == '{') return v;
  std::ifstream in(v);
  if (!in) {
    return absl::NotFoundError(absl::StrCat(
        "--adapter_config: cannot read ", v, " (give a path to "
        "adapter_config.json or the JSON text)"));
  }
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

int PrintAdapterOutcome(const std::string& verb,
                        const absl::StatusOr<v1::InstanceStatus>& status) {
  if (!status.ok()) return Fail(status.status());
  if (FLAGS_json) {
    PrintJson(*status);
    return status->state() == v1::INSTANCE_STATE_ABORTED ? 1 : 0;
  }
  std::cout << "adapter " << FLAGS_adapter << " " << verb << " on instance "
            << FLAGS_instance << ": ";
  if (status->state() == v1::INSTANCE_STATE_COMMITTED) {
    std::cout << "holds version " << status->committed_version() << "\n";
  } else if (status->state() == v1::INSTANCE_STATE_ABORTED) {
    std::cout << InstanceStateName(*status) << ": " << status->abort_reason()
              << "\n";
  } else {
    std::cout << InstanceStateName(*status) << ": "
              << status->waiting_reason() << "\n";
  }
  return status->state() == v1::INSTANCE_STATE_ABORTED ? 1 : 0;
}

int LoadAdapterVerb(const Connection& c) {
  if (FLAGS_instance.empty() || FLAGS_adapter.empty() ||
      FLAGS_adapter_stream.empty() || FLAGS_adapter_config.empty()) {
    std::cerr << "ferryctl load-adapter: --instance, --adapter, "
                 "--adapter_stream and --adapter_config are required\n";
    return 2;
  }
  absl::StatusOr<std::string> config = AdapterConfig();
  if (!config.ok()) return Fail(config.status());
  return PrintAdapterOutcome(
      "loaded", LoadAdapter(c, FLAGS_instance, FLAGS_adapter,
                            FLAGS_adapter_stream, *config, LongTimeout()));
}

int UpdateAdapterVerb(const Connection& c) {
  if (FLAGS_instance.empty() || FLAGS_adapter.empty() ||
      (FLAGS_adapter_stream.empty() && FLAGS_adapter_config.empty())) {
    std::cerr << "ferryctl update-adapter: --instance and --adapter are "
                 "required, with --adapter_stream, --adapter_config or both\n";
    return 2;
  }
  absl::StatusOr<std::string> config = AdapterConfig();
  if (!config.ok()) return Fail(config.status());
  return PrintAdapterOutcome(
      "updated", UpdateAdapter(c, FLAGS_instance, FLAGS_adapter,
                               FLAGS_adapter_stream, *config, LongTimeout()));
}

int UnloadAdapterVerb(const Connection& c) {
  if (FLAGS_instance.empty() || FLAGS_adapter.empty()) {
    std::cerr << "ferryctl unload-adapter: --instance and --adapter are "
                 "required\n";
    return 2;
  }
  absl::Status s =
      UnloadAdapter(c, FLAGS_instance, FLAGS_adapter, LongTimeout());
  if (!s.ok()) return Fail(s);
  if (!FLAGS_json) {
    std::cout << "adapter " << FLAGS_adapter << " unloaded from instance "
              << FLAGS_instance << "\n";
  } else {
    std::cout << "{}\n";
  }
  return 0;
}

int Config(const Connection& c) {
  if (FLAGS_instance.empty()) {
    std::cerr << "ferryctl config: --instance=ID is required\n";
    return 2;
  }
  std::map<std::string, std::string> set;
  for (absl::string_view kv : absl::StrSplit(FLAGS_set, ',', absl::SkipEmpty())) {
    const size_t eq = kv.find('=');
    if (eq == absl::string_view::npos || eq == 0) {
      std::cerr << "ferryctl config: --set takes KEY=VALUE pairs; got '" << kv
                << "'\n";
      return 2;
    }
    set[std::string(kv.substr(0, eq))] = std::string(kv.substr(eq + 1));
  }
  const std::vector<std::string> clear =
      absl::StrSplit(FLAGS_clear, ',', absl::SkipEmpty());
  absl::StatusOr<std::map<std::string, std::string>> options =
      UpdateConfig(c, FLAGS_instance, set, clear);
  if (!options.ok()) return Fail(options.status());
  v1::UpdateConfigResponse shown;
  shown.mutable_options()->insert(options->begin(), options->end());
  if (FLAGS_json) {
    PrintJson(shown);
  } else {
    std::cout << FormatConfig(FLAGS_instance, shown.options());
  }
  return 0;
}

int Health(const Connection& c) {
  v1::GetHealthResponse response;
  auto context = c.NewContext(Timeout());
  grpc::Status s =
      c.inspection().GetHealth(context.get(), v1::GetHealthRequest(), &response);
  if (!s.ok()) return Fail(FromGrpcStatus(s, "GetHealth"));
  if (FLAGS_json) {
    PrintJson(response);
  } else {
    std::cout << FormatHealth(response);
  }
  return response.problems().empty() ? 0 : 1;
}

// Picks the stream to watch and the version: --stream/--version, else the
// stream with a version in progress, else the only stream's next version.
// Returns the version, or 0 to wait for the next one to begin.
absl::StatusOr<std::pair<std::string, int64_t>> PickWatchTarget(
    const Connection& c) {
  absl::StatusOr<v1::ListStreamsResponse> streams = ListStreams(c, FLAGS_stream);
  if (!streams.ok()) return streams.status();
  if (streams->streams().empty()) {
    return absl::NotFoundError("no streams registered; nothing to watch");
  }
  const v1::StreamInfo* pick = nullptr;
  for (const v1::StreamInfo& s : streams->streams()) {
    if (s.version_in_progress() > 0) {
      pick = &s;
      break;
    }
  }
  if (pick == nullptr) {
    if (streams->streams_size() > 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "no version in progress and ", streams->streams_size(),
          " streams: pick one with --stream"));
    }
    pick = &streams->streams(0);
  }
  return std::make_pair(pick->name(), FLAGS_watch_version > 0
                                          ? FLAGS_watch_version
                                          : pick->version_in_progress());
}

int Watch(const Connection& c) {
  const bool tty = isatty(STDOUT_FILENO);
  absl::StatusOr<std::pair<std::string, int64_t>> target = PickWatchTarget(c);
  if (!target.ok()) return Fail(target.status());
  const std::string stream = target->first;
  int64_t version = target->second;
  // Wait for the next version (or the one asked for) to begin.
  const int64_t wanted = version;
  version = 0;
  bool said_waiting = false;
  while (version == 0 && !g_interrupted) {
    absl::StatusOr<v1::ListStreamsResponse> s = ListStreams(c, stream);
    if (!s.ok()) return Fail(s.status());
    if (s->streams_size() == 1) {
      const v1::StreamInfo& info = s->streams(0);
      if (wanted == 0 && info.version_in_progress() > 0) {
        version = info.version_in_progress();
        break;
      }
      if (wanted > 0 && (info.version_in_progress() >= wanted ||
                         info.latest_committed_version() >= wanted)) {
        version = wanted;  // begun, or already settled: report it
        break;
      }
    }
    // A bootstrap or reload runs between versions: show it meanwhile.
    if (!FLAGS_json && s->streams_size() == 1 && s->streams(0).has_delivery() &&
        !s->streams(0).delivery().settled()) {
      const std::string line = FormatDelivery(s->streams(0).delivery(), 30);
      if (tty) {
        std::cout << "\r\x1b[K" << line << std::flush;
      } else {
        std::cout << line << "\n" << std::flush;
      }
    }
    if (!said_waiting && !FLAGS_json) {
      std::cout << "stream " << stream << ": waiting for "
                << (wanted > 0 ? absl::StrCat("version ", wanted)
                               : std::string("a version"))
                << " to begin "
                << "(latest committed v"
                << (s->streams_size() == 1
                        ? s->streams(0).latest_committed_version()
                        : 0)
                << "; Ctrl-C to stop)" << std::endl;
      said_waiting = true;
    }
    absl::SleepFor(absl::Milliseconds(FLAGS_interval_ms));
  }
  absl::Time last_print = absl::InfinitePast();
  while (!g_interrupted) {
    v1::GetProgressRequest request;
    request.set_stream(stream);
    request.set_version(version);
    v1::GetProgressResponse progress;
    auto context = c.NewContext(Timeout());
    grpc::Status s = c.inspection().GetProgress(context.get(), request, &progress);
    if (!s.ok()) {
      if (tty) std::cout << "\n";
      return Fail(FromGrpcStatus(s, "GetProgress"));
    }
    const bool settled =
        progress.instances_committed() + progress.instances_aborted() ==
        progress.instances_total();
    if (FLAGS_json) {  // no live line: the settled progress, once
      if (settled) {
        PrintJson(progress);
        return progress.instances_aborted() > 0 ? 1 : 0;
      }
      absl::SleepFor(absl::Milliseconds(FLAGS_interval_ms));
      continue;
    }
    const std::string line = FormatProgressLine(progress, 30);
    if (tty) {
      std::cout << "\r\x1b[K" << line << std::flush;
    } else if (settled || absl::Now() - last_print >= absl::Seconds(1)) {
      std::cout << line << "\n" << std::flush;  // logs: one line a second
      last_print = absl::Now();
    }
    if (settled) {
      if (tty) std::cout << "\n";
      std::cout << FormatProgressInstances(progress);
      return progress.instances_aborted() > 0 ? 1 : 0;
    }
    absl::SleepFor(absl::Milliseconds(FLAGS_interval_ms));
  }
  if (tty && !FLAGS_json) std::cout << "\n";
  std::cerr << "interrupted\n";
  return 130;
}

int Versions(const Connection& c) {
  if (FLAGS_stream.empty()) {
    std::cerr << "ferryctl versions: --stream=S is required (see `ferryctl "
                 "streams`)\n";
    return 2;
  }
  v1::ListVersionsRequest request;
  request.set_stream(FLAGS_stream);
  v1::ListVersionsResponse response;
  auto context = c.NewContext(Timeout());
  grpc::Status s = c.inspection().ListVersions(context.get(), request, &response);
  if (!s.ok()) return Fail(FromGrpcStatus(s, "ListVersions"));
  if (FLAGS_json) {
    PrintJson(response);
  } else {
    std::cout << FormatVersions(response);
  }
  return 0;
}

// Exit 0 while ferryd serves (SERVING), 1 otherwise (NOT_SERVING while it
// drains, or no answer).
int Probe(const Connection& c) {
  auto stub = grpc::health::v1::Health::NewStub(c.channel());
  grpc::health::v1::HealthCheckRequest request;  // service "": the server
  grpc::health::v1::HealthCheckResponse response;
  auto context = c.NewContext(Timeout());
  grpc::Status s = stub->Check(context.get(), request, &response);
  if (!s.ok()) return Fail(FromGrpcStatus(s, "grpc.health.v1.Health/Check"));
  if (FLAGS_json) {
    PrintJson(response);
  } else {
    std::cout << grpc::health::v1::HealthCheckResponse::ServingStatus_Name(
                     response.status())
              << "\n";
  }
  return response.status() == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : 1;
}

// One verb: its line in the command list, its own help page, and the
// flags it reads (besides the connection flags every verb takes).
struct Verb {
  const char* name;
  const char* summary;
  const char* usage;  // its flags, as on its usage line
  const char* details;
  std::vector<const char*> flags;
  int (*run)(const Connection&);
};

const std::vector<Verb>& Verbs() {
  static const std::vector<Verb> verbs = {
      {"participants",
       "registered trainer (source) and engine (destination) ranks",
       "[--stream=S] [--node=N] [--json]",
       "Lists every rank registered with the daemon (and, on a coordinator,\n"
       "with its members): role, stream, instance and TP rank, node, device,\n"
       "registered bytes, pieces, lease left.\n",
       {"stream", "node", "json"},
       &Participants},
      {"streams", "streams, their source ranks, versions and instances",
       "[--stream=S] [--json]",
       "Per stream: model bytes, source ranks, the latest committed version,\n"
       "the version in progress, every instance with its state, and a peer\n"
       "delivery (bootstrap or reload) if one runs or ran last.\n",
       {"stream", "json"},
       &Streams},
      {"versions",
       "a stream's recent versions: duration, bytes, GB/s, outcomes",
       "--stream=S [--json]",
       "The version in progress and the last 16 settled versions the daemon\n"
       "keeps for the stream, newest first: state (committed, partial,\n"
       "aborted, in progress), begin to settled, bytes moved, GB/s of\n"
       "transfer, instances committed of all, and why each aborted instance\n"
       "aborted.\n",
       {"stream", "json"},
       &Versions},
      {"plan",
       "how an instance receives its weights, per parameter and why",
       "--instance=ID [--tp_rank=R] [--all] [--json]",
       "Per engine parameter and TP rank: the resolution (direct, fused,\n"
       "fallback) and its one-line reason, bytes, and the source ranks that\n"
       "send them; totals, the plan's digest and any bytes no source holds.\n",
       {"instance", "tp_rank", "all", "json"},
       &Plan},
      {"watch",
       "live progress of a version until it settles (or Ctrl-C)",
       "[--stream=S] [--watch_version=V] [--interval_ms=N] [--json]",
       "Waits for the version (the one in progress, or the next to begin)\n"
       "and shows bytes, GB/s and instances settled as it runs (a bootstrap\n"
       "or reload running meanwhile shows too), then each instance's outcome.\n"
       "--json prints the settled version's progress as JSON instead.\n"
       "Exit 1 when an instance aborted.\n",
       {"stream", "watch_version", "interval_ms", "json"},
       &Watch},
      {"health", "the daemon's role, peers, devices and known problems",
       "[--json]",
       "The daemon's node, role (coordinator or member), version, uptime,\n"
       "peers, GPUs and every problem it knows of. Exit 1 when it reports\n"
       "problems (a readiness probe can run it).\n",
       {"json"},
       &Health},
      {"probe", "is ferryd serving? (the standard gRPC health service)",
       "[--json]",
       "Asks grpc.health.v1.Health/Check for the server as a whole: SERVING\n"
       "(exit 0) while ferryd takes work, NOT_SERVING (exit 1) once it drains\n"
       "after SIGTERM; no answer is exit 1 too. For liveness probes: unlike\n"
       "`health` it does not fail on problems a restart would not cure (a\n"
       "coordinator out of reach).\n",
       {"json"},
       &Probe},
      {"reload",
       "rewrite an instance with the latest version, from a peer",
       "--instance=ID [--json]",
       "Lifecycle.ReloadInPlace: the instance's buffers are rewritten from a\n"
       "peer instance that holds the stream's latest committed version (never\n"
       "from the trainer), through the same pause / apply / commit steps as a\n"
       "version. For root, a TCP operator or the user that registered the\n"
       "instance. Waits 10 minutes unless --timeout_s says. Exit 1 if it\n"
       "aborted.\n",
       {"instance", "json"},
       &Reload},
      {"offload", "release an instance's weights (optionally kept in ferryd)",
       "--instance=ID [--keep_host_copy] [--json]",
       "Lifecycle.Offload: the instance pauses, ferryd copies its registered\n"
       "memory into its own with --keep_host_copy, then every rank releases\n"
       "its memory. The instance is OFFLOADED: versions list it as such and\n"
       "write nothing to it until `onload`. For root, a TCP operator or the\n"
       "user that registered the instance. Exit 1 unless it was offloaded.\n",
       {"instance", "keep_host_copy", "json"},
       &OffloadVerb},
      {"onload", "bring an offloaded instance back and refill it",
       "--instance=ID [--json]",
       "Lifecycle.Onload: every rank allocates its memory again, then ferryd\n"
       "refills it from the host copy if that holds the stream's latest\n"
       "committed version, else from a peer instance that holds it, else the\n"
       "instance stays paused (ABORTED, dirty) until the stream's next\n"
       "version. Exit 0 when COMMITTED, 1 otherwise.\n",
       {"instance", "json"},
       &OnloadVerb},
      {"adapters", "the LoRA adapters on each instance: stream, version, "
                   "bytes",
       "[--instance=ID] [--json]",
       "Per instance with adapters (Lifecycle.LoadAdapter): each adapter's\n"
       "name, the stream it follows, the version the instance holds, its\n"
       "state there and the bytes of the instance's shares in ferryd's\n"
       "staging. `watch --stream=ADAPTER_STREAM` follows an adapter's\n"
       "versions as they run.\n",
       {"instance", "json"},
       &Adapters},
      {"load-adapter", "attach a LoRA adapter stream to an instance",
       "--instance=ID --adapter=NAME --adapter_stream=S "
       "--adapter_config=PATH|JSON [--json]",
       "Lifecycle.LoadAdapter: the adapter whose tensors the trainer publishes\n"
       "on stream S (PEFT names, lora_A / lora_B) is served by the instance\n"
       "under NAME; each engine rank receives only its share. Delivered now\n"
       "from another instance that holds the stream's latest version, else\n"
       "with the stream's next version. Exit 1 only if it aborted.\n",
       {"instance", "adapter", "adapter_stream", "adapter_config", "json"},
       &LoadAdapterVerb},
      {"update-adapter", "point a loaded adapter at another stream or config",
       "--instance=ID --adapter=NAME [--adapter_stream=S] "
       "[--adapter_config=PATH|JSON] [--json]",
       "Lifecycle.UpdateAdapter: the name keeps serving while it is switched\n"
       "to another stream and/or configuration, re-delivered now when an\n"
       "instance holds the stream's latest version.\n",
       {"instance", "adapter", "adapter_stream", "adapter_config", "json"},
       &UpdateAdapterVerb},
      {"unload-adapter", "detach a LoRA adapter from an instance",
       "--instance=ID --adapter=NAME [--json]",
       "Lifecycle.UnloadAdapter: the engine ranks drop the adapter, and\n"
       "ferryd releases its staging.\n",
       {"instance", "adapter", "json"},
       &UnloadAdapterVerb},
      {"config", "show an instance's load options, or set / clear them",
       "--instance=ID [--set=KEY=VALUE,...] [--clear=KEY,...] [--json]",
       "Lifecycle.UpdateConfig / GetConfig. Keys: load_format (auto,\n"
       "direct_only, fallback_only) and serve_as_peer (true, false); they\n"
       "apply from the instance's next delivery (docs/api.md, \"Load\n"
       "options\"). Without --set or --clear it only shows them.\n",
       {"instance", "set", "clear", "json"},
       &Config},
      {"verify",
       "checksums of what engine ranks hold against what was sent",
       "--instance=ID [--json]",
       "Hashes (XXH3-64) what each engine rank of the instance holds now, box\n"
       "by box as its last committed version was delivered, and compares each\n"
       "box with the checksum of the same bytes where they left the trainer\n"
       "(taken by ferryd while it delivered that version). Prints a summary\n"
       "and one line per mismatch: parameter, tp rank, box (elements), node,\n"
       "expected and found checksums. Not compared, and said so: fallback\n"
       "tensors (the engine's own loader placed them), GPU memory (ferryd\n"
       "hashes host memory only). Run it while the instance is idle at a\n"
       "committed version; it is read-only, but reads every verified byte.\n"
       "ferryd must run with --transfer_checksums (off by default) when it\n"
       "delivers the version. Waits 10 minutes unless --timeout_s says.\n"
       "\n"
       "exit: 0 every compared box matches, 1 mismatches, 2 error (a version\n"
       "in progress, no checksums kept, no daemon, usage).\n",
       {"instance", "json"},
       &Verify},
  };
  return verbs;
}

const Verb* FindVerb(const std::string& name) {
  for (const Verb& v : Verbs()) {
    if (name == v.name) return &v;
  }
  return nullptr;
}

constexpr const char* kConnectionFlags[] = {"daemon", "timeout_s", "tls_cert",
                                            "tls_key", "tls_ca"};

std::string FlagLine(const std::string& name) {
  gflags::CommandLineFlagInfo f;
  if (!gflags::GetCommandLineFlagInfo(name.c_str(), &f)) return "";
  return absl::StrCat("  --", f.name, "  ", f.description, " (default: ",
                      f.default_value.empty() ? "\"\"" : f.default_value, ")\n");
}

std::string Usage() {
  std::string out =
      "ferryctl: inspect and operate a ferry weight-sync daemon (ferryd).\n"
      "\n"
      "usage: ferryctl [--daemon=unix:PATH|host:port] COMMAND [flags]\n"
      "\n"
      "commands:\n";
  for (const Verb& v : Verbs()) {
    absl::StrAppend(&out, absl::StrFormat("  %-15s %s\n", v.name, v.summary));
  }
  absl::StrAppend(
      &out,
      "\n`ferryctl COMMAND --help` (or `ferryctl help COMMAND`) shows a "
      "command's flags.\n"
      "Every command takes --json and the connection flags:\n");
  for (const char* f : kConnectionFlags) absl::StrAppend(&out, FlagLine(f));
  absl::StrAppend(
      &out,
      "\nexit: 0 ok, 1 the daemon answered an error (printed) or an instance\n"
      "aborted (watch, reload, offload, onload), 2 usage error.\n"
      "examples:\n"
      "  ferryctl streams\n"
      "  ferryctl versions --stream=policy\n"
      "  ferryctl plan --instance=vllm-0\n"
      "  ferryctl --daemon=node-a:7070 watch --stream=policy\n"
      "  ferryctl verify --instance=vllm-0\n"
      "  ferryctl offload --instance=vllm-1 --keep_host_copy\n"
      "  ferryctl load-adapter --instance=vllm-0 --adapter=sql \\\n"
      "      --adapter_stream=policy-lora --adapter_config=adapter_config.json\n"
      "  ferryctl config --instance=vllm-1 --set=load_format=fallback_only\n");
  return out;
}

std::string VerbUsage(const Verb& v) {
  std::string out = absl::StrCat(
      "usage: ferryctl [--daemon=unix:PATH|host:port] ", v.name, " ", v.usage,
      "\n\n", v.details, "\nflags:\n");
  for (const char* f : v.flags) absl::StrAppend(&out, FlagLine(f));
  absl::StrAppend(&out, "connection:\n");
  for (const char* f : kConnectionFlags) absl::StrAppend(&out, FlagLine(f));
  return out;
}

}  // namespace
}  // namespace ferry

int main(int argc, char** argv) {
  gflags::SetUsageMessage("ferryctl COMMAND [flags]; ferryctl --help");
  gflags::SetVersionString("ferry v1");
  // Our own --help: the commands and ferryctl's flags only (gflags' default
  // lists every flag of every linked library).
  gflags::ParseCommandLineNonHelpFlags(&argc, &argv, /*remove_flags=*/true);
  const bool help_wanted = FLAGS_help || FLAGS_helpshort ||
                           (argc >= 2 && std::string(argv[1]) == "help");
  if (help_wanted) {
    // `ferryctl verify --help`, `ferryctl help verify`: the verb's own page.
    for (int i = 1; i < argc; ++i) {
      if (const ferry::Verb* v = ferry::FindVerb(argv[i])) {
        std::cout << ferry::VerbUsage(*v);
        return 0;
      }
    }
    std::cout << ferry::Usage();
    return 0;
  }
  if (argc != 2) {
    std::cerr << (argc < 2 ? "ferryctl: no command given\n"
                           : "ferryctl: one command at a time\n")
              << "run `ferryctl --help` for the commands\n";
    return 2;
  }
  const std::string command = argv[1];
  const ferry::Verb* verb = ferry::FindVerb(command);
  if (verb == nullptr) {
    std::cerr << "ferryctl: unknown command '" << command
              << "'; run `ferryctl --help` for the commands\n";
    return 2;
  }
  // verify reports every error as 2 (1 means mismatches).
  const int error_exit = command == "verify" ? 2 : 1;
  ferry::ConnectionOptions options;
  options.address = FLAGS_daemon;
  options.rpc_timeout = absl::Seconds(FLAGS_timeout_s);
  options.tls_cert = FLAGS_tls_cert;
  options.tls_key = FLAGS_tls_key;
  options.tls_ca = FLAGS_tls_ca;
  absl::StatusOr<ferry::Connection> connection = ferry::Connection::Open(options);
  if (!connection.ok()) {
    ferry::Fail(connection.status());
    return error_exit;
  }
  if (absl::Status s = connection->WaitForReady(absl::Seconds(FLAGS_timeout_s));
      !s.ok()) {
    ferry::Fail(s);
    return error_exit;
  }
  std::signal(SIGINT, ferry::OnSignal);
  std::signal(SIGTERM, ferry::OnSignal);
  return verb->run(*connection);
}
