// The checkpoint verifier: checkpoint.json against what it renders to and hashes to, every
// listed file against its recorded size, xxh3 and tensor count.
#include <string>
#include <system_error>

#include "checkpoint/detail/names.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/verify.h"
#include "core/error.h"
#include "core/util.h"
#include "schemas/checkpoint.capnp.h"
#include "schemas/json.h"
#include "schemas/run_layout.h"

namespace megacpp::checkpoint {

using detail::kManifestName;
using detail::kTmpSuffix;

VerifyResult verify_checkpoint(const fs::path& dir) {
  VerifyResult result;
  auto problem = [&](std::string text) { result.problems.push_back(std::move(text)); };
  try {
    const std::string text = read_file(dir / kManifestName);
    schemas::JsonDocument<schema::CheckpointManifest> doc(text, (dir / kManifestName).string());
    auto manifest = doc.get();
    // The file must be exactly what its fields render to (a damaged key or value that still
    // parses renders differently), and hash, with selfXxh3 empty, to selfXxh3 (absent in
    // checkpoints written before it).
    if (schemas::to_json(manifest) != text)
      problem(fmt::format("{}: not as written (a damaged byte that still parses)", kManifestName));
    if (manifest.hasSelfXxh3() && manifest.getSelfXxh3().size() > 0) {
      const std::string recorded = manifest.getSelfXxh3();
      doc.builder().setSelfXxh3("");
      const std::string hash = xxh3_hex(schemas::to_json(doc.get()));
      if (hash != recorded)
        problem(fmt::format("{}: xxh3 {} expected {}", kManifestName, hash, recorded));
      doc.builder().setSelfXxh3(recorded);
      manifest = doc.get();
    }
    std::string dir_name = dir.filename().string();
    if (dir_name.ends_with(kTmpSuffix)) dir_name.resize(dir_name.size() - kTmpSuffix.size());
    if (layout::checkpoint_dir_step(dir_name) &&
        dir_name != layout::checkpoint_dir_name(manifest.getStep())) {
      problem(fmt::format("{} records step {}", dir_name, manifest.getStep()));
    }
    // A node's part of a job's checkpoint lists its own ranks only.
    const bool part = manifest.getRanks() != 0;
    if (part && (manifest.getRanks() > manifest.getWorld() ||
                 manifest.getFirstRank() > manifest.getWorld() - manifest.getRanks())) {
      problem(fmt::format("{} holds ranks {}..{} of world {}", kManifestName,
                          manifest.getFirstRank(),
                          manifest.getFirstRank() + manifest.getRanks() - 1, manifest.getWorld()));
    } else if (manifest.getFiles().size() != (part ? manifest.getRanks() : manifest.getWorld())) {
      problem(part ? fmt::format("{} lists {} files for ranks {}..{}", kManifestName,
                                 manifest.getFiles().size(), manifest.getFirstRank(),
                                 manifest.getFirstRank() + manifest.getRanks() - 1)
                   : fmt::format("{} lists {} files for world {}", kManifestName,
                                 manifest.getFiles().size(), manifest.getWorld()));
    }
    for (auto f : manifest.getFiles()) {
      const std::string name = f.getName();
      if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..") {
        problem(fmt::format("bad file name '{}' in {}", name, kManifestName));
        continue;
      }
      const fs::path path = dir / name;
      std::error_code ec;
      const auto size = fs::file_size(path, ec);
      if (ec) {
        problem(fmt::format("{}: missing or unreadable ({})", name, ec.message()));
        continue;
      }
      if (size != f.getBytes()) {
        problem(fmt::format("{}: {} bytes, expected {}", name, size, f.getBytes()));
        continue;
      }
      try {
        if (auto hash = xxh3_file(path); hash != f.getXxh3().cStr()) {
          problem(fmt::format("{}: xxh3 {} expected {}", name, hash, f.getXxh3().cStr()));
        }
        if (name.ends_with(".safetensors")) {
          auto header = read_safetensors_header(path);
          if (header.tensors.size() != f.getTensors()) {
            problem(fmt::format("{}: {} tensors, expected {}", name, header.tensors.size(),
                                f.getTensors()));
          }
        }
      } catch (const std::exception& e) {
        problem(fmt::format("{}: {}", name, user_message(e)));
      }
    }
  } catch (const std::exception& e) {
    problem(std::string(user_message(e)));
  }
  result.ok = result.problems.empty();
  return result;
}

}  // namespace megacpp::checkpoint
