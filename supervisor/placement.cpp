#include "supervisor/placement.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>

#include <fmt/format.h>

#include "core/error.h"
#include "core/knobs.h"

namespace megacpp::supervisor {

namespace {

// The most names one bracket range may give (Slurm's MAX_RANGE) and one host list in all.
constexpr uint64_t kMaxRange = 64 * 1024;
constexpr size_t kMaxHosts = 1 << 20;

[[noreturn]] void refuse(std::string line) {
  throw Error(ErrorKind::kInvalidArgument, std::move(line));
}

// A value as the user can see it on one line: control characters become '?'.
std::string printable(std::string_view s) {
  std::string out(s);
  for (char& c : out) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  }
  return out;
}

bool all_digits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// A value and who stated it: a flag ("--node-rank 1") or a variable ("SLURM_NODEID=1").
struct Said {
  std::string name;
  std::string value;
  bool flag = false;

  std::string text() const {
    return flag ? fmt::format("{} {}", name, printable(value))
                : fmt::format("{}={}", name, printable(value));
  }
};

std::optional<Said> variable(const Environment& env, std::string_view name) {
  const auto it = env.find(name);
  if (it == env.end() || it->second.empty()) return std::nullopt;
  return Said{std::string(name), it->second, false};
}

std::optional<Said> flag(const std::optional<std::string>& value, std::string_view name) {
  if (!value) return std::nullopt;
  return Said{std::string(name), *value, true};
}

std::string_view knob_name(Knob k) {
  return knob_spec(k).name;
}

uint32_t whole_number(const Said& s) {
  if (!all_digits(s.value) || s.value.size() > 10)
    refuse(fmt::format("{} is not a whole number", s.text()));
  const uint64_t v = std::stoull(s.value);
  if (v > std::numeric_limits<uint32_t>::max()) refuse(fmt::format("{} is too large", s.text()));
  return static_cast<uint32_t>(v);
}

uint32_t node_count(const Said& s) {
  if (s.name == "PET_NNODES" && s.value.find(':') != std::string::npos)
    refuse(
        fmt::format("{} is an elastic range, which only torchrun's rendezvous settles: start "
                    "megacpp as torchrun's worker (torchrun --nproc-per-node 1 --no-python "
                    "megacpp run ...)",
                    s.text()));
  const uint32_t n = whole_number(s);
  if (n == 0) refuse(fmt::format("{}: a job has at least one node", s.text()));
  if (n > kMaxHosts) refuse(fmt::format("{}: more than {} nodes", s.text(), kMaxHosts));
  return n;
}

std::optional<uint16_t> parse_port(const std::string& text) {
  if (!all_digits(text) || text.size() > 5) return std::nullopt;
  const unsigned long v = std::stoul(text);
  if (v < 1 || v > 65535) return std::nullopt;
  return static_cast<uint16_t>(v);
}

uint16_t port_number(const Said& s) {
  const auto port = parse_port(s.value);
  if (!port) refuse(fmt::format("{} is not a port (1-65535)", s.text()));
  return *port;
}

bool plain_host(std::string_view h) {
  return !h.empty() && std::none_of(h.begin(), h.end(), [](char c) {
    return static_cast<unsigned char>(c) <= 0x20 || c == 0x7f || c == '[' || c == ']' || c == '/';
  });
}

struct Address {
  std::string host;
  std::optional<uint16_t> port;
};

// ADDR, ADDR:PORT, [V6], [V6]:PORT, or a bare V6 address (two or more ':', no port).
Address parse_master(const Said& s) {
  const std::string& v = s.value;
  auto bad = [&] {
    refuse(
        fmt::format("{} is not ADDR[:PORT] (an IPv6 address with a port: [ADDR]:PORT)", s.text()));
  };
  Address a;
  std::string port;
  if (v.starts_with('[')) {
    const auto close = v.find(']');
    if (close == std::string::npos) bad();
    a.host = v.substr(1, close - 1);
    const std::string rest = v.substr(close + 1);
    if (!rest.empty()) {
      if (!rest.starts_with(':')) bad();
      port = rest.substr(1);
      if (port.empty()) bad();
    }
  } else if (std::count(v.begin(), v.end(), ':') == 1) {
    const auto colon = v.find(':');
    a.host = v.substr(0, colon);
    port = v.substr(colon + 1);
    if (port.empty()) bad();
  } else {
    a.host = v;
  }
  if (!plain_host(a.host)) bad();
  if (!port.empty()) {
    a.port = parse_port(port);
    if (!a.port) refuse(fmt::format("{}: {} is not a port (1-65535)", s.text(), port));
  }
  return a;
}

std::string host_of(const Said& s) {
  if (!plain_host(s.value)) refuse(fmt::format("{} is not a host name or address", s.text()));
  return s.value;
}

// What one engine of the environment says. A `said` beside a value means the engine states it
// (a flag may not contradict it); a value without one is derived (a flag overrides it).
struct EngineView {
  std::string source;
  std::optional<Said> nodes;
  std::optional<Said> node_rank;
  std::optional<std::string> derived_host;  // Slurm's first host, the pattern's node 0
  std::optional<Said> master_addr;          // MASTER_ADDR
  std::optional<Said> master_port;          // MEGACPP_MASTER_PORT, else MASTER_PORT
  std::vector<std::string> hosts;
  std::optional<Said> host_pattern;
  std::string job_id;
  std::optional<Said> attempt;
  std::string nodes_hint;     // how to give a missing node count, in the engine's terms
  std::string rank_hint;      // how to give a missing node rank
  bool engine_store = false;  // NodePlacement::engine_store
};

void read_master(const Environment& env, EngineView& e) {
  e.master_addr = variable(env, "MASTER_ADDR");
  e.master_port = variable(env, knob_name(Knob::kMasterPort));
  if (!e.master_port) e.master_port = variable(env, "MASTER_PORT");
}

bool torchrun_present(const Environment& env) {
  for (const char* name : {"GROUP_RANK", "PET_NNODES", "PET_NODE_RANK", "TORCHELASTIC_RUN_ID"}) {
    if (variable(env, name)) return true;
  }
  return false;
}

// torchrun's worker (GROUP_RANK set: `torchrun --nproc-per-node 1 --no-python megacpp run`)
// takes its place from the rendezvous, which under c10d need not match PET_NODE_RANK; started
// by a PyTorchJob without torchrun, from the operator's PET_* variables.
EngineView read_torchrun(const Environment& env) {
  EngineView e;
  e.source = "torchrun";
  if (auto group_rank = variable(env, "GROUP_RANK")) {
    if (auto local = variable(env, "LOCAL_WORLD_SIZE"); local && local->value != "1")
      refuse(
          fmt::format("{}: torchrun starts one megacpp per node, which starts the node's "
                      "ranks itself: pass torchrun --nproc-per-node 1",
                      local->text()));
    e.node_rank = group_rank;
    e.nodes = variable(env, "GROUP_WORLD_SIZE");
    if (!e.nodes) e.nodes = variable(env, "PET_NNODES");
    if (auto id = variable(env, "TORCHELASTIC_RUN_ID")) e.job_id = id->value;
  } else {
    e.node_rank = variable(env, "PET_NODE_RANK");
    e.nodes = variable(env, "PET_NNODES");
    if (auto id = variable(env, "TORCHELASTIC_RUN_ID")) {
      e.job_id = id->value;
    } else if (auto rdzv = variable(env, "PET_RDZV_ID")) {
      e.job_id = rdzv->value;
    }
  }
  e.attempt = variable(env, "TORCHELASTIC_RESTART_COUNT");
  read_master(env, e);
  // torchrun's worker under its agent store: MASTER_ADDR:MASTER_PORT is torchrun's TCPStore on
  // node 0, serving already; the job keeps its keys there (under its secret prefix) instead of
  // hosting a second store on a port of its own (MEGACPP_MASTER_PORT chooses that instead).
  if (auto agent = variable(env, "TORCHELASTIC_USE_AGENT_STORE");
      agent && agent->value == "True" && variable(env, "GROUP_RANK") &&
      !variable(env, knob_name(Knob::kMasterPort)))
    e.engine_store = true;
  e.nodes_hint = "set PET_NNODES or pass --nodes";
  e.rank_hint = "set PET_NODE_RANK or pass --node-rank";
  return e;
}

bool slurm_present(const Environment& env) {
  return variable(env, "SLURM_JOB_ID") || variable(env, "SLURM_NNODES") ||
         variable(env, "SLURM_NODEID");
}

// Inside an srun step the step's variables describe the nodes that run it (SLURM_NODEID is
// relative to the step); the job's describe the allocation (an sbatch script, or srun -N 1
// inside a larger allocation).
EngineView read_slurm(const Environment& env) {
  EngineView e;
  e.source = "slurm";
  for (const char* name : {"SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"}) {
    if (!e.nodes) e.nodes = variable(env, name);
  }
  e.node_rank = variable(env, "SLURM_NODEID");
  std::optional<Said> list;
  for (const char* name : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}) {
    if (!list) list = variable(env, name);
  }
  if (list) {
    e.hosts = expand_hostlist(list->value, list->name);
    if (e.hosts.empty()) refuse(fmt::format("{} names no host", list->text()));
    if (e.nodes && e.hosts.size() != node_count(*e.nodes))
      refuse(
          fmt::format("{} names {} host(s) but {}", list->text(), e.hosts.size(), e.nodes->text()));
    e.derived_host = e.hosts.front();
  }
  if (auto id = variable(env, "SLURM_JOB_ID")) e.job_id = id->value;
  e.attempt = variable(env, "SLURM_RESTART_COUNT");
  read_master(env, e);
  e.nodes_hint = "SLURM_NNODES is not set (start megacpp with srun)";
  e.rank_hint = "SLURM_NODEID is not set (start megacpp with srun, one task per node)";
  return e;
}

