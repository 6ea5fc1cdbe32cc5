// ipc/control_client.h: the stage side of the control plane (hello, heartbeats, progress, stop,
// failure) against a real router. Against the real thing; timings are never asserted, every wait is
// bounded.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "core/error.h"
#include "ipc/channel.h"
#include "ipc/control_client.h"
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
// Control client

// Receives until `match` accepts a message or ~10 s pass.
template <typename F>
std::unique_ptr<Received> receive_until(Channel& router, F&& match) {
  auto deadline = Clock::now() + std::chrono::seconds(10);
  while (Clock::now() < deadline) {
    auto r = router.receive(Millis(100));
    if (r && match(*r)) return r;
  }
  return nullptr;
}

TEST(ControlClientTest, HelloHeartbeatsStopAndFailure) {
  TempDir dir;
  const std::string endpoint = "ipc://" + (dir.path() / "control").string();
  ZmqContext ctx;
  Channel router(ctx, Channel::Kind::kRouter, endpoint);

  ControlClient client(endpoint, {schema::StageKind::TRAINER, 1, 3}, Millis(20));
  auto first = router.receive(Millis(10000));
  ASSERT_NE(first, nullptr);
  EXPECT_EQ(first->peer(), "trainer-1");
  ASSERT_TRUE(first->root().isHello());
  EXPECT_EQ(first->root().getHello().getRank(), 1u);
  EXPECT_EQ(first->root().getHello().getGeneration(), 3u);
  EXPECT_EQ(first->root().getHello().getPid(), ::getpid());

  auto hb0 = receive_until(router, [](Received& r) { return r.root().isHeartbeat(); });
  ASSERT_NE(hb0, nullptr);
  EXPECT_EQ(hb0->root().getHeartbeat().getPhase(), schema::Phase::STARTUP);
  EXPECT_TRUE(std::isnan(hb0->root().getHeartbeat().getLoss()));

  client.set_phase(schema::Phase::FORWARD);
  client.publish({.step = 5, .tokens = 1000.0, .loss = 2.5f, .step_seconds = 0.25});
  auto hb = receive_until(router, [](Received& r) {
    return r.root().isHeartbeat() && r.root().getHeartbeat().getStep() == 5 &&
           r.root().getHeartbeat().getPhase() == schema::Phase::FORWARD;
  });
  ASSERT_NE(hb, nullptr);
  auto beat = hb->root().getHeartbeat();
  EXPECT_EQ(hb->peer(), "trainer-1");
  EXPECT_EQ(beat.getStage(), schema::StageKind::TRAINER);
  EXPECT_EQ(beat.getRank(), 1u);
  EXPECT_EQ(beat.getTokens(), 1000.0);
  EXPECT_EQ(beat.getLoss(), 2.5f);
  EXPECT_EQ(beat.getStepSeconds(), 0.25);
  EXPECT_GT(beat.getPhaseStartedMonoNs(), 0);
  EXPECT_GE(beat.getMonoNs(), beat.getPhaseStartedMonoNs());

  EXPECT_FALSE(client.stop_requested());
  ControlMessageBuilder stop;
  stop.root().initStop().setReason("teardown: trainer-0 exited");
  ASSERT_TRUE(router.send_to("trainer-1", stop.message()));
  auto deadline = Clock::now() + std::chrono::seconds(10);
  while (!client.stop_requested() && Clock::now() < deadline) {
    std::this_thread::sleep_for(Millis(5));
  }
  ASSERT_TRUE(client.stop_requested());
  EXPECT_EQ(client.stop_reason(), "teardown: trainer-0 exited");

  client.set_step(6);
  client.report_failure(schema::FailureReport::EXCEPTION, "boom");
  auto failure = receive_until(router, [](Received& r) { return r.root().isFailure(); });
  ASSERT_NE(failure, nullptr);
  auto f = failure->root().getFailure();
  EXPECT_EQ(f.getReport(), schema::FailureReport::EXCEPTION);
  EXPECT_EQ(std::string(f.getKind().cStr()), "exception");  // its name, for schema-1 readers
  EXPECT_EQ(std::string(f.getMessage().cStr()), "boom");
  EXPECT_EQ(f.getRank(), 1u);
  EXPECT_EQ(f.getStep(), 6u);
  EXPECT_EQ(f.getPhase(), schema::Phase::FORWARD);
  EXPECT_EQ(router.malformed(), 0u);
}

