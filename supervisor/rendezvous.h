// The c10d TCPStore the trainer ranks rendezvous through, hosted in the supervisor process.
// This is the only supervisor code that touches torch; the header keeps torch out of every
// other translation unit.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace megacpp::supervisor {

class StoreServer {
 public:
  // Hosts a TCPStore server listening on `host` only (port 0 = any free port), expecting
  // `world` workers. Throws Error{kInvalidArgument} for a host that does not resolve.
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

std::string torch_version();

}  // namespace megacpp::supervisor