// An Indexed Job's index alone does not make its pods one job (Indexed Jobs also run sweeps of
// independent runs): MEGACPP_NODES, or --nodes, says they are.
bool kubernetes_present(const Environment& env, const PlacementFlags& flags) {
  return variable(env, "JOB_COMPLETION_INDEX") &&
         (variable(env, knob_name(Knob::kNodes)) || flags.nodes);
}

EngineView read_kubernetes(const Environment& env) {
  EngineView e;
  e.source = "kubernetes";
  e.nodes = variable(env, knob_name(Knob::kNodes));
  e.node_rank = variable(env, "JOB_COMPLETION_INDEX");
  e.host_pattern = variable(env, knob_name(Knob::kHostPattern));
  if (e.host_pattern && e.host_pattern->value.find("{index}") == std::string::npos)
    refuse(
        fmt::format("{} has no {{index}} (where each node's rank goes, e.g. "
                    "myjob-workers-0-{{index}}.myjob)",
                    e.host_pattern->text()));
  read_master(env, e);
  e.nodes_hint = fmt::format("set {} or pass --nodes", knob_name(Knob::kNodes));
  e.rank_hint = "JOB_COMPLETION_INDEX is not set";
  return e;
}

std::string replace_all(std::string s, std::string_view what, std::string_view with) {
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + with.size()))
    s.replace(at, what.size(), with);
  return s;
}

