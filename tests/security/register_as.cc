// register_as: sends one registration (or, with --instance, one Lifecycle
// call that changes that instance) to ferryd's unix socket as another user, for
// the security tests (a second uid against the test's own
// ferryd, which runs as root).
//
//   register_as --uid=U --gid=G --socket=PATH --request=FILE
//               [--destination] [--own_shm_bytes=N]
//
// FILE holds a serialized RegisterSourceRequest (or, with --destination, a
// RegisterDestinationRequest). Privileges are dropped (no supplementary
// groups, then gid, then uid) before anything else. --own_shm_bytes: first
// create a shared-memory object of that size as the new user and point
// region 0 of the request at it (what an honest client of that uid does).
// Prints "<grpc status code> <message>" and exits 0; 1 when it could not
// run at all.
#include <fcntl.h>
#include <grp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#include "gflags/gflags.h"
#include "grpcpp/grpcpp.h"
#include "proto/ferry/v1/lifecycle.grpc.pb.h"
#include "proto/ferry/v1/registration.grpc.pb.h"

DEFINE_int32(uid, 65534, "uid to run as");
DEFINE_int32(gid, 65534, "gid to run as");
DEFINE_string(socket, "", "ferryd's unix socket");
DEFINE_string(request, "", "file with the serialized request");
DEFINE_bool(destination, false, "the request is a RegisterDestinationRequest");
DEFINE_int64(own_shm_bytes, 0, "create own shm of this size for region 0");
DEFINE_string(instance, "",
              "instead of registering: the Lifecycle call --lifecycle on this "
              "instance");
DEFINE_string(lifecycle, "ReloadInPlace",
              "with --instance: ReloadInPlace, Offload, Onload, LoadAdapter, "
              "UnloadAdapter or UpdateConfig (setting an option)");

namespace {

std::string OwnShm(int64_t bytes) {
  const std::string name = "/ferry-test-own-" + std::to_string(::getpid());
  const int fd = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0 || ::ftruncate(fd, bytes) != 0) return "";
  ::close(fd);
  return name;
}

}  // namespace

int main(int argc, char** argv) {
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  if (::setgroups(0, nullptr) != 0 || ::setgid(FLAGS_gid) != 0 ||
      ::setuid(FLAGS_uid) != 0) {
    std::perror("register_as: dropping privileges");
    return 1;
  }
  if (!FLAGS_instance.empty()) {
    auto lifecycle = ferry::v1::Lifecycle::NewStub(grpc::CreateChannel(
        "unix:" + FLAGS_socket, grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    const std::string& id = FLAGS_instance;
    grpc::Status s = grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                                  "register_as: unknown --lifecycle");
    if (FLAGS_lifecycle == "ReloadInPlace") {
      ferry::v1::ReloadInPlaceRequest req;
      req.set_instance_id(id);
      ferry::v1::ReloadInPlaceResponse resp;
      s = lifecycle->ReloadInPlace(&ctx, req, &resp);
    } else if (FLAGS_lifecycle == "Offload") {
      ferry::v1::OffloadRequest req;
      req.set_instance_id(id);
      ferry::v1::OffloadResponse resp;
      s = lifecycle->Offload(&ctx, req, &resp);
    } else if (FLAGS_lifecycle == "Onload") {
      ferry::v1::OnloadRequest req;
      req.set_instance_id(id);
      ferry::v1::OnloadResponse resp;
      s = lifecycle->Onload(&ctx, req, &resp);
    } else if (FLAGS_lifecycle == "LoadAdapter") {
      ferry::v1::LoadAdapterRequest req;
      req.set_instance_id(id);
      req.set_adapter_name("sql");
      req.set_adapter_stream("lora-sql");
      req.set_adapter_config_json("{}");
      ferry::v1::LoadAdapterResponse resp;
      s = lifecycle->LoadAdapter(&ctx, req, &resp);
    } else if (FLAGS_lifecycle == "UnloadAdapter") {
      ferry::v1::UnloadAdapterRequest req;
      req.set_instance_id(id);
      req.set_adapter_name("sql");
      ferry::v1::UnloadAdapterResponse resp;
      s = lifecycle->UnloadAdapter(&ctx, req, &resp);
    } else if (FLAGS_lifecycle == "UpdateConfig") {
      ferry::v1::UpdateConfigRequest req;
      req.set_instance_id(id);
      (*req.mutable_set_options())["serve_as_peer"] = "false";
      ferry::v1::UpdateConfigResponse resp;
      s = lifecycle->UpdateConfig(&ctx, req, &resp);
    }
    std::cout << static_cast<int>(s.error_code()) << " " << s.error_message()
              << std::endl;
    return 0;
  }
  std::ifstream in(FLAGS_request, std::ios::binary);
  std::stringstream bytes;
  bytes << in.rdbuf();
  if (!in) {
    std::cerr << "register_as: cannot read " << FLAGS_request << "\n";
    return 1;
  }
  std::string own;
  if (FLAGS_own_shm_bytes > 0) {
    own = OwnShm(FLAGS_own_shm_bytes);
    if (own.empty()) {
      std::perror("register_as: own shm");
      return 1;
    }
  }
  auto channel = grpc::CreateChannel("unix:" + FLAGS_socket,
                                     grpc::InsecureChannelCredentials());
  auto stub = ferry::v1::Registry::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  grpc::Status s;
  if (FLAGS_destination) {
    ferry::v1::RegisterDestinationRequest req;
    if (!req.ParseFromString(bytes.str())) return 1;
    if (!own.empty()) {
      req.mutable_destination()->mutable_regions(0)->mutable_shared_memory()
          ->set_shm_name(own);
    }
    ferry::v1::RegisterDestinationResponse resp;
    s = stub->RegisterDestination(&ctx, req, &resp);
  } else {
    ferry::v1::RegisterSourceRequest req;
    if (!req.ParseFromString(bytes.str())) return 1;
    if (!own.empty()) {
      req.mutable_source()->mutable_regions(0)->mutable_shared_memory()
          ->set_shm_name(own);
    }
    ferry::v1::RegisterSourceResponse resp;
    s = stub->RegisterSource(&ctx, req, &resp);
  }
  if (!own.empty()) ::shm_unlink(own.c_str());
  std::cout << static_cast<int>(s.error_code()) << " " << s.error_message()
            << std::endl;
  return 0;
}
