// supervisor/placement.h: a node's place in a job from flags, torchrun, Slurm and Kubernetes,
// their precedence, and every refusal (one line naming the flag or variable). Hermetic: the
// environment is a map. The host-list expectations are what Slurm 22.05's
// `scontrol show hostnames` printed for the same lists.
#include "supervisor/placement.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/error.h"

namespace {

using megacpp::Error;
using megacpp::ErrorKind;
using megacpp::supervisor::Environment;
using megacpp::supervisor::environment_of;
using megacpp::supervisor::expand_hostlist;
using megacpp::supervisor::kDefaultMasterPort;
using megacpp::supervisor::NodePlacement;
using megacpp::supervisor::PlacementFlags;
using megacpp::supervisor::resolve_placement;
using Hosts = std::vector<std::string>;

Hosts expand(std::string_view list) {
  return expand_hostlist(list, "SLURM_JOB_NODELIST");
}

// The message of the Error{kInvalidArgument} `f` throws; fails the test when it throws none.
template <class F>
std::string refusal(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.message();
    EXPECT_EQ(e.message().find('\n'), std::string::npos) << "not one line: " << e.message();
    return e.message();
  }
  ADD_FAILURE() << "no refusal";
  return "";
}

std::string refusal(const PlacementFlags& flags, const Environment& env) {
  return refusal([&] { (void)resolve_placement(flags, env); });
}

std::string hostlist_refusal(std::string_view list) {
  return refusal([&] { (void)expand(list); });
}

Environment slurm(std::string nnodes, std::string nodeid, std::string list) {
  return {{"SLURM_JOB_ID", "4242"},
          {"SLURM_NNODES", std::move(nnodes)},
          {"SLURM_NODEID", std::move(nodeid)},
          {"SLURM_JOB_NODELIST", std::move(list)}};
}

// ---------------------------------------------------------------------------------------------
// Host lists

TEST(Hostlist, RangesAndListsInOneBracket) {
  EXPECT_EQ(expand("node[01-04,07]"), (Hosts{"node01", "node02", "node03", "node04", "node07"}));
  EXPECT_EQ(expand("n[2,1]"), (Hosts{"n2", "n1"}));  // written order, not sorted
  EXPECT_EQ(expand("n[1,1]"), (Hosts{"n1", "n1"}));  // duplicates kept
  EXPECT_EQ(expand("n[0-0]"), (Hosts{"n0"}));
  EXPECT_EQ(expand("[1-2]"), (Hosts{"1", "2"}));
  EXPECT_EQ(expand("plain"), (Hosts{"plain"}));
  EXPECT_EQ(expand("gpu-a.b_c"), (Hosts{"gpu-a.b_c"}));
}

TEST(Hostlist, ZeroPaddingIsLosWidth) {
  EXPECT_EQ(expand("x[08-10]"), (Hosts{"x08", "x09", "x10"}));
  EXPECT_EQ(expand("n[8-10]"), (Hosts{"n8", "n9", "n10"}));
  EXPECT_EQ(expand("n[008-10]"), (Hosts{"n008", "n009", "n010"}));
  EXPECT_EQ(expand("n[1-02]"), (Hosts{"n1", "n2"}));
  EXPECT_EQ(expand("n[00-2]"), (Hosts{"n00", "n01", "n02"}));
  EXPECT_EQ(expand("n[1-010]").size(), 10u);
  EXPECT_EQ(expand("n[1-010]").back(), "n10");
}

TEST(Hostlist, TopLevelCommasAndBracketCommas) {
  EXPECT_EQ(expand("n[1-3],m5,x[08-10]"), (Hosts{"n1", "n2", "n3", "m5", "x08", "x09", "x10"}));
  EXPECT_EQ(expand("n[1-2],n[1]"), (Hosts{"n1", "n2", "n1"}));
  // Empty entries are skipped, as scontrol skips them.
  EXPECT_EQ(expand(",n1"), (Hosts{"n1"}));
  EXPECT_EQ(expand("n[1-3],"), (Hosts{"n1", "n2", "n3"}));
  EXPECT_EQ(expand("n,,m"), (Hosts{"n", "m"}));
  EXPECT_TRUE(expand("").empty());
}