[[noreturn]] void conflict(const Said& flag_said, const Said& env_said, std::string_view source) {
  refuse(fmt::format("{} disagrees with {} ({}): drop the flag, or fix the job's environment",
                     flag_said.text(), env_said.text(), source));
}

// Linux interface names: 1-15 bytes, no '/', ':' or whitespace.
bool interface_name(std::string_view s) {
  return !s.empty() && s.size() < 16 && s != "." && s != ".." &&
         std::none_of(s.begin(), s.end(), [](char c) {
           return static_cast<unsigned char>(c) <= 0x20 || c == 0x7f || c == '/' || c == ':' ||
                  c == ',';
         });
}

// --iface, else GLOO_SOCKET_IFNAME, else NCCL_SOCKET_IFNAME when it names one interface
// (NCCL's prefix lists, "^docker,lo", leave the choice to NCCL: empty). A flag that contradicts
// GLOO_SOCKET_IFNAME is refused: Gloo would read the variable.
std::string resolve_iface(const PlacementFlags& flags, const Environment& env) {
  const auto gloo = variable(env, "GLOO_SOCKET_IFNAME");
  if (auto f = flag(flags.iface, "--iface")) {
    if (!interface_name(f->value))
      refuse(fmt::format("{} is not a network interface name", f->text()));
    if (gloo && gloo->value != f->value) conflict(*f, *gloo, "Gloo");
    return f->value;
  }
  if (gloo) {
    if (!interface_name(gloo->value))
      refuse(fmt::format("{} is not one network interface name", gloo->text()));
    return gloo->value;
  }
  if (auto nccl = variable(env, "NCCL_SOCKET_IFNAME")) {
    std::string_view v = nccl->value;
    if (v.starts_with('=')) v.remove_prefix(1);
    if (interface_name(v) && !v.starts_with('^')) return std::string(v);
  }
  return "";
}

}  // namespace

