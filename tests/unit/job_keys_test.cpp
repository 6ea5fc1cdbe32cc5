// ipc/job_keys.h: a job's CURVE keys made fresh each time, written 0600 without a window in
// which another user could read them, and a key file others may read refused like ssh does.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <string>

#include "core/error.h"
#include "ipc/job_keys.h"
#include "tests/unit/temp_dir.h"

namespace {

namespace fs = std::filesystem;
using megacpp::Error;
using megacpp::ErrorKind;
using megacpp::ipc::generate_job_keys;
using megacpp::ipc::job_keys_path;
using megacpp::ipc::JobKeys;
using megacpp::ipc::read_job_keys;
using megacpp::ipc::write_job_keys;
using megacpp::test_support::TempDir;

mode_t mode_of(const fs::path& p) {
  struct stat st {};
  EXPECT_EQ(::stat(p.c_str(), &st), 0);
  return st.st_mode & 07777;
}

// The user's line of the Error `f` throws (empty when it throws none).
template <class F>
std::string refusal(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.what();
    return e.message();
  }
  return {};
}

TEST(JobKeys, EveryGenerationMakesDistinctKeys) {
  const JobKeys a = generate_job_keys();
  const JobKeys b = generate_job_keys();
  for (const auto* k :
       {&a.server.public_key, &a.server.secret_key, &a.client.public_key, &a.client.secret_key}) {
    EXPECT_EQ(k->size(), 40u);
  }
  EXPECT_NE(a.server.public_key, b.server.public_key);
  EXPECT_NE(a.server.secret_key, b.server.secret_key);
  EXPECT_NE(a.client.public_key, b.client.public_key);
  EXPECT_NE(a.client.secret_key, b.client.secret_key);
  EXPECT_NE(a.server.public_key, a.client.public_key);
}

// The store prefix and a record's seal: the same for every holder of the keys, different for
// other keys, and neither shows the key (nor the prefix the seal, or the other way round).
TEST(JobKeys, ThePrefixAndTheSealAreTheKeysOnly) {
  const JobKeys a = generate_job_keys();
  const JobKeys b = generate_job_keys();
  EXPECT_EQ(megacpp::ipc::job_store_prefix(a), megacpp::ipc::job_store_prefix(a));
  EXPECT_NE(megacpp::ipc::job_store_prefix(a), megacpp::ipc::job_store_prefix(b));
  const megacpp::ipc::RecordSealer seal_a(a), seal_a2(a), seal_b(b);
  const std::string text = "prefix/watch/failure\nlost 1\nnode 1 lost";
  EXPECT_EQ(seal_a(text).size(), 64u);
  EXPECT_EQ(seal_a(text), seal_a2(text));
  EXPECT_NE(seal_a(text), seal_b(text));
  EXPECT_NE(seal_a(text), seal_a(text + " "));
  for (const auto& k : {a.client.secret_key, a.server.secret_key}) {
    EXPECT_EQ(seal_a(text).find(k), std::string::npos);
    EXPECT_EQ(megacpp::ipc::job_store_prefix(a).find(k), std::string::npos);
  }
  EXPECT_EQ(megacpp::ipc::job_store_prefix(a).find(seal_a("")), std::string::npos);
}

TEST(JobKeys, WrittenOnlyForThisUserAndReadBack) {
  TempDir dir;
  const fs::path path = job_keys_path(dir.path());
  EXPECT_EQ(path, dir.path() / "job.keys");
  const JobKeys keys = generate_job_keys();
  // A permissive umask must not widen the file: it is created 0600, never chmod-ed down.
  const mode_t old = ::umask(0);
  write_job_keys(path, keys);
  ::umask(old);
  EXPECT_EQ(mode_of(path), 0600u);
  EXPECT_EQ(read_job_keys(path), keys);
  // Nothing but the key file is left in the directory (no temporary).
  size_t entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir.path())) ++entries;
  EXPECT_EQ(entries, 1u);
}

TEST(JobKeys, AnExistingKeyFileIsNeverReplaced) {
  TempDir dir;
  const fs::path path = job_keys_path(dir.path());
  const JobKeys first = generate_job_keys();
  write_job_keys(path, first);
  const std::string why = refusal([&] { write_job_keys(path, generate_job_keys()); });
  EXPECT_NE(why.find("already exists"), std::string::npos) << why;
  EXPECT_EQ(read_job_keys(path), first);
}

TEST(JobKeys, AKeyFileGroupOrOthersMayReadIsRefusedInOneLine) {
  TempDir dir;
  const fs::path path = job_keys_path(dir.path());
  write_job_keys(path, generate_job_keys());
  for (const mode_t mode : {0644, 0640, 0604, 0620}) {
    ASSERT_EQ(::chmod(path.c_str(), mode), 0);
    const std::string why = refusal([&] { read_job_keys(path); });
    EXPECT_NE(why.find(path.string()), std::string::npos) << why;
    EXPECT_NE(why.find("too open"), std::string::npos) << why;
    EXPECT_NE(why.find("chmod 600"), std::string::npos) << why;
    EXPECT_EQ(why.find('\n'), std::string::npos) << why;
  }
  ASSERT_EQ(::chmod(path.c_str(), 0400), 0);
  EXPECT_NO_THROW(read_job_keys(path));
}

TEST(JobKeys, ASymlinkOrAFileThatIsNotAKeyFileIsRefused) {
  TempDir dir;
  const fs::path path = job_keys_path(dir.path());
  write_job_keys(path, generate_job_keys());
  fs::create_symlink(path, dir.path() / "link.keys");
  EXPECT_NE(refusal([&] { read_job_keys(dir.path() / "link.keys"); }).find("symbolic link"),
            std::string::npos);

  const fs::path other = dir.path() / "other.keys";
  std::ofstream(other) << "server-public not-a-key\n";
  ASSERT_EQ(::chmod(other.c_str(), 0600), 0);
  EXPECT_NE(refusal([&] { read_job_keys(other); }).find("not a 40-character Z85 key"),
            std::string::npos);
}

}  // namespace
