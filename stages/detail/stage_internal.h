// Internals of the stage runtime shared by stage.cpp, crash_dump.cpp and
// fault_injection.cpp. Not a public header (stage.h is).
#pragma once

#include <cstdint>
#include <exception>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "schemas/common.capnp.h"
#include "schemas/enums.h"
#include "stages/stage.h"

namespace megacpp::stage::detail {

// A failure met in-process, described for the log, the failure dump and the supervisor.
struct DumpFields {
  schema::FailureReport kind = schema::FailureReport::EXCEPTION;  // exception | terminate
  // The thrown megacpp::ErrorKind, or capnp / c10 / std / unknown for a foreign exception;
  // nullopt only when describing the failure ran out of memory.
  std::optional<schema::ErrorKind> error_kind;
  std::string error_kind_name() const {
    return error_kind ? std::string(schemas::name(*error_kind)) : std::string();
  }
  std::string message;
  std::vector<std::string> backtrace;
  int64_t mono_ns = 0;  // when the failure was met
};

// Describes the exception in flight (`ep`) as a DumpFields of `kind` ("exception",
// "terminate"); never throws (a description that runs out of memory says so).
DumpFields classify(std::exception_ptr ep, schema::FailureReport report) noexcept;
// Logs the message and backtrace; never throws.
void log_failure(const DumpFields& f) noexcept;
// Writes RUN/failures/<stage>-<rank>.json atomically; an error is logged, never thrown.
void write_failure_dump(const StageContext* ctx, schema::StageKind stage, uint32_t rank,
                        const std::filesystem::path& path, const DumpFields& f) noexcept;
// Prepares every path and text the crash handlers need, then installs the fatal-signal and
// terminate handlers. Called once, before any thread exists.
void arm_crash_handlers(schema::StageKind stage, const StageArgs& args);
// The context whose phase and step a crash dump records (one per process); retract_context
// clears it only if it is still `ctx`.
void publish_context(const StageContext* ctx) noexcept;
void retract_context(const StageContext* ctx) noexcept;

// The MEGACPP_FAULT name of an action ("throw", "segv", ...).
std::string_view action_name(FaultAction action);

}  // namespace megacpp::stage::detail
