// megacpp::trainer collectives — the one place a rank's error is typed as caused by a peer.
//
// A collective that fails while it runs (a peer closed its connections, the transport's
// deadline passed) is the evidence that the failure began elsewhere: the rank is a victim.
// An error anywhere else in a rank (a bad index, an allocation failure, a NaN check) is the
// rank's own, whatever the world size. Typing by where the error happened, not by the world
// size, keeps a rank's own bug from being filed as a victim's claim.
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace megacpp::ipc {
class PeerExchange;
}

namespace megacpp::trainer {

// A group whose abort() also ends the waits of run_collective: the collective in flight and
// every later one end in Error{kPeerFailure} naming the abort, instead of waiting out the
// transport's timeout. The trainer's Gloo group implements it (rendezvous.h): Gloo's own
// abort() does nothing, while ProcessGroupNCCL's aborts the communicators, which ends their
// kernels and the host's waits on them by itself.
class AbortableWaits {
 public:
  virtual ~AbortableWaits() = default;
  // Blocks until `work` completes (true; its error, if any, is rethrown by work.wait()) or
  // the group is aborted first (false). Thread-safe against abort() from another thread.
  virtual bool wait_unless_aborted(c10d::Work& work) = 0;
};

// A group whose ranks share a host and exchange point to point through shared memory instead
// of the backend's send and receive (the trainer's Gloo group when rendezvous.h's
// peer_exchange_prefix is set and every rank could attach every other's outbox).
class WithPeerExchange {
 public:
  virtual ~WithPeerExchange() = default;
  // Null when the group exchanges through its backend.
  virtual ipc::PeerExchange* peer_exchange() noexcept = 0;
};
ipc::PeerExchange* peer_exchange_of(const c10::intrusive_ptr<c10d::Backend>& pg) noexcept;

// Issues a collective with `issue` and waits for it. A failure of either is rethrown as
// Error{kTimeout} when it came once `pg`'s timeout had passed since the collective was issued
// (the transports' exceptions carry no type for a timeout, but the deadline is ours), else
// Error{kPeerFailure}, naming `what`. A megacpp::Error passes through unchanged. On a group
// that implements AbortableWaits, an abort ends the wait in Error{kPeerFailure}.
void run_collective(std::string_view what, const c10::intrusive_ptr<c10d::Backend>& pg,
                    const std::function<c10::intrusive_ptr<c10d::Work>()>& issue);
// The same for operations that are in flight together (a send and a receive of one ring
// step): `issue` starts all of them, and each is waited for in the order given.
void run_collectives(std::string_view what, const c10::intrusive_ptr<c10d::Backend>& pg,
                     const std::function<std::vector<c10::intrusive_ptr<c10d::Work>>()>& issue);

// A foreign exception's text in one line, for a user-facing error: a c10::Error's without its
// C++ backtrace, torch's and NCCL's advice lines joined by "; ".
std::string exception_text(const std::exception& e);

// NCCL's waits do not block the host (Work::wait() only makes the compute stream wait), so a
// collective that timed out in NCCL's watchdog, or whose communicator failed or was aborted,
// shows only once the host reads the device, and then as bytes nobody finished reducing. Call
// this right after such a read and before using what was read, for each group the read depends
// on: it throws Error{kTimeout} (the watchdog's timeout) or Error{kPeerFailure} (a communicator
// error, a peer's) naming `what`. A null group, or one whose backend keeps no error state (Gloo,
// whose waits throw themselves), passes.
void check_async_error(std::string_view what, const c10::intrusive_ptr<c10d::Backend>& pg);

// Runs `connect` (a rendezvous: the store and the peers' connections) with the same typing;
// `deadline` is the earliest timeout the rendezvous was given.
void with_peers(std::string_view what, std::chrono::milliseconds deadline,
                const std::function<void()>& connect);

}  // namespace megacpp::trainer
