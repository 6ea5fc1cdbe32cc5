// megacpp::supervisor placement — a node's place in a job: how many nodes the job has, which
// one this is, where node 0 listens, and which engine said so (DESIGN.md "Joining a job across
// nodes"). Torch-free and pure: the environment comes in as a map, so every source and every
// refusal is testable without touching the process's own environment.
//
// Sources, highest first: flags (--nodes, --node-rank, --master, --iface), then one engine of
// the environment, torchrun (PET_*, GROUP_RANK, MASTER_ADDR/PORT, TORCHELASTIC_*) > Slurm
// (SLURM_*) > Kubernetes (JOB_COMPLETION_INDEX with MEGACPP_NODES), then a single node. Only
// the highest engine present is read. A flag fills or overrides what that engine only derives
// (Slurm's first host as master, the default port); a flag that contradicts what the engine
// states (SLURM_NODEID, MASTER_ADDR, ...) is an error naming both.
//
// Every refusal is an Error{kInvalidArgument} whose message is one line naming the flag or
// variable and its value.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace megacpp::supervisor {

// The process environment as name -> value. A variable set to "" counts as unset.
using Environment = std::map<std::string, std::string, std::less<>>;

// A copy of `envp` (a NULL-terminated "NAME=value" array, e.g. environ).
Environment environment_of(char* const* envp);

// The port node 0 listens on when no flag or variable names one (torch's MASTER_PORT default).
inline constexpr uint16_t kDefaultMasterPort = 29500;

// `megacpp run`'s placement flags as the user typed them (unset: not given), parsed here so a
// bad value is refused in the same words as a bad variable.
struct PlacementFlags {
  std::optional<std::string> nodes = {};      // --nodes N
  std::optional<std::string> node_rank = {};  // --node-rank R
  std::optional<std::string> master = {};     // --master ADDR[:PORT] ([v6addr]:PORT for IPv6)
  std::optional<std::string> iface = {};      // --iface NAME

  bool any_placement() const { return nodes || node_rank || master; }
};

struct NodePlacement {
  uint32_t nodes = 1;
  uint32_t node_rank = 0;
  std::string master_host;  // empty with source "single": the job is this node
  uint16_t master_port = 0;
  std::vector<std::string> hosts;  // every node's host name, by node rank, when the engine says
  std::string job_id;              // the engine's job id (SLURM_JOB_ID, TORCHELASTIC_RUN_ID, ...)
  uint32_t attempt = 0;            // the engine's restart count of this job (0: first start)
  std::string iface;               // the interface cross-node traffic uses; empty: the default
  std::string source;              // "flags", "torchrun", "slurm", "kubernetes" or "single"
  // What stated the node count, as the user would write it ("SLURM_NNODES=4", "--nodes 2");
  // empty for "single". Refusals quote it.
  std::string nodes_from;
  // Node 0's store is the engine's own: torchrun's agent store at MASTER_ADDR:MASTER_PORT
  // (TORCHELASTIC_USE_AGENT_STORE=True, and no MEGACPP_MASTER_PORT). Every node, node 0
  // included, connects to it; none hosts one.
  bool engine_store = false;

  // "host:port" ("[v6]:port" for IPv6); empty when there is no master.
  std::string master() const;
};

// The first IPv4 address of network interface `iface` (getifaddrs); nullopt when it has none
// or does not exist.
std::optional<std::string> interface_address(const std::string& iface);

// Resolves this node's placement. Throws Error{kInvalidArgument} (one line) on a bad value
// (an unparsable number, nodes 0, node_rank >= nodes, a port outside 1-65535, a bad host list,
// a missing variable the engine needs) and on a flag that contradicts the engine.
NodePlacement resolve_placement(const PlacementFlags& flags, const Environment& env);

// A Slurm host list expanded as `scontrol show hostnames` does: top-level commas separate
// names (empty entries skipped), a bracket holds comma-separated numbers and lo-hi ranges
// whose width is lo's (so [08-10] gives 08 09 10), and a name with several brackets expands to
// scontrol's order: the last bracket varies fastest, then the first, second, ... (for
// a[1-2]b[3-4]c[5-6]: a1b3c5 a1b3c6 a2b3c5 a2b3c6 a1b4c5 ...). Where scontrol would print
// something odd for bad syntax (an unclosed bracket, a stray ']', text after the last bracket,
// an empty or signed number, hi < lo, more than 65536 names in a range, whitespace), this throws
// Error{kInvalidArgument} naming `what` (the variable, e.g. "SLURM_JOB_NODELIST") and the list.
std::vector<std::string> expand_hostlist(std::string_view list, std::string_view what);

}  // namespace megacpp::supervisor
