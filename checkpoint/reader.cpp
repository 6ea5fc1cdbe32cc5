// Reading committed checkpoints back: the reader behind resume and export.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstring>

#include <nlohmann/json.hpp>

#include "checkpoint/reader.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/store.h"
#include "core/error.h"
#include "core/util.h"
#include "schemas/checkpoint.capnp.h"
#include "schemas/json.h"
#include "schemas/run_layout.h"

namespace megacpp::checkpoint {

// A rank file mapped read-only for the reader's lifetime.
struct CheckpointReader::Mapping {
  explicit Mapping(const fs::path& path) {
    Fd fd(SYSCALL_CHECK_PATH(::open(path.c_str(), O_RDONLY | O_CLOEXEC), "open", path.string()));
    struct stat st {};
    SYSCALL_CHECK(::fstat(fd.get(), &st));
    size = static_cast<uint64_t>(st.st_size);
    if (size > 0) {
      void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd.get(), 0);
      if (p == MAP_FAILED) MEGACPP_FAIL_SYS(errno, "cannot map {}", path.string());
      base = static_cast<const std::byte*>(p);
    }
  }
  ~Mapping() {
    if (base != nullptr) ::munmap(const_cast<std::byte*>(base), size);
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;

  const std::byte* base = nullptr;
  uint64_t size = 0;
};

namespace {

[[noreturn]] void corrupt(const fs::path& file, const std::string& what) {
  MEGACPP_FAIL(ErrorKind::kCorruption, "checkpoint file {}: {}", file.string(), what);
}

uint64_t product(std::span<const uint64_t> dims) {
  uint64_t n = 1;
  for (uint64_t d : dims) n *= d;
  return n;
}

}  // namespace

CheckpointReader::CheckpointReader(const fs::path& dir) : dir_(dir) {
  const fs::path manifest_path = dir / "checkpoint.json";
  schemas::JsonFile<schema::CheckpointManifest> doc(manifest_path);
  auto manifest = doc.get();
  step_ = manifest.getStep();
  world_ = manifest.getWorld();
  run_id_ = manifest.getRunId();
  recipe_hash_ = manifest.getRecipeHash();
  mode_ = manifest.getMode().size() ? std::string(manifest.getMode()) : std::string("author_dp");
  tensor_parallel_ = manifest.getTensorParallel() ? manifest.getTensorParallel() : 1;
  // A node's part of a job's checkpoint (a job across nodes) holds that node's ranks only,
  // with the replicated state once (its first rank's file): what those ranks resume from.
  first_rank_ = manifest.getRanks() == 0 ? 0 : manifest.getFirstRank();
  ranks_ = manifest.getRanks() == 0 ? world_ : manifest.getRanks();
  if (world_ == 0 || ranks_ > world_ || first_rank_ > world_ - ranks_ ||
      manifest.getFiles().size() != ranks_)
    corrupt(manifest_path,
            fmt::format("lists {} files for ranks {}..{} of world {}", manifest.getFiles().size(),
                        first_rank_, first_rank_ + ranks_ - 1, world_));

  for (uint32_t rank = first_rank_; rank < first_rank_ + ranks_; ++rank) {
    const fs::path path = dir / fmt::format("rank_{}.safetensors", rank);
    auto& map = *files_.emplace_back(std::make_unique<Mapping>(path));
    if (map.size < 8) corrupt(path, "shorter than a safetensors header");
    uint64_t header_bytes = 0;
    std::memcpy(&header_bytes, map.base, 8);
    if (header_bytes > map.size - 8) corrupt(path, "header length past the end of the file");
    const SafetensorsHeader header = parse_safetensors_header(
        std::string_view(reinterpret_cast<const char*>(map.base), 8 + header_bytes), map.size);
    const std::byte* data = map.base + 8 + header.header_bytes;

    // Sharded entries: name -> (logical, full shape, first index along dim), from the rank's
    // layout.
    struct Shard {
      std::string logical;
      std::vector<uint64_t> full_shape;
      uint64_t offset = 0;
      uint64_t dim = 0;
    };
    std::map<std::string, Shard> shards;
    if (auto it = header.metadata.find("megacpp.layout"); it != header.metadata.end()) {
      const auto layout = nlohmann::json::parse(it->second, nullptr, false);
      if (!layout.is_object()) corrupt(path, "megacpp.layout is not a JSON object");
      if (layout.value("world", 0u) != world_ || layout.value("rank", ~0u) != rank)
        corrupt(path,
                fmt::format("megacpp.layout names rank {} of world {}, expected {} of {}",
                            layout.value("rank", ~0u), layout.value("world", 0u), rank, world_));
      try {
        if (muon_stacks_.empty() && layout.contains("muon_stacks")) {
          for (const auto& [stack, members] : layout.at("muon_stacks").items())
            muon_stacks_[stack] = members.get<std::vector<std::string>>();
        }
        for (const auto& [name, s] : layout.at("shards").items()) {
          shards[name] = Shard{s.at("logical").get<std::string>(),
                               s.at("full_shape").get<std::vector<uint64_t>>(),
                               s.at("offset").get<uint64_t>(), s.value("dim", uint64_t{0})};
        }
      } catch (const nlohmann::json::exception& e) {
        corrupt(path, fmt::format("megacpp.layout: {}", e.what()));
      }
    }

    for (const auto& t : header.tensors) {
      const uint64_t elem = *dtype_size(t.dtype);
      StoredTensor::Piece piece;
      piece.rank = rank;
      piece.data = {data + t.begin, t.end - t.begin};
      std::string logical = t.name;
      std::vector<uint64_t> full_shape = t.shape;
      bool columns = false;
      if (auto s = shards.find(t.name); s != shards.end()) {
        logical = s->second.logical;
        full_shape = s->second.full_shape;
        columns = s->second.dim == 1;
        const bool fits =
            columns
                ? t.shape.size() == 2 && full_shape.size() == 2 && t.shape[0] == full_shape[0] &&
                      s->second.offset + t.shape[1] <= full_shape[1]
                : s->second.dim == 0 && !t.shape.empty() && full_shape.size() == t.shape.size() &&
                      std::equal(t.shape.begin() + 1, t.shape.end(), full_shape.begin() + 1);
        if (!fits)
          corrupt(path, fmt::format("shard {} of shape {} does not fit {} of shape {}", t.name,
                                    nlohmann::json(t.shape).dump(), logical,
                                    nlohmann::json(full_shape).dump()));
        if (!columns) piece.row = s->second.offset;
      }
      piece.rows = t.shape.empty() ? 1 : t.shape[0];
      const uint64_t row_bytes =
          full_shape.empty() ? elem : elem * product(std::span(full_shape).subspan(1));
      piece.col_bytes = columns ? elem * t.shape[1] : row_bytes;
      if (columns) piece.col_offset = elem * shards.at(t.name).offset;
      auto [it, fresh] = tensors_.try_emplace(logical);
      StoredTensor& st = it->second;
      if (fresh) {
        st.name = logical;
        st.dtype = t.dtype;
        st.full_shape = full_shape;
        st.row_bytes = row_bytes;
      } else if (st.dtype != t.dtype || st.full_shape != full_shape || st.row_bytes != row_bytes) {
        corrupt(path, fmt::format("{} disagrees with another rank's shard of {}", t.name, logical));
      }
      for (const auto& other : st.pieces) {
        if (piece.row < other.row + other.rows && other.row < piece.row + piece.rows &&
            piece.col_offset < other.col_offset + other.col_bytes &&
            other.col_offset < piece.col_offset + piece.col_bytes)
          corrupt(path,
                  fmt::format("{} overlaps rank {}'s rows of {}", t.name, other.rank, logical));
      }
      st.column_blocks = st.column_blocks || columns;
      st.pieces.push_back(piece);
    }
  }
  for (auto& [name, t] : tensors_) {
    std::sort(t.pieces.begin(), t.pieces.end(), [](const auto& a, const auto& b) {
      return a.row != b.row ? a.row < b.row : a.col_offset < b.col_offset;
    });
  }
}

CheckpointReader::~CheckpointReader() = default;

const StoredTensor* CheckpointReader::find(std::string_view logical) const {
  auto it = tensors_.find(logical);
  return it == tensors_.end() ? nullptr : &it->second;
}

void CheckpointReader::read_rows(const StoredTensor& t, uint64_t row, uint64_t rows,
                                 std::span<std::byte> out) const {
  MEGACPP_CHECK(out.size() == rows * t.row_bytes, ErrorKind::kInvalidArgument,
                fmt::format("{}: {} bytes asked for {} rows of {} bytes", t.name, out.size(), rows,
                            t.row_bytes));
  const uint64_t real_rows = t.full_shape.empty() ? 1 : t.full_shape[0];
  uint64_t at = row;
  const uint64_t end = row + rows;
  if (t.column_blocks) {
    // Blocks of columns (a matrix's tensor-parallel parts): every byte of the rows asked for
    // must be stored, and the pieces never overlap, so their bytes add up to all of them.
    uint64_t filled = 0;
    for (const auto& p : t.pieces) {
      const uint64_t lo = std::max(row, p.row), hi = std::min(end, p.row + p.rows);
      for (uint64_t r = lo; r < hi; ++r)
        std::memcpy(out.data() + (r - row) * t.row_bytes + p.col_offset,
                    p.data.data() + (r - p.row) * p.col_bytes, p.col_bytes);
      if (hi > lo) filled += (hi - lo) * p.col_bytes;
    }
    if (filled == out.size()) return;
    if (ranks_ < world_)
      MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                   "checkpoint {} is one node's part (ranks {}..{} of world {}): part of {} is in "
                   "another node's part; resume the job with the same nodes and ranks per node",
                   dir_.string(), first_rank_, first_rank_ + ranks_ - 1, world_, t.name);
    MEGACPP_FAIL(ErrorKind::kCorruption, "checkpoint {}: {} is not wholly stored (rows {}..{})",
                 dir_.string(), t.name, row, end - 1);
  }
  for (const auto& p : t.pieces) {
    if (p.row + p.rows <= at) continue;
    if (p.row > at) break;
    const uint64_t n = std::min(end, p.row + p.rows) - at;
    std::memcpy(out.data() + (at - row) * t.row_bytes, p.data.data() + (at - p.row) * t.row_bytes,
                n * t.row_bytes);
    at += n;
    if (at == end) return;
  }
  if (at < real_rows && ranks_ < world_)
    MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                 "checkpoint {} is one node's part (ranks {}..{} of world {}): row {} of {} is in "
                 "another node's part; resume the job with the same nodes and ranks per node",
                 dir_.string(), first_rank_, first_rank_ + ranks_ - 1, world_, at, t.name);
  if (at < real_rows)
    MEGACPP_FAIL(ErrorKind::kCorruption, "checkpoint {}: {} has no stored row {} (of {})",
                 dir_.string(), t.name, at, real_rows);
  std::memset(out.data() + (at - row) * t.row_bytes, 0, (end - at) * t.row_bytes);
}

