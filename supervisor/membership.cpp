#include "supervisor/membership.h"

#include <algorithm>
#include <exception>
#include <optional>
#include <random>
#include <thread>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "supervisor/rendezvous.h"

namespace megacpp::supervisor {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// The first line of every identity record: a record megacpp did not write, or a later
// format, is refused instead of compared field by field.
constexpr std::string_view kRecordFormat = "megacpp-node-identity 2";

milliseconds left(Clock::time_point deadline) {
  return std::max(milliseconds(0),
                  std::chrono::duration_cast<milliseconds>(deadline - Clock::now()));
}

std::string seconds_text(milliseconds t) {
  return fmt::format("{:g} s", static_cast<double>(t.count()) / 1000.0);
}

struct Record {
  NodeIdentity identity;
  uint32_t nodes = 0;  // the node count this node was given
};

std::string encode(const Record& r) {
  return fmt::format(
      "{}\nnodes={}\nbuild={}\nrecipe_hash={}\ndataset_xxh3={}\n"
      "ranks_per_node={}\nhost={}\nmuon_precision={}\n",
      kRecordFormat, r.nodes, r.identity.build, r.identity.recipe_hash, r.identity.dataset_xxh3,
      r.identity.ranks_per_node, r.identity.host, r.identity.muon_precision);
}

std::optional<uint32_t> number(std::string_view s) {
  if (s.empty() || s.size() > 9 ||
      !std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return std::nullopt;
  return static_cast<uint32_t>(std::stoul(std::string(s)));
}

// The record `text` node `node` published; nullopt for anything encode() does not write.
std::optional<Record> decode(std::string_view text) {
  std::vector<std::string_view> lines;
  while (!text.empty()) {
    const size_t nl = text.find('\n');
    if (nl == std::string_view::npos) return std::nullopt;
    lines.push_back(text.substr(0, nl));
    text.remove_prefix(nl + 1);
  }
  static constexpr std::string_view kNames[] = {
      "nodes", "build", "recipe_hash", "dataset_xxh3", "ranks_per_node", "host", "muon_precision"};
  if (lines.size() != 1 + std::size(kNames) || lines[0] != kRecordFormat) return std::nullopt;
  std::string_view values[std::size(kNames)];
  for (size_t i = 0; i < std::size(kNames); ++i) {
    const std::string_view line = lines[i + 1];
    if (!line.starts_with(kNames[i]) || line.size() <= kNames[i].size() ||
        line[kNames[i].size()] != '=')
      return std::nullopt;
    values[i] = line.substr(kNames[i].size() + 1);
  }
  Record r;
  const auto nodes = number(values[0]);
  const auto ranks = number(values[4]);
  if (!nodes || !ranks) return std::nullopt;
  r.nodes = *nodes;
  r.identity.build = values[1];
  r.identity.recipe_hash = values[2];
  r.identity.dataset_xxh3 = values[3];
  r.identity.ranks_per_node = *ranks;
  r.identity.host = values[5];
  r.identity.muon_precision = values[6];
  return r;
}

// The first field in which `r` differs from node 0's record, as (field, r's value, node 0's).
std::optional<std::tuple<IdentityField, std::string, std::string>> first_difference(
    const Record& r, const Record& node0) {
  const auto& a = r.identity;
  const auto& b = node0.identity;
  if (r.nodes != node0.nodes)
    return std::tuple{IdentityField::kNodeCount, std::to_string(r.nodes),
                      std::to_string(node0.nodes)};
  if (a.build != b.build) return std::tuple{IdentityField::kBuild, a.build, b.build};
  // "bfloat16 (auto: cpu with amx_bf16 avx512_bf16)" and "bfloat16 (auto: cpu with
  // avx512_bf16)" orthogonalize alike; only the precision itself must agree.
  const auto precision = [](const std::string& s) { return s.substr(0, s.find(' ')); };
  if (precision(a.muon_precision) != precision(b.muon_precision))
    return std::tuple{IdentityField::kMuonPrecision, a.muon_precision, b.muon_precision};
  if (a.recipe_hash != b.recipe_hash)
    return std::tuple{IdentityField::kRecipeHash, a.recipe_hash, b.recipe_hash};
  if (a.dataset_xxh3 != b.dataset_xxh3)
    return std::tuple{IdentityField::kDatasetXxh3, a.dataset_xxh3, b.dataset_xxh3};
  if (a.ranks_per_node != b.ranks_per_node)
    return std::tuple{IdentityField::kRanksPerNode, std::to_string(a.ranks_per_node),
                      std::to_string(b.ranks_per_node)};
  return std::nullopt;
}

std::string mismatch_message(uint32_t node, IdentityField field, const std::string& value,
                             const std::string& node0_value) {
  switch (field) {
    case IdentityField::kNodeCount:
      return fmt::format(
          "node {} was told the job has {} nodes, node 0 was told {}: start every node with "
          "the same node count",
          node, value, node0_value);
    case IdentityField::kBuild:
      return fmt::format(
          "node {} runs build {}, node 0 runs {}: install the same megacpp build on every node",
          node, value, node0_value);
    case IdentityField::kMuonPrecision:
      // An "auto" on both sides is the same recipe on CPUs that differ in bfloat16 units.
      if (value.find("(auto") != std::string::npos &&
          node0_value.find("(auto") != std::string::npos)
        return fmt::format(
            "node {} orthogonalizes Muon's updates in {}, node 0 in {}: the nodes' CPUs differ "
            "in bfloat16 units, so set [optim] muon_bf16 = true or false in the recipe",
            node, value, node0_value);
      return fmt::format(
          "node {} orthogonalizes Muon's updates in {}, node 0 in {}: start every node from "
          "the same recipe",
          node, value, node0_value);
    case IdentityField::kRecipeHash:
      return fmt::format(
          "node {} runs recipe hash {}, node 0 runs {}: start every node from the same recipe",
          node, value, node0_value);
    case IdentityField::kDatasetXxh3:
      return fmt::format(
          "node {} reads dataset XXH3 {}, node 0 reads {}: give every node the same dataset "
          "files",
          node, value, node0_value);
    case IdentityField::kRanksPerNode:
      return fmt::format(
          "node {} runs {} ranks per node, node 0 runs {}: start every node with the same "
          "--ranks",
          node, value, node0_value);
  }
  return {};
}

std::string missing_message(const std::vector<uint32_t>& missing, const std::string& master,
                            milliseconds waited) {
  return fmt::format(
      "{} {} never joined the job at {} within {}: start {} with this master address, or "
      "raise the join timeout",
      missing.size() == 1 ? "node" : "nodes", fmt::join(missing, ", "), master,
      seconds_text(waited), missing.size() == 1 ? "it" : "them");
}

bool wildcard(const std::string& host) {
  return host == "0.0.0.0" || host == "::" || host == "[::]" || host == "*";
}

void refuse_newline(std::string_view what, const std::string& value) {
  if (value.find('\n') != std::string::npos)
    MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                 "this node's {} holds a line break, which a node identity cannot carry", what);
}

}  // namespace

