// The one table of environment knobs: every MEGACPP_* variable a megacpp binary reads is
// declared here once (name, type, default, meaning) and read through the typed accessors
// below; `env_knob` refuses a name that is not declared. README.md's knob table lists exactly
// these rows with the same defaults (tests/unit/knobs_test.cpp checks both).
//
// Variables read only by the build and test scripts (MEGACPP_WERROR, MEGACPP_BIN, ...) are not
// knobs of the binaries and are not declared here; README.md lists them in a table of their
// own, "Build and test variables".
//
// Layer: above core/error.h (a bad value throws), below core/util.h; it includes no utility.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace megacpp {

enum class Knob : uint8_t {
  kTrainerThreads,
  kStoreTimeoutS,
  kCollectiveTimeoutS,
  kSnapshotLeaseTimeoutS,
  kFinalCommitTimeoutS,
  kDrainTimeoutS,
  kSnapshotResendS,
  kGlooHostname,
  kPeerExchange,
  kTraceBatches,
  kHostAllocator,
  kSnapshotStaging,
  kFusedOptim,
  kProfileSteps,
  kTestUnkillable,
  kTestMuteFailure,
  kFault,
  kMasterPort,
  kNodes,
  kHostPattern,
};

enum class KnobType : uint8_t {
  kInt,      // decimal integer
  kSeconds,  // seconds, a decimal number
  kString,
};

struct KnobSpec {
  Knob knob;
  std::string_view name;
  KnobType type;
  // The default as README.md shows it. "—": unset means off (string knobs). A default that
  // depends on the run (computed = true) is a formula the call site evaluates.
  std::string_view default_text;
  bool computed;
  std::string_view meaning;
};

// clang-format off
inline constexpr std::array kKnobs{
  KnobSpec{Knob::kTrainerThreads, "MEGACPP_TRAINER_THREADS", KnobType::kInt, "1", false,
           "torch intra-op threads per rank"},
  KnobSpec{Knob::kStoreTimeoutS, "MEGACPP_STORE_TIMEOUT_S", KnobType::kSeconds, "60", false,
           "rendezvous timeout"},
  KnobSpec{Knob::kCollectiveTimeoutS, "MEGACPP_COLLECTIVE_TIMEOUT_S", KnobType::kSeconds, "300", false,
           "Gloo collective timeout"},
  KnobSpec{Knob::kSnapshotLeaseTimeoutS, "MEGACPP_SNAPSHOT_LEASE_TIMEOUT_S", KnobType::kSeconds,
           "max(60, 2 × checkpointer stall budget + 30)", true,
           "a rank waits this long for the checkpointer to release its staging region"},
  KnobSpec{Knob::kFinalCommitTimeoutS, "MEGACPP_FINAL_COMMIT_TIMEOUT_S", KnobType::kSeconds,
           "max(120, 2 × checkpointer stall budget + 60)", true,
           "a rank waits this long for the final checkpoint to commit"},
  KnobSpec{Knob::kDrainTimeoutS, "MEGACPP_DRAIN_TIMEOUT_S", KnobType::kInt, "60", false,
           "loader and checkpointer must stop this soon (seconds) after training ends"},
  KnobSpec{Knob::kSnapshotResendS, "MEGACPP_SNAPSHOT_RESEND_S", KnobType::kSeconds, "2", false,
           "a rank re-sends a pending SnapshotReady this often while it waits (survives a checkpointer restart)"},
  KnobSpec{Knob::kGlooHostname, "MEGACPP_GLOO_HOSTNAME", KnobType::kString, "127.0.0.1", false,
           "the interface Gloo's TCP transport binds"},
  KnobSpec{Knob::kPeerExchange, "MEGACPP_PEER_EXCHANGE", KnobType::kInt, "1", false,
           "1: the optimizer exchanges of CPU ranks on one host go through shared memory; 0: through Gloo"},
  KnobSpec{Knob::kTraceBatches, "MEGACPP_TRACE_BATCHES", KnobType::kInt, "0", false,
           "trainer ranks append their first N batches, as trained (int64 tokens, row-major), to RUN/logs/batches-<rank>.bin"},
  KnobSpec{Knob::kHostAllocator, "MEGACPP_HOST_ALLOCATOR", KnobType::kString, "cache", false,
           "cache: a rank's tensors of 256 KiB and more come from mappings reused by size class (resident size close to the bytes held; system when unset in AddressSanitizer builds); system: torch's default allocator"},
  KnobSpec{Knob::kSnapshotStaging, "MEGACPP_SNAPSHOT_STAGING", KnobType::kString, "auto", false,
           "where a rank stages its snapshot: auto (device memory exported to the checkpointer on a CUDA rank whose driver allows it, else host shm), host, device, or memfd (a descriptor-passed host buffer: the device protocol on a CPU)"},
  KnobSpec{Knob::kFusedOptim, "MEGACPP_FUSED_OPTIM", KnobType::kInt, "1", false,
           "1: a CUDA rank's DistAdamW update and Muon's tail run through the fused kernels (ops/adamw.cu, ops/muon_tail.cu); 0: through torch's operations"},
  KnobSpec{Knob::kProfileSteps, "MEGACPP_PROFILE_STEPS", KnobType::kString, "—", false,
           "FIRST:LAST: trainer ranks run torch's profiler over those steps and write RUN/logs/profile-<rank>.txt (the device's kernels by time and its busy share of the wall time; torch's operators by host time) and profile-<rank>.json (a Chrome trace)"},
  KnobSpec{Knob::kTestUnkillable, "MEGACPP_TEST_UNKILLABLE", KnobType::kString, "—", false,
           "test hook: the supervisor's teardown signals to this process are not sent"},
  KnobSpec{Knob::kTestMuteFailure, "MEGACPP_TEST_MUTE_FAILURE", KnobType::kString, "—", false,
           "test hook: this process writes its failure dump but sends no Failure message, as one whose report is lost at its exit"},
  KnobSpec{Knob::kFault, "MEGACPP_FAULT", KnobType::kString, "—", false,
           "fault injection for tests (see stages/stage.h)"},
  // Placement (supervisor/placement.h), read from the environment map the resolver is given.
  KnobSpec{Knob::kMasterPort, "MEGACPP_MASTER_PORT", KnobType::kInt, "29500", false,
           "the port of node 0 in a job across nodes (over MASTER_PORT)"},
  KnobSpec{Knob::kNodes, "MEGACPP_NODES", KnobType::kInt, "— (--nodes)", true,
           "the node count of a Kubernetes Indexed Job / JobSet; with it, JOB_COMPLETION_INDEX is the node rank"},
  KnobSpec{Knob::kHostPattern, "MEGACPP_HOST_PATTERN", KnobType::kString, "—", false,
           "Kubernetes: every node's host name, {index} standing for its node rank (node 0's is the master)"},
};
// clang-format on

