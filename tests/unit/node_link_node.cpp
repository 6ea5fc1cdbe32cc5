// A node for tests/unit/node_link_test.cpp's liveness tests, in a process of its own (the test
// forks and execs it: a fork of the multi-threaded test that went on running would be outside
// what ThreadSanitizer supports). Usage: node_link_node KEY_FILE CONTROLLER_ENDPOINT NODE_NAME.
// Serves a local link that accepts every command and sends no event, until it is killed (or
// its parent dies).
#include <signal.h>
#include <sys/prctl.h>

#include <chrono>
#include <cstdio>
#include <exception>
#include <thread>

#include "ipc/job_keys.h"
#include "supervisor/node_agent_link.h"
#include "supervisor/zmq_node_link.h"

namespace {

class AcceptingLink final : public megacpp::supervisor::NodeAgentLink {
 public:
  bool command(megacpp::schema::NodeCommand::Reader) override { return true; }
  void poll(int timeout_ms) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(timeout_ms));
  }
  std::vector<megacpp::supervisor::RingLevel> ring_levels() const override { return {}; }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: node_link_node KEY_FILE CONTROLLER_ENDPOINT NODE_NAME\n");
    return 2;
  }
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  try {
    const megacpp::ipc::JobKeys keys = megacpp::ipc::read_job_keys(argv[1]);
    AcceptingLink local;
    megacpp::supervisor::NodeAgentServer server(local, keys, argv[2], argv[3]);
    for (;;) server.serve(100);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "node_link_node: %s\n", e.what());
    return 1;
  }
}