// The progress stamp is set by report_progress() alone (the working thread); heartbeats that
// go on without it carry the old stamp, which is what lets the supervisor see a wedged stage.
TEST(ControlClientTest, ProgressIsStampedOnlyByTheWorkingThread) {
  TempDir dir;
  const std::string endpoint = "ipc://" + (dir.path() / "control").string();
  ZmqContext ctx;
  Channel router(ctx, Channel::Kind::kRouter, endpoint);
  ControlClient client(endpoint, {schema::StageKind::CHECKPOINTER, 0, 0}, Millis(20));

  auto hb0 = receive_until(router, [](Received& r) { return r.root().isHeartbeat(); });
  ASSERT_NE(hb0, nullptr);
  EXPECT_EQ(hb0->root().getHeartbeat().getProgressMonoNs(), 0);  // nothing reported yet

  const int64_t before = mono_ns();
  client.report_progress(7, before - 1000);
  auto hb = receive_until(router, [](Received& r) {
    return r.root().isHeartbeat() && r.root().getHeartbeat().getWorkDone() == 7;
  });
  ASSERT_NE(hb, nullptr);
  const int64_t stamp = hb->root().getHeartbeat().getProgressMonoNs();
  EXPECT_GE(stamp, before);
  EXPECT_EQ(hb->root().getHeartbeat().getPendingSinceMonoNs(), before - 1000);

  // Later heartbeats, with no report in between, keep the same stamp.
  for (int i = 0; i < 3; ++i) {
    auto later = receive_until(router, [](Received& r) { return r.root().isHeartbeat(); });
    ASSERT_NE(later, nullptr);
    EXPECT_EQ(later->root().getHeartbeat().getProgressMonoNs(), stamp);
    EXPECT_GT(later->root().getHeartbeat().getMonoNs(), stamp);
  }
}

// AbortCollectives runs the owner's abort handler on a thread of the client's, and the client
// replies CollectivesAborted: with no handler (no group), with one, and with one that throws.
TEST(ControlClientTest, AbortCollectivesRunsTheHandlerAndReplies) {
  TempDir dir;
  const std::string endpoint = "ipc://" + (dir.path() / "control").string();
  ZmqContext ctx;
  Channel router(ctx, Channel::Kind::kRouter, endpoint);
  ControlClient client(endpoint, {schema::StageKind::TRAINER, 2, 0}, Millis(20));
  ASSERT_NE(receive_until(router, [](Received& r) { return r.root().isHello(); }), nullptr);

  auto abort_and_reply = [&] {
    ControlMessageBuilder abort;
    abort.root().initAbortCollectives().setReason("teardown: trainer-1 hung");
    EXPECT_TRUE(router.send_to("trainer-2", abort.message()));
    return receive_until(router, [](Received& r) { return r.root().isCollectivesAborted(); });
  };

  auto none = abort_and_reply();
  ASSERT_NE(none, nullptr);
  EXPECT_EQ(none->root().getCollectivesAborted().getRank(), 2u);
  EXPECT_FALSE(none->root().getCollectivesAborted().getHadGroup());
  EXPECT_TRUE(none->root().getCollectivesAborted().getOk());

  std::atomic<int> calls{0};
  std::atomic<bool> on_client_thread{false};
  const auto owner = std::this_thread::get_id();
  client.set_abort_handler([&] {
    on_client_thread = std::this_thread::get_id() != owner;
    std::this_thread::sleep_for(Millis(20));
    ++calls;
  });
  auto done = abort_and_reply();
  ASSERT_NE(done, nullptr);
  auto a = done->root().getCollectivesAborted();
  EXPECT_TRUE(a.getHadGroup());
  EXPECT_TRUE(a.getOk());
  EXPECT_GE(a.getSeconds(), 0.015);
  EXPECT_EQ(calls.load(), 1);
  EXPECT_TRUE(on_client_thread.load());

  client.set_abort_handler([] { throw std::runtime_error("ncclCommAbort failed"); });
  auto failed = abort_and_reply();
  ASSERT_NE(failed, nullptr);
  EXPECT_TRUE(failed->root().getCollectivesAborted().getHadGroup());
  EXPECT_FALSE(failed->root().getCollectivesAborted().getOk());
  EXPECT_EQ(std::string(failed->root().getCollectivesAborted().getError().cStr()),
            "ncclCommAbort failed");
  client.set_abort_handler({});
  EXPECT_EQ(calls.load(), 1);
}

