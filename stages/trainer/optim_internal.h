// megacpp::trainer optimizer internals shared by the optimizer's translation units
// (orthogonalize.cpp, optim_state.cpp, dist_adamw.cpp, dist_muon.cpp; their collectives are
// exchange.h's).
// Not part of the trainer's public interface (optim.h). Contracts as in optim.h; blocking and
// failure of the collectives are exchange.h's.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "stages/trainer/optim.h"

namespace megacpp::trainer::detail {

using Pg = c10::intrusive_ptr<c10d::Backend>;

// Adds the wall time since the previous lap (or construction) to the field a lap names; does
// nothing, not even read the clock, without `times`.
class PhaseClock {
 public:
  explicit PhaseClock(OptimizerPhaseTimes* times) : times_(times) {
    if (times_ != nullptr) last_ = std::chrono::steady_clock::now();
  }
  void lap(double OptimizerPhaseTimes::*field) {
    if (times_ == nullptr) return;
    const auto now = std::chrono::steady_clock::now();
    times_->*field += std::chrono::duration<double>(now - last_).count();
    last_ = now;
  }

 private:
  OptimizerPhaseTimes* times_;
  std::chrono::steady_clock::time_point last_;
};

// --- optim_state.cpp: small helpers of the optimizers.

at::Tensor scalar_tensor(double v, const at::Device& device);
std::string shape_str(at::IntArrayRef s);

// --- orthogonalize.cpp: the coefficients of the orthogonalizers (DistMuon checks ns_steps
// against kPolarExpress's length).

inline constexpr std::array<std::array<double, 3>, 5> kPolarExpress{{
    {8.156554524902461, -22.48329292557795, 15.878769915207462},
    {4.042929935166739, -2.808917465908714, 0.5000178451051316},
    {3.8916678022926607, -2.772484153217685, 0.5060648178503393},
    {3.285753657755655, -2.3681294933425376, 0.46449024233003106},
    {2.3465413258596377, -1.7097828382687081, 0.42323551169305323},
}};
inline constexpr std::array<double, 3> kNewtonSchulz{3.4445, -4.7750, 2.0315};

// --- optim_state.cpp: state dict entries and keys.

// One entry of a state dict while it is being collected: `value` is the live tensor.
using Entries = std::vector<OptimizerStateEntry>;

void load_entries(const std::string& kind, uint32_t rank, uint32_t world, const Entries& live,
                  const OptimizerState& state);
void add_scalar_entry(Entries& out, StateKey key, const at::Tensor& t);
StateKey param_key(size_t param, StateField field);
StateKey group_key(size_t group, StateField field);
StateKey stack_key(size_t group, size_t stack, StateField field);

}  // namespace megacpp::trainer::detail
