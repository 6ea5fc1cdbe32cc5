// megacpp::checkpoint resume — which committed checkpoint a resume starts from.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/store.h"

namespace megacpp::checkpoint {

namespace fs = std::filesystem;

// The checkpoints of RUN/checkpoints, newest first, and the first of them that verifies —
// the one a resume starts from. A newer one that does not verify (torn, corrupt) is listed in
// `skipped` with its problems and is never loaded. `at_most`: steps after it are not
// considered (a job across nodes resumes from a step every node's part has).
struct ResumeChoice {
  std::optional<CommittedCheckpoint> chosen;
  struct Skipped {
    uint32_t step = 0;
    std::string relative_path;
    std::vector<std::string> problems;
  };
  std::vector<Skipped> skipped;
};
// The steps of RUN/checkpoints' committed directories (step_NNNNNNNN), newest first, verified
// or not; none when there is no such directory.
std::vector<uint32_t> committed_steps(const fs::path& run_dir);

ResumeChoice select_resume_checkpoint(const fs::path& run_dir,
                                      std::optional<uint32_t> at_most = std::nullopt);

}  // namespace megacpp::checkpoint