std::string_view to_string(IdentityField field) {
  switch (field) {
    case IdentityField::kNodeCount:
      return "node count";
    case IdentityField::kBuild:
      return "build";
    case IdentityField::kMuonPrecision:
      return "Muon precision";
    case IdentityField::kRecipeHash:
      return "recipe hash";
    case IdentityField::kDatasetXxh3:
      return "dataset XXH3";
    case IdentityField::kRanksPerNode:
      return "ranks per node";
  }
  return "?";
}

NodeMismatch::NodeMismatch(uint32_t node, IdentityField field, std::string value,
                           std::string node0_value)
    : Error(ErrorKind::kInvalidArgument, mismatch_message(node, field, value, node0_value)),
      node_(node),
      field_(field),
      value_(std::move(value)),
      node0_value_(std::move(node0_value)) {}

NodesMissing::NodesMissing(std::vector<uint32_t> missing, const std::string& master,
                           milliseconds waited)
    : Error(ErrorKind::kTimeout, missing_message(missing, master, waited)),
      missing_(std::move(missing)) {}

JoinedJob::JoinedJob(std::vector<NodeIdentity> nodes, std::unique_ptr<StoreServer> server,
                     std::unique_ptr<StoreClient> client)
    : nodes_(std::move(nodes)), server_(std::move(server)), client_(std::move(client)) {}
JoinedJob::~JoinedJob() = default;
JoinedJob::JoinedJob(JoinedJob&&) noexcept = default;
JoinedJob& JoinedJob::operator=(JoinedJob&&) noexcept = default;

