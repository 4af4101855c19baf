// ferryctl: the operator's view of ferryd.
//
//   ferryctl [--daemon=unix:PATH|host:port] COMMAND [flags]
//
// Every command but `reload` and `config --set/--clear` is read-only
// (Inspection service); those two are Lifecycle calls. Errors print the
// daemon's message and exit non-zero: 1 for an error from the daemon (or
// no daemon), 2 for a usage error. `health` exits 1 when the daemon reports
// problems; `watch` and `reload` exit 1 when an instance aborted. `verify`
// exits 0 clean, 1 on mismatches, 2 on any error (so a script can tell a
// corrupt engine from a check that could not run).
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/strings/str_split.h"
#include "client/connection.h"
#include "client/ferryctl/format.h"
#include "client/lifecycle_client.h"
#include "gflags/gflags.h"
#include "google/protobuf/util/json_util.h"

DEFINE_string(daemon, "",
              "ferryd address: unix:PATH or host:port. Default: $FERRY_SOCKET, "
              "else $XDG_RUNTIME_DIR/ferry/ferryd.sock, else "
              "/tmp/ferry-$UID/ferryd.sock");
DEFINE_string(stream, "", "participants, streams, watch: only this stream");
DEFINE_string(node, "", "participants: only this node");
DEFINE_string(instance, "",
              "plan, verify, reload, config: the instance (required)");
DEFINE_string(set, "",
              "config: options to set, KEY=VALUE[,KEY=VALUE...] (keys: "
              "load_format, serve_as_peer; docs/api.md \"Load options\")");
DEFINE_string(clear, "", "config: options back to their defaults, KEY[,KEY...]");
DEFINE_int32(tp_rank, -1, "plan: list this TP rank's parameters only");
DEFINE_bool(all, false, "plan: list every parameter (default: the first 40)");
DEFINE_bool(json, false,
            "plan, participants, streams, health, verify: print JSON");
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

constexpr char kUsage[] =
    "ferryctl: inspect a ferry weight-sync daemon (ferryd).\n"
    "\n"
    "usage: ferryctl [--daemon=unix:PATH|host:port] COMMAND [flags]\n"
    "\n"
    "commands:\n"
    "  participants  registered trainer (source) and engine (destination) ranks\n"
    "                [--stream=S] [--node=N] [--json]\n"
    "  streams       streams, their source ranks, versions and instances\n"
    "                [--stream=S] [--json]\n"
    "  plan          how an instance receives its weights: per parameter and\n"
    "                rank direct / fused / fallback and why, bytes, source ranks\n"
    "                --instance=ID [--tp_rank=R] [--all] [--json]\n"
    "  watch         live progress of a version: bytes, GB/s, instances done;\n"
    "                until it settles or Ctrl-C (a bootstrap or reload running\n"
    "                meanwhile shows too)  [--stream=S] [--watch_version=V]\n"
    "  health        the daemon's role, peers, devices and known problems\n"
    "                (exit 1 when it reports problems)  [--json]\n"
    "  reload        write the stream's latest committed version into the\n"
    "                instance again, from a peer instance (exit 1 if it aborted)\n"
    "                --instance=ID\n"
    "  config        show an instance's load options, or set / clear them\n"
    "                (they apply from its next delivery)\n"
    "                --instance=ID [--set=load_format=fallback_only] [--clear=K]\n"
    "  verify        checksums of what each engine rank holds against what the\n"
    "                sources sent for its committed version; names every\n"
    "                mismatch (exit 0 clean, 1 mismatches, 2 error)\n"
    "                --instance=ID [--json]   (`ferryctl verify --help`)\n"
    "\n"
    "exit: 0 ok, 1 the daemon answered an error (printed) or an instance\n"
    "aborted (watch), 2 usage error.\n"
    "examples:\n"
    "  ferryctl streams\n"
    "  ferryctl plan --instance=vllm-0\n"
    "  ferryctl --daemon=node-a:7070 watch --stream=policy\n"
    "  ferryctl verify --instance=vllm-0\n"
    "  ferryctl reload --instance=vllm-1\n"
    "  ferryctl config --instance=vllm-1 --set=load_format=fallback_only\n";

constexpr char kVerifyUsage[] =
    "usage: ferryctl [--daemon=unix:PATH|host:port] verify --instance=ID "
    "[--json] [--timeout_s=N]\n"
    "\n"
    "Hashes (XXH3-64) what each engine rank of the instance holds now, box by\n"
    "box as its last committed version was delivered, and compares each box\n"
    "with the checksum of the same bytes where they left the trainer (taken\n"
    "by ferryd while it delivered that version). Prints a summary and one\n"
    "line per mismatch: parameter, tp rank, box (elements), node, expected\n"
    "and found checksums. Not compared, and said so: fallback tensors (the\n"
    "engine's own loader placed them), GPU memory (ferryd hashes host memory\n"
    "only). Run it while the instance is idle at a committed version; it is\n"
    "read-only, but reads every verified byte. ferryd must run with\n"
    "--transfer_checksums (off by default) when it delivers the version.\n"
    "\n"
    "exit: 0 every compared box matches, 1 mismatches, 2 error (a version in\n"
    "progress, no checksums kept, no daemon, usage).\n"
    "\n"
    "  --instance  the instance to verify (required)\n"
    "  --json      print the VerifyInstanceResponse as JSON\n"
    "  --timeout_s deadline of the call, seconds (verify: 600 unless given)\n";

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

