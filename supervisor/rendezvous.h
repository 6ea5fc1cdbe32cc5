// The c10d TCPStore the trainer ranks rendezvous through, hosted in the supervisor process by
// libmegacpp_store.so (store_plugin.cpp), loaded beside the executable when a run starts. No
// supervisor translation unit sees torch, and the `megacpp` command links none: only `run` needs
// the library (and through it libtorch).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace megacpp::supervisor {

class StoreServer {
 public:
  // Hosts a TCPStore server listening on `host` only (port 0 = any free port), expecting
  // `world` workers. Throws Error{kInvalidArgument} for a host that does not resolve or a
  // library that does not load, Error{kSystem} when the store cannot be hosted.
  // Lifetime: serves until destroyed; destruction closes every client connection.
  StoreServer(const std::string& host, uint16_t port, uint32_t world);
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;
  uint16_t port() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Throws what StoreServer's constructor throws when libmegacpp_store.so does not load: `run`
// checks it before it writes anything.
void check_store_plugin();

// The torch this build was configured against (the trainer's; recorded in provenance).
std::string torch_version();

}  // namespace megacpp::supervisor
