// The real ferryd binary: starts, serves GetHealth and the standard health
// service on its unix socket and its TCP port, and exits 0 on SIGTERM.
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "grpcpp/grpcpp.h"
#include "tests/client/process_harness.h"
#include "tests/daemon/test_certs.h"
#include "proto/ferry/v1/inspection.grpc.pb.h"

namespace {

bool Exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

std::string FerryctlPath() {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  return std::string(srcdir == nullptr ? "." : srcdir) +
         "/ferry/client/ferryctl/ferryctl";
}

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

TEST_CASE("ferryd serves GetHealth and exits 0 on SIGTERM", "[ferryd]") {
  char tmpl[] = "/tmp/ferryd-bin-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  const std::string socket = dir + "/ferryd.sock";
  const std::string port_file = dir + "/port";
  std::vector<std::string> args = {"--socket=" + socket, "--node=node-a",
                                   "--listen=127.0.0.1:0",
                                   "--port_file=" + port_file,
                                   "--lease_ms=5000"};
  for (const std::string& f : ferry::testing::TlsFlags("node-a")) {
    args.push_back(f);
  }
  std::unique_ptr<ferry::testing::Process> ferryd =
      ferry::testing::StartFerryd(args, /*log=*/"");
  REQUIRE(ferry::testing::Eventually(
      [&] { return Exists(socket) && Exists(port_file); }, absl::Seconds(5)));

  auto channel = grpc::CreateChannel("unix:" + socket,
                                     grpc::InsecureChannelCredentials());
  auto inspection = ferry::v1::Inspection::NewStub(channel);
  grpc::ClientContext c;
  c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  ferry::v1::GetHealthRequest req;
  ferry::v1::GetHealthResponse resp;
  grpc::Status s = inspection->GetHealth(&c, req, &resp);
  INFO(s.error_message());
  CHECK(s.ok());
  CHECK(resp.role() == ferry::v1::DAEMON_ROLE_COORDINATOR);
  CHECK(resp.daemon_version() != "");

  // The TCP port from --port_file serves too, to a cluster certificate.
  std::ifstream in(port_file);
  int port = 0;
  in >> port;
  CHECK(port > 0);
  if (port > 0) {
    auto tcp = ferry::testing::TcpChannel("127.0.0.1:" + std::to_string(port));
    auto tcp_inspection = ferry::v1::Inspection::NewStub(tcp);
    grpc::ClientContext c2;
    c2.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    grpc::Status tcp_status = tcp_inspection->GetHealth(&c2, req, &resp);
    INFO(tcp_status.error_message());
    CHECK(tcp_status.ok());

    // ferryctl over TCP: refused without TLS files, served with them.
    const std::string ferryctl = FerryctlPath();
    const std::string target = "--daemon=127.0.0.1:" + std::to_string(port);
    const std::string out = dir + "/ferryctl.out";
    const ferry::TlsFiles op = ferry::testing::TestTls("operator");
    int rc = std::system(
        (ferryctl + " " + target + " health >" + out + " 2>&1").c_str());
    CHECK(WEXITSTATUS(rc) == 1);
    CHECK(Slurp(out).find("mutual TLS") != std::string::npos);
    rc = std::system((ferryctl + " " + target + " --tls_cert=" + op.cert +
                      " --tls_key=" + op.key + " --tls_ca=" + op.ca +
                      " health >" + out + " 2>&1")
                         .c_str());
    INFO(Slurp(out));
    CHECK(WEXITSTATUS(rc) == 0);
  }

  REQUIRE(::kill(ferryd->pid(), SIGTERM) == 0);
  const int code = ferryd->Wait(absl::Seconds(10));
  if (code < 0) FAIL("ferryd did not exit within 10 s of SIGTERM");
  INFO("wait status " << ferryd->wait_status());
  REQUIRE(WIFEXITED(ferryd->wait_status()));
  CHECK(code == 0);
  CHECK_FALSE(Exists(socket));  // removed on shutdown
  std::string cmd = "rm -rf '" + dir + "'";
  (void)::system(cmd.c_str());
}

TEST_CASE("ferryd refuses thread counts out of range, naming the flag",
          "[ferryd]") {
  char tmpl[] = "/tmp/ferryd-flags-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  struct Case {
    const char* flag;
    const char* message;
  };
  const Case cases[] = {
      {"--planning_threads=-1", "--planning_threads must be 0 to 64"},
      {"--planning_threads=65", "--planning_threads must be 0 to 64"},
      {"--transfer_workers=0", "--transfer_workers must be 1 to 256"},
  };
  for (const Case& c : cases) {
    INFO(c.flag);
    const std::string log = dir + "/ferryd.log";
    std::unique_ptr<ferry::testing::Process> ferryd =
        ferry::testing::StartFerryd(
            {"--socket=" + dir + "/ferryd.sock", "--node=node-a", c.flag},
            log);
    const int code = ferryd->Wait(absl::Seconds(10));
    INFO(Slurp(log));
    CHECK(code == 2);
    CHECK(Slurp(log).find(c.message) != std::string::npos);
    CHECK_FALSE(Exists(dir + "/ferryd.sock"));
  }
  // In range: starts (and 1 plans on one thread).
  const std::string socket = dir + "/ok.sock";
  std::unique_ptr<ferry::testing::Process> ferryd = ferry::testing::StartFerryd(
      {"--socket=" + socket, "--node=node-a", "--planning_threads=1"},
      dir + "/ok.log");
  CHECK(ferry::testing::Eventually([&] { return Exists(socket); },
                                   absl::Seconds(5)));
  REQUIRE(::kill(ferryd->pid(), SIGTERM) == 0);
  CHECK(ferryd->Wait(absl::Seconds(10)) == 0);
  std::string cmd = "rm -rf '" + dir + "'";
  (void)::system(cmd.c_str());
}

TEST_CASE("ferryd and ferryctl find one socket through $FERRY_SOCKET",
          "[ferryd]") {
  // One rule (common/socket_path.h): ferryd started without --socket
  // listens where $FERRY_SOCKET says, and ferryctl given no --daemon
  // connects there. ferryd used to ignore the variable, so the two missed
  // each other.
  char tmpl[] = "/tmp/ferryd-env-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  const std::string socket = dir + "/by-env.sock";
  REQUIRE(::setenv("FERRY_SOCKET", socket.c_str(), 1) == 0);
  std::unique_ptr<ferry::testing::Process> ferryd =
      ferry::testing::StartFerryd({"--node=node-a"}, dir + "/ferryd.log");
  const bool listening = ferry::testing::Eventually(
      [&] { return Exists(socket); }, absl::Seconds(5));
  const std::string out = dir + "/ferryctl.out";
  const int rc =
      std::system((FerryctlPath() + " health >" + out + " 2>&1").c_str());
  ::unsetenv("FERRY_SOCKET");
  INFO(Slurp(dir + "/ferryd.log"));
  CHECK(listening);
  INFO(Slurp(out));
  CHECK(WEXITSTATUS(rc) == 0);
  REQUIRE(::kill(ferryd->pid(), SIGTERM) == 0);
  CHECK(ferryd->Wait(absl::Seconds(10)) == 0);
  std::string cmd = "rm -rf '" + dir + "'";
  (void)::system(cmd.c_str());
}
