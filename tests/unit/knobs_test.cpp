// core/knobs.h: the one table of MEGACPP_* environment knobs. Every knob a binary reads is
// declared there, is read only through it, and README.md's knob table lists exactly the
// declared knobs with the same defaults. Variables that only the build and test scripts read
// are not knobs; README.md lists them in "Build and test variables", checked here too.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>

#include "core/error.h"
#include "core/knobs.h"
#include "core/util.h"

namespace fs = std::filesystem;
using namespace megacpp;

namespace {

const fs::path kSource{MEGACPP_SOURCE_DIR};

std::set<std::string> declared() {
  std::set<std::string> out;
  for (const auto& k : kKnobs) out.emplace(k.name);
  return out;
}

// The rows `| `MEGACPP_X` | default | meaning |` of README.md's section `heading`.
std::map<std::string, std::string> readme_table(const std::string& heading) {
  const std::string readme = megacpp::read_file(kSource / "README.md");
  const auto start = readme.find("\n## " + heading + "\n");
  EXPECT_NE(start, std::string::npos) << "README.md has no section " << heading;
  if (start == std::string::npos) return {};
  const auto end = readme.find("\n## ", start + 1);
  std::istringstream section(readme.substr(start, end - start));
  static const std::regex row(R"(^\| `(MEGACPP_[A-Z0-9_]+)` \| (.*?) \| .*\|$)");
  std::map<std::string, std::string> out;
  std::string line;
  std::smatch m;
  while (std::getline(section, line)) {
    if (std::regex_match(line, m, row)) {
      EXPECT_TRUE(out.emplace(m[1], m[2]).second) << m[1] << " listed twice";
    }
  }
  return out;
}

}  // namespace

TEST(Knobs, DeclarationsAreWellFormed) {
  std::set<std::string> names;
  for (const auto& k : kKnobs) {
    EXPECT_TRUE(k.name.starts_with("MEGACPP_")) << k.name;
    EXPECT_TRUE(names.emplace(k.name).second) << k.name << " declared twice";
    EXPECT_FALSE(k.meaning.empty()) << k.name;
    EXPECT_EQ(find_knob(k.name), &k);
    if (k.computed || k.type == KnobType::kString) continue;
    // A fixed numeric default parses (the accessors fall back to it).
    EXPECT_NO_THROW((void)std::stod(std::string(k.default_text))) << k.name;
  }
  EXPECT_EQ(find_knob("MEGACPP_NO_SUCH_KNOB"), nullptr);
}

TEST(Knobs, TypedReadsUseTheDeclaredDefault) {
  ::unsetenv("MEGACPP_TRAINER_THREADS");
  ::unsetenv("MEGACPP_SNAPSHOT_RESEND_S");
  ::unsetenv("MEGACPP_GLOO_HOSTNAME");
  ::unsetenv("MEGACPP_FAULT");
  ::unsetenv("MEGACPP_SNAPSHOT_LEASE_TIMEOUT_S");
  EXPECT_EQ(knob_int(Knob::kTrainerThreads), 1);
  EXPECT_EQ(knob_seconds(Knob::kSnapshotResendS), 2.0);
  EXPECT_EQ(knob_string(Knob::kGlooHostname), "127.0.0.1");
  EXPECT_EQ(knob_string(Knob::kFault), "");
  EXPECT_EQ(knob_seconds(Knob::kSnapshotLeaseTimeoutS, 90.0), 90.0);
  ::setenv("MEGACPP_TRAINER_THREADS", "3", 1);
  ::setenv("MEGACPP_SNAPSHOT_LEASE_TIMEOUT_S", "7.5", 1);
  EXPECT_EQ(knob_int(Knob::kTrainerThreads), 3);
  EXPECT_EQ(knob_seconds(Knob::kSnapshotLeaseTimeoutS, 90.0), 7.5);
  ::setenv("MEGACPP_TRAINER_THREADS", "three", 1);
  EXPECT_THROW((void)knob_int(Knob::kTrainerThreads), Error);
  ::unsetenv("MEGACPP_TRAINER_THREADS");
  ::unsetenv("MEGACPP_SNAPSHOT_LEASE_TIMEOUT_S");
  // The wrong accessor for a declaration, and an undeclared name, are programming errors.
  EXPECT_THROW((void)knob_int(Knob::kGlooHostname), Error);
  EXPECT_THROW((void)knob_seconds(Knob::kSnapshotLeaseTimeoutS), Error);
  EXPECT_THROW((void)env_knob("MEGACPP_NO_SUCH_KNOB"), Error);
}