Environment environment_of(char* const* envp) {
  Environment env;
  for (; envp != nullptr && *envp != nullptr; ++envp) {
    const std::string_view kv = *envp;
    const auto eq = kv.find('=');
    if (eq == std::string_view::npos) continue;
    env.emplace(std::string(kv.substr(0, eq)), std::string(kv.substr(eq + 1)));
  }
  return env;
}

std::string NodePlacement::master() const {
  if (master_host.empty()) return "";
  return master_host.find(':') != std::string::npos
             ? fmt::format("[{}]:{}", master_host, master_port)
             : fmt::format("{}:{}", master_host, master_port);
}

std::vector<std::string> expand_hostlist(std::string_view list, std::string_view what) {
  auto bad = [&](std::string_view why) {
    refuse(fmt::format("{}={} is not a Slurm host list: {}", what, printable(list), why));
  };
  // Top-level entries: commas inside brackets belong to the bracket.
  std::vector<std::string_view> entries;
  bool open = false;
  size_t start = 0;
  for (size_t i = 0; i < list.size(); ++i) {
    const char c = list[i];
    if (static_cast<unsigned char>(c) <= 0x20 || c == 0x7f) bad("it holds whitespace");
    if (c == '[') {
      if (open) bad("a '[' inside a bracket");
      open = true;
    } else if (c == ']') {
      if (!open) bad("a ']' without its '['");
      open = false;
    } else if (c == ',' && !open) {
      entries.push_back(list.substr(start, i - start));
      start = i + 1;
    }
  }
  if (open) bad("a '[' is not closed");
  entries.push_back(list.substr(start));

  std::vector<std::string> hosts;
  for (const std::string_view entry : entries) {
    if (entry.empty()) continue;  // "a,,b" and a trailing comma, as scontrol skips them
    // texts[0] group[0] texts[1] group[1] ... texts[k]; brackets are balanced (checked above).
    std::vector<std::string> texts;
    std::vector<std::vector<std::string>> groups;
    size_t at = 0;
    while (true) {
      const size_t lb = entry.find('[', at);
      texts.emplace_back(entry.substr(at, lb == std::string_view::npos ? lb : lb - at));
      if (lb == std::string_view::npos) break;
      const size_t rb = entry.find(']', lb);
      const std::string_view inside = entry.substr(lb + 1, rb - lb - 1);
      std::vector<std::string> numbers;
      size_t from = 0;
      while (true) {
        const size_t comma = inside.find(',', from);
        const std::string_view item = inside.substr(
            from, comma == std::string_view::npos ? std::string_view::npos : comma - from);
        const size_t dash = item.find('-');
        const std::string_view lo = item.substr(0, dash);
        const std::string_view hi = dash == std::string_view::npos ? lo : item.substr(dash + 1);
        if (!all_digits(lo) || !all_digits(hi) || lo.size() > 18 || hi.size() > 18)
          bad(fmt::format("[{}] holds '{}', not a number or a lo-hi range", inside, item));
        const uint64_t l = std::stoull(std::string(lo)), h = std::stoull(std::string(hi));
        if (h < l) bad(fmt::format("the range {} runs backwards", item));
        if (h - l + 1 > kMaxRange)
          bad(fmt::format("the range {} names more than {} hosts", item, kMaxRange));
        for (uint64_t n = l; n <= h; ++n) numbers.push_back(fmt::format("{:0{}}", n, lo.size()));
        if (comma == std::string_view::npos) break;
        from = comma + 1;
      }
      groups.push_back(std::move(numbers));
      at = rb + 1;
    }
    if (!groups.empty() && !texts.back().empty())
      bad(fmt::format("'{}' follows the last bracket of {}", texts.back(), entry));
    size_t count = 1;
    for (const auto& g : groups) {
      count *= g.size();
      if (count > kMaxHosts) bad(fmt::format("it names more than {} hosts", kMaxHosts));
    }
    if (hosts.size() + count > kMaxHosts)
      bad(fmt::format("it names more than {} hosts", kMaxHosts));
    // scontrol's order: the last bracket varies fastest, then the first, the second, ...
    // (most significant first: k-2, k-3, ..., 0, then k-1).
    const size_t k = groups.size();
    std::vector<size_t> significance;  // most significant first
    for (size_t j = k >= 2 ? k - 1 : 0; j-- > 0;) significance.push_back(j);
    if (k > 0) significance.push_back(k - 1);
    std::vector<size_t> index(k, 0);
    while (true) {
      std::string name = texts[0];
      for (size_t j = 0; j < k; ++j) name += groups[j][index[j]] + texts[j + 1];
      hosts.push_back(std::move(name));
      size_t d = significance.size();
      while (d > 0) {
        const size_t j = significance[d - 1];
        if (++index[j] < groups[j].size()) break;
        index[j] = 0;
        --d;
      }
      if (d == 0) break;
    }
  }
  return hosts;
}

