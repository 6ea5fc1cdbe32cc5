// megacpp::supervisor membership — a job's nodes agree, through node 0's c10d TCPStore, that
// they run the same build, recipe and data before any rank starts (DESIGN.md "Joining a job
// across nodes"). Torch-free: the store is reached through libmegacpp_store.so
// (rendezvous.h's StoreServer and StoreClient).
//
// Protocol, every key under `<secret_prefix>/`: node 0 hosts the store on the master address
// (bound to it alone); every node, node 0 included, connects a client, claims its node rank
// (`claim/<r>`, a counter: a second claim is a duplicate node rank), publishes its identity
// (`identity/<r>`), then reads every node's identity in rank order and compares each with node
// 0's. Every node reads the same records in the same order, so every node reaches the same
// verdict, on every node in the same words: the first node (by rank) whose identity differs
// from node 0's, and in what field; or the nodes that had not joined at the deadline. Each
// node then marks `done/<r>`; node 0 keeps its store up (after a success and after a
// refusal, so a refusal on node 0 waits for the deadline while a node is still missing) until
// every node that joined by its deadline has marked done, or `timeout` after that deadline, so
// no node loses the store before it has read what it needs to reach its verdict. A node that
// starts after node 0's deadline finds no store and names node 0 as missing.
//
// One join per round: a job restarted against a store that outlived the previous start joins
// under node 0's new round (join_job), else its claims would count as duplicates.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "supervisor/placement.h"

namespace megacpp::supervisor {

class StoreServer;
class StoreClient;

// What a node runs, as its supervisor resolved it before starting any rank. Values are text
// compared byte for byte and may not hold a newline.
struct NodeIdentity {
  // The build: what `megacpp compare` calls "build", from the launch contract's provenance
  // (git revision with "+dirty", build type, compiler, torch version; run_dir.cpp).
  std::string build;
  std::string recipe_hash;  // recipe::Recipe's hash, as the launch contract records it
  // How the node settled Muon's orthogonalization precision, as the launch contract records it
  // (recipe::resolve_muon_precision, e.g. "float32 (auto: cpu without bfloat16 matrix units)").
  // Compared by its first word, before the recipe's hash: nodes whose CPUs differ settle
  // muon_bf16 = "auto" differently, and their hashes then differ for that reason alone.
  std::string muon_precision;
  std::string dataset_xxh3;     // XXH3 over the files' XXH3 and token counts, as `compare` takes it
  uint32_t ranks_per_node = 0;  // --ranks: global rank = node rank x ranks per node + local rank
  std::string host;             // this node's host name; reported, not compared
  bool operator==(const NodeIdentity&) const = default;
};

// What join_job compares, in the order it compares them.
enum class IdentityField : uint8_t {
  kNodeCount,
  kBuild,
  kMuonPrecision,
  kRecipeHash,
  kDatasetXxh3,
  kRanksPerNode
};

// "node count", "build", "Muon precision", "recipe hash", "dataset XXH3", "ranks per node".
std::string_view to_string(IdentityField field);

// A node whose identity differs from node 0's: Error{kInvalidArgument}, one line naming the
// node, the field and both values, e.g. "node 1 runs recipe hash 3f…, node 0 runs 9a…: start
// every node from the same recipe".
class NodeMismatch : public Error {
 public:
  NodeMismatch(uint32_t node, IdentityField field, std::string value, std::string node0_value);
  uint32_t node() const noexcept { return node_; }
  IdentityField field() const noexcept { return field_; }
  const std::string& value() const noexcept { return value_; }
  const std::string& node0_value() const noexcept { return node0_value_; }

 private:
  uint32_t node_;
  IdentityField field_;
  std::string value_;
  std::string node0_value_;
};

// Nodes that had not published their identity when the deadline passed (node 0 among them
// when its store did not answer): Error{kTimeout}, one line naming their ranks and the master
// address.
class NodesMissing : public Error {
 public:
  NodesMissing(std::vector<uint32_t> missing, const std::string& master,
               std::chrono::milliseconds waited);
  const std::vector<uint32_t>& missing() const noexcept { return missing_; }

 private:
  std::vector<uint32_t> missing_;
};

// A job this node has joined: every node's identity by node rank and the job's store (hosted
// here on node 0: the store lives as long as this object).
class JoinedJob {
 public:
  JoinedJob(std::vector<NodeIdentity> nodes, std::unique_ptr<StoreServer> server,
            std::unique_ptr<StoreClient> client);
  ~JoinedJob();
  JoinedJob(JoinedJob&&) noexcept;
  JoinedJob& operator=(JoinedJob&&) noexcept;

  const std::vector<NodeIdentity>& nodes() const noexcept { return nodes_; }
  StoreClient& store() noexcept { return *client_; }
  // The round this start of the job joined (node 0's nonce): every key of the job's start lives
  // under `<secret_prefix>/r<round>/`.
  const std::string& round() const noexcept { return round_; }

 private:
  friend JoinedJob join_job(const NodePlacement&, const NodeIdentity&, std::string_view,
                            std::chrono::milliseconds, std::string_view);
  std::string round_;
  std::vector<NodeIdentity> nodes_;
  std::unique_ptr<StoreServer> server_;  // node 0 only
  std::unique_ptr<StoreClient> client_;
};

// Joins `placement`'s job as its node `placement.node_rank`, waiting at most `timeout` for
// every node to publish (node 0 may linger up to `timeout` more, see above).
//
// `secret_prefix` keeps the job's keys apart from anything else on the store: it is the only
// thing between a peer that can connect to the store and the job's keys, and only against a
// peer that cannot list them (DESIGN.md says what such a peer can still do). It is the caller's:
// the cross-node launch derives it from the job's key file (ipc/job_keys.h), which every node
// already reads as the job's user, so no second secret has to travel; derived by a one-way hash,
// never the key itself, because the store's traffic is plain text.
//
// Throws NodeMismatch, NodesMissing, Error{kInvalidArgument} for a placement without a master,
// a wildcard master address (0.0.0.0, ::), an empty prefix, a value holding a newline, or a
// node rank claimed twice (this node was the second), Error{kProtocol} for an identity record
// megacpp does not write, and what StoreServer/StoreClient throw (node 0's store lost midway).
//
// Rounds: an engine restarts a job's nodes against a store that may outlive the previous start
// (torchrun's agent store), and its restart count is not the same on every node (torchrun
// counts a node's own failures only). So node 0 sets `<secret_prefix>/round` to a fresh nonce
// at every start, and every other node joins the newest round that is not `last_round` (the
// one it joined last, which its caller keeps; empty: any), waiting for node 0 until the
// deadline. A node that restarts alone waits for node 0's next start.
JoinedJob join_job(const NodePlacement& placement, const NodeIdentity& identity,
                   std::string_view secret_prefix, std::chrono::milliseconds timeout,
                   std::string_view last_round = {});

}  // namespace megacpp::supervisor
