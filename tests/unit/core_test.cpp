// core/: the owned descriptor (core/fd.h). Torch-free; runs in the sanitizer builds too.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

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
