// `megacpp export`: a committed checkpoint as one consolidated safetensors file.
#include <unistd.h>

#include <cstring>

#include "checkpoint/export.h"
#include "checkpoint/safetensors.h"
#include "core/error.h"
#include "core/util.h"

namespace megacpp::checkpoint {

namespace {

constexpr std::string_view kModelPrefix = "model.";

struct Owned {
  TensorView view;
  std::vector<std::byte> bytes;
};

// The whole logical tensor, rows [0, rows) (a Muon stack without its padding).
Owned assemble(const CheckpointReader& ckpt, const StoredTensor& t, std::string name,
               uint64_t first_row, uint64_t rows) {
  Owned o;
  o.bytes.resize(rows * t.row_bytes);
  ckpt.read_rows(t, first_row, rows, o.bytes);
  o.view.name = std::move(name);
  o.view.dtype = t.dtype;
  o.view.shape = t.full_shape;
  if (!o.view.shape.empty()) o.view.shape[0] = rows;
  return o;
}

uint64_t rows_of(const StoredTensor& t) {
  return t.full_shape.empty() ? 1 : t.full_shape[0];
}

}  // namespace

ExportReport export_checkpoint(const CheckpointReader& ckpt, const fs::path& out, bool optimizer) {
  std::vector<Owned> tensors;
  for (const auto& [name, t] : ckpt.tensors()) {
    if (name.starts_with(kModelPrefix)) {
      tensors.push_back(assemble(ckpt, t, name.substr(kModelPrefix.size()), 0, rows_of(t)));
      continue;
    }
    if (!optimizer) continue;
    // A Muon stack's rows go out one per member parameter.
    const auto dot = name.rfind('.');
    const std::string stack = dot == std::string::npos ? "" : name.substr(0, dot);
    if (auto it = ckpt.muon_stacks().find(stack); it != ckpt.muon_stacks().end()) {
      const std::string field = name.substr(dot + 1);
      for (size_t i = 0; i < it->second.size(); ++i) {
        Owned row = assemble(ckpt, t, fmt::format("optim.muon.{}.{}", it->second[i], field), i, 1);
        row.view.shape.erase(row.view.shape.begin());  // one matrix, not a stack of one
        tensors.push_back(std::move(row));
      }
      continue;
    }
    tensors.push_back(assemble(ckpt, t, name, 0, rows_of(t)));
  }
  MEGACPP_CHECK(!tensors.empty(), ErrorKind::kInvalidArgument,
                fmt::format("checkpoint {} holds no model parameters", ckpt.dir().string()));
  std::vector<TensorView> views;
  for (auto& o : tensors) {
    o.view.data = o.bytes.data();
    o.view.bytes = o.bytes.size();
    views.push_back(o.view);
  }
  const std::map<std::string, std::string> metadata{
      {"megacpp.run_id", ckpt.run_id()},
      {"megacpp.step", std::to_string(ckpt.step())},
      {"megacpp.recipe_hash", ckpt.recipe_hash()},
      {"megacpp.world", std::to_string(ckpt.world())},
      {"megacpp.optimizer", optimizer ? "included" : "not included"},
  };
  const fs::path tmp = out.string() + fmt::format(".tmp.{}", ::getpid());
  const WrittenFile written = write_safetensors(tmp, views, metadata);
  SYSCALL_CHECK(::rename(tmp.c_str(), out.c_str()));
  fsync_path(fs::absolute(out).parent_path());
  return ExportReport{written.tensors, written.bytes};
}

}  // namespace megacpp::checkpoint
