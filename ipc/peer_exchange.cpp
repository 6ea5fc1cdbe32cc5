#include "ipc/peer_exchange.h"

#include <linux/futex.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cstring>
#include <random>

#include <fmt/format.h>

#include "core/error.h"
#include "ipc/detail/internal.h"
#include "ipc/shm.h"

namespace megacpp::ipc {

namespace {

constexpr uint64_t kMagic = 0x6d65676178636831ULL;  // "megaxch1"
constexpr uint32_t kVersion = 1;
constexpr size_t kDataAlign = 4096;
constexpr uint64_t kLastChunk = uint64_t{1} << 63;  // in a chunk's length word
constexpr auto kSpin = std::chrono::microseconds(20);
constexpr auto kNap = std::chrono::milliseconds(10);  // between checks of abort, peers, deadline

// Geometry, written once by the creator before any peer attaches.
struct Header {
  uint64_t magic;
  uint32_t version;
  uint32_t world;
  uint32_t rank;
  int32_t pid;
  uint64_t nonce;
  uint64_t slot_bytes;
  uint64_t total_bytes;
};

// The futex word peers ring when they published to this rank or consumed from it, and how
// many of the owner's threads sleep on it (a ring with no sleeper makes no system call).
struct alignas(64) Bell {
  std::atomic<uint32_t> word;
  std::atomic<uint32_t> sleepers;
};
static_assert(std::atomic<uint32_t>::is_always_lock_free && sizeof(std::atomic<uint32_t>) == 4);

struct alignas(64) Counter {
  std::atomic<uint64_t> value;
};
static_assert(std::atomic<uint64_t>::is_always_lock_free);

// Per peer q, in this rank's outbox: chunks published to q, chunks consumed from q (both
// cumulative over the group's life), and the length word of each of q's two slots.
struct alignas(64) Lane {
  std::atomic<uint64_t> sent;
  std::atomic<uint64_t> consumed;
  std::atomic<uint64_t> length[2];
};

// Every structure in the outbox starts on its own cache line, as its alignas asks.
constexpr size_t kBellOffset = (sizeof(Header) + 63) / 64 * 64;

struct Layout {
  size_t lanes, data, total;
  explicit Layout(uint32_t world, size_t slot_bytes) {
    lanes = kBellOffset + sizeof(Bell);
    data = lanes + sizeof(Lane) * world;
    data = (data + kDataAlign - 1) / kDataAlign * kDataAlign;
    total = data + 2 * static_cast<size_t>(world - 1) * slot_bytes;
  }
};

size_t default_slot_bytes(uint32_t world) {
  if (world <= 5) return size_t{4} << 20;
  const size_t s = (size_t{32} << 20) / (2 * static_cast<size_t>(world - 1));
  return std::max<size_t>(size_t{256} << 10, s / kDataAlign * kDataAlign);
}

// A view of one outbox (own or a peer's) in its mapping.
struct Outbox {
  std::byte* base = nullptr;
  uint32_t rank = 0;
  size_t slot_bytes = 0;
  Layout layout{2, 0};

  Header& header() const { return *reinterpret_cast<Header*>(base); }
  Bell& bell() const { return *reinterpret_cast<Bell*>(base + kBellOffset); }
  Lane& lane(uint32_t peer) const { return reinterpret_cast<Lane*>(base + layout.lanes)[peer]; }
  // Slot `parity` of the messages from this outbox's rank to `peer`.
  std::byte* slot(uint32_t peer, uint64_t parity) const {
    const uint32_t index = peer < rank ? peer : peer - 1;
    return base + layout.data + (2 * static_cast<size_t>(index) + parity) * slot_bytes;
  }
};

void futex_wake(std::atomic<uint32_t>& word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE, INT_MAX, nullptr, nullptr,
            0);
}

// Sleeps while `word` holds `seen`, at most `for_`. EAGAIN (it changed), EINTR and ETIMEDOUT
// are all "look again".
void futex_wait(std::atomic<uint32_t>& word, uint32_t seen, std::chrono::nanoseconds for_) {
  const auto ns = std::max<int64_t>(for_.count(), 1000);
  struct timespec ts {
    static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(ns % 1'000'000'000)
  };
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT, seen, &ts, nullptr, 0);
}

void ring(Bell& bell) {
  bell.word.fetch_add(1, std::memory_order_seq_cst);
  if (bell.sleepers.load(std::memory_order_seq_cst) != 0) futex_wake(bell.word);
}

}  // namespace

struct PeerExchange::Peer {
  std::unique_ptr<ShmRegion> region;
  Outbox box;
  pid_t pid = 0;
  detail::Fd pidfd;  // none where pidfd_open is unavailable: kill(pid, 0)

  bool exited() const {
    if (pidfd.valid()) {
      struct pollfd p {
        pidfd.get(), POLLIN, 0
      };
      return ::poll(&p, 1, 0) > 0;
    }
    return ::kill(pid, 0) != 0 && errno == ESRCH;
  }
};

