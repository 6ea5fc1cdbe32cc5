// supervisor/membership.h: a job's nodes joining through node 0's c10d TCPStore, each node a
// thread of this process on 127.0.0.1 (the store is libmegacpp_store.so, loaded from beside the
// test). Every node must reach the same verdict: the full membership, or the same one line
// naming the node and the field that differs, or the nodes that never joined.
#include "supervisor/membership.h"

#include <netinet/in.h>
#include <sys/socket.h>

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/fd.h"
#include "supervisor/rendezvous.h"
#include "tests/unit/placement_test_support.h"

namespace {

using megacpp::Error;
using megacpp::ErrorKind;
using megacpp::supervisor::IdentityField;
using megacpp::supervisor::join_job;
using megacpp::supervisor::JoinedJob;
using megacpp::supervisor::NodeIdentity;
using megacpp::supervisor::NodeMismatch;
using megacpp::supervisor::NodePlacement;
using megacpp::supervisor::NodesMissing;
using megacpp::supervisor::StoreClient;
using std::chrono::milliseconds;

constexpr char kPrefix[] = "job-7f3a9c1e5b2d4866";

// A port nothing listens on now (bound to 127.0.0.1:0, then released): node 0 must be told
// its port before it starts, like every other node.
uint16_t free_port() {
  megacpp::Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  EXPECT_EQ(::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  EXPECT_EQ(::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&a), &len), 0);
  return ntohs(a.sin_port);
}

NodePlacement place(uint32_t nodes, uint32_t rank, uint16_t port) {
  return megacpp::supervisor::test::loopback_placement(nodes, rank, port);
}

// Every node its own host name: the full-membership tests also check that hosts are not
// compared.
NodeIdentity identity(uint32_t rank) {
  return NodeIdentity{.build = "0123abcd release gcc 12.2.0 torch 2.11.0",
                      .recipe_hash = "9a41c2d07e55b3f1",
                      .muon_precision = "bfloat16 (auto: cpu with avx512_bf16)",
                      .dataset_xxh3 = "5d0c9e2a7b13f486",
                      .ranks_per_node = 2,
                      .host = "node" + std::to_string(rank)};
}

// What one node's join_job gave: the job (kept alive until every node is done: node 0's
// holds the store), or the error it threw.
struct Outcome {
  std::optional<JoinedJob> job;
  std::unique_ptr<Error> error;
  std::optional<NodeMismatch> mismatch;
  std::optional<NodesMissing> missing;
};

