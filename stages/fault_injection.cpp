// Fault injection (MEGACPP_FAULT): parsing the specification once per process and acting at
// the named points. Contracts in stages/stage.h (fault_point) and stages/detail/stage_internal.h.
#include "stages/detail/stage_internal.h"

#include <limits.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <thread>

#include "core/error.h"
#include "core/util.h"

namespace megacpp::stage {

namespace {

constexpr std::pair<std::string_view, detail::FaultAction> kFaultActions[] = {
    {"throw", detail::FaultAction::kThrow},     {"abort", detail::FaultAction::kAbort},
    {"segv", detail::FaultAction::kSegv},       {"exit", detail::FaultAction::kExit},
    {"hang", detail::FaultAction::kHang},       {"stop", detail::FaultAction::kStop},
    {"foreign", detail::FaultAction::kForeign}, {"nan", detail::FaultAction::kNan},
};

std::optional<uint32_t> parse_u32(std::string_view s) {
  if (s.empty() || s.size() > 10) return std::nullopt;
  uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  if (v > UINT32_MAX) return std::nullopt;
  return static_cast<uint32_t>(v);
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

}  // namespace

namespace detail {

std::string_view action_name(FaultAction action) {
  for (const auto& [name, a] : kFaultActions) {
    if (a == action) return name;
  }
  return "?";
}

std::vector<Fault> parse_faults(std::string_view spec, schema::StageKind stage, uint32_t rank,
                                uint32_t generation, uint32_t attempt) {
  std::vector<Fault> mine;
  if (trim(spec).empty()) return mine;
  size_t begin = 0;
  for (;;) {
    const size_t comma = spec.find(',', begin);
    const std::string_view entry =
        trim(spec.substr(begin, comma == std::string_view::npos ? spec.npos : comma - begin));
    auto invalid = [&](std::string_view why) {
      MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                   "MEGACPP_FAULT: invalid entry '{}': {} (expected "
                   "<stage>:<rank>:<point>:<step>:<action>[:<generation>|*], action one of "
                   "throw|abort|segv|exit|hang|stop|foreign|nan)",
                   entry, why);
    };
    std::vector<std::string_view> fields;
    size_t f = 0;
    for (;;) {
      const size_t colon = entry.find(':', f);
      fields.push_back(entry.substr(f, colon == std::string_view::npos ? entry.npos : colon - f));
      if (colon == std::string_view::npos) break;
      f = colon + 1;
    }
    if (fields.size() != 5 && fields.size() != 6) {
      invalid(fmt::format("{} fields, not 5 or 6", fields.size()));
    }
    schema::StageKind fault_stage{};
    try {
      fault_stage = layout::parse_stage(fields[0]);
    } catch (const Error&) {
      invalid(fmt::format("unknown stage '{}'", fields[0]));
    }
    const auto fault_rank = parse_u32(fields[1]);
    if (!fault_rank) invalid(fmt::format("rank '{}' is not a number", fields[1]));
    const std::string_view point = fields[2];
    if (point.empty() || point.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789_") !=
                             std::string_view::npos) {
      invalid(fmt::format("point '{}' is not a lower-case name", point));
    }
    const auto step = parse_u32(fields[3]);
    if (!step) invalid(fmt::format("step '{}' is not a number", fields[3]));
    std::optional<FaultAction> action;
    for (const auto& [name, a] : kFaultActions) {
      if (fields[4] == name) action = a;
    }
    if (!action) invalid(fmt::format("unknown action '{}'", fields[4]));
    // The first launch only, by default: generation 0 of attempt 0.
    std::optional<uint32_t> fault_generation = 0;
    if (fields.size() == 6) {
      fault_generation = fields[5] == "*" ? std::nullopt : parse_u32(fields[5]);
      if (fields[5] != "*" && !fault_generation) {
        invalid(fmt::format("generation '{}' is not a number or *", fields[5]));
      }
    }
    if (fault_stage == stage && *fault_rank == rank &&
        (!fault_generation || (*fault_generation == generation && attempt == 0))) {
      mine.push_back(Fault{std::string(point), *step, *action});
    }
    if (comma == std::string_view::npos) break;
    begin = comma + 1;
  }
  return mine;
}

}  // namespace detail

bool fault_point(StageContext& ctx, std::string_view point, uint32_t step) {
  if (ctx.faults_.empty()) [[likely]]
    return false;
  bool poison = false;
  for (const auto& f : ctx.faults_) {
    if (f.step != step || f.point != point) continue;
    log_warn("injected fault at {} step {}: {}", point, step, detail::action_name(f.action));
    switch (f.action) {
      case detail::FaultAction::kThrow:
        MEGACPP_FAIL(ErrorKind::kInternal, "injected fault at {} step {}", point, step);
      case detail::FaultAction::kForeign:
        // Not a megacpp::Error: stands for a library's own exception (a c10::Error from a bad
        // index, std::bad_alloc), which the process must type by where it happened.
        throw std::runtime_error(fmt::format("injected foreign error at {} step {}", point, step));
      case detail::FaultAction::kAbort:
        std::abort();
      case detail::FaultAction::kSegv: {
        // A real invalid access (SEGV_ACCERR) to an inaccessible page; unlike a null store,
        // UBSan does not intercept it, so the sanitizer build faults as the release one does.
        void* page = ::mmap(nullptr, 4096, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (page != MAP_FAILED) *static_cast<volatile char*>(page) = 1;
        ::raise(SIGSEGV);
        break;
      }
      case detail::FaultAction::kExit:
        ctx.journal().sync();
        ::_exit(3);
      case detail::FaultAction::kHang:
        // Heartbeats go on (they come from the control client's thread); step and phase stay.
        for (;;) std::this_thread::sleep_for(std::chrono::milliseconds(50));
      case detail::FaultAction::kStop:
        ::raise(SIGSTOP);
        break;
      case detail::FaultAction::kNan:
        poison = true;
        break;
    }
  }
  return poison;
}

}  // namespace megacpp::stage
