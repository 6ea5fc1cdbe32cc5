// Optimizer state dict keys and entries (optim.h: StateKey, field_name, entry_name).
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "core/error.h"
#include "stages/trainer/optim_internal.h"

namespace megacpp::trainer {

namespace detail {

at::Tensor scalar_tensor(double v, const at::Device& device) {
  return at::full({}, v, at::TensorOptions().dtype(at::kFloat).device(device));
}

std::string shape_str(at::IntArrayRef s) {
  return c10::str(s);
}

void load_entries(const std::string& kind, uint32_t rank, uint32_t world, const Entries& live,
                  const OptimizerState& state) {
  MEGACPP_CHECK(state.kind == kind, ErrorKind::kInvalidArgument,
                fmt::format("state dict of kind '{}' loaded into {}", state.kind, kind));
  MEGACPP_CHECK(state.rank == rank && state.world == world, ErrorKind::kInvalidArgument,
                fmt::format("state dict of rank {}/{} loaded into rank {}/{}", state.rank,
                            state.world, rank, world));
  MEGACPP_CHECK(state.entries.size() == live.size(), ErrorKind::kInvalidArgument,
                fmt::format("state dict has {} entries, the optimizer {}", state.entries.size(),
                            live.size()));
  for (size_t i = 0; i < live.size(); ++i) {
    const auto& in = state.entries[i];
    const auto& to = live[i];
    MEGACPP_CHECK(in.key == to.key && in.value.defined() && in.value.sizes() == to.value.sizes() &&
                      in.offset == to.offset && in.full_shape == to.full_shape &&
                      in.replicated == to.replicated,
                  ErrorKind::kInvalidArgument,
                  fmt::format("state entry {} ('{}') does not match the optimizer's '{}'", i,
                              entry_name(in.key), entry_name(to.key)));
  }
  at::NoGradGuard ng;
  for (size_t i = 0; i < live.size(); ++i) {
    at::Tensor dst = live[i].value;
    dst.copy_(state.entries[i].value);
  }
}

void add_scalar_entry(Entries& out, StateKey key, const at::Tensor& t) {
  out.push_back(OptimizerStateEntry{
      .key = key, .value = t, .full_shape = {}, .offset = 0, .replicated = true});
}

StateKey param_key(size_t param, StateField field) {
  return StateKey::of_param(static_cast<uint32_t>(param), field);
}
StateKey group_key(size_t group, StateField field) {
  return StateKey::of_group(static_cast<uint32_t>(group), field);
}
StateKey stack_key(size_t group, size_t stack, StateField field) {
  return StateKey::of_stack(static_cast<uint32_t>(group), static_cast<uint32_t>(stack), field);
}

}  // namespace detail

std::string_view field_name(StateField field) {
  switch (field) {
    case StateField::kExpAvg:
      return "exp_avg";
    case StateField::kExpAvgSq:
      return "exp_avg_sq";
    case StateField::kStep:
      return "step";
    case StateField::kMomentum:
      return "momentum";
    case StateField::kSecondMomentum:
      return "second_momentum";
    case StateField::kLr:
      return "lr";
    case StateField::kBeta1:
      return "beta1";
    case StateField::kBeta2:
      return "beta2";
    case StateField::kEps:
      return "eps";
    case StateField::kWeightDecay:
      return "weight_decay";
    case StateField::kMaster:
      return "master";
  }
  MEGACPP_FAIL(ErrorKind::kInternal, "unknown optimizer state field {}", static_cast<int>(field));
}

std::string entry_name(const StateKey& key) {
  switch (key.scope) {
    case StateScope::kParam:
      return fmt::format("p{}.{}", key.param, field_name(key.field));
    case StateScope::kGroup:
      return fmt::format("g{}.{}", key.group, field_name(key.field));
    case StateScope::kStack:
      return fmt::format("g{}.s{}.{}", key.group, key.stack, field_name(key.field));
  }
  MEGACPP_FAIL(ErrorKind::kInternal, "unknown optimizer state scope {}",
               static_cast<int>(key.scope));
}

}  // namespace megacpp::trainer