fs::path resolve_checkpoint_dir(const fs::path& path) {
  auto follow = [](const fs::path& latest) {
    std::string name = read_file(latest);
    while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
    return latest.parent_path() / name;
  };
  if (fs::exists(path / "launch.json") || fs::exists(layout::checkpoints_dir(path) / "LATEST")) {
    // A node's run of a job across nodes: the job's LATEST (a step every node committed), not
    // its own part's newest.
    const fs::path job_latest = layout::checkpoints_dir(path) / kJobLatestName;
    if (fs::exists(job_latest)) return follow(job_latest);
    const fs::path latest = layout::checkpoints_dir(path) / "LATEST";
    MEGACPP_CHECK(fs::exists(latest), ErrorKind::kInvalidArgument,
                  fmt::format("{}: the run has no committed checkpoint", path.string()));
    return follow(latest);
  }
  if (fs::is_regular_file(path)) {
    MEGACPP_CHECK(path.filename() == "LATEST", ErrorKind::kInvalidArgument,
                  fmt::format("{} is a file; pass a checkpoint directory (RUN/checkpoints/step_N), "
                              "a run directory or its checkpoints/LATEST",
                              path.string()));
    return follow(path);
  }
  MEGACPP_CHECK(fs::is_directory(path), ErrorKind::kInvalidArgument,
                fmt::format("{}: no such checkpoint; pass a checkpoint directory "
                            "(RUN/checkpoints/step_N), a run directory or its checkpoints/LATEST",
                            path.string()));
  // A directory named step_N (or step_N.tmp) is a checkpoint however damaged: verify lists what
  // is wrong with it. Any other directory is one only when it holds checkpoint.json.
  std::string name = (path.has_filename() ? path : path.parent_path()).filename().string();
  if (name.ends_with(".tmp")) name.resize(name.size() - 4);
  if (!layout::checkpoint_dir_step(name) && !fs::exists(path / "checkpoint.json"))
    MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                 "{} is not a checkpoint (no checkpoint.json); pass a checkpoint directory "
                 "(RUN/checkpoints/step_N), a run directory or its checkpoints/LATEST",
                 path.string());
  return path;
}

}  // namespace megacpp::checkpoint
