// megacpp::supervisor::Metrics and MetricsServer: the rendered exposition text (content,
// order, escaping, completeness per declared stage), promtool's verdict on it, and the HTTP
// server over real loopback sockets.
#include "supervisor/metrics.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"

namespace megacpp::supervisor {
namespace {

namespace fs = std::filesystem;
using schema::StageKind;

constexpr const char* kPromtool = "/usr/bin/promtool";

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

bool has_line(const std::string& text, const std::string& line) {
  for (const auto& l : lines_of(text)) {
    if (l == line) return true;
  }
  return false;
}

// The sample lines of one family (name or name_bucket/_sum/_count for histograms), in order.
std::vector<std::string> samples_of(const std::string& text, const std::string& name) {
  std::vector<std::string> out;
  for (const auto& l : lines_of(text)) {
    if (l.rfind(name + "{", 0) == 0 || l.rfind(name + " ", 0) == 0) out.push_back(l);
  }
  return out;
}

// A fully populated registry: two trainers, every service stage, queues, a checkpoint.
void populate(Metrics& m) {
  m.declare_stage(StageKind::DATA_LOADER, 0);
  m.declare_stage(StageKind::TRAINER, 0);
  m.declare_stage(StageKind::TRAINER, 1);
  m.declare_stage(StageKind::COLLECTOR, 0);
  m.declare_stage(StageKind::CHECKPOINTER, 0);
  m.set_up(StageKind::TRAINER, 0, true);
  m.set_heartbeat(StageKind::TRAINER, 0, 1700000000.125);
  m.set_last_step(StageKind::TRAINER, 0, 12, 1700000000.5);
  m.add_restart(StageKind::COLLECTOR, 0);
  m.add_exit(StageKind::COLLECTOR, schema::FailureKind::STALLED);
  m.add_exit(StageKind::TRAINER, schema::FailureKind::SIGNALED);
  m.set_trainer_progress(0, 12, 49152);
  m.observe_step_seconds(0, 0.02);
  m.observe_step_seconds(0, 0.3);
  m.observe_step_seconds(0, 120);
  m.set_queue("data_loader->trainer-0", 3, 4);
  m.set_queue("data_loader->trainer-1", 0, 4);
  m.set_checkpoint(10, 0.25, 1700000001);
  m.set_collector_lag(0.75);
  m.set_validation(10, 2.5);  // PromtoolCheckMetricsIsSilent checks these families too
}

// Runs promtool check metrics on `text`; returns its exit status and combined output.
std::pair<int, std::string> promtool_check(const std::string& text) {
  fs::path file = fs::temp_directory_path() / ("megacpp-metrics-" + std::to_string(::getpid()));
  {
    std::ofstream f(file, std::ios::binary);
    f << text;
  }
  std::string cmd = std::string(kPromtool) + " check metrics < " + file.string() + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  EXPECT_NE(p, nullptr);
  std::string out;
  char buf[4096];
  size_t n;
  while (p && (n = std::fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  int status = p ? ::pclose(p) : -1;
  fs::remove(file);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

struct HttpReply {
  int status = 0;
  std::map<std::string, std::string> headers;  // names lower-cased
  std::string body;
};

// A minimal HTTP/1.1 client over a real loopback socket (Connection: close, read to EOF).
HttpReply http_get(uint16_t port, const std::string& path) {
  int fd = SYSCALL_CHECK(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  timeval tv{10, 0};  // bounds a broken server, never asserted on
  SYSCALL_CHECK(::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  SYSCALL_CHECK(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)));
  std::string req = "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
  SYSCALL_CHECK(::send(fd, req.data(), req.size(), MSG_NOSIGNAL));
  std::string raw;
  char buf[8192];
  for (;;) {
    ssize_t n = SYSCALL_CHECK(::recv(fd, buf, sizeof(buf), 0));
    if (n == 0) break;
    raw.append(buf, n);
  }
  ::close(fd);
  HttpReply r;
  auto head_end = raw.find("\r\n\r\n");
  MEGACPP_CHECK(head_end != std::string::npos, ErrorKind::kProtocol, "no end of headers");
  auto head = raw.substr(0, head_end);
  r.body = raw.substr(head_end + 4);
  std::istringstream in(head);
  std::string line;
  std::getline(in, line);
  r.status = std::atoi(line.substr(line.find(' ') + 1).c_str());
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string name = line.substr(0, colon);
    for (auto& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    r.headers[name] = line.substr(line.find_first_not_of(' ', colon + 1));
  }
  return r;
}

// Local addresses (hex, as in /proc/net/tcp) of the TCP sockets listening on `port`.
std::set<std::string> listening_addresses(uint16_t port) {
  std::set<std::string> out;
  std::ifstream f("/proc/net/tcp");
  std::string line;
  std::getline(f, line);  // header
  char want[8];
  std::snprintf(want, sizeof(want), "%04X", port);
  while (std::getline(f, line)) {
    std::istringstream in(line);
    std::string slot, local, remote, state;
    in >> slot >> local >> remote >> state;
    auto colon = local.find(':');
    if (state == "0A" && local.substr(colon + 1) == want) out.insert(local.substr(0, colon));
  }
  return out;
}

TEST(Metrics, FreshRegistryRendersOnlyGlobalFamilies) {
  Metrics m("0.1.0", "abc123", "2.11.0");
  std::string text = m.render();
  EXPECT_TRUE(
      has_line(text, R"(megacpp_build_info{version="0.1.0",revision="abc123",torch="2.11.0"} 1)"))
      << text;
  EXPECT_TRUE(has_line(text, "megacpp_checkpoint_last_committed_step 0"));
  EXPECT_TRUE(has_line(text, "megacpp_checkpoint_last_duration_seconds 0"));
  EXPECT_TRUE(has_line(text, "megacpp_checkpoint_last_committed_timestamp_seconds 0"));
  EXPECT_TRUE(has_line(text, "megacpp_collector_lag_seconds 0"));
  EXPECT_EQ(text.find("megacpp_stage_"), std::string::npos) << text;
  EXPECT_EQ(text.find("megacpp_queue_"), std::string::npos) << text;
}

// The whole text minus the HELP lines (their wording is free): families, TYPEs, order, values.
TEST(Metrics, RenderContentAndOrder) {
  Metrics m("0.1.0", "abc123", "2.11.0");
  m.declare_stage(StageKind::TRAINER, 1);
  m.declare_stage(StageKind::COLLECTOR, 0);
  m.set_up(StageKind::TRAINER, 1, true);
  m.set_heartbeat(StageKind::TRAINER, 1, 1700000000.25);
  m.set_last_step(StageKind::TRAINER, 1, 7, 1700000000.5);
  m.set_progress(StageKind::COLLECTOR, 0, 1700000000.75);
  m.add_restart(StageKind::COLLECTOR, 0);
  m.add_exit(StageKind::COLLECTOR, schema::FailureKind::STALLED);
  m.set_trainer_progress(1, 7, 3584);
  m.observe_step_seconds(1, 0.02);
  m.observe_step_seconds(1, 0.025);  // on a bucket bound: le is "less than or equal"
  m.observe_step_seconds(1, 100);    // above the last bound: +Inf only
  m.set_queue("data_loader->trainer-1", 3, 4);
  m.set_checkpoint(5, 0.125, 1700000001);
  m.set_collector_lag(0.5);
  m.add_job_restart();

  std::string expected = R"(# TYPE megacpp_stage_up gauge
megacpp_stage_up{stage="collector",rank="0"} 0
megacpp_stage_up{stage="trainer",rank="1"} 1
# TYPE megacpp_stage_last_heartbeat_timestamp_seconds gauge
megacpp_stage_last_heartbeat_timestamp_seconds{stage="collector",rank="0"} 0
megacpp_stage_last_heartbeat_timestamp_seconds{stage="trainer",rank="1"} 1700000000.25
# TYPE megacpp_stage_last_progress_timestamp_seconds gauge
megacpp_stage_last_progress_timestamp_seconds{stage="collector",rank="0"} 1700000000.75
megacpp_stage_last_progress_timestamp_seconds{stage="trainer",rank="1"} 0
# TYPE megacpp_stage_last_step gauge
megacpp_stage_last_step{stage="collector",rank="0"} 0
megacpp_stage_last_step{stage="trainer",rank="1"} 7
# TYPE megacpp_stage_last_step_timestamp_seconds gauge
megacpp_stage_last_step_timestamp_seconds{stage="collector",rank="0"} 0
megacpp_stage_last_step_timestamp_seconds{stage="trainer",rank="1"} 1700000000.5
# TYPE megacpp_stage_restarts_total counter
megacpp_stage_restarts_total{stage="collector",rank="0"} 1
megacpp_stage_restarts_total{stage="trainer",rank="1"} 0
# TYPE megacpp_stage_exits_total counter
megacpp_stage_exits_total{stage="collector",reason="clean"} 0
megacpp_stage_exits_total{stage="collector",reason="exited"} 0
megacpp_stage_exits_total{stage="collector",reason="heartbeat_lost"} 0
megacpp_stage_exits_total{stage="collector",reason="hung"} 0
megacpp_stage_exits_total{stage="collector",reason="signaled"} 0
megacpp_stage_exits_total{stage="collector",reason="stalled"} 1
megacpp_stage_exits_total{stage="collector",reason="torn_down"} 0
megacpp_stage_exits_total{stage="trainer",reason="clean"} 0
megacpp_stage_exits_total{stage="trainer",reason="exited"} 0
megacpp_stage_exits_total{stage="trainer",reason="heartbeat_lost"} 0
megacpp_stage_exits_total{stage="trainer",reason="hung"} 0
megacpp_stage_exits_total{stage="trainer",reason="signaled"} 0
megacpp_stage_exits_total{stage="trainer",reason="stalled"} 0
megacpp_stage_exits_total{stage="trainer",reason="torn_down"} 0
# TYPE megacpp_trainer_steps_total counter
megacpp_trainer_steps_total{rank="1"} 7
# TYPE megacpp_trainer_tokens_total counter
megacpp_trainer_tokens_total{rank="1"} 3584
# TYPE megacpp_trainer_step_duration_seconds histogram
megacpp_trainer_step_duration_seconds_bucket{rank="1",le="0.005"} 0
megacpp_trainer_step_duration_seconds_bucket{rank="1",le="0.01"} 0
megacpp_trainer_step_duration_seconds_bucket{rank="1",le="0.025"} 2
megacpp_trainer_step_duration_seconds_bucket{rank="1",le="0.05"} 2
megacpp_trainer_step_duration_seconds_bucket{rank="1",le="0.1"} 2
megacpp_trainer_step_duration_seconds_bucket{rank="1",le="0.25"} 2
megacpp_trainer_step_duration_seconds_bucket{rank="1",le="0.5"} 2
megacpp_trainer_step_duration_seconds_bucket{rank="1",le="1"} 2
megacpp_trainer_step_duration_seconds_bucket{rank="1",le="2.5"} 2
megacpp_trainer_step_duration_seconds_bucket{rank="1",le="5"} 2
megacpp_trainer_step_duration_seconds_bucket{rank="1",le="10"} 2
megacpp_trainer_step_duration_seconds_bucket{rank="1",le="20"} 2
megacpp_trainer_step_duration_seconds_bucket{rank="1",le="30"} 2
megacpp_trainer_step_duration_seconds_bucket{rank="1",le="60"} 2
megacpp_trainer_step_duration_seconds_bucket{rank="1",le="+Inf"} 3
megacpp_trainer_step_duration_seconds_sum{rank="1"} 100.045
megacpp_trainer_step_duration_seconds_count{rank="1"} 3
# TYPE megacpp_queue_depth gauge
megacpp_queue_depth{edge="data_loader->trainer-1"} 3
# TYPE megacpp_queue_capacity gauge
megacpp_queue_capacity{edge="data_loader->trainer-1"} 4
# TYPE megacpp_job_restarts_total counter
megacpp_job_restarts_total 1
# TYPE megacpp_checkpoint_last_committed_step gauge
megacpp_checkpoint_last_committed_step 5
# TYPE megacpp_checkpoint_last_duration_seconds gauge
megacpp_checkpoint_last_duration_seconds 0.125
# TYPE megacpp_checkpoint_last_committed_timestamp_seconds gauge
megacpp_checkpoint_last_committed_timestamp_seconds 1700000001
# TYPE megacpp_collector_lag_seconds gauge
megacpp_collector_lag_seconds 0.5
# TYPE megacpp_build_info gauge
megacpp_build_info{version="0.1.0",revision="abc123",torch="2.11.0"} 1
)";
  std::string text = m.render();
  std::string without_help;
  for (const auto& l : lines_of(text)) {
    if (l.rfind("# HELP ", 0) != 0) without_help += l + "\n";
  }
  EXPECT_EQ(without_help, expected);

  // Every TYPE line is directly preceded by the HELP line of the same family.
  auto ls = lines_of(text);
  for (size_t i = 0; i < ls.size(); ++i) {
    if (ls[i].rfind("# TYPE ", 0) != 0) continue;
    std::string name = ls[i].substr(7, ls[i].find(' ', 7) - 7);
    ASSERT_GT(i, 0u);
    EXPECT_EQ(ls[i - 1].rfind("# HELP " + name + " ", 0), 0u) << ls[i - 1];
    EXPECT_GT(ls[i - 1].size(), ("# HELP " + name + " ").size()) << "empty HELP for " << name;
  }
  EXPECT_EQ(m.render(), text) << "render is deterministic";
}

TEST(Metrics, AJobAcrossNodesHasItsNodeSeries) {
  Metrics m("0.1.0", "abc123", "2.11.0");
  EXPECT_EQ(m.render().find("megacpp_job_nodes"), std::string::npos);  // one node: none
  m.set_job_nodes(4, 0, 3);
  m.set_job_steps({12, 9, 12, 11});
  const std::string text = m.render();
  EXPECT_NE(text.find("megacpp_job_node_step{node=\"1\"} 9\n"), std::string::npos) << text;
  EXPECT_NE(text.find("megacpp_job_slowest_step 9\n"), std::string::npos) << text;
  EXPECT_NE(text.find("# TYPE megacpp_job_nodes gauge\nmegacpp_job_nodes{node=\"0\"} 4\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("megacpp_job_nodes_up{node=\"0\"} 3\n"), std::string::npos) << text;
}

// The newest held-out evaluation: absent before the first; a late report of an older one does
// not replace it.
TEST(Metrics, ValidationLossOfTheNewestEvaluation) {
  Metrics m("0.1.0", "abc123", "2.11.0");
  EXPECT_EQ(m.render().find("megacpp_validation_"), std::string::npos);
  m.set_validation(10, 2.5);
  m.set_validation(20, 2.25);
  m.set_validation(10, 2.5);
  const std::string text = m.render();
  EXPECT_NE(text.find("# TYPE megacpp_validation_loss gauge\nmegacpp_validation_loss 2.25\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("megacpp_validation_step 20\n"), std::string::npos) << text;
}

TEST(Metrics, SeriesSortedByStageNameThenNumericRank) {
  Metrics m("v", "r", "t");
  m.declare_stage(StageKind::TRAINER, 10);
  m.declare_stage(StageKind::TRAINER, 2);
  m.declare_stage(StageKind::DATA_LOADER, 0);
  m.declare_stage(StageKind::CHECKPOINTER, 0);
  m.declare_stage(StageKind::TRAINER, 2);  // idempotent
  std::vector<std::string> expected = {
      R"(megacpp_stage_up{stage="checkpointer",rank="0"} 0)",
      R"(megacpp_stage_up{stage="data_loader",rank="0"} 0)",
      R"(megacpp_stage_up{stage="trainer",rank="2"} 0)",
      R"(megacpp_stage_up{stage="trainer",rank="10"} 0)",
  };
  EXPECT_EQ(samples_of(m.render(), "megacpp_stage_up"), expected);
  std::vector<std::string> steps = {R"(megacpp_trainer_steps_total{rank="2"} 0)",
                                    R"(megacpp_trainer_steps_total{rank="10"} 0)"};
  EXPECT_EQ(samples_of(m.render(), "megacpp_trainer_steps_total"), steps);
}

TEST(Metrics, EveryDeclaredStageHasAllSeries) {
  Metrics m("v", "r", "t");
  const std::vector<std::pair<StageKind, uint32_t>> stages = {{StageKind::COLLECTOR, 0},
                                                              {StageKind::CHECKPOINTER, 0},
                                                              {StageKind::DATA_LOADER, 0},
                                                              {StageKind::TRAINER, 0},
                                                              {StageKind::TRAINER, 1}};
  for (auto [s, r] : stages) m.declare_stage(s, r);
  std::string text = m.render();
  const std::map<StageKind, std::string> names = {{StageKind::COLLECTOR, "collector"},
                                                  {StageKind::CHECKPOINTER, "checkpointer"},
                                                  {StageKind::DATA_LOADER, "data_loader"},
                                                  {StageKind::TRAINER, "trainer"}};
  for (auto [s, r] : stages) {
    std::string labels = "{stage=\"" + names.at(s) + "\",rank=\"" + std::to_string(r) + "\"}";
    for (const char* family :
         {"megacpp_stage_up", "megacpp_stage_last_heartbeat_timestamp_seconds",
          "megacpp_stage_last_progress_timestamp_seconds", "megacpp_stage_last_step",
          "megacpp_stage_last_step_timestamp_seconds", "megacpp_stage_restarts_total"}) {
      EXPECT_TRUE(has_line(text, family + labels + " 0")) << family << labels;
    }
    for (const char* reason :
         {"clean", "exited", "signaled", "stalled", "torn_down", "hung", "heartbeat_lost"}) {
      EXPECT_TRUE(has_line(text, "megacpp_stage_exits_total{stage=\"" + names.at(s) +
                                     "\",reason=\"" + reason + "\"} 0"))
          << names.at(s) << " " << reason;
    }
    if (s == StageKind::TRAINER) {
      std::string rl = "{rank=\"" + std::to_string(r) + "\"}";
      EXPECT_TRUE(has_line(text, "megacpp_trainer_steps_total" + rl + " 0"));
      EXPECT_TRUE(has_line(text, "megacpp_trainer_tokens_total" + rl + " 0"));
      EXPECT_TRUE(has_line(text, "megacpp_trainer_step_duration_seconds_count" + rl + " 0"));
      EXPECT_TRUE(has_line(text, "megacpp_trainer_step_duration_seconds_sum" + rl + " 0"));
      EXPECT_TRUE(has_line(text, "megacpp_trainer_step_duration_seconds_bucket{rank=\"" +
                                     std::to_string(r) + "\",le=\"+Inf\"} 0"));
    }
  }
  EXPECT_EQ(samples_of(text, "megacpp_stage_up").size(), stages.size());
  EXPECT_EQ(samples_of(text, "megacpp_stage_exits_total").size(), 4u * 7u);
  EXPECT_EQ(samples_of(text, "megacpp_trainer_step_duration_seconds_bucket").size(), 2u * 15u);
}

TEST(Metrics, DeadStageReadsZeroNotMissing) {
  Metrics m("v", "r", "t");
  m.set_up(StageKind::TRAINER, 1, true);  // implicitly declared
  EXPECT_TRUE(has_line(m.render(), R"(megacpp_stage_up{stage="trainer",rank="1"} 1)"));
  m.set_up(StageKind::TRAINER, 1, false);
  m.add_exit(StageKind::TRAINER, schema::FailureKind::SIGNALED);
  std::string text = m.render();
  EXPECT_TRUE(has_line(text, R"(megacpp_stage_up{stage="trainer",rank="1"} 0)"));
  EXPECT_TRUE(has_line(text, R"(megacpp_stage_exits_total{stage="trainer",reason="signaled"} 1)"));
  EXPECT_TRUE(has_line(text, R"(megacpp_stage_exits_total{stage="trainer",reason="hung"} 0)"));
}

TEST(Metrics, CountersNeverGoDown) {
  Metrics m("v", "r", "t");
  m.set_trainer_progress(0, 10, 1000.5);
  m.set_trainer_progress(0, 4, 200);  // a late report
  std::string text = m.render();
  EXPECT_TRUE(has_line(text, R"(megacpp_trainer_steps_total{rank="0"} 10)")) << text;
  EXPECT_TRUE(has_line(text, R"(megacpp_trainer_tokens_total{rank="0"} 1000.5)")) << text;
  m.set_trainer_progress(0, 11, 1100);
  EXPECT_TRUE(has_line(m.render(), R"(megacpp_trainer_steps_total{rank="0"} 11)"));
}

// Exit reasons are a fixed label set (bounded cardinality): a failure kind that no process
// exits with, or a value outside the enum (a newer writer), is a bug, and no series appears.
TEST(Metrics, UnknownExitReasonIsABug) {
  Metrics m("v", "r", "t");
  for (auto reason : {schema::FailureKind::INCOMPLETE, static_cast<schema::FailureKind>(1234)}) {
    try {
      m.add_exit(StageKind::TRAINER, reason);
      FAIL() << "expected Error";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInternal);
      EXPECT_NE(std::string(e.what()).find("is not an exit reason"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(m.render().find("incomplete"), std::string::npos);
  EXPECT_EQ(m.render().find("unknown"), std::string::npos);
}

TEST(Metrics, LabelValuesAreEscaped) {
  Metrics m("1.0 \"beta\"", "C:\\tree\nx", "t");
  m.set_queue("a\"b", 1, 2);
  std::string text = m.render();
  EXPECT_TRUE(has_line(
      text, R"(megacpp_build_info{version="1.0 \"beta\"",revision="C:\\tree\nx",torch="t"} 1)"))
      << text;
  EXPECT_TRUE(has_line(text, R"(megacpp_queue_depth{edge="a\"b"} 1)")) << text;
}

TEST(Metrics, NonFiniteValuesUseTheFormatsSpelling) {
  Metrics m("v", "r", "t");
  m.set_collector_lag(std::numeric_limits<double>::infinity());
  EXPECT_TRUE(has_line(m.render(), "megacpp_collector_lag_seconds +Inf"));
  m.set_collector_lag(std::numeric_limits<double>::quiet_NaN());
  EXPECT_TRUE(has_line(m.render(), "megacpp_collector_lag_seconds NaN"));
}

TEST(Metrics, PromtoolCheckMetricsIsSilent) {
  if (!fs::exists(kPromtool)) GTEST_SKIP() << kPromtool << " is absent (Debian package prometheus)";
  {
    Metrics m("0.1.0", "0123456789ab-dirty", "2.11.0+cpu");
    populate(m);
    auto [rc, out] = promtool_check(m.render());
    EXPECT_EQ(rc, 0) << out;
    EXPECT_EQ(out, "") << m.render();
  }
  {
    Metrics m("0.1.0", "r", "t");
    m.declare_stage(StageKind::TRAINER, 0);
    m.declare_stage(StageKind::COLLECTOR, 0);
    auto [rc, out] = promtool_check(m.render());
    EXPECT_EQ(rc, 0) << out;
    EXPECT_EQ(out, "") << m.render();
  }
  {  // promtool is not silent on a broken text: the check has teeth.
    auto [rc, out] = promtool_check("# TYPE megacpp_bad counter\nmegacpp_bad 1\n");
    EXPECT_FALSE(rc == 0 && out.empty());
  }
}

TEST(MetricsServer, ServesMetricsOnLoopback) {
  Metrics m("0.1.0", "r", "t");
  populate(m);
  MetricsServer server(m, "127.0.0.1", 0);
  ASSERT_NE(server.port(), 0);
  HttpReply r = http_get(server.port(), "/metrics");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.headers["content-type"], "text/plain; version=0.0.4; charset=utf-8");
  EXPECT_EQ(r.body, m.render());

  HttpReply other = http_get(server.port(), "/");
  EXPECT_EQ(other.status, 404);
  EXPECT_EQ(http_get(server.port(), "/metrics/x").status, 404);

  // The body follows the registry.
  m.set_up(StageKind::TRAINER, 1, true);
  EXPECT_NE(http_get(server.port(), "/metrics")
                .body.find(R"(megacpp_stage_up{stage="trainer",rank="1"} 1)"),
            std::string::npos);
}

TEST(MetricsServer, BindsLoopbackOnly) {
  Metrics m("v", "r", "t");
  MetricsServer server(m, "127.0.0.1", 0);
  auto addrs = listening_addresses(server.port());
  EXPECT_EQ(addrs, std::set<std::string>{"0100007F"}) << "127.0.0.1 in /proc/net/tcp";
}

TEST(MetricsServer, ExplicitPortIsUsed) {
  // A port the kernel just handed out and that is free again.
  int fd = SYSCALL_CHECK(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  SYSCALL_CHECK(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)));
  socklen_t len = sizeof(addr);
  SYSCALL_CHECK(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len));
  ::close(fd);
  uint16_t port = ntohs(addr.sin_port);

  Metrics m("v", "r", "t");
  MetricsServer server(m, "127.0.0.1", port);
  EXPECT_EQ(server.port(), port);
  EXPECT_EQ(http_get(port, "/metrics").status, 200);
}

TEST(MetricsServer, PortInUseThrowsInvalidArgument) {
  Metrics m("v", "r", "t");
  MetricsServer first(m, "127.0.0.1", 0);
  try {
    MetricsServer second(m, "127.0.0.1", first.port());
    FAIL() << "a second server bound port " << first.port();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_EQ(std::string(e.what()), "cannot serve /metrics on 127.0.0.1:" +
                                         std::to_string(first.port()) + ": Address already in use");
  }
  EXPECT_EQ(http_get(first.port(), "/metrics").status, 200) << "the first server is unharmed";
}

TEST(MetricsServer, AddressNotOnThisHostThrowsInvalidArgument) {
  Metrics m("v", "r", "t");
  try {
    MetricsServer server(m, "203.0.113.1", 0);  // TEST-NET-3: never a local address
    FAIL() << "bound 203.0.113.1";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_EQ(std::string(e.what()),
              "cannot serve /metrics on 203.0.113.1:0: Cannot assign requested address");
  }
}

TEST(MetricsServer, ScrapesWhileTheWatchLoopUpdates) {
  Metrics m("v", "r", "t");
  m.declare_stage(StageKind::TRAINER, 0);
  MetricsServer server(m, "127.0.0.1", 0);
  std::atomic<bool> done{false};
  std::thread writer([&] {
    for (uint32_t i = 1; !done; ++i) {
      m.set_up(StageKind::TRAINER, 0, i % 2);
      m.set_heartbeat(StageKind::TRAINER, 0, 1700000000.0 + i);
      m.set_trainer_progress(0, i, i * 4096.0);
      m.observe_step_seconds(0, 0.001 * (i % 100));
      m.set_queue("data_loader->trainer-0", i % 5, 4);
      if (i % 7 == 0) m.add_exit(StageKind::COLLECTOR, schema::FailureKind::STALLED);
      std::this_thread::yield();
    }
  });
  for (int i = 0; i < 50; ++i) {
    HttpReply r = http_get(server.port(), "/metrics");
    ASSERT_EQ(r.status, 200);
    ASSERT_EQ(r.body.substr(r.body.size() - 2), "1\n");
    ASSERT_NE(r.body.find("megacpp_build_info{"), std::string::npos);
    ASSERT_EQ(samples_of(r.body, "megacpp_stage_up").size(), 1u) << r.body;
  }
  done = true;
  writer.join();
}

TEST(MetricsServer, DestructionWithAnIdleClientConnectedReturns) {
  Metrics m("v", "r", "t");
  int fd = -1;
  {
    MetricsServer server(m, "127.0.0.1", 0);
    fd = SYSCALL_CHECK(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(server.port());
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    SYSCALL_CHECK(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)));
    // Sends nothing: a worker sits in its keep-alive wait while the server is destroyed.
  }
  ::close(fd);
}

}  // namespace
}  // namespace megacpp::supervisor