// An abort that takes its time (ncclCommAbort may take seconds) runs off the client's thread:
// heartbeats go on meanwhile, and a second request during the run is answered by its end. Fails
// on a client that runs the handler on its own thread: no heartbeat would come while it waits.
TEST(ControlClientTest, HeartbeatsGoOnWhileAnAbortRuns) {
  TempDir dir;
  const std::string endpoint = "ipc://" + (dir.path() / "control").string();
  ZmqContext ctx;
  Channel router(ctx, Channel::Kind::kRouter, endpoint);
  ControlClient client(endpoint, {schema::StageKind::TRAINER, 1, 0}, Millis(20));
  ASSERT_NE(receive_until(router, [](Received& r) { return r.root().isHello(); }), nullptr);

  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  std::atomic<int> calls{0};
  client.set_abort_handler([&] {
    ++calls;
    std::unique_lock lock(mu);
    cv.wait_for(lock, std::chrono::seconds(20), [&] { return release; });
  });
  for (int i = 0; i < 2; ++i) {
    ControlMessageBuilder abort;
    abort.root().initAbortCollectives().setReason("teardown: trainer-0 hung");
    EXPECT_TRUE(router.send_to("trainer-1", abort.message()));
  }
  // Heartbeats while the handler waits, and no reply before it returns.
  int heartbeats = 0;
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (heartbeats < 5 && Clock::now() < deadline) {
    auto r = router.receive(Millis(100));
    if (!r) continue;
    EXPECT_FALSE(r->root().isCollectivesAborted());
    if (r->root().isHeartbeat()) ++heartbeats;
  }
  EXPECT_EQ(heartbeats, 5);
  EXPECT_EQ(calls.load(), 1);
  {
    std::lock_guard lock(mu);
    release = true;
  }
  cv.notify_all();
  for (int i = 0; i < 2; ++i) {
    auto reply = receive_until(router, [](Received& r) { return r.root().isCollectivesAborted(); });
    ASSERT_NE(reply, nullptr) << "reply " << i;
    EXPECT_TRUE(reply->root().getCollectivesAborted().getHadGroup());
    EXPECT_TRUE(reply->root().getCollectivesAborted().getOk());
  }
  EXPECT_EQ(calls.load(), 1);  // one run answered both requests
  client.set_abort_handler({});
}

TEST(ControlClientTest, PendingFailureIsFlushedByDestructor) {
  TempDir dir;
  const std::string endpoint = "ipc://" + (dir.path() / "control").string();
  ZmqContext ctx;
  Channel router(ctx, Channel::Kind::kRouter, endpoint);
  {
    // A long interval: only the destructor's flush can deliver the report in time.
    ControlClient client(endpoint, {schema::StageKind::DATA_LOADER, 0, 1}, Millis(60000));
    client.report_failure(schema::FailureReport::SIGNAL, "SIGSEGV");
  }
  auto failure = receive_until(router, [](Received& r) { return r.root().isFailure(); });
  ASSERT_NE(failure, nullptr);
  EXPECT_EQ(failure->peer(), "data_loader-0");
  EXPECT_EQ(failure->root().getFailure().getReport(), schema::FailureReport::SIGNAL);
  EXPECT_EQ(std::string(failure->root().getFailure().getKind().cStr()), "signal");
}

// A new held-out evaluation goes out at once (a run's last one comes just before its ranks
// exit): with an interval of a minute no heartbeat is due, yet the one published arrives,
// carrying the evaluation; a record without a new evaluation waits for the interval.
TEST(ControlClientTest, ANewEvaluationIsSentAtOnce) {
  TempDir dir;
  const std::string endpoint = "ipc://" + (dir.path() / "control").string();
  ZmqContext ctx;
  Channel router(ctx, Channel::Kind::kRouter, endpoint);
  ControlClient client(endpoint, {schema::StageKind::TRAINER, 0, 1}, Millis(60000));
  auto hello = receive_until(router, [](Received& r) { return r.root().isHello(); });
  ASSERT_NE(hello, nullptr);
  client.publish({.step = 3, .tokens = 10, .loss = 2.5f, .step_seconds = 0.1});
  EXPECT_EQ(router.receive(Millis(300)), nullptr);  // no evaluation: nothing before the interval
  client.publish({.step = 4, .tokens = 20, .loss = 2.25f, .val_loss = 2.125f, .val_step = 4});
  auto hb = receive_until(router, [](Received& r) { return r.root().isHeartbeat(); });
  ASSERT_NE(hb, nullptr);
  EXPECT_EQ(hb->root().getHeartbeat().getValStep(), 4u);
  EXPECT_EQ(hb->root().getHeartbeat().getValLoss(), 2.125f);
  EXPECT_EQ(hb->root().getHeartbeat().getStep(), 4u);
}

TEST(ControlClientTest, AbsentSupervisorNeverBlocks) {
  TempDir dir;
  {
    ControlClient client("ipc://" + (dir.path() / "control").string(),
                         {schema::StageKind::COLLECTOR, 0, 1}, Millis(5));
    client.set_phase(schema::Phase::WRITE);
    for (uint32_t i = 0; i < 50; ++i)
      client.publish({.step = i, .tokens = static_cast<double>(i), .loss = 0.0f});
    std::this_thread::sleep_for(Millis(50));
    client.report_failure(schema::FailureReport::EXCEPTION, "nobody listens");
    EXPECT_FALSE(client.stop_requested());
  }
  EXPECT_TRUE(fs::is_empty(dir.path()));
}

}  // namespace
}  // namespace megacpp::ipc
