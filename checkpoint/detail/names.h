// Names inside a checkpoint directory, shared by the store and the verifier (internal to
// checkpoint/).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include <fmt/format.h>

namespace megacpp::checkpoint::detail {

// A step directory being written: step_NNNNNNNN.tmp.
inline constexpr std::string_view kTmpSuffix = ".tmp";
// A committed checkpoint being pruned: renamed to this first, so a crash mid-removal leaves a
// name the next store removes, never a damaged step_NNNNNNNN.
inline constexpr std::string_view kDeletingSuffix = ".deleting";
inline constexpr std::string_view kManifestName = "checkpoint.json";

inline std::string rank_file_name(uint32_t rank) {
  return fmt::format("rank_{}.safetensors", rank);
}

}  // namespace megacpp::checkpoint::detail