NodePlacement resolve_placement(const PlacementFlags& flags, const Environment& env) {
  const auto f_nodes = flag(flags.nodes, "--nodes");
  const auto f_rank = flag(flags.node_rank, "--node-rank");
  const auto f_master = flag(flags.master, "--master");
  // Flags are checked first, so a bad flag is named even when the environment is bad too.
  const uint32_t flag_nodes = f_nodes ? node_count(*f_nodes) : 0;
  const uint32_t flag_rank = f_rank ? whole_number(*f_rank) : 0;
  const std::optional<Address> flag_master =
      f_master ? std::optional(parse_master(*f_master)) : std::nullopt;

  std::optional<EngineView> engine;
  if (torchrun_present(env)) {
    engine = read_torchrun(env);
  } else if (slurm_present(env)) {
    engine = read_slurm(env);
  } else if (kubernetes_present(env, flags)) {
    engine = read_kubernetes(env);
  }

  NodePlacement p;
  p.source = engine ? engine->source : flags.any_placement() ? "flags" : "single";

  // The node count and this node's rank: a flag may fill what the engine lacks, never
  // contradict what it states.
  std::optional<Said> nodes_said, rank_said;
  if (engine && engine->nodes) {
    const uint32_t n = node_count(*engine->nodes);
    if (f_nodes && flag_nodes != n) conflict(*f_nodes, *engine->nodes, engine->source);
    p.nodes = n;
    nodes_said = engine->nodes;
  } else if (f_nodes) {
    p.nodes = flag_nodes;
    nodes_said = f_nodes;
  } else if (engine) {
    refuse(fmt::format("{} gives no node count: {}", engine->source, engine->nodes_hint));
  } else if (f_rank) {
    refuse(fmt::format("{} needs --nodes, the job's node count", f_rank->text()));
  }
  if (engine && engine->node_rank) {
    const uint32_t r = whole_number(*engine->node_rank);
    if (f_rank && flag_rank != r) conflict(*f_rank, *engine->node_rank, engine->source);
    p.node_rank = r;
    rank_said = engine->node_rank;
  } else if (f_rank) {
    p.node_rank = flag_rank;
    rank_said = f_rank;
  } else if (p.nodes > 1) {
    refuse(engine ? fmt::format("{} gives no node rank for its {} nodes: {}", engine->source,
                                p.nodes, engine->rank_hint)
                  : fmt::format("{} needs --node-rank, this node's place (0..{})",
                                nodes_said->text(), p.nodes - 1));
  }
  if (p.node_rank >= p.nodes)
    refuse(fmt::format("{} is not below {}: node ranks run 0..{}", rank_said->text(),
                       nodes_said ? nodes_said->text() : "the node count 1", p.nodes - 1));
  p.nodes_from = nodes_said ? nodes_said->text() : "";

  // Node 0's address: a stated MASTER_ADDR / port binds the flag; a derived one yields to it.
  if (engine && engine->host_pattern) {
    for (uint32_t i = 0; i < p.nodes; ++i)
      engine->hosts.push_back(
          replace_all(engine->host_pattern->value, "{index}", std::to_string(i)));
    engine->derived_host = engine->hosts.front();
    if (!plain_host(*engine->derived_host))
      refuse(fmt::format("{} does not give a host name", engine->host_pattern->text()));
  }
  std::optional<std::string> host;
  std::optional<uint16_t> port;
  if (engine && engine->master_addr) {
    host = host_of(*engine->master_addr);
    if (flag_master && flag_master->host != *host)
      conflict(*f_master, *engine->master_addr, engine->source);
  } else if (flag_master) {
    host = flag_master->host;
  } else if (engine && engine->derived_host) {
    host = engine->derived_host;
  }
  if (engine && engine->master_port) {
    port = port_number(*engine->master_port);
    if (flag_master && flag_master->port && *flag_master->port != *port)
      conflict(*f_master, *engine->master_port, engine->source);
  } else if (flag_master && flag_master->port) {
    port = flag_master->port;
  }
  if (!host && p.nodes > 1) {
    refuse(fmt::format("{} but no address for node 0: {}", nodes_said->text(),
                       engine && engine->source == "kubernetes"
                           ? fmt::format("set MASTER_ADDR or {}, or pass --master ADDR:PORT",
                                         knob_name(Knob::kHostPattern))
                       : engine ? "set MASTER_ADDR, or pass --master ADDR:PORT"
                                : "pass --master ADDR:PORT"));
  }
  if (host) {
    p.master_host = *host;
    p.master_port = port.value_or(kDefaultMasterPort);
  }

  if (engine) {
    p.hosts = engine->hosts;
    p.job_id = engine->job_id;
    if (engine->attempt) p.attempt = whole_number(*engine->attempt);
    p.engine_store = engine->engine_store && engine->master_addr &&
                     p.master_host == host_of(*engine->master_addr);
  }
  p.iface = resolve_iface(flags, env);
  return p;
}

std::optional<std::string> interface_address(const std::string& iface) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return std::nullopt;
  std::optional<std::string> out;
  for (ifaddrs* a = list; a != nullptr && !out; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET || iface != a->ifa_name)
      continue;
    char text[INET_ADDRSTRLEN] = {};
    const auto* in = reinterpret_cast<const sockaddr_in*>(a->ifa_addr);
    if (::inet_ntop(AF_INET, &in->sin_addr, text, sizeof text) != nullptr) out = text;
  }
  ::freeifaddrs(list);
  return out;
}

}  // namespace megacpp::supervisor