PeerExchange::PeerExchange(const Config& config)
    : rank_(config.rank),
      world_(config.world),
      slot_bytes_(config.slot_bytes != 0 ? config.slot_bytes : default_slot_bytes(config.world)) {
  MEGACPP_CHECK(
      world_ >= 2 && rank_ < world_, ErrorKind::kInvalidArgument,
      fmt::format("peer exchange: rank {} of world {} (a world of at least 2)", rank_, world_));
  MEGACPP_CHECK(slot_bytes_ % 64 == 0, ErrorKind::kInvalidArgument,
                fmt::format("peer exchange: slot of {} bytes (a multiple of 64)", slot_bytes_));
  std::random_device rd;
  nonce_ = (uint64_t{rd()} << 32) ^ rd();
  const Layout layout(world_, slot_bytes_);
  own_ = std::make_unique<ShmRegion>(ShmRegion::Create{},
                                     config.name_prefix + std::to_string(rank_), layout.total);
  auto* h = reinterpret_cast<Header*>(own_->data());
  h->magic = kMagic;
  h->version = kVersion;
  h->world = world_;
  h->rank = rank_;
  h->pid = ::getpid();
  h->nonce = nonce_;
  h->slot_bytes = slot_bytes_;
  h->total_bytes = layout.total;  // the lanes and the bell are zero: a fresh segment
  peers_.resize(world_);
}

PeerExchange::~PeerExchange() = default;

std::string PeerExchange::token() const {
  return fmt::format("{} {:016x}", own_->name(), nonce_);
}

void PeerExchange::attach(uint32_t rank, std::string_view token) {
  MEGACPP_CHECK(rank < world_ && rank != rank_, ErrorKind::kInvalidArgument,
                fmt::format("peer exchange: no peer rank {} in a world of {}", rank, world_));
  const size_t space = token.find(' ');
  MEGACPP_CHECK(space != std::string_view::npos, ErrorKind::kProtocol,
                fmt::format("peer exchange: rank {} sent a malformed token '{}'", rank, token));
  const std::string name(token.substr(0, space));
  const std::string_view hex = token.substr(space + 1);
  uint64_t nonce = 0;
  const auto [end, ec] = std::from_chars(hex.data(), hex.data() + hex.size(), nonce, 16);
  MEGACPP_CHECK(ec == std::errc() && end == hex.data() + hex.size(), ErrorKind::kProtocol,
                fmt::format("peer exchange: rank {} sent a malformed token '{}'", rank, token));
  auto peer = std::make_unique<Peer>();
  peer->region = std::make_unique<ShmRegion>(ShmRegion::Attach{}, name);
  const Layout layout(world_, slot_bytes_);
  MEGACPP_CHECK(peer->region->size() == layout.total, ErrorKind::kCorruption,
                fmt::format("peer exchange: {} is {} bytes, not rank {}'s outbox of {}", name,
                            peer->region->size(), rank, layout.total));
  const auto& h = *reinterpret_cast<const Header*>(peer->region->data());
  MEGACPP_CHECK(h.magic == kMagic && h.version == kVersion && h.nonce == nonce &&
                    h.world == world_ && h.rank == rank && h.slot_bytes == slot_bytes_,
                ErrorKind::kCorruption,
                fmt::format("peer exchange: {} is not rank {}'s outbox of this group", name, rank));
  peer->box = Outbox{peer->region->data(), rank, slot_bytes_, layout};
  peer->pid = h.pid;
  const long fd = ::syscall(SYS_pidfd_open, h.pid, 0);
  if (fd < 0) {
    MEGACPP_CHECK(errno == ENOSYS || errno == EPERM, ErrorKind::kSystem,
                  fmt::format("peer exchange: cannot watch rank {}'s process {}: {}", rank, h.pid,
                              std::strerror(errno)));
  } else {
    peer->pidfd.reset(static_cast<int>(fd));
  }
  peers_[rank] = std::move(peer);
}

void PeerExchange::unlink() {
  own_->unlink();
}

void PeerExchange::forget(uint32_t rank) {
  MEGACPP_CHECK(rank < world_ && rank != rank_, ErrorKind::kInvalidArgument,
                fmt::format("peer exchange: no peer rank {} in a world of {}", rank, world_));
  peers_[rank].reset();
}

void PeerExchange::abort() noexcept {
  aborted_.store(true, std::memory_order_seq_cst);
  auto* bell = reinterpret_cast<Bell*>(own_->data() + kBellOffset);
  bell->word.fetch_add(1, std::memory_order_seq_cst);
  futex_wake(bell->word);
}