TEST(Hostlist, SeveralBracketsExpandInScontrolsOrder) {
  EXPECT_EQ(expand("a[1-2]-b[3-4]"), (Hosts{"a1-b3", "a1-b4", "a2-b3", "a2-b4"}));
  EXPECT_EQ(expand("n[1-3]-[4-5]"), (Hosts{"n1-4", "n1-5", "n2-4", "n2-5", "n3-4", "n3-5"}));
  EXPECT_EQ(expand("n[1][2]"), (Hosts{"n12"}));
  // Three and four brackets: the last varies fastest, then the first, then the second, ...
  EXPECT_EQ(expand("a[1-2]b[3-4]c[5-6]"), (Hosts{"a1b3c5", "a1b3c6", "a2b3c5", "a2b3c6", "a1b4c5",
                                                 "a1b4c6", "a2b4c5", "a2b4c6"}));
  EXPECT_EQ(expand("a[1-3]b[4-5]c[6-7]"),
            (Hosts{"a1b4c6", "a1b4c7", "a2b4c6", "a2b4c7", "a3b4c6", "a3b4c7", "a1b5c6", "a1b5c7",
                   "a2b5c6", "a2b5c7", "a3b5c6", "a3b5c7"}));
  EXPECT_EQ(expand("a[1,3]b[4]c[6-7]"), (Hosts{"a1b4c6", "a1b4c7", "a3b4c6", "a3b4c7"}));
  EXPECT_EQ(expand("a[1-2]b[3-4]c[5-6]d[7-8]"),
            (Hosts{"a1b3c5d7", "a1b3c5d8", "a2b3c5d7", "a2b3c5d8", "a1b4c5d7", "a1b4c5d8",
                   "a2b4c5d7", "a2b4c5d8", "a1b3c6d7", "a1b3c6d8", "a2b3c6d7", "a2b3c6d8",
                   "a1b4c6d7", "a1b4c6d8", "a2b4c6d7", "a2b4c6d8"}));
  EXPECT_EQ(expand("a[1-2]b[3-4],c[1-2]d[5-6]e[7-8]"),
            (Hosts{"a1b3", "a1b4", "a2b3", "a2b4", "c1d5e7", "c1d5e8", "c2d5e7", "c2d5e8", "c1d6e7",
                   "c1d6e8", "c2d6e7", "c2d6e8"}));
}

