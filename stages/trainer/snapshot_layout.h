// megacpp::trainer snapshot layout — where each tensor of a rank's snapshot share lies in a
// staging region, and how that is described to the checkpointer (TensorEntry).
//
// Contract: pure functions over (name, tensor) lists; nothing blocks, nothing is kept. The
// layout depends only on names, dtypes and shapes, so a share's layout never changes over a
// run. Unsupported dtypes and mis-sized output lists throw Error{kInvalidArgument} /
// Error{kInternal}.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "schemas/control.capnp.h"

namespace megacpp::trainer {

using NamedTensor = std::pair<std::string, at::Tensor>;

// One entry of a snapshot share: where a tensor lies in the staging region.
struct SnapshotEntry {
  std::string name;
  std::string dtype;  // safetensors dtype name: F32, I64, ...
  std::vector<uint64_t> shape;
  uint64_t offset = 0;  // from the region start, a multiple of kSnapshotAlignment
  uint64_t bytes = 0;
};

struct SnapshotLayout {
  std::vector<SnapshotEntry> entries;
  uint64_t total_bytes = 0;  // end of the last entry, rounded up to kSnapshotAlignment
};

inline constexpr uint64_t kSnapshotAlignment = 64;

// Safetensors dtype name of a torch dtype; throws Error{kInvalidArgument} for others.
std::string safetensors_dtype(at::ScalarType type);
// Packs `tensors` in order at kSnapshotAlignment-aligned offsets.
SnapshotLayout layout_of(const std::vector<NamedTensor>& tensors);
// Writes `layout` into `out`, which must have exactly layout.entries.size() elements.
void fill_tensor_entries(const SnapshotLayout& layout,
                         capnp::List<schema::TensorEntry>::Builder out);

}  // namespace megacpp::trainer
