#include "supervisor/console.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include <fmt/format.h>

#include "core/util.h"

namespace megacpp::supervisor {

namespace {

std::string hms(double s) {
  if (!std::isfinite(s) || s < 0) return "--:--";
  auto t = static_cast<long>(s + 0.5);
  return t >= 3600 ? fmt::format("{}:{:02d}:{:02d}", t / 3600, (t / 60) % 60, t % 60)
                   : fmt::format("{}:{:02d}", t / 60, t % 60);
}

std::string si(double v) {
  if (!std::isfinite(v)) return "-";
  if (v >= 1e6) return fmt::format("{:.2f}M", v / 1e6);
  if (v >= 1e3) return fmt::format("{:.1f}k", v / 1e3);
  return fmt::format("{:.0f}", v);
}

class LineConsole final : public Console {
 public:
  LineConsole(bool tty, uint32_t steps) : tty_(tty), steps_(steps), t0_(mono_ns()) {}

  void update(const std::vector<ConsoleRank>& ranks, uint32_t up, uint32_t total) override {
    if (ranks.empty()) return;
    int64_t now = mono_ns();
    uint32_t step = UINT32_MAX;
    double tokens = 0;
    for (const auto& r : ranks) {
      step = std::min(step, r.step);
      tokens += r.tokens;
    }
    if (step >= 1 && first_ns_ == 0) {
      first_ns_ = now;
      first_tokens_ = tokens;
      first_step_ = step;
    }
    double rate = NAN, eta = NAN;
    if (first_ns_ != 0 && now > first_ns_ && step > first_step_) {
      double dt = static_cast<double>(now - first_ns_) / 1e9;
      rate = (tokens - first_tokens_) / dt;
      eta = dt / (step - first_step_) * (steps_ - step);
    }
    bool changed = step != last_step_;
    if (tty_) {
      if (now - last_print_ns_ < 200'000'000 && !(changed && step == steps_)) return;
    } else {
      // Plain output is for logs: a line per tenth of the run, and at least every 30 s.
      uint32_t stride = std::max<uint32_t>(1, steps_ / 10);
      bool milestone = changed && step != UINT32_MAX && (step % stride == 0 || step == steps_);
      if (!milestone && now - last_print_ns_ < 30'000'000'000) return;
    }
    last_print_ns_ = now;
    last_step_ = step;
    float loss = ranks[0].loss;
    // The newest evaluation every rank has reported (each reports the job's loss).
    uint32_t val_step = UINT32_MAX;
    float val_loss = NAN;
    for (const auto& r : ranks) {
      if (r.val_step < val_step) {
        val_step = r.val_step;
        val_loss = r.val_loss;
      }
    }
    const std::string val = val_step != UINT32_MAX && val_step > 0 && std::isfinite(val_loss)
                                ? fmt::format(" | val {:.4f} @{}", val_loss, val_step)
                                : std::string();
    std::string line = fmt::format(
        "step {:>{}}/{} | loss {:>7}{} | {:>7} tok/s | elapsed {} | ETA {} | stages {}/{} up", step,
        std::to_string(steps_).size(), steps_,
        std::isfinite(loss) ? fmt::format("{:.4f}", loss) : "-", val, si(rate),
        hms(static_cast<double>(now - t0_) / 1e9), hms(eta), up, total);
    if (tty_) {
      fmt::print("\r{}\x1b[K", line);
      printed_ = true;
    } else {
      fmt::print("{}\n", line);
    }
    std::fflush(stdout);
  }

  void finish() override {
    if (tty_ && printed_) fmt::print("\n");
    std::fflush(stdout);
  }

 private:
  bool tty_;
  uint32_t steps_;
  int64_t t0_;
  int64_t first_ns_ = 0;
  double first_tokens_ = 0;
  uint32_t first_step_ = 0;
  int64_t last_print_ns_ = 0;
  uint32_t last_step_ = UINT32_MAX;
  bool printed_ = false;
};

}  // namespace

std::unique_ptr<Console> make_console(const std::string& mode, uint32_t steps,
                                      const std::string& recipe, const std::string& run_dir) {
  if (mode == "none") return nullptr;
  bool tty = mode == "tty" || (mode == "auto" && ::isatty(STDOUT_FILENO));
  fmt::print("megacpp: training recipe {} for {} steps; run directory {}\n", recipe, steps,
             run_dir);
  std::fflush(stdout);
  return std::make_unique<LineConsole>(tty, steps);
}

}  // namespace megacpp::supervisor
