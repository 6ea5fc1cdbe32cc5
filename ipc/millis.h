// megacpp::ipc timeouts: every bounded wait in ipc takes a Millis.
#pragma once

#include <chrono>

namespace megacpp::ipc {

using Millis = std::chrono::milliseconds;

}  // namespace megacpp::ipc
