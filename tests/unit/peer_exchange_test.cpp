// ipc/peer_exchange.h: the optimizer exchange of CPU ranks through shared memory, ranks forked.
// Against the real thing; timings are never asserted, every wait is bounded.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "core/error.h"
#include "ipc/peer_exchange.h"
#include "ipc/shm.h"
#include "tests/unit/ipc_test_support.h"
#include "tests/unit/test_support.h"

namespace megacpp::ipc {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using megacpp::test_support::TempDir;
using test::Child;
using test::ShmTest;

// ---------------------------------------------------------------------------------------
// Peer exchange

// Forks `world` ranks; rank r makes its outbox, swaps tokens with the others through files in
// `dir`, attaches every peer's, unlinks its name once all attached, and returns body(x, r)
// (2 on an exception). Returns each rank's exit code (-1: it did not exit normally).
std::vector<int> run_exchange_ranks(uint32_t world, const std::string& prefix, const fs::path& dir,
                                    size_t slot_bytes,
                                    const std::function<int(PeerExchange&, uint32_t)>& body) {
  auto wait_file = [](const fs::path& p) {
    const auto deadline = Clock::now() + std::chrono::seconds(20);
    while (!fs::exists(p)) {
      if (Clock::now() > deadline) throw std::runtime_error("no " + p.string());
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  };
  auto publish = [](const fs::path& p, const std::string& text) {
    std::ofstream(p.string() + ".tmp") << text;
    fs::rename(p.string() + ".tmp", p);
  };
  std::vector<std::unique_ptr<Child>> children;
  for (uint32_t r = 0; r < world; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      int code = 2;
      try {
        PeerExchange x(
            {.name_prefix = prefix, .rank = r, .world = world, .slot_bytes = slot_bytes});
        publish(dir / fmt::format("token-{}", r), x.token());
        for (uint32_t q = 0; q < world; ++q) {
          if (q == r) continue;
          wait_file(dir / fmt::format("token-{}", q));
          std::ifstream in(dir / fmt::format("token-{}", q));
          std::string token;
          std::getline(in, token);
          x.attach(q, token);
        }
        publish(dir / fmt::format("attached-{}", r), "1");
        for (uint32_t q = 0; q < world; ++q) wait_file(dir / fmt::format("attached-{}", q));
        x.unlink();
        code = body(x, r);
      } catch (const std::exception& e) {
        fprintf(stderr, "rank %u: %s\n", r, e.what());
      }
      ::_exit(code);
    }
    children.push_back(std::make_unique<Child>(pid));
  }
  std::vector<int> codes;
  for (auto& c : children) codes.push_back(c->wait());
  return codes;
}

uint8_t pattern(uint32_t from, uint32_t to, int round, size_t k) {
  return static_cast<uint8_t>(from * 31 + to * 7 + static_cast<uint32_t>(round) * 13 + k);
}

// Kind of the Error `f` throws and how long it took; kInternal when it threw nothing.
std::pair<ErrorKind, double> failure_of(const std::function<void()>& f, std::string* what) {
  const auto t0 = Clock::now();
  try {
    f();
  } catch (const Error& e) {
    *what = e.what();
    return {e.kind(), std::chrono::duration<double>(Clock::now() - t0).count()};
  }
  return {ErrorKind::kInternal, std::chrono::duration<double>(Clock::now() - t0).count()};
}

class PeerExchangeTest : public ShmTest {
 protected:
  TempDir dir_;
};

// Three ranks, slots of 4 KiB: messages of no bytes, of less than, exactly and just over a
// slot, and of many slots (streamed through the two slots) arrive intact, round after round.
TEST_F(PeerExchangeTest, MessagesOfEverySizeArriveIntact) {
  constexpr uint32_t kWorld = 3;
  const std::vector<size_t> sizes{0, 1, 4095, 4096, 4097, 3 * 4096 + 17, 200'000};
  const auto codes =
      run_exchange_ranks(kWorld, prefix_, dir_.path(), 4096, [&](PeerExchange& x, uint32_t r) {
        for (int round = 0; round < 2 * static_cast<int>(sizes.size()); ++round) {
          const size_t n = sizes[static_cast<size_t>(round) % sizes.size()];
          std::vector<std::vector<std::byte>> out(kWorld), in(kWorld);
          std::vector<PeerExchange::Transfer> transfers;
          for (uint32_t q = 0; q < kWorld; ++q) {
            if (q == r) continue;
            out[q].resize(n);
            in[q].assign(n, std::byte{0});
            for (size_t k = 0; k < n; ++k) out[q][k] = std::byte{pattern(r, q, round, k)};
            transfers.push_back({q, out[q], in[q]});
          }
          x.exchange("test", transfers, std::chrono::seconds(20));
          for (uint32_t q = 0; q < kWorld; ++q) {
            if (q == r) continue;
            for (size_t k = 0; k < n; ++k)
              if (in[q][k] != std::byte{pattern(q, r, round, k)}) return 10 + round;
          }
        }
        return 0;
      });
  for (uint32_t r = 0; r < kWorld; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
  EXPECT_TRUE(list_shm(prefix_).empty()) << "every name is unlinked once all attached";
}

// A peer that exits instead of exchanging is named within a nap or two, not at the deadline;
// a peer that is alive but silent is a timeout at the deadline; abort() ends a wait, and
// every later exchange fails at once.
TEST_F(PeerExchangeTest, ExitTimeoutAndAbortEndTheWait) {
  for (const std::string mode : {"exit", "timeout", "abort"}) {
    fs::remove_all(dir_.path());
    fs::create_directories(dir_.path());
    const auto codes =
        run_exchange_ranks(2, prefix_, dir_.path(), 0, [&](PeerExchange& x, uint32_t r) {
          if (r == 1) {
            if (mode != "exit") std::this_thread::sleep_for(std::chrono::milliseconds(1500));
            return 0;
          }
          std::vector<std::byte> out(64), in(64);
          const PeerExchange::Transfer t{1, out, in};
          std::thread aborter;
          if (mode == "abort") {
            aborter = std::thread([&x] {
              std::this_thread::sleep_for(std::chrono::milliseconds(200));
              x.abort();
            });
          }
          const auto timeout = mode == "timeout" ? std::chrono::milliseconds(300)
                                                 : std::chrono::milliseconds(20'000);
          std::string what;
          const auto [kind, took] = failure_of(
              [&] {
                x.exchange("step 1", {&t, 1}, timeout);
              },
              &what);
          if (aborter.joinable()) aborter.join();
          fprintf(stderr, "%s: %s (%.3f s)\n", mode.c_str(), what.c_str(), took);
          if (mode == "exit" && !(kind == ErrorKind::kPeerFailure && took < 1.2 &&
                                  what.find("rank 1") != std::string::npos))
            return 10;
          if (mode == "timeout" && !(kind == ErrorKind::kTimeout && took >= 0.29 && took < 1.2))
            return 11;
          if (mode == "abort") {
            if (!(kind == ErrorKind::kPeerFailure && took < 1.2 &&
                  what.find("aborted") != std::string::npos))
              return 12;
            const auto [again, took2] = failure_of(
                [&] {
                  x.exchange("step 2", {&t, 1}, timeout);
                },
                &what);
            if (again != ErrorKind::kPeerFailure || took2 > 0.5) return 13;
          }
          return 0;
        });
    EXPECT_EQ(codes[0], 0) << mode;
    EXPECT_EQ(codes[1], 0) << mode;
  }
}

// The two ranks disagree on a message's size: each receiver says so instead of reading a
// message of another exchange as its own.
TEST_F(PeerExchangeTest, SizesThatDisagreeAreAProtocolError) {
  const auto codes =
      run_exchange_ranks(2, prefix_, dir_.path(), 4096, [&](PeerExchange& x, uint32_t r) {
        std::vector<std::byte> out(r == 0 ? 100 : 200), in(r == 0 ? 100 : 200);
        const PeerExchange::Transfer t{1 - r, out, in};
        std::string what;
        const auto [kind, took] = failure_of(
            [&] {
              x.exchange("mismatch", {&t, 1}, std::chrono::seconds(5));
            },
            &what);
        return kind == ErrorKind::kProtocol ? 0 : 10;
      });
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[1], 0);
}

// Only the outbox a token names is attached: another segment under that name (a stale run's,
// another group's) is refused, and so is a name with nothing behind it.
TEST_F(PeerExchangeTest, AttachRefusesAnotherOutbox) {
  PeerExchange a({.name_prefix = prefix_ + "a", .rank = 0, .world = 2, .slot_bytes = 4096});
  PeerExchange b({.name_prefix = prefix_ + "b", .rank = 1, .world = 2, .slot_bytes = 4096});
  PeerExchange c({.name_prefix = prefix_ + "c", .rank = 0, .world = 2, .slot_bytes = 4096});
  const std::string token = b.token();
  const std::string name = token.substr(0, token.find(' '));
  auto kind_of = [&](PeerExchange& x, uint32_t rank, const std::string& t) {
    try {
      x.attach(rank, t);
    } catch (const Error& e) {
      return e.kind();
    }
    return ErrorKind::kInternal;
  };
  EXPECT_EQ(kind_of(a, 1, name + " 0123456789abcdef"), ErrorKind::kCorruption) << "nonce";
  EXPECT_EQ(kind_of(a, 1, c.token()), ErrorKind::kCorruption) << "rank 0's outbox as rank 1's";
  EXPECT_EQ(kind_of(a, 1, prefix_ + "none1 0123456789abcdef"), ErrorKind::kSystem);
  EXPECT_EQ(kind_of(a, 1, "no-token"), ErrorKind::kProtocol);
  EXPECT_EQ(kind_of(a, 1, token), ErrorKind::kInternal) << "the right token attaches";
  b.unlink();
  EXPECT_EQ(list_shm(prefix_ + "b"), std::vector<std::string>{});
}

}  // namespace
}  // namespace megacpp::ipc
