// core/: what every ErrorKind tells its catcher to do (core/error.h action_of) and the owned
// descriptor (core/fd.h). Torch-free; runs in the sanitizer builds too.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <map>
#include <utility>

#include "core/error.h"
#include "core/fd.h"

using namespace megacpp;

namespace {

// Whether `fd` is an open descriptor of this process.
bool is_open(int fd) {
  return ::fcntl(fd, F_GETFD) != -1;
}

int open_null() {
  const int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  EXPECT_GE(fd, 0);
  return fd;
}

}  // namespace

// Every kind, one answer each; the table is the contract DESIGN.md "Failure model as
// implemented" states for the restart policy.
TEST(ErrorAction, EveryKindHasItsAction) {
  const std::map<ErrorKind, ErrorAction> expected{
      {ErrorKind::kInvalidArgument, ErrorAction::kGiveUp},
      {ErrorKind::kSystem, ErrorAction::kRetry},
      {ErrorKind::kZmq, ErrorAction::kReconnect},
      {ErrorKind::kProtocol, ErrorAction::kGiveUp},
      {ErrorKind::kCorruption, ErrorAction::kGiveUp},
      {ErrorKind::kTimeout, ErrorAction::kRetry},
      {ErrorKind::kPeerFailure, ErrorAction::kReconnect},
      {ErrorKind::kInterrupted, ErrorAction::kGiveUp},
      {ErrorKind::kInternal, ErrorAction::kGiveUp},
      {ErrorKind::kDiverged, ErrorAction::kGiveUp},
  };
  ASSERT_EQ(expected.size(), static_cast<size_t>(kErrorKindCount));
  for (int i = 0; i < kErrorKindCount; ++i) {
    const auto kind = static_cast<ErrorKind>(i);
    ASSERT_TRUE(expected.contains(kind)) << "ErrorKind " << i << " has no expected action";
    EXPECT_EQ(action_of(kind), expected.at(kind)) << to_string(kind);
    EXPECT_NE(to_string(action_of(kind)), "unknown") << to_string(kind);
  }
}

// kErrorKindCount is exact: the value after the last kind is not a kind.
TEST(ErrorAction, KindCountIsExact) {
  EXPECT_NE(to_string(static_cast<ErrorKind>(kErrorKindCount - 1)), "unknown");
  EXPECT_EQ(to_string(static_cast<ErrorKind>(kErrorKindCount)), "unknown");
  EXPECT_THROW((void)action_of(static_cast<ErrorKind>(kErrorKindCount)), Error);
}

TEST(ErrorAction, AnErrorCarriesItsKindsAction) {
  try {
    MEGACPP_FAIL(ErrorKind::kPeerFailure, "rank {} went away", 1);
  } catch (const Error& e) {
    EXPECT_EQ(e.action(), ErrorAction::kReconnect);
    return;
  }
  FAIL() << "MEGACPP_FAIL did not throw";
}

TEST(Fd, ClosesOnDestruction) {
  int raw = open_null();
  { Fd fd(raw); }
  EXPECT_FALSE(is_open(raw));
}

TEST(Fd, MoveTransfersOwnershipAndClosesOnce) {
  const int raw = open_null();
  Fd a(raw);
  Fd b(std::move(a));
  EXPECT_FALSE(a.valid());  // NOLINT(bugprone-use-after-move): moved-from is empty by contract
  EXPECT_EQ(b.get(), raw);
  Fd c;
  c = std::move(b);
  EXPECT_EQ(c.get(), raw);
  EXPECT_TRUE(is_open(raw));
  c.reset();
  EXPECT_FALSE(is_open(raw));
}

TEST(Fd, MoveAssignmentClosesTheOverwrittenDescriptor) {
  const int first = open_null();
  const int second = open_null();
  Fd a(first);
  a = Fd(second);
  EXPECT_FALSE(is_open(first));
  EXPECT_TRUE(is_open(second));
}

TEST(Fd, ReleaseGivesUpOwnership) {
  const int raw = open_null();
  {
    Fd fd(raw);
    EXPECT_EQ(fd.release(), raw);
    EXPECT_FALSE(fd.valid());
  }
  EXPECT_TRUE(is_open(raw));
  ::close(raw);
}

TEST(Fd, CloseCheckedReportsABadDescriptor) {
  const int raw = open_null();
  ::close(raw);  // the Fd below holds a descriptor that is no longer open
  Fd fd(raw);
  EXPECT_THROW(fd.close_checked(), Error);
  EXPECT_FALSE(fd.valid());
  fd.close_checked();  // empty: nothing to close, no error
}