// Runs node r of `ids` (nullopt: node r never starts) on its own thread, `late` after the
// others if r is `late_node`; joins them all.
std::vector<Outcome> run_job(const std::vector<std::optional<NodeIdentity>>& ids,
                             milliseconds timeout, uint16_t port,
                             std::optional<uint32_t> late_node = std::nullopt,
                             milliseconds late = milliseconds(0)) {
  const auto nodes = static_cast<uint32_t>(ids.size());
  std::vector<Outcome> out(nodes);
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < nodes; ++r) {
    if (!ids[r]) continue;
    threads.emplace_back([&, r] {
      if (late_node == r) std::this_thread::sleep_for(late);
      try {
        out[r].job.emplace(join_job(place(nodes, r, port), *ids[r], kPrefix, timeout));
      } catch (const NodeMismatch& e) {
        out[r].mismatch.emplace(e);
        out[r].error = std::make_unique<Error>(e);
      } catch (const NodesMissing& e) {
        out[r].missing.emplace(e);
        out[r].error = std::make_unique<Error>(e);
      } catch (const Error& e) {
        out[r].error = std::make_unique<Error>(e);
      }
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

std::vector<std::optional<NodeIdentity>> same(uint32_t nodes) {
  std::vector<std::optional<NodeIdentity>> ids;
  for (uint32_t r = 0; r < nodes; ++r) ids.emplace_back(identity(r));
  return ids;
}

void expect_full_membership(uint32_t nodes) {
  const auto out = run_job(same(nodes), milliseconds(10000), free_port());
  for (uint32_t r = 0; r < nodes; ++r) {
    ASSERT_TRUE(out[r].job) << "node " << r << ": " << out[r].error->message();
    ASSERT_EQ(out[r].job->nodes().size(), nodes) << "node " << r;
    for (uint32_t n = 0; n < nodes; ++n)
      EXPECT_EQ(out[r].job->nodes()[n], identity(n)) << "node " << r << " sees node " << n;
  }
}

TEST(Membership, TwoIdenticalNodesEachSeeTheFullMembership) {
  expect_full_membership(2);
}

TEST(Membership, ThreeIdenticalNodesEachSeeTheFullMembership) {
  expect_full_membership(3);
}

// Every node (the differing one too) throws the same NodeMismatch: node, field, both values.
void expect_mismatch_everywhere(const std::vector<Outcome>& out, uint32_t node, IdentityField field,
                                const std::string& words, const std::string& value,
                                const std::string& node0_value) {
  for (uint32_t r = 0; r < out.size(); ++r) {
    ASSERT_TRUE(out[r].mismatch) << "node " << r << " reached no mismatch: "
                                 << (out[r].error ? out[r].error->message() : "joined");
    const NodeMismatch& e = *out[r].mismatch;
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_EQ(e.node(), node) << "node " << r;
    EXPECT_EQ(e.field(), field) << "node " << r;
    EXPECT_EQ(e.value(), value);
    EXPECT_EQ(e.node0_value(), node0_value);
    const std::string& m = e.message();
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    EXPECT_NE(m.find("node " + std::to_string(node) + " "), std::string::npos) << m;
    EXPECT_NE(m.find(words), std::string::npos) << m;
    EXPECT_NE(m.find(value), std::string::npos) << m;
    EXPECT_NE(m.find(node0_value), std::string::npos) << m;
    EXPECT_EQ(m, out[0].mismatch->message()) << "node " << r << " says it otherwise";
  }
}

TEST(Membership, ARecipeHashMismatchOnNode1IsNamedOnEveryNode) {
  auto ids = same(3);
  ids[1]->recipe_hash = "3f00aa11bb22cc33";
  const auto out = run_job(ids, milliseconds(10000), free_port());
  expect_mismatch_everywhere(out, 1, IdentityField::kRecipeHash, "recipe hash", "3f00aa11bb22cc33",
                             "9a41c2d07e55b3f1");
}

// Node 0 has its verdict before node 2 arrives: its store stays up until node 2 has read it.
TEST(Membership, ANodeArrivingAfterTheVerdictReachesTheSameOne) {
  auto ids = same(3);
  ids[1]->recipe_hash = "3f00aa11bb22cc33";
  const auto out = run_job(ids, milliseconds(10000), free_port(), 2, milliseconds(1500));
  expect_mismatch_everywhere(out, 1, IdentityField::kRecipeHash, "recipe hash", "3f00aa11bb22cc33",
                             "9a41c2d07e55b3f1");
}

// muon_bf16 = "auto" on a node without bfloat16 units settles float32, which changes its recipe's
// hash too: the precision is named (with the key that settles it), not the hash.
TEST(Membership, APrecisionAutoSettledOtherwiseByANodesCpuNamesTheRecipeKey) {
  auto ids = same(3);
  ids[2]->muon_precision = "float32 (auto: cpu without bfloat16 matrix units)";
  ids[2]->recipe_hash = "77aa00bb11cc22dd";
  const auto out = run_job(ids, milliseconds(10000), free_port());
  expect_mismatch_everywhere(out, 2, IdentityField::kMuonPrecision, "muon_bf16 = true or false",
                             "float32 (auto: cpu without bfloat16 matrix units)",
                             "bfloat16 (auto: cpu with avx512_bf16)");
}

// Explicit precisions that differ are different recipes.
TEST(Membership, ExplicitPrecisionsThatDifferAskForTheSameRecipe) {
  auto ids = same(2);
  ids[0]->muon_precision = "bfloat16 (the recipe)";
  ids[1]->muon_precision = "float32 (the recipe)";
  ids[1]->recipe_hash = "77aa00bb11cc22dd";
  const auto out = run_job(ids, milliseconds(10000), free_port());
  expect_mismatch_everywhere(out, 1, IdentityField::kMuonPrecision, "the same recipe",
                             "float32 (the recipe)", "bfloat16 (the recipe)");
}

// Different bfloat16 units orthogonalize alike: the nodes join.
TEST(Membership, BfloatUnitsThatDifferStillJoin) {
  auto ids = same(2);
  ids[1]->muon_precision = "bfloat16 (auto: cpu with amx_bf16 avx512_bf16)";
  const auto out = run_job(ids, milliseconds(10000), free_port());
  for (uint32_t r = 0; r < 2; ++r)
    ASSERT_TRUE(out[r].job) << "node " << r << ": " << out[r].error->message();
  EXPECT_EQ(out[0].job->nodes()[1].muon_precision, ids[1]->muon_precision);
}

TEST(Membership, ADatasetMismatchOnNode2IsNamedOnEveryNode) {
  auto ids = same(3);
  ids[2]->dataset_xxh3 = "ffffeeee00001111";
  const auto out = run_job(ids, milliseconds(10000), free_port());
  expect_mismatch_everywhere(out, 2, IdentityField::kDatasetXxh3, "dataset XXH3",
                             "ffffeeee00001111", "5d0c9e2a7b13f486");
}

TEST(Membership, ABuildMismatchIsNamedOnEveryNode) {
  auto ids = same(2);
  ids[1]->build = "4567cdef+dirty release gcc 12.2.0 torch 2.11.0";
  const auto out = run_job(ids, milliseconds(10000), free_port());
  expect_mismatch_everywhere(out, 1, IdentityField::kBuild, "build", ids[1]->build, ids[0]->build);
}

TEST(Membership, ARanksPerNodeMismatchIsNamedOnEveryNode) {
  auto ids = same(2);
  ids[1]->ranks_per_node = 4;
  const auto out = run_job(ids, milliseconds(10000), free_port());
  expect_mismatch_everywhere(out, 1, IdentityField::kRanksPerNode, "ranks per node", "4", "2");
}

TEST(Membership, ANodeThatNeverStartsIsNamedOnTheOthersWithTheMaster) {
  auto ids = same(3);
  ids[2].reset();
  const uint16_t port = free_port();
  const auto t0 = std::chrono::steady_clock::now();
  const auto out = run_job(ids, milliseconds(1500), port);
  const auto took = std::chrono::steady_clock::now() - t0;
  for (uint32_t r = 0; r < 2; ++r) {
    ASSERT_TRUE(out[r].missing) << "node " << r << ": "
                                << (out[r].error ? out[r].error->message() : "joined");
    EXPECT_EQ(out[r].missing->kind(), ErrorKind::kTimeout);
    EXPECT_EQ(out[r].missing->missing(), std::vector<uint32_t>{2});
    const std::string& m = out[r].missing->message();
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    EXPECT_NE(m.find("node 2 never joined"), std::string::npos) << m;
    EXPECT_NE(m.find("127.0.0.1:" + std::to_string(port)), std::string::npos) << m;
  }
  // Bounded: the join timeout, then node 0's linger for node 1's verdict (immediate here).
  EXPECT_LT(took, std::chrono::seconds(6));
}

TEST(Membership, EveryNodeMissingAtTheDeadlineIsNamed) {
  auto ids = same(4);
  ids[1].reset();
  ids[3].reset();
  // 3 s: node 2 must have joined by then on a loaded 2-core machine too (1 s was not enough).
  const auto out = run_job(ids, milliseconds(3000), free_port());
  for (uint32_t r : {0u, 2u}) {
    ASSERT_TRUE(out[r].missing) << "node " << r;
    EXPECT_EQ(out[r].missing->missing(), (std::vector<uint32_t>{1, 3}));
    EXPECT_NE(out[r].missing->message().find("nodes 1, 3 never joined"), std::string::npos)
        << out[r].missing->message();
  }
}

TEST(Membership, WithoutNode0TheOthersNameNode0) {
  auto ids = same(2);
  ids[0].reset();
  const uint16_t port = free_port();
  const auto out = run_job(ids, milliseconds(1000), port);
  ASSERT_TRUE(out[1].missing) << (out[1].error ? out[1].error->message() : "joined");
  EXPECT_EQ(out[1].missing->missing(), std::vector<uint32_t>{0});
  EXPECT_NE(out[1].missing->message().find("127.0.0.1:" + std::to_string(port)), std::string::npos);
}

TEST(Membership, AClientUnderAnotherPrefixSeesNothingOfTheJob) {
  const uint16_t port = free_port();
  auto out = run_job(same(2), milliseconds(10000), port);
  ASSERT_TRUE(out[0].job && out[1].job);  // node 0's store is up while out lives

  StoreClient stranger("127.0.0.1", port, milliseconds(5000));
  // Every node joined node 0's round, under the job's prefix.
  EXPECT_EQ(out[0].job->round(), out[1].job->round());
  const std::string round = std::string(kPrefix) + "/r" + out[0].job->round();
  // The job's key is there under the job's prefix (so a miss below is the prefix's doing) ...
  EXPECT_TRUE(stranger.get(round + "/identity/0", milliseconds(0)));
  // ... and nothing of it under any other.
  for (const std::string other : {"job-0000000000000000", "", "job"}) {
    for (const char* what : {"/identity/0", "/identity/1", "/claim/0", "/done/1"})
      EXPECT_FALSE(stranger.get(other + what, milliseconds(0))) << other << what;
  }
  // A node joining under another prefix finds no node 0 there and does not count as node 1.
  try {
    join_job(place(2, 1, port), identity(1), "job-0000000000000000", milliseconds(500));
    ADD_FAILURE() << "a node under another prefix joined the job";
  } catch (const NodesMissing& e) {
    EXPECT_EQ(e.missing(), std::vector<uint32_t>{0}) << e.message();
  }
  EXPECT_EQ(out[0].job->store().add(round + "/claim/1", 0), 1);
}

// A node that restarts alone does not rejoin the round it joined last (its claims are there):
// it waits for node 0's next start, and names node 0 missing at the deadline.
TEST(Membership, ANodeRestartedAloneWaitsForNodeZerosNextRound) {
  const uint16_t port = free_port();
  auto out = run_job(same(2), milliseconds(10000), port);
  ASSERT_TRUE(out[0].job && out[1].job);
  try {
    join_job(place(2, 1, port), identity(1), kPrefix, milliseconds(500), out[1].job->round());
    ADD_FAILURE() << "node 1 rejoined the round it had joined";
  } catch (const NodesMissing& e) {
    EXPECT_EQ(e.missing(), std::vector<uint32_t>{0}) << e.message();
  }
}

TEST(Membership, ANodeRankClaimedTwiceIsRefusedOnTheSecond) {
  const uint16_t port = free_port();
  auto out = run_job(same(2), milliseconds(10000), port);
  ASSERT_TRUE(out[0].job && out[1].job);
  try {
    join_job(place(2, 1, port), identity(1), kPrefix, milliseconds(2000));
    ADD_FAILURE() << "a second node 1 joined";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(e.message().find("node rank 1 has already joined"), std::string::npos) << e.message();
  }
}

TEST(Membership, AWildcardMasterIsRefusedBeforeAnythingListens) {
  auto p = place(2, 0, free_port());
  for (const std::string host : {"0.0.0.0", "::"}) {
    p.master_host = host;
    try {
      join_job(p, identity(0), kPrefix, milliseconds(500));
      ADD_FAILURE() << host << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      EXPECT_NE(e.message().find("every interface"), std::string::npos) << e.message();
    }
  }
}

TEST(StoreClient, GetReturnsAbsentOnTimeoutAndTheValueOnceSet) {
  megacpp::supervisor::StoreServer server("127.0.0.1", 0, 1);
  StoreClient c("127.0.0.1", server.port(), milliseconds(5000));
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(c.get("k", milliseconds(200)));
  EXPECT_GE(std::chrono::steady_clock::now() - t0, milliseconds(150));
  c.set("k", std::string("a\0b", 3));
  EXPECT_EQ(c.get("k", milliseconds(200)), std::string("a\0b", 3));
  EXPECT_EQ(c.add("n", 2), 2);
  EXPECT_EQ(c.add("n", 3), 5);
}

TEST(StoreClient, NoStoreAtTheAddressIsATimeoutNamingIt) {
  const uint16_t port = free_port();
  try {
    StoreClient c("127.0.0.1", port, milliseconds(300));
    ADD_FAILURE() << "connected to nothing";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kTimeout) << e.message();
    EXPECT_NE(e.message().find("127.0.0.1:" + std::to_string(port)), std::string::npos)
        << e.message();
  }
}

}  // namespace
