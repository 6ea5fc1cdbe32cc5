// megacpp::checkpoint verify — whether a checkpoint directory is whole (`megacpp verify`, and
// before every load: resume, export).
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace megacpp::checkpoint {

namespace fs = std::filesystem;

struct VerifyResult {
  bool ok = false;
  std::vector<std::string> problems;  // empty when ok
};
// Checks a committed (or tmp) checkpoint directory on the local filesystem: checkpoint.json
// parses, every listed file exists with the recorded size and xxh3, every safetensors header
// is consistent and its tensor count matches. Never throws for a damaged checkpoint; problems
// are listed.
VerifyResult verify_checkpoint(const fs::path& dir);

}  // namespace megacpp::checkpoint
