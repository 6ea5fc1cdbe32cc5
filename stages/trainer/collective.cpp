#include "stages/trainer/collective.h"

#include <chrono>
#include <exception>
#include <string>

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include "core/error.h"
#include "core/util.h"

namespace megacpp::trainer {

namespace {

// Called from a catch block: rethrows the exception in flight as a typed Error. Gloo's and
// the store's exceptions carry no type for a timeout, but their deadlines are ours: a failure
// that came no earlier than the deadline after the operation began is the deadline passing
// (Error{kTimeout}); one that came before it is a peer's doing (Error{kPeerFailure}).
[[noreturn]] void rethrow_as_peer_failure(std::string_view what, int64_t started_ns,
                                          int64_t deadline_ns) {
  try {
    throw;
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    const std::string text = exception_text(e);
    const bool timeout = deadline_ns > 0 && mono_ns() - started_ns >= deadline_ns;
    MEGACPP_FAIL(timeout ? ErrorKind::kTimeout : ErrorKind::kPeerFailure, "{}: {}", what, text);
  }
}

}  // namespace

std::string exception_text(const std::exception& e) {
  const auto* c10 = dynamic_cast<const c10::Error*>(&e);
  const std::string_view text = c10 != nullptr ? c10->what_without_backtrace() : e.what();
  std::string out;
  for (size_t at = 0; at <= text.size();) {
    size_t end = text.find('\n', at);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(at, end - at);
    while (!line.empty() && (line.back() == ' ' || line.back() == '\r')) line.remove_suffix(1);
    if (!line.empty()) {
      if (!out.empty()) out += "; ";
      out += line;
    }
    at = end + 1;
  }
  return out;
}

ipc::PeerExchange* peer_exchange_of(const c10::intrusive_ptr<c10d::Backend>& pg) noexcept {
  auto* with = dynamic_cast<WithPeerExchange*>(pg.get());
  return with != nullptr ? with->peer_exchange() : nullptr;
}

void run_collective(std::string_view what, const c10::intrusive_ptr<c10d::Backend>& pg,
                    const std::function<c10::intrusive_ptr<c10d::Work>()>& issue) {
  run_collectives(what, pg, [&] { return std::vector<c10::intrusive_ptr<c10d::Work>>{issue()}; });
}

void run_collectives(std::string_view what, const c10::intrusive_ptr<c10d::Backend>& pg,
                     const std::function<std::vector<c10::intrusive_ptr<c10d::Work>>()>& issue) {
  const int64_t started = mono_ns();
  bool aborted = false;
  try {
    const auto works = issue();
    auto* abortable = dynamic_cast<AbortableWaits*>(pg.get());
    for (const auto& work : works) {
      if (abortable != nullptr) {
        aborted = !abortable->wait_unless_aborted(*work);
        if (aborted) break;
      } else {
        work->wait();
      }
    }
  } catch (...) {
    const auto timeout = pg->getBackendOptions()->timeout;
    rethrow_as_peer_failure(what, started,
                            std::chrono::duration_cast<std::chrono::nanoseconds>(timeout).count());
  }
  MEGACPP_CHECK(!aborted, ErrorKind::kPeerFailure,
                fmt::format("{}: the group's collectives were aborted by the supervisor's "
                            "teardown of the failed job",
                            what));
}

void check_async_error(std::string_view what, const c10::intrusive_ptr<c10d::Backend>& pg) {
  if (!pg || pg->getBackendName() != "nccl") return;
  const c10d::ErrorType e = pg->getError();
  if (e == c10d::ErrorType::SUCCESS) return;
  const char* which = e == c10d::ErrorType::TIMEOUT        ? "a collective timed out"
                      : e == c10d::ErrorType::REMOTE_ERROR ? "a peer's communicator failed"
                                                           : "the communicator failed";
  MEGACPP_FAIL(e == c10d::ErrorType::TIMEOUT ? ErrorKind::kTimeout : ErrorKind::kPeerFailure,
               "{}: {} (NCCL) before the host read the result; the result is not used", what,
               which);
}

void with_peers(std::string_view what, std::chrono::milliseconds deadline,
                const std::function<void()>& connect) {
  const int64_t started = mono_ns();
  try {
    connect();
  } catch (...) {
    rethrow_as_peer_failure(what, started,
                            std::chrono::duration_cast<std::chrono::nanoseconds>(deadline).count());
  }
}

}  // namespace megacpp::trainer
