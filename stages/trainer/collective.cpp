#include "stages/trainer/collective.h"

#include <exception>
#include <string>

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include "core/error.h"

namespace megacpp::trainer {

namespace {

// Called from a catch block: rethrows the exception in flight as a typed Error.
[[noreturn]] void rethrow_as_peer_failure(std::string_view what) {
  try {
    throw;
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    std::string text = e.what();
    if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) text = c10->what_without_backtrace();
    // Gloo and the store say "Timed out" / "timeout" in their messages; they carry no type.
    const bool timeout =
        text.find("imed out") != std::string::npos || text.find("imeout") != std::string::npos;
    MEGACPP_FAIL(timeout ? ErrorKind::kTimeout : ErrorKind::kPeerFailure, "{}: {}", what, text);
  }
}

}  // namespace

void run_collective(std::string_view what,
                    const std::function<c10::intrusive_ptr<c10d::Work>()>& issue) {
  try {
    issue()->wait();
  } catch (...) {
    rethrow_as_peer_failure(what);
  }
}

void with_peers(std::string_view what, const std::function<void()>& connect) {
  try {
    connect();
  } catch (...) {
    rethrow_as_peer_failure(what);
  }
}

}  // namespace megacpp::trainer