// Exit 0 committed, 1 aborted or an error, 2 usage.
int Reload(const Connection& c) {
  if (FLAGS_instance.empty()) {
    std::cerr << "ferryctl reload: --instance=ID is required\n";
    return 2;
  }
  // A reload moves the whole model: minutes unless --timeout_s says.
  gflags::CommandLineFlagInfo timeout_flag;
  const bool timeout_given =
      gflags::GetCommandLineFlagInfo("timeout_s", &timeout_flag) &&
      !timeout_flag.is_default;
  absl::StatusOr<v1::InstanceStatus> status = ReloadInPlace(
      c, FLAGS_instance, timeout_given ? Timeout() : absl::Minutes(10));
  if (!status.ok()) return Fail(status.status());
  std::cout << "instance " << FLAGS_instance << " reloaded at version "
            << status->version() << ": " << InstanceStateName(*status);
  if (status->state() == v1::INSTANCE_STATE_ABORTED) {
    std::cout << ": " << status->abort_reason();
  }
  std::cout << "\n";
  return status->state() == v1::INSTANCE_STATE_COMMITTED ? 0 : 1;
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
  google::protobuf::Map<std::string, std::string> shown(options->begin(),
                                                        options->end());
  std::cout << FormatConfig(FLAGS_instance, shown);
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
    if (s->streams_size() == 1 && s->streams(0).has_delivery() &&
        !s->streams(0).delivery().settled()) {
      const std::string line = FormatDelivery(s->streams(0).delivery(), 30);
      if (tty) {
        std::cout << "\r\x1b[K" << line << std::flush;
      } else {
        std::cout << line << "\n" << std::flush;
      }
    }
    if (!said_waiting) {
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
  if (tty) std::cout << "\n";
  std::cout << "interrupted\n";
  return 130;
}

}  // namespace
}  // namespace ferry

int main(int argc, char** argv) {
  gflags::SetUsageMessage(ferry::kUsage);
  gflags::SetVersionString("ferry v1");
  // Our own --help: the commands and ferryctl's flags only (gflags' default
  // lists every flag of every linked library).
  gflags::ParseCommandLineNonHelpFlags(&argc, &argv, /*remove_flags=*/true);
  const bool help_wanted = FLAGS_help || FLAGS_helpshort ||
                           (argc >= 2 && std::string(argv[1]) == "help");
  // `ferryctl verify --help`, `ferryctl help verify`: the verb's own page.
  for (int i = 1; help_wanted && i < argc; ++i) {
    if (std::string(argv[i]) == "verify") {
      std::cout << ferry::kVerifyUsage;
      return 0;
    }
  }
  if (help_wanted) {
    std::cout << ferry::kUsage << "\nflags:\n";
    std::vector<gflags::CommandLineFlagInfo> flags;
    gflags::GetAllFlags(&flags);
    for (const gflags::CommandLineFlagInfo& f : flags) {
      if (f.filename.find("ferryctl") == std::string::npos) continue;
      std::cout << "  --" << f.name << " (" << f.description << ") default: "
                << (f.default_value.empty() ? "\"\"" : f.default_value) << "\n";
    }
    return 0;
  }
  if (argc != 2) {
    std::cerr << (argc < 2 ? "ferryctl: no command given\n"
                           : "ferryctl: one command at a time\n")
              << "run `ferryctl --help` for the commands\n";
    return 2;
  }
  const std::string command = argv[1];
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
  if (command != "participants" && command != "streams" && command != "plan" &&
      command != "watch" && command != "health" && command != "verify" &&
      command != "reload" && command != "config") {
    std::cerr << "ferryctl: unknown command '" << command
              << "'; run `ferryctl --help` for the commands\n";
    return 2;
  }
  if (absl::Status s = connection->WaitForReady(absl::Seconds(FLAGS_timeout_s));
      !s.ok()) {
    ferry::Fail(s);
    return error_exit;
  }
  std::signal(SIGINT, ferry::OnSignal);
  std::signal(SIGTERM, ferry::OnSignal);
  if (command == "participants") return ferry::Participants(*connection);
  if (command == "streams") return ferry::Streams(*connection);
  if (command == "plan") return ferry::Plan(*connection);
  if (command == "watch") return ferry::Watch(*connection);
  if (command == "verify") return ferry::Verify(*connection);
  if (command == "reload") return ferry::Reload(*connection);
  if (command == "config") return ferry::Config(*connection);
  return ferry::Health(*connection);
}
