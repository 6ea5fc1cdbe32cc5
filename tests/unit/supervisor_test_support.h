// Helpers shared by the supervisor's unit tests (node_agent_test, job_controller_test): a stage
// reference and its process name both ways, and a Cap'n Proto message built in place and handed
// on as a reader (a NodeCommand to the agent, a NodeEvent to the controller). Header-only; not
// part of any library.
#pragma once

#include <gtest/gtest.h>

#include <capnp/message.h>

#include <cstdint>
#include <string>
#include <utility>

#include "schemas/common.capnp.h"
#include "schemas/node.capnp.h"
#include "schemas/run_layout.h"

namespace megacpp::supervisor::test {

// "trainer-1" for (TRAINER, 1): layout::process_name of a reference.
inline std::string name_of(schema::StageRef::Reader ref) {
  return layout::process_name(ref.getStage(), ref.getRank());
}

// The stage and rank a process name stands for (ranks below 8); a name no stage has fails the
// test and gives (SUPERVISOR, 0).
inline std::pair<schema::StageKind, uint32_t> ref_of(const std::string& name) {
  for (auto s : {schema::StageKind::TRAINER, schema::StageKind::DATA_LOADER,
                 schema::StageKind::COLLECTOR, schema::StageKind::CHECKPOINTER}) {
    for (uint32_t r = 0; r < 8; ++r)
      if (layout::process_name(s, r) == name) return {s, r};
  }
  ADD_FAILURE() << "no such process " << name;
  return {schema::StageKind::SUPERVISOR, 0};
}

inline void set_ref(schema::StageRef::Builder ref, schema::StageKind stage, uint32_t rank) {
  ref.setStage(stage);
  ref.setRank(rank);
}

// Builds a `Root` message with build(Root::Builder) and returns use(Root::Reader); the message
// lives until `use` returns.
template <class Root, class Build, class Use>
auto with_message(Build&& build, Use&& use) {
  capnp::MallocMessageBuilder msg;
  build(msg.initRoot<Root>());
  return use(msg.getRoot<Root>().asReader());
}

}  // namespace megacpp::supervisor::test