// Every "MEGACPP_..." string literal in the C++ tree names a declared knob, and nothing but
// core/ reads the environment by name: call sites go through the Knob table.
TEST(Knobs, EveryKnobReadInTheTreeIsDeclared) {
  const auto known = declared();
  static const std::regex literal(R"re("(MEGACPP_[A-Z0-9_]+)")re");
  static const std::regex raw_read(
      R"(\b(getenv|secure_getenv|env_knob|env_knob_int|env_knob_double)\s*\()");
  int files = 0;
  for (const char* dir :
       {"core", "ipc", "ops", "recipes", "schemas", "stages", "supervisor", "bench"}) {
    for (const auto& e : fs::recursive_directory_iterator(kSource / dir)) {
      const auto ext = e.path().extension();
      if (!e.is_regular_file() || (ext != ".cpp" && ext != ".h" && ext != ".cu")) continue;
      ++files;
      const std::string text = megacpp::read_file(e.path());
      const std::string rel = fs::relative(e.path(), kSource).string();
      for (std::sregex_iterator it(text.begin(), text.end(), literal), end; it != end; ++it) {
        EXPECT_TRUE(known.contains((*it)[1]))
            << rel << " names " << (*it)[1] << ", which core/knobs.h does not declare";
      }
      if (rel.starts_with("core/")) continue;
      std::smatch m;
      EXPECT_FALSE(std::regex_search(text, m, raw_read))
          << rel << " reads the environment directly (" << m.str()
          << "); use the typed accessors of core/knobs.h";
    }
  }
  EXPECT_GT(files, 20);
}

TEST(Knobs, ReadmeTableListsExactlyTheDeclaredKnobs) {
  std::map<std::string, std::string> want;
  for (const auto& k : kKnobs) want.emplace(k.name, k.default_text);
  EXPECT_EQ(readme_table("Environment knobs"), want)
      << "README.md's knob table must list every knob of core/knobs.h with the same default";
}

// Build and test scripts read MEGACPP_* variables of their own (MEGACPP_WERROR, MEGACPP_BIN,
// ...). They are not knobs of the binaries: README.md lists exactly those in a table of its
// own, and no name is in both tables.
TEST(Knobs, ScriptVariablesAreListedApartFromKnobs) {
  const auto knobs = declared();
  const auto table = readme_table("Build and test variables");
  std::set<std::string> listed;
  for (const auto& [name, def] : table) {
    listed.insert(name);
    EXPECT_FALSE(knobs.contains(name)) << name << " is a knob and a script variable";
  }
  // -DMEGACPP_... are CMake options, not environment variables.
  static const std::regex token(R"((-D)?\b(MEGACPP_[A-Z0-9_]+))");
  std::set<std::string> used;
  auto scan = [&](const fs::path& p) {
    const std::string text = megacpp::read_file(p);
    for (std::sregex_iterator it(text.begin(), text.end(), token), end; it != end; ++it) {
      if ((*it)[1].matched) continue;
      if (!knobs.contains((*it)[2])) used.insert((*it)[2]);
    }
  };
  scan(kSource / "Makefile");
  scan(kSource / ".ci" / "run");
  for (const char* dir : {"scripts", "tests", "bench", "tools"}) {
    for (const auto& e : fs::recursive_directory_iterator(kSource / dir)) {
      const auto ext = e.path().extension();
      if (e.is_regular_file() && (ext == ".py" || ext == ".sh")) scan(e.path());
    }
  }
  EXPECT_EQ(used, listed) << "README.md's \"Build and test variables\" must list exactly the "
                             "MEGACPP_* variables the scripts and tests read";
}