TEST(Hostlist, BadSyntaxIsOneLineNamingTheVariable) {
  struct Case {
    const char* list;
    const char* why;
  };
  for (const Case& c :
       {Case{"n[10-8]", "runs backwards"}, Case{"n[1-3", "not closed"},
        Case{"n1-3]", "without its '['"}, Case{"n[]", "not a number"},
        Case{"n[a-b]", "not a number"}, Case{"n[1--2]", "not a number"},
        Case{"n[-2]", "not a number"}, Case{"n[2-]", "not a number"}, Case{"n[,1]", "not a number"},
        Case{"n[1,]", "not a number"}, Case{"n[+1]", "not a number"},
        Case{"n[1-0x3]", "not a number"}, Case{"n[1-2]x", "follows the last bracket"},
        Case{"x[1-2]y[3-4]z", "follows the last bracket"}, Case{"n[1-2]]", "without its '['"},
        Case{"n[[1]]", "inside a bracket"}, Case{"n [1]", "whitespace"},
        Case{"n[1-3 ]", "whitespace"}, Case{"n[1-100000]", "more than 65536"}}) {
    const std::string m = hostlist_refusal(c.list);
    EXPECT_NE(m.find(std::string("SLURM_JOB_NODELIST=") + c.list), std::string::npos) << m;
    EXPECT_NE(m.find(c.why), std::string::npos) << c.list << ": " << m;
  }
  // A newline in the value does not break the line.
  EXPECT_NE(hostlist_refusal("n\n1").find("SLURM_JOB_NODELIST=n?1"), std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// Sources

TEST(Placement, NothingIsASingleNode) {
  const NodePlacement p = resolve_placement({}, {{"PATH", "/bin"}, {"HOME", "/root"}});
  EXPECT_EQ(p.source, "single");
  EXPECT_EQ(p.nodes, 1u);
  EXPECT_EQ(p.node_rank, 0u);
  EXPECT_EQ(p.master_host, "");
  EXPECT_EQ(p.master_port, 0);
  EXPECT_EQ(p.master(), "");
  EXPECT_TRUE(p.hosts.empty());
  EXPECT_EQ(p.job_id, "");
  EXPECT_EQ(p.attempt, 0u);
  EXPECT_EQ(p.nodes_from, "");
  // A stray MASTER_ADDR alone places nothing.
  EXPECT_EQ(resolve_placement({}, {{"MASTER_ADDR", "10.0.0.1"}}).source, "single");
}

TEST(Placement, Flags) {
  const NodePlacement p = resolve_placement(
      {.nodes = "4", .node_rank = "3", .master = "head:29600", .iface = "eth1"}, {});
  EXPECT_EQ(p.source, "flags");
  EXPECT_EQ(p.nodes, 4u);
  EXPECT_EQ(p.node_rank, 3u);
  EXPECT_EQ(p.master_host, "head");
  EXPECT_EQ(p.master_port, 29600);
  EXPECT_EQ(p.master(), "head:29600");
  EXPECT_EQ(p.iface, "eth1");
  EXPECT_EQ(p.nodes_from, "--nodes 4");
  // No port: the default. IPv6, bracketed with a port or bare without one.
  EXPECT_EQ(
      resolve_placement({.nodes = "2", .node_rank = "0", .master = "10.1.2.3"}, {}).master_port,
      kDefaultMasterPort);
  const auto v6 =
      resolve_placement({.nodes = "2", .node_rank = "1", .master = "[fd00::1]:7000"}, {});
  EXPECT_EQ(v6.master_host, "fd00::1");
  EXPECT_EQ(v6.master_port, 7000);
  EXPECT_EQ(v6.master(), "[fd00::1]:7000");
  EXPECT_EQ(resolve_placement({.nodes = "2", .node_rank = "1", .master = "fd00::1"}, {}).master(),
            "[fd00::1]:29500");
  // --nodes 1 needs neither a rank nor a master.
  const auto one = resolve_placement({.nodes = "1"}, {});
  EXPECT_EQ(one.source, "flags");
  EXPECT_EQ(one.nodes, 1u);
  EXPECT_EQ(one.master(), "");
}

TEST(Placement, Slurm) {
  Environment env = slurm("4", "2", "node[01-04]");
  env["SLURM_RESTART_COUNT"] = "1";
  const NodePlacement p = resolve_placement({}, env);
  EXPECT_EQ(p.source, "slurm");
  EXPECT_EQ(p.nodes, 4u);
  EXPECT_EQ(p.node_rank, 2u);
  EXPECT_EQ(p.hosts, (Hosts{"node01", "node02", "node03", "node04"}));
  EXPECT_EQ(p.master(), "node01:29500");
  EXPECT_EQ(p.job_id, "4242");
  EXPECT_EQ(p.attempt, 1u);
  EXPECT_EQ(p.nodes_from, "SLURM_NNODES=4");
  // The port: MEGACPP_MASTER_PORT over MASTER_PORT over the default.
  env["MASTER_PORT"] = "29700";
  EXPECT_EQ(resolve_placement({}, env).master_port, 29700);
  env["MEGACPP_MASTER_PORT"] = "29800";
  EXPECT_EQ(resolve_placement({}, env).master_port, 29800);
  // A job script's MASTER_ADDR (the head node on the fast network) over the first host.
  env["MASTER_ADDR"] = "10.9.0.1";
  EXPECT_EQ(resolve_placement({}, env).master(), "10.9.0.1:29800");
}

TEST(Placement, SlurmSingleNodeRunsAndSaysSlurm) {
  const NodePlacement p = resolve_placement({}, slurm("1", "0", "gpu17"));
  EXPECT_EQ(p.source, "slurm");
  EXPECT_EQ(p.nodes, 1u);
  EXPECT_EQ(p.master(), "gpu17:29500");
}

TEST(Placement, SlurmStepVariablesOverTheAllocations) {
  // srun -N 2 inside a 4-node allocation: the step's nodes, SLURM_NODEID relative to them.
  Environment env = slurm("4", "1", "n[1-4]");
  env["SLURM_STEP_NUM_NODES"] = "2";
  env["SLURM_STEP_NODELIST"] = "n[3-4]";
  const NodePlacement p = resolve_placement({}, env);
  EXPECT_EQ(p.nodes, 2u);
  EXPECT_EQ(p.hosts, (Hosts{"n3", "n4"}));
  EXPECT_EQ(p.master_host, "n3");
  EXPECT_EQ(p.nodes_from, "SLURM_STEP_NUM_NODES=2");
}

TEST(Placement, TorchrunWorker) {
  // `torchrun --nnodes 2 --nproc-per-node 1 --no-python megacpp run`: the rendezvous' rank
  // (GROUP_RANK), not PET_NODE_RANK, which c10d ignores.
  const Environment env = {{"GROUP_RANK", "1"},
                           {"GROUP_WORLD_SIZE", "2"},
                           {"LOCAL_WORLD_SIZE", "1"},
                           {"PET_NODE_RANK", "0"},
                           {"PET_NNODES", "1:2"},
                           {"MASTER_ADDR", "10.0.0.5"},
                           {"MASTER_PORT", "29400"},
                           {"TORCHELASTIC_RUN_ID", "job7"},
                           {"TORCHELASTIC_RESTART_COUNT", "3"}};
  const NodePlacement p = resolve_placement({}, env);
  EXPECT_EQ(p.source, "torchrun");
  EXPECT_EQ(p.nodes, 2u);
  EXPECT_EQ(p.node_rank, 1u);
  EXPECT_EQ(p.master(), "10.0.0.5:29400");
  EXPECT_EQ(p.job_id, "job7");
  EXPECT_EQ(p.attempt, 3u);
  EXPECT_EQ(p.nodes_from, "GROUP_WORLD_SIZE=2");
  EXPECT_TRUE(p.hosts.empty());
}

TEST(Placement, TorchrunsAgentStoreIsTheJobsUnlessMegacppNamesAPort) {
  Environment env = {{"GROUP_RANK", "0"},
                     {"GROUP_WORLD_SIZE", "2"},
                     {"LOCAL_WORLD_SIZE", "1"},
                     {"MASTER_ADDR", "node0"},
                     {"MASTER_PORT", "29400"},
                     {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                     {"TORCHELASTIC_RUN_ID", "job7"}};
  NodePlacement p = resolve_placement({}, env);
  EXPECT_TRUE(p.engine_store);
  EXPECT_EQ(p.master(), "node0:29400");
  // Without the agent store, or with a port of megacpp's own, node 0 hosts the job's store.
  env["TORCHELASTIC_USE_AGENT_STORE"] = "False";
  EXPECT_FALSE(resolve_placement({}, env).engine_store);
  env["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  env["MEGACPP_MASTER_PORT"] = "29517";
  p = resolve_placement({}, env);
  EXPECT_FALSE(p.engine_store);
  EXPECT_EQ(p.master(), "node0:29517");
  // Slurm's and the flags' jobs never use an engine's store.
  EXPECT_FALSE(
      resolve_placement({.nodes = "2", .node_rank = "0", .master = "h:1"}, {}).engine_store);
}

TEST(Placement, PyTorchJobWithoutTorchrun) {
  const Environment env = {{"PET_NNODES", "3"},
                           {"PET_NODE_RANK", "2"},
                           {"MASTER_ADDR", "myjob-master-0"},
                           {"MASTER_PORT", "23456"},
                           {"PET_RDZV_ID", "myjob"}};
  const NodePlacement p = resolve_placement({}, env);
  EXPECT_EQ(p.source, "torchrun");
  EXPECT_EQ(p.nodes, 3u);
  EXPECT_EQ(p.node_rank, 2u);
  EXPECT_EQ(p.master(), "myjob-master-0:23456");
  EXPECT_EQ(p.job_id, "myjob");
  EXPECT_EQ(p.attempt, 0u);
}

TEST(Placement, Kubernetes) {
  Environment env = {{"JOB_COMPLETION_INDEX", "2"},
                     {"MEGACPP_NODES", "3"},
                     {"MEGACPP_HOST_PATTERN", "train-workers-0-{index}.train"}};
  const NodePlacement p = resolve_placement({}, env);
  EXPECT_EQ(p.source, "kubernetes");
  EXPECT_EQ(p.nodes, 3u);
  EXPECT_EQ(p.node_rank, 2u);
  EXPECT_EQ(p.hosts, (Hosts{"train-workers-0-0.train", "train-workers-0-1.train",
                            "train-workers-0-2.train"}));
  EXPECT_EQ(p.master(), "train-workers-0-0.train:29500");
  EXPECT_EQ(p.nodes_from, "MEGACPP_NODES=3");
  // MASTER_ADDR over the pattern.
  env["MASTER_ADDR"] = "train-master";
  EXPECT_EQ(resolve_placement({}, env).master_host, "train-master");
  // The node count from --nodes instead of MEGACPP_NODES.
  const auto by_flag =
      resolve_placement({.nodes = "4"}, {{"JOB_COMPLETION_INDEX", "3"}, {"MASTER_ADDR", "m"}});
  EXPECT_EQ(by_flag.source, "kubernetes");
  EXPECT_EQ(by_flag.node_rank, 3u);
  EXPECT_EQ(by_flag.nodes_from, "--nodes 4");
  // An index with no node count is not a job across nodes (Indexed Jobs also run sweeps).
  EXPECT_EQ(resolve_placement({}, {{"JOB_COMPLETION_INDEX", "5"}}).source, "single");
}

TEST(Placement, Iface) {
  EXPECT_EQ(resolve_placement({.iface = "eth0"}, {}).iface, "eth0");
  EXPECT_EQ(resolve_placement({}, {{"GLOO_SOCKET_IFNAME", "ib0"}}).iface, "ib0");
  EXPECT_EQ(resolve_placement({}, {{"NCCL_SOCKET_IFNAME", "ens5"}}).iface, "ens5");
  EXPECT_EQ(resolve_placement({}, {{"NCCL_SOCKET_IFNAME", "=ens5"}}).iface, "ens5");
  EXPECT_EQ(
      resolve_placement({}, {{"GLOO_SOCKET_IFNAME", "ib0"}, {"NCCL_SOCKET_IFNAME", "ens5"}}).iface,
      "ib0");
  // NCCL's prefix lists leave the choice to NCCL.
  EXPECT_EQ(resolve_placement({}, {{"NCCL_SOCKET_IFNAME", "^docker,lo"}}).iface, "");
  EXPECT_EQ(resolve_placement({.iface = "eth0"}, {{"GLOO_SOCKET_IFNAME", "eth0"}}).iface, "eth0");
  EXPECT_EQ(resolve_placement({}, {}).iface, "");
}

TEST(Placement, EnvironmentOf) {
  char a[] = "A=1", b[] = "B=x=y", c[] = "NOEQUALS", d[] = "E=";
  char* envp[] = {a, b, c, d, nullptr};
  const Environment env = environment_of(envp);
  EXPECT_EQ(env, (Environment{{"A", "1"}, {"B", "x=y"}, {"E", ""}}));
  // "E=" counts as unset.
  EXPECT_EQ(resolve_placement({}, {{"SLURM_NNODES", ""}}).source, "single");
}

// ---------------------------------------------------------------------------------------------
// Precedence

TEST(Precedence, TorchrunOverSlurmOverKubernetes) {
  // srun torchrun ...: the rendezvous' rank, though it differs from SLURM_NODEID.
  Environment env = slurm("2", "0", "n[1-2]");
  env.insert({{"GROUP_RANK", "1"},
              {"GROUP_WORLD_SIZE", "2"},
              {"MASTER_ADDR", "n2"},
              {"TORCHELASTIC_RUN_ID", "t1"}});
  env.insert({{"JOB_COMPLETION_INDEX", "0"}, {"MEGACPP_NODES", "2"}});
  const NodePlacement p = resolve_placement({}, env);
  EXPECT_EQ(p.source, "torchrun");
  EXPECT_EQ(p.node_rank, 1u);
  EXPECT_EQ(p.master_host, "n2");
  EXPECT_EQ(p.job_id, "t1");
  EXPECT_TRUE(p.hosts.empty());
  // Slurm over Kubernetes.
  Environment sk = slurm("2", "1", "n[1-2]");
  sk.insert({{"JOB_COMPLETION_INDEX", "0"}, {"MEGACPP_NODES", "2"}});
  EXPECT_EQ(resolve_placement({}, sk).source, "slurm");
  EXPECT_EQ(resolve_placement({}, sk).node_rank, 1u);
}

TEST(Precedence, FlagsAgreeingOrFillingKeepTheEnginesName) {
  const Environment env = slurm("2", "1", "n[1-2]");
  const auto agree = resolve_placement({.nodes = "2", .node_rank = "1"}, env);
  EXPECT_EQ(agree.source, "slurm");
  EXPECT_EQ(agree.node_rank, 1u);
  // A derived master (Slurm's first host, the default port) yields to --master.
  const auto moved = resolve_placement({.master = "n2:31000"}, env);
  EXPECT_EQ(moved.source, "slurm");
  EXPECT_EQ(moved.master(), "n2:31000");
  // --master without a port keeps the engine's port.
  Environment with_port = env;
  with_port["MASTER_PORT"] = "29444";
  EXPECT_EQ(resolve_placement({.master = "n2"}, with_port).master(), "n2:29444");
}

// ---------------------------------------------------------------------------------------------
// Refusals

TEST(Refusals, AFlagContradictingTheEngineNamesBoth) {
  const Environment env = slurm("2", "0", "n[1-2]");
  std::string m = refusal({.node_rank = "1"}, env);
  EXPECT_NE(m.find("--node-rank 1 disagrees with SLURM_NODEID=0 (slurm)"), std::string::npos) << m;
  m = refusal({.nodes = "3"}, env);
  EXPECT_NE(m.find("--nodes 3 disagrees with SLURM_NNODES=2 (slurm)"), std::string::npos) << m;
  Environment tr = {
      {"PET_NNODES", "2"}, {"PET_NODE_RANK", "0"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "1234"}};
  m = refusal({.master = "b:1234"}, tr);
  EXPECT_NE(m.find("--master b:1234 disagrees with MASTER_ADDR=a (torchrun)"), std::string::npos)
      << m;
  m = refusal({.master = "a:999"}, tr);
  EXPECT_NE(m.find("--master a:999 disagrees with MASTER_PORT=1234 (torchrun)"), std::string::npos)
      << m;
  m = refusal({.node_rank = "0"},
              {{"GROUP_RANK", "1"}, {"GROUP_WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}});
  EXPECT_NE(m.find("--node-rank 0 disagrees with GROUP_RANK=1 (torchrun)"), std::string::npos) << m;
  m = refusal({.nodes = "4"},
              {{"JOB_COMPLETION_INDEX", "1"}, {"MEGACPP_NODES", "2"}, {"MASTER_ADDR", "a"}});
  EXPECT_NE(m.find("--nodes 4 disagrees with MEGACPP_NODES=2 (kubernetes)"), std::string::npos)
      << m;
  m = refusal({.iface = "eth1"}, {{"GLOO_SOCKET_IFNAME", "eth0"}});
  EXPECT_NE(m.find("--iface eth1 disagrees with GLOO_SOCKET_IFNAME=eth0"), std::string::npos) << m;
}

TEST(Refusals, BadNumbersNameTheirFlagOrVariable) {
  struct Case {
    PlacementFlags flags;
    Environment env;
    const char* needle;
  };
  const std::vector<Case> cases = {
      {{.nodes = "two"}, {}, "--nodes two is not a whole number"},
      {{.nodes = "-1"}, {}, "--nodes -1 is not a whole number"},
      {{.nodes = "0"}, {}, "--nodes 0: a job has at least one node"},
      {{.nodes = "99999999999"}, {}, "--nodes 99999999999 is not a whole number"},
      {{.nodes = "4294967296"}, {}, "--nodes 4294967296 is too large"},
      {{.nodes = "2", .node_rank = "x", .master = "h"}, {}, "--node-rank x is not a whole number"},
      {{.nodes = "2", .node_rank = "2", .master = "h"},
       {},
       "--node-rank 2 is not below --nodes 2: node ranks run 0..1"},
      {{.nodes = "2", .node_rank = "0", .master = "h:0"}, {}, "--master h:0: 0 is not a port"},
      {{.nodes = "2", .node_rank = "0", .master = "h:65536"},
       {},
       "--master h:65536: 65536 is not a port"},
      {{.nodes = "2", .node_rank = "0", .master = "h:x"}, {}, "--master h:x: x is not a port"},
      {{.nodes = "2", .node_rank = "0", .master = "h:"}, {}, "--master h: is not ADDR[:PORT]"},
      {{.nodes = "2", .node_rank = "0", .master = ":80"}, {}, "--master :80 is not ADDR[:PORT]"},
      {{.nodes = "2", .node_rank = "0", .master = "[::1"}, {}, "--master [::1 is not ADDR[:PORT]"},
      {{.iface = "a/b"}, {}, "--iface a/b is not a network interface name"},
      {{.iface = "a-very-long-interface"}, {}, "is not a network interface name"},
      {{}, slurm("zero", "0", "n1"), "SLURM_NNODES=zero is not a whole number"},
      {{}, slurm("0", "0", "n1"), "SLURM_NNODES=0: a job has at least one node"},
      {{}, slurm("2", "2", "n[1-2]"), "SLURM_NODEID=2 is not below SLURM_NNODES=2"},
      {{}, slurm("2", "-1", "n[1-2]"), "SLURM_NODEID=-1 is not a whole number"},
      {{},
       slurm("2", "0", "n[1-3]"),
       "SLURM_JOB_NODELIST=n[1-3] names 3 host(s) but SLURM_NNODES=2"},
      {{}, slurm("2", "0", "n[1-"), "SLURM_JOB_NODELIST=n[1- is not a Slurm host list"},
      {{}, slurm("1", "0", ","), "SLURM_JOB_NODELIST=, names no host"},
      {{},
       [] {
         auto e = slurm("2", "0", "n[1-2]");
         e["MEGACPP_MASTER_PORT"] = "70000";
         return e;
       }(),
       "MEGACPP_MASTER_PORT=70000 is not a port (1-65535)"},
      {{},
       [] {
         auto e = slurm("2", "0", "n[1-2]");
         e["SLURM_RESTART_COUNT"] = "again";
         return e;
       }(),
       "SLURM_RESTART_COUNT=again is not a whole number"},
      {{}, {{"PET_NNODES", "1:4"}, {"PET_NODE_RANK", "0"}}, "PET_NNODES=1:4 is an elastic range"},
      {{},
       {{"PET_NNODES", "2"},
        {"PET_NODE_RANK", "0"},
        {"MASTER_ADDR", "a"},
        {"MASTER_PORT", "99999"}},
       "MASTER_PORT=99999 is not a port"},
      {{},
       {{"GROUP_RANK", "0"}, {"GROUP_WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "8"}},
       "LOCAL_WORLD_SIZE=8: torchrun starts one megacpp per node"},
      {{},
       {{"GROUP_RANK", "0"}, {"GROUP_WORLD_SIZE", "1"}, {"TORCHELASTIC_RESTART_COUNT", "x"}},
       "TORCHELASTIC_RESTART_COUNT=x is not a whole number"},
      {{},
       {{"JOB_COMPLETION_INDEX", "3"}, {"MEGACPP_NODES", "3"}, {"MASTER_ADDR", "m"}},
       "JOB_COMPLETION_INDEX=3 is not below MEGACPP_NODES=3"},
      {{},
       {{"JOB_COMPLETION_INDEX", "0"}, {"MEGACPP_NODES", "2"}, {"MEGACPP_HOST_PATTERN", "w-0"}},
       "MEGACPP_HOST_PATTERN=w-0 has no {index}"},
      {{},
       {{"GLOO_SOCKET_IFNAME", "eth0,eth1"}},
       "GLOO_SOCKET_IFNAME=eth0,eth1 is not one network"},
  };
  for (const Case& c : cases) {
    const std::string m = refusal(c.flags, c.env);
    EXPECT_NE(m.find(c.needle), std::string::npos) << "want: " << c.needle << "\ngot:  " << m;
  }
}

TEST(Refusals, WhatAJobAcrossNodesLacks) {
  struct Case {
    PlacementFlags flags;
    Environment env;
    const char* needle;
  };
  const std::vector<Case> cases = {
      {{.nodes = "2", .master = "h"}, {}, "--nodes 2 needs --node-rank, this node's place (0..1)"},
      {{.nodes = "2", .node_rank = "1"}, {}, "--nodes 2 but no address for node 0: pass --master"},
      {{.node_rank = "1"}, {}, "--node-rank 1 needs --nodes"},
      {{},
       {{"PET_NODE_RANK", "1"}},
       "torchrun gives no node count: set PET_NNODES or pass --nodes"},
      {{},
       {{"PET_NNODES", "2"}, {"MASTER_ADDR", "a"}},
       "torchrun gives no node rank for its 2 nodes"},
      {{},
       {{"PET_NNODES", "2"}, {"PET_NODE_RANK", "1"}},
       "PET_NNODES=2 but no address for node 0: set MASTER_ADDR"},
      {{}, {{"SLURM_JOB_ID", "1"}}, "slurm gives no node count: SLURM_NNODES is not set"},
      {{},
       {{"SLURM_JOB_ID", "1"}, {"SLURM_NNODES", "2"}, {"SLURM_JOB_NODELIST", "n[1-2]"}},
       "slurm gives no node rank for its 2 nodes: SLURM_NODEID is not set"},
      {{},
       {{"JOB_COMPLETION_INDEX", "1"}, {"MEGACPP_NODES", "2"}},
       "MEGACPP_NODES=2 but no address for node 0: set MASTER_ADDR or MEGACPP_HOST_PATTERN"},
  };
  for (const Case& c : cases) {
    const std::string m = refusal(c.flags, c.env);
    EXPECT_NE(m.find(c.needle), std::string::npos) << "want: " << c.needle << "\ngot:  " << m;
  }
}

}  // namespace