namespace detail {
constexpr bool knobs_in_enum_order() {
  for (size_t i = 0; i < kKnobs.size(); ++i) {
    if (static_cast<size_t>(kKnobs[i].knob) != i) return false;
  }
  return true;
}
}  // namespace detail
static_assert(detail::knobs_in_enum_order(), "kKnobs rows must follow the Knob enum's order");

constexpr const KnobSpec& knob_spec(Knob k) {
  return kKnobs[static_cast<size_t>(k)];
}
// The declaration of `name`, or nullptr when no knob has that name.
const KnobSpec* find_knob(std::string_view name);

// Typed reads. A non-computed knob falls back to its declared default; a computed one to the
// `fallback` its call site computes. A value that does not parse as the type is an
// Error{kInvalidArgument} naming the knob; reading a knob as another type is kInternal.
std::optional<std::string> knob_value(Knob k);  // set and non-empty, else nullopt
std::string knob_string(Knob k);                // value, else the default ("" for "—")
int64_t knob_int(Knob k);
double knob_seconds(Knob k);
double knob_seconds(Knob k, double fallback);

// The untyped reads under the accessors above. `name` must be declared in kKnobs (checked:
// Error{kInternal} otherwise); a value that does not parse is Error{kInvalidArgument} naming
// the variable. Call sites use the typed accessors; these stay public for the knobs test.
std::optional<std::string> env_knob(std::string_view name);
int64_t env_knob_int(std::string_view name, int64_t fallback);
double env_knob_double(std::string_view name, double fallback);

// A variable of a library megacpp configures (TORCH_NCCL_* for ProcessGroupNCCL), read only so
// that a value the user set is kept and recorded; nullopt when unset or empty.
std::optional<std::string> foreign_env(std::string_view name);

}  // namespace megacpp
