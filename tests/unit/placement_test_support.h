// A node's place in a job on this host's loopback, for the tests of what nodes do through node
// 0's store (membership_test, job_watch_test). Header-only; not part of any library.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "supervisor/placement.h"

namespace megacpp::supervisor::test {

// Node `rank` of `nodes`, node 0's store on 127.0.0.1:`port`, placed by flags; `hosts` the
// nodes' host names when the test names them.
inline NodePlacement loopback_placement(uint32_t nodes, uint32_t rank, uint16_t port,
                                        std::vector<std::string> hosts = {}) {
  NodePlacement p;
  p.nodes = nodes;
  p.node_rank = rank;
  p.master_host = "127.0.0.1";
  p.master_port = port;
  p.source = "flags";
  p.hosts = std::move(hosts);
  return p;
}

}  // namespace megacpp::supervisor::test
