// megacpp::ipc peer exchange: point-to-point messages between the ranks of one host through
// shared memory, for the optimizer's exchanges (stages/trainer/exchange.h), link by link:
// the peers of a group that share this host attach each other; others are reached elsewhere.
//
// Every rank creates one region, its outbox: for each peer two slots (a message larger than a
// slot streams through them in chunks, double-buffered) and the counters of what it published
// to that peer and consumed from it. It attaches each peer's outbox and reads its messages
// there. Each counter has one writer, so the protocol is lock-free: data, then a release
// store of the counter, then the reader's bell rung (a futex word in the reader's own
// outbox, woken only while the reader sleeps on it).
//
// Lifetime: a PeerExchange owns its region and its peers' mappings and pidfds. Creation is
// local; the caller hands token() to the peers (a store), attach()es theirs and, once every
// rank attached, unlink()s the name, so a crash leaves nothing in /dev/shm. Neither copyable
// nor movable.
// Blocking: exchange() returns once every message of the call was sent and received. It waits
// by spinning ~20 us, then sleeping on the bell in steps of at most 10 ms, between which it
// checks abort(), its peers' liveness and the deadline.
// Failure: a peer that exited → Error{kPeerFailure} naming it; no progress before the deadline
// → Error{kTimeout}; abort() → Error{kPeerFailure} saying so; a message whose size differs
// from the peer's → Error{kProtocol}. Region errors → Error{kSystem} / Error{kCorruption}.
// After a failure the exchange's state is undefined: the group is done.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace megacpp::ipc {

class ShmRegion;

class PeerExchange {
 public:
  struct Config {
    std::string name_prefix;  // rank r's region: name_prefix + "<r>" (a valid shm name)
    uint32_t rank = 0;
    uint32_t world = 1;
    // Per slot; two per peer. 0: 4 MiB at world <= 5, shrinking so the outbox stays <= 32 MiB.
    size_t slot_bytes = 0;
  };
  // Creates this rank's outbox. Throws Error{kInvalidArgument} for a bad config, Error{kSystem}
  // when the segment cannot be made (no /dev/shm, too small a /dev/shm).
  explicit PeerExchange(const Config& config);
  ~PeerExchange();
  PeerExchange(const PeerExchange&) = delete;
  PeerExchange& operator=(const PeerExchange&) = delete;

  // What a peer needs to attach this outbox: its name and a random nonce that proves the
  // segment found under that name is this one (another run's, another host's, is refused).
  std::string token() const;
  // Attaches peer `rank`'s outbox from its token and opens a pidfd on its process. Throws
  // Error{kCorruption} when the segment is not the token's, Error{kSystem} when it is absent
  // (another host or /dev/shm namespace) or its process cannot be watched.
  void attach(uint32_t rank, std::string_view token);
  // Removes this outbox's name (every peer has attached it); the mappings stay.
  void unlink();
  // Drops peer `rank`'s attachment: from here on messages to and from it go another way
  // (the group agreed that this link is not shared: the peer could not attach this outbox).
  void forget(uint32_t rank);
  // Whether peer `rank` is attached: its messages can go through shared memory.
  bool reaches(uint32_t rank) const noexcept {
    return rank < peers_.size() && peers_[rank] != nullptr;
  }

  // One message to and one from each listed peer; `send` and `recv` of one peer have the
  // sizes the peer gives to its own `recv` and `send` for this rank. Collective: every rank
  // of the group calls exchange() the same number of times. `recv` must not alias `send`.
  struct Transfer {
    uint32_t peer = 0;
    std::span<const std::byte> send;
    std::span<std::byte> recv;
  };
  void exchange(std::string_view what, std::span<const Transfer> transfers,
                std::chrono::milliseconds timeout);

  // Ends a wait in exchange(), now or later, with Error{kPeerFailure}. Thread-safe.
  void abort() noexcept;

  uint32_t rank() const noexcept { return rank_; }
  uint32_t world() const noexcept { return world_; }
  size_t slot_bytes() const noexcept { return slot_bytes_; }

 private:
  struct Peer;
  uint32_t rank_, world_;
  size_t slot_bytes_;
  uint64_t nonce_;
  std::unique_ptr<ShmRegion> own_;
  std::vector<std::unique_ptr<Peer>> peers_;  // index = rank; own rank's entry is null
  std::atomic<bool> aborted_{false};
};

}  // namespace megacpp::ipc
