// Console progress of a run (internal): a live line on a TTY, plain periodic lines otherwise.
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace megacpp::supervisor {

struct ConsoleRank {
  uint32_t step;
  double tokens;
  float loss;
  float val_loss = NAN;   // the newest held-out evaluation's
  uint32_t val_step = 0;  // the step it followed; 0: none yet
};

class Console {
 public:
  virtual ~Console() = default;
  // Called from the watch loop (every ~100 ms); rate-limits its own output.
  virtual void update(const std::vector<ConsoleRank>& ranks, uint32_t up, uint32_t total) = 0;
  virtual void finish() = 0;
};

// mode: auto (tty if stdout is a terminal, else plain) | tty | plain | none (nullptr).
std::unique_ptr<Console> make_console(const std::string& mode, uint32_t steps,
                                      const std::string& recipe, const std::string& run_dir);

}  // namespace megacpp::supervisor
