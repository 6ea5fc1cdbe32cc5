// StepProfile (step_profile.h): torch's Kineto profiler over a range of steps, summarised.
#include "stages/trainer/step_profile.h"

#include <kineto/ActivityType.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <algorithm>
#include <charconv>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "core/util.h"

namespace megacpp::trainer {

namespace {

namespace prof = torch::profiler::impl;
namespace kp = torch::autograd::profiler;
using Clock = std::chrono::steady_clock;

bool parse_step(std::string_view s, uint32_t& out) {
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  return ec == std::errc() && end == s.data() + s.size();
}

std::set<prof::ActivityType> activities(bool cuda) {
  std::set<prof::ActivityType> a{prof::ActivityType::CPU};
  if (cuda) a.insert(prof::ActivityType::CUDA);
  return a;
}

prof::ProfilerConfig config() {
  return prof::ProfilerConfig(prof::ProfilerState::KINETO, /*report_input_shapes=*/false,
                              /*profile_memory=*/false, /*with_stack=*/false,
                              /*with_flops=*/false, /*with_modules=*/false);
}

struct Total {
  uint64_t ns = 0;
  uint64_t calls = 0;
};

// The device's work (kernels, copies, fills) and the host's operators, by name.
std::string summary(const kp::ProfilerResult& result, const ProfileSteps& steps,
                    const std::string& device, double wall_s) {
  std::map<std::string, Total> kernels, ops;
  std::vector<std::pair<uint64_t, uint64_t>> spans;  // device work [start, end)
  uint64_t device_ns = 0;
  for (const kp::KinetoEvent& e : result.events()) {
    const auto type = static_cast<libkineto::ActivityType>(e.activityType());
    if (type == libkineto::ActivityType::CONCURRENT_KERNEL ||
        type == libkineto::ActivityType::GPU_MEMCPY ||
        type == libkineto::ActivityType::GPU_MEMSET) {
      Total& t = kernels[e.name()];
      t.ns += e.durationNs();
      ++t.calls;
      device_ns += e.durationNs();
      spans.emplace_back(e.startNs(), e.endNs());
    } else if (type == libkineto::ActivityType::CPU_OP) {
      Total& t = ops[e.name()];
      t.ns += e.durationNs();
      ++t.calls;
    }
  }
  // The busy time: the union of the device's spans (two streams' overlapping work once).
  std::sort(spans.begin(), spans.end());
  uint64_t busy = 0, open_start = 0, open_end = 0;
  for (const auto& [s, e] : spans) {
    if (s > open_end) {
      busy += open_end - open_start;
      open_start = s;
      open_end = e;
    } else {
      open_end = std::max(open_end, e);
    }
  }
  busy += open_end - open_start;

  const auto by_time = [](const std::map<std::string, Total>& m) {
    std::vector<std::pair<std::string, Total>> v(m.begin(), m.end());
    std::sort(v.begin(), v.end(),
              [](const auto& a, const auto& b) { return a.second.ns > b.second.ns; });
    return v;
  };
  const uint32_t n = steps.last - steps.first + 1;
  std::string out =
      fmt::format("profile of steps {}..{} ({} step{}) on {}: {:.1f} ms of wall time\n",
                  steps.first, steps.last, n, n == 1 ? "" : "s", device, 1e3 * wall_s);
  if (!spans.empty()) {
    out += fmt::format(
        "device: busy {:.1f} ms ({:.1f}% of the wall time; idle {:.1f} ms), {:.1f} ms of work in "
        "{} kernels, copies and fills\n",
        busy / 1e6, 100.0 * busy / 1e9 / wall_s, std::max(0.0, 1e3 * wall_s - busy / 1e6),
        device_ns / 1e6, spans.size());
    out += fmt::format("  {:>6} {:>10} {:>7} {:>9}  {}\n", "% work", "total ms", "calls", "mean us",
                       "kernel");
    size_t shown = 0;
    for (const auto& [name, t] : by_time(kernels)) {
      if (++shown > 40) break;
      out += fmt::format("  {:6.1f} {:10.2f} {:7} {:9.1f}  {}\n", 100.0 * t.ns / device_ns,
                         t.ns / 1e6, t.calls, t.ns / 1e3 / t.calls, name.substr(0, 120));
    }
  }
  out += fmt::format("host: torch's operators by total time (each including what it calls)\n");
  out += fmt::format("  {:>10} {:>7}  {}\n", "total ms", "calls", "operator");
  size_t shown = 0;
  for (const auto& [name, t] : by_time(ops)) {
    if (++shown > 30) break;
    out += fmt::format("  {:10.2f} {:7}  {}\n", t.ns / 1e6, t.calls, name.substr(0, 120));
  }
  return out;
}

}  // namespace

std::optional<ProfileSteps> parse_profile_steps(std::string_view text) {
  if (text.empty()) return std::nullopt;
  const size_t colon = text.find(':');
  ProfileSteps s;
  const bool ok = colon != std::string_view::npos && parse_step(text.substr(0, colon), s.first) &&
                  parse_step(text.substr(colon + 1), s.last) && s.first >= 1 && s.first <= s.last;
  MEGACPP_CHECK(ok, ErrorKind::kInvalidArgument,
                fmt::format("MEGACPP_PROFILE_STEPS={}: give FIRST:LAST, the steps to profile "
                            "(1 <= FIRST <= LAST), e.g. 6:10",
                            text));
  return s;
}

StepProfile::StepProfile(ProfileSteps steps, bool cuda, std::filesystem::path out,
                         std::string device)
    : steps_(steps), cuda_(cuda), out_(std::move(out)), device_(std::move(device)) {}

StepProfile::~StepProfile() {
  if (!on_) return;
  try {
    (void)kp::disableProfiler();
  } catch (const std::exception& e) {
    log_warn("profile: stopping torch's profiler: {}", e.what());
  }
}

void StepProfile::before(uint32_t step) {
  if (step != steps_.first || on_) return;
  kp::prepareProfiler(config(), activities(cuda_));
  kp::enableProfiler(config(), activities(cuda_));
  on_ = true;
  started_ = Clock::now();
  log_info("profile: torch's profiler on for steps {}..{}", steps_.first, steps_.last);
}

void StepProfile::after(uint32_t step) {
  if (step != steps_.last || !on_) return;
  const double wall = std::chrono::duration<double>(Clock::now() - started_).count();
  on_ = false;
  const std::unique_ptr<kp::ProfilerResult> result = kp::disableProfiler();
  const std::filesystem::path text = out_.string() + ".txt";
  try {
    write_file_atomic(text, summary(*result, steps_, device_, wall));
    result->save(out_.string() + ".json");
  } catch (const std::exception& e) {
    log_warn("profile: writing {}: {}", text.string(), e.what());
    return;
  }
  log_info("profile: steps {}..{} written to {}", steps_.first, steps_.last, text.string());
}

}  // namespace megacpp::trainer
