// The c10d TCPStore the trainer ranks rendezvous through, hosted in the supervisor process by
// libmegacpp_store.so (store_plugin.cpp), loaded beside the executable when a run starts, and a
// client of such a store (a node joining its job through node 0's store: membership.h). No
// supervisor translation unit sees torch, and the `megacpp` command links none: only `run` needs
// the library (and through it libtorch).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

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

// A connection to a TCPStore (node 0's, or any c10d store). Every call blocks this thread; a
// client is for one thread at a time. The store has no authentication: whoever reaches its
// port reads and writes every key (DESIGN.md "Joining a job across nodes").
class StoreClient {
 public:
  // Connects to host:port, retrying for at most `timeout` (which then bounds each call but
  // get's own wait). Throws Error{kTimeout} when nothing answered in time (no server there,
  // or not yet), Error{kInvalidArgument} when libmegacpp_store.so does not load, and
  // Error{kSystem} otherwise; each message names host:port.
  StoreClient(const std::string& host, uint16_t port, std::chrono::milliseconds timeout);
  ~StoreClient();
  StoreClient(const StoreClient&) = delete;
  StoreClient& operator=(const StoreClient&) = delete;

  // Throws Error{kSystem} (the store went away, ...); no message names the key.
  void set(const std::string& key, std::string_view value);
  // The value of `key` once it is set, waiting at most `timeout` (0: not at all); nullopt when
  // it was not set in time (an expected answer: the connection stays usable). Throws
  // Error{kSystem} when the store fails.
  std::optional<std::string> get(const std::string& key, std::chrono::milliseconds timeout);
  // Adds `delta` to the counter `key` (0 before its first add); returns its new value.
  int64_t add(const std::string& key, int64_t delta);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A job's records on a store, sealed: each value is stored as `<value> <seal>`, the seal a keyed
// hash of key and value under the job's keys (ipc::RecordSealer), so a peer that reaches the
// store but lacks the keys cannot forge a record; it can still delete, overwrite or replay one
// (readers keep values monotonic where that matters, and every start has its own round in the
// key), and load or crash the store. An empty `seal` seals nothing (tests). Same threading as
// the StoreClient it wraps.
class SealedRecords {
 public:
  using Seal = std::function<std::string(std::string_view)>;
  SealedRecords(StoreClient& store, Seal seal) : store_(store), seal_(std::move(seal)) {}
  void set(const std::string& key, std::string_view value);
  // The value once set (waiting as StoreClient::get); nullopt when absent in time or when its
  // seal is not the job's (counted in forged()).
  std::optional<std::string> get(const std::string& key, std::chrono::milliseconds timeout);
  uint64_t forged() const noexcept { return forged_; }

 private:
  StoreClient& store_;
  Seal seal_;
  uint64_t forged_ = 0;
};

// Whether `given` is `seal`'s seal of `text`, compared in time independent of where it differs
// (SealedRecords' records, a job watch's liveness hello).
bool seal_matches(const SealedRecords::Seal& seal, std::string_view text, std::string_view given);

// Throws what StoreServer's constructor throws when libmegacpp_store.so does not load: `run`
// checks it before it writes anything.
void check_store_plugin();

// The torch this build was configured against (the trainer's; recorded in provenance).
std::string torch_version();

}  // namespace megacpp::supervisor
