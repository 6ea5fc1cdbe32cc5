// The choice of the checkpoint a resume starts from.
#include <algorithm>
#include <system_error>

#include "checkpoint/resume.h"
#include "checkpoint/verify.h"
#include "schemas/run_layout.h"

namespace megacpp::checkpoint {

std::vector<uint32_t> committed_steps(const fs::path& run_dir) {
  std::vector<uint32_t> steps;
  std::error_code ec;
  for (fs::directory_iterator it(layout::checkpoints_dir(run_dir), ec), end; !ec && it != end;
       it.increment(ec)) {
    const auto step = layout::checkpoint_dir_step(it->path().filename().string());
    if (it->is_directory() && step) steps.push_back(*step);
  }
  std::sort(steps.rbegin(), steps.rend());
  return steps;
}

ResumeChoice select_resume_checkpoint(const fs::path& run_dir, std::optional<uint32_t> at_most) {
  ResumeChoice out;
  const fs::path dir = layout::checkpoints_dir(run_dir);
  for (uint32_t step : committed_steps(run_dir)) {
    if (at_most && step > *at_most) continue;
    const std::string name = layout::checkpoint_dir_name(step);
    const std::string relative = (fs::path("checkpoints") / name).string();
    VerifyResult v = verify_checkpoint(dir / name);
    if (!v.ok) {
      out.skipped.push_back({step, relative, std::move(v.problems)});
      continue;
    }
    CommittedCheckpoint c{step, dir / name, relative, 0};
    for (const auto& entry : fs::directory_iterator(dir / name)) {
      if (entry.is_regular_file()) c.bytes += entry.file_size();
    }
    out.chosen = std::move(c);
    break;
  }
  return out;
}

}  // namespace megacpp::checkpoint