void PeerExchange::exchange(std::string_view what, std::span<const Transfer> transfers,
                            std::chrono::milliseconds timeout) {
  const Outbox own{own_->data(), rank_, slot_bytes_, Layout(world_, slot_bytes_)};
  struct Progress {
    const Transfer* t;
    Peer* peer;
    uint64_t send_base, sent, send_chunks;
    uint64_t recv_base, received, recv_chunks;
  };
  auto chunks = [&](size_t bytes) {
    return std::max<uint64_t>(1, (bytes + slot_bytes_ - 1) / slot_bytes_);
  };
  std::vector<Progress> work;
  work.reserve(transfers.size());
  for (const Transfer& t : transfers) {
    MEGACPP_CHECK(t.peer < world_ && t.peer != rank_ && peers_[t.peer] != nullptr,
                  ErrorKind::kInvalidArgument,
                  fmt::format("{}: rank {} is not an attached peer", what, t.peer));
    Lane& lane = own.lane(t.peer);
    work.push_back({&t, peers_[t.peer].get(), lane.sent.load(std::memory_order_relaxed), 0,
                    chunks(t.send.size()), lane.consumed.load(std::memory_order_relaxed), 0,
                    chunks(t.recv.size())});
  }

  // One pass over every peer: publishes what the peer's consumption allows, consumes what the
  // peer published. True when anything moved.
  auto advance = [&]() {
    bool moved = false;
    for (Progress& w : work) {
      const Outbox& theirs = w.peer->box;
      const uint32_t q = w.t->peer;
      if (w.sent < w.send_chunks) {
        const uint64_t g = w.send_base + w.sent;
        // Slot g % 2 last held chunk g - 2: free once the peer consumed it.
        if (g < 2 || theirs.lane(rank_).consumed.load(std::memory_order_acquire) >= g - 1) {
          const size_t off = w.sent * slot_bytes_;
          const size_t n = std::min(slot_bytes_, w.t->send.size() - off);
          if (n > 0) std::memcpy(own.slot(q, g % 2), w.t->send.data() + off, n);
          const bool last = w.sent + 1 == w.send_chunks;
          own.lane(q).length[g % 2].store(n | (last ? kLastChunk : 0), std::memory_order_relaxed);
          own.lane(q).sent.store(g + 1, std::memory_order_release);
          ring(theirs.bell());
          ++w.sent;
          moved = true;
        }
      }
      if (w.received < w.recv_chunks) {
        const uint64_t g = w.recv_base + w.received;
        if (theirs.lane(rank_).sent.load(std::memory_order_acquire) >= g + 1) {
          const size_t off = w.received * slot_bytes_;
          const size_t n = std::min(slot_bytes_, w.t->recv.size() - off);
          const bool last = w.received + 1 == w.recv_chunks;
          const uint64_t word = theirs.lane(rank_).length[g % 2].load(std::memory_order_relaxed);
          MEGACPP_CHECK(word == (n | (last ? kLastChunk : 0)), ErrorKind::kProtocol,
                        fmt::format("{}: rank {} sent a message of another size than rank {} "
                                    "expects ({} bytes): the ranks disagree on the exchange",
                                    what, q, rank_, w.t->recv.size()));
          if (n > 0) std::memcpy(w.t->recv.data() + off, theirs.slot(rank_, g % 2), n);
          own.lane(q).consumed.store(g + 1, std::memory_order_release);
          ring(theirs.bell());
          ++w.received;
          moved = true;
        }
      }
    }
    return moved;
  };
  auto done = [&] {
    return std::all_of(work.begin(), work.end(), [](const Progress& w) {
      return w.sent == w.send_chunks && w.received == w.recv_chunks;
    });
  };

  Bell& bell = own.bell();
  const auto started = detail::Clock::now();
  const auto deadline = started + timeout;
  auto checked = started;
  bool seen_exit = false;
  for (;;) {
    const uint32_t seen = bell.word.load(std::memory_order_seq_cst);
    if (advance()) {
      if (done()) return;
      continue;
    }
    if (aborted_.load(std::memory_order_seq_cst))
      MEGACPP_FAIL(ErrorKind::kPeerFailure,
                   "{}: the exchange was aborted (the group's abort(): the supervisor's teardown "
                   "of a failed job)",
                   what);
    const auto spin_until = detail::Clock::now() + kSpin;
    while (bell.word.load(std::memory_order_acquire) == seen && detail::Clock::now() < spin_until)
      detail::cpu_relax();
    if (bell.word.load(std::memory_order_acquire) == seen) {
      const auto now = detail::Clock::now();
      bell.sleepers.fetch_add(1, std::memory_order_seq_cst);
      futex_wait(bell.word, seen, std::min<std::chrono::nanoseconds>(kNap, deadline - now));
      bell.sleepers.fetch_sub(1, std::memory_order_seq_cst);
    }
    const auto now = detail::Clock::now();
    if (now - checked < kNap && now < deadline) continue;
    checked = now;
    // A peer's exit is only a failure once what it published before exiting is consumed: one
    // more pass after the exit is seen.
    for (const Progress& w : work) {
      if (!(w.sent == w.send_chunks && w.received == w.recv_chunks) && w.peer->exited()) {
        if (seen_exit)
          MEGACPP_FAIL(ErrorKind::kPeerFailure,
                       "{}: rank {} (pid {}) exited in the middle of the exchange", what, w.t->peer,
                       w.peer->pid);
        seen_exit = true;
      }
    }
    if (now >= deadline)
      MEGACPP_FAIL(ErrorKind::kTimeout,
                   "{}: the exchange did not complete within the collective timeout ({} s)", what,
                   static_cast<double>(timeout.count()) / 1000.0);
  }
}

}  // namespace megacpp::ipc
