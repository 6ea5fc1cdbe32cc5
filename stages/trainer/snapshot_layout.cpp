// Snapshot layout: safetensors dtype names, aligned packing, TensorEntry lists.
#include "stages/trainer/snapshot_layout.h"

#include <fmt/format.h>

#include "core/error.h"

namespace megacpp::trainer {

namespace {

uint64_t align_up(uint64_t n) {
  return (n + kSnapshotAlignment - 1) / kSnapshotAlignment * kSnapshotAlignment;
}

}  // namespace

std::string safetensors_dtype(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return "F32";
    case at::kDouble:
      return "F64";
    case at::kHalf:
      return "F16";
    case at::kBFloat16:
      return "BF16";
    case at::kLong:
      return "I64";
    case at::kInt:
      return "I32";
    case at::kShort:
      return "I16";
    case at::kChar:
      return "I8";
    case at::kByte:
      return "U8";
    case at::kBool:
      return "BOOL";
    default:
      MEGACPP_FAIL(ErrorKind::kInvalidArgument, "no safetensors dtype for {}", c10::toString(type));
  }
}

SnapshotLayout layout_of(const std::vector<NamedTensor>& tensors) {
  SnapshotLayout layout;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    SnapshotEntry e;
    e.name = name;
    e.dtype = safetensors_dtype(t.scalar_type());
    for (int64_t d : t.sizes()) e.shape.push_back(static_cast<uint64_t>(d));
    e.offset = offset;
    e.bytes = static_cast<uint64_t>(t.numel()) * t.element_size();
    offset = align_up(offset + e.bytes);
    layout.entries.push_back(std::move(e));
  }
  layout.total_bytes = offset;
  return layout;
}

void fill_tensor_entries(const SnapshotLayout& layout,
                         capnp::List<schema::TensorEntry>::Builder out) {
  MEGACPP_CHECK(out.size() == layout.entries.size(), ErrorKind::kInternal,
                fmt::format("TensorEntry list has {} elements, layout {}", out.size(),
                            layout.entries.size()));
  for (uint32_t i = 0; i < out.size(); ++i) {
    const SnapshotEntry& e = layout.entries[i];
    auto b = out[i];
    b.setName(e.name);
    b.setDtype(e.dtype);
    auto shape = b.initShape(static_cast<uint32_t>(e.shape.size()));
    for (uint32_t d = 0; d < e.shape.size(); ++d) shape.set(d, e.shape[d]);
    b.setOffset(e.offset);
    b.setBytes(e.bytes);
  }
}

}  // namespace megacpp::trainer
