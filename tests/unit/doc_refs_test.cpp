// Comments and docs cite sections as DESIGN.md "Heading" or README.md "Heading"; every such
// citation names a heading that exists in this repository's file, and the old "DESIGN §n"
// form (section numbers of a design document that is not in this repository) is gone.
#include <gtest/gtest.h>

#include <filesystem>
#include <regex>
#include <set>
#include <sstream>
#include <string>

#include "core/util.h"

namespace fs = std::filesystem;

namespace {

const fs::path kSource{MEGACPP_SOURCE_DIR};

std::set<std::string> headings(const fs::path& doc) {
  std::set<std::string> out;
  std::istringstream in(megacpp::read_file(doc));
  std::string line;
  static const std::regex heading(R"(^#+ (.*)$)");
  std::smatch m;
  while (std::getline(in, line)) {
    if (std::regex_match(line, m, heading)) out.insert(m[1]);
  }
  return out;
}

}  // namespace

TEST(DocReferences, CitedSectionsExist) {
  const std::set<std::string> design = headings(kSource / "DESIGN.md");
  const std::set<std::string> readme = headings(kSource / "README.md");
  ASSERT_FALSE(design.empty());
  static const std::regex cite(R"re((DESIGN|README)\.md,? "([^"]+)")re");
  static const std::regex numbered(R"(DESIGN §)");
  int citations = 0;
  for (auto it = fs::recursive_directory_iterator(kSource);
       it != fs::recursive_directory_iterator(); ++it) {
    const auto& e = *it;
    const std::string rel = fs::relative(e.path(), kSource).string();
    if (rel.starts_with(".") || rel.starts_with("build") || rel.starts_with("runs")) {
      if (e.is_directory()) it.disable_recursion_pending();
      continue;
    }
    const auto ext = e.path().extension();
    if (!e.is_regular_file() ||
        (ext != ".cpp" && ext != ".h" && ext != ".cu" && ext != ".py" && ext != ".md")) {
      continue;
    }
    if (rel == "tests/unit/doc_refs_test.cpp") continue;
    // A citation may wrap across comment lines: join them (newline, indent, comment marker).
    static const std::regex wrap(R"(\n[ \t]*(//+|#)?[ \t]*)");
    const std::string text = std::regex_replace(megacpp::read_file(e.path()), wrap, " ");
    EXPECT_FALSE(std::regex_search(text, numbered))
        << rel << " cites \"DESIGN §n\"; cite a heading of DESIGN.md as DESIGN.md \"Heading\"";
    for (std::sregex_iterator c(text.begin(), text.end(), cite), end; c != end; ++c) {
      ++citations;
      const auto& doc = (*c)[1] == "DESIGN" ? design : readme;
      EXPECT_TRUE(doc.contains((*c)[2])) << rel << " cites " << c->str() << ", no such heading";
    }
  }
  EXPECT_GT(citations, 10);
}