JoinedJob join_job(const NodePlacement& placement, const NodeIdentity& identity,
                   std::string_view secret_prefix, milliseconds timeout,
                   std::string_view last_round) {
  const auto deadline = Clock::now() + timeout;
  const std::string master = placement.master();
  if (placement.master_host.empty())
    MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                 "joining a job needs node 0's address: give --master ADDR:PORT");
  if (wildcard(placement.master_host))
    MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                 "master address {} is every interface of node 0, and the job's store has no "
                 "authentication: name node 0's address on the job's network",
                 placement.master_host);
  if (secret_prefix.empty())
    MEGACPP_FAIL(ErrorKind::kInternal, "join_job needs the job's secret prefix");
  refuse_newline("build", identity.build);
  refuse_newline("recipe hash", identity.recipe_hash);
  refuse_newline("dataset XXH3", identity.dataset_xxh3);
  refuse_newline("host name", identity.host);
  refuse_newline("Muon precision", identity.muon_precision);

  const uint32_t me = placement.node_rank;
  const uint32_t nodes = placement.nodes;
  std::string prefix(secret_prefix);  // then the round's
  const auto key = [&](std::string_view what, uint32_t node) {
    return fmt::format("{}/{}/{}", prefix, what, node);
  };

  std::unique_ptr<StoreServer> server;
  if (me == 0 && !placement.engine_store)
    server = std::make_unique<StoreServer>(placement.master_host, placement.master_port, nodes);
  std::unique_ptr<StoreClient> client;
  try {
    client = std::make_unique<StoreClient>(placement.master_host, placement.master_port,
                                           std::max(left(deadline), milliseconds(1)));
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::kTimeout) throw NodesMissing({0}, master, timeout);
    throw;
  }
  StoreClient& store = *client;

  // This start's round (see the declaration): node 0's fresh nonce.
  std::string round;
  const std::string round_key = prefix + "/round";
  if (me == 0) {
    std::random_device rd;
    round = fmt::format("{:08x}{:08x}", rd(), rd());
    store.set(round_key, round);
  } else {
    for (;;) {
      const auto v = store.get(round_key, left(deadline));
      if (v && *v != last_round) {
        round = *v;
        break;
      }
      if (left(deadline) <= milliseconds(0)) throw NodesMissing({0}, master, timeout);
      std::this_thread::sleep_for(milliseconds(50));
    }
  }
  prefix = fmt::format("{}/r{}", prefix, round);

  if (store.add(key("claim", me), 1) != 1)
    MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                 "node rank {} has already joined the job at {} from another process: give "
                 "every node its own node rank",
                 me, master);
  store.set(key("identity", me), encode(Record{identity, nodes}));

  // The verdict, in rank order; kept (not thrown) until node 0 has let everyone read.
  std::vector<NodeIdentity> joined;
  std::exception_ptr verdict;
  try {
    std::optional<Record> node0;
    for (uint32_t r = 0; r < nodes; ++r) {
      const auto text = store.get(key("identity", r), left(deadline));
      if (!text) {
        std::vector<uint32_t> missing{r};
        for (uint32_t later = r + 1; later < nodes; ++later)
          if (!store.get(key("identity", later), milliseconds(0))) missing.push_back(later);
        throw NodesMissing(std::move(missing), master, timeout);
      }
      auto record = decode(*text);
      if (!record)
        MEGACPP_FAIL(ErrorKind::kProtocol,
                     "node {}'s identity in the job's store at {} is not one this megacpp "
                     "writes: another program wrote under the job's keys, or node {} runs "
                     "another megacpp",
                     r, master, r);
      if (r == 0) node0 = record;
      if (auto d = first_difference(*record, *node0))
        throw NodeMismatch(r, std::get<0>(*d), std::get<1>(*d), std::get<2>(*d));
      joined.push_back(std::move(record->identity));
    }
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::kSystem) throw;  // the store itself failed: nothing to mark
    verdict = std::current_exception();
  }
  store.set(key("done", me), "");

  if (me == 0) {
    // The store stays up for every node that joins by the deadline, even after node 0 has
    // its verdict (a mismatch found before a later node arrived): that node reads the same
    // records and reaches the same verdict. It needs nothing more from the store once it has
    // marked done, which it does by its own deadline: at most `timeout` after this one.
    const auto linger = deadline + timeout;
    for (uint32_t r = 1; r < nodes; ++r)
      if (store.get(key("identity", r), left(deadline)))
        (void)store.get(key("done", r), left(linger));
  }
  if (verdict) std::rethrow_exception(verdict);
  JoinedJob job(std::move(joined), std::move(server), std::move(client));
  job.round_ = std::move(round);
  return job;
}

}  // namespace megacpp::supervisor
