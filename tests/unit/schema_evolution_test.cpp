// Run formats stay readable: every schema in schemas/ must be an additive evolution of each
// committed snapshot of it (tests/schema_snapshots/v<N>/, the schemas as they stood when format
// version N was last changed): Cap'n Proto's rules — add fields, enumerants and declarations,
// never remove, rename, renumber or retype one. Names count, not only ordinals: run files are
// Cap'n Proto JSON, which names fields. The schemas are parsed by capnp's own compiler
// (capnp::SchemaParser), so the comparison sees what the generated code sees.
//
// Refresh a snapshot after an additive change (make the current schemas the baseline):
//   cp schemas/*.capnp tests/schema_snapshots/v<SCHEMA_VERSION>/
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <capnp/schema-parser.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <kj/filesystem.h>

#include "schemas/common.capnp.h"

namespace {

namespace fs = std::filesystem;

std::string short_name(const capnp::Schema& s) {
  const auto proto = s.getProto();
  return std::string(proto.getDisplayName().slice(proto.getDisplayNamePrefixLength()).cStr());
}

// A type as text: "UInt32", "List(Text)", "struct Dataset", "enum Phase".
std::string type_text(const capnp::Type& t) {
  using W = capnp::schema::Type::Which;
  switch (t.which()) {
    case W::VOID:
      return "Void";
    case W::BOOL:
      return "Bool";
    case W::INT8:
      return "Int8";
    case W::INT16:
      return "Int16";
    case W::INT32:
      return "Int32";
    case W::INT64:
      return "Int64";
    case W::UINT8:
      return "UInt8";
    case W::UINT16:
      return "UInt16";
    case W::UINT32:
      return "UInt32";
    case W::UINT64:
      return "UInt64";
    case W::FLOAT32:
      return "Float32";
    case W::FLOAT64:
      return "Float64";
    case W::TEXT:
      return "Text";
    case W::DATA:
      return "Data";
    case W::LIST:
      return "List(" + type_text(t.asList().getElementType()) + ")";
    case W::ENUM:
      return "enum " + short_name(t.asEnum());
    case W::STRUCT:
      return "struct " + short_name(t.asStruct());
    case W::INTERFACE:
      return "interface " + short_name(t.asInterface());
    case W::ANY_POINTER:
      return "AnyPointer";
  }
  return "?";
}

void compare(const capnp::ParsedSchema& old_node, const capnp::ParsedSchema& new_node,
             const std::string& where, std::vector<std::string>& problems);

void compare_struct(const capnp::StructSchema& was, const capnp::StructSchema& now,
                    const std::string& where, std::vector<std::string>& problems) {
  for (const auto& f : was.getFields()) {
    const std::string name = f.getProto().getName();
    const std::string at = where + "." + name;
    KJ_IF_MAYBE (g, now.findFieldByName(f.getProto().getName())) {
      const auto fp = f.getProto(), gp = g->getProto();
      if (fp.which() != gp.which()) {
        problems.push_back(fmt::format("{}: changed between a slot and a group", at));
        continue;
      }
      const bool in_union = fp.getDiscriminantValue() != capnp::schema::Field::NO_DISCRIMINANT;
      if (in_union != (gp.getDiscriminantValue() != capnp::schema::Field::NO_DISCRIMINANT))
        problems.push_back(fmt::format("{}: moved {} a union", at, in_union ? "out of" : "into"));
      if (fp.isSlot()) {
        if (fp.getOrdinal().isExplicit() != gp.getOrdinal().isExplicit() ||
            (fp.getOrdinal().isExplicit() &&
             fp.getOrdinal().getExplicit() != gp.getOrdinal().getExplicit()))
          problems.push_back(
              fmt::format("{}: renumbered @{} -> @{}", at,
                          fp.getOrdinal().isExplicit() ? fp.getOrdinal().getExplicit() : 0,
                          gp.getOrdinal().isExplicit() ? gp.getOrdinal().getExplicit() : 0));
        const std::string a = type_text(f.getType()), b = type_text(g->getType());
        if (a != b) problems.push_back(fmt::format("{}: retyped {} -> {}", at, a, b));
      } else {
        compare_struct(f.getType().asStruct(), g->getType().asStruct(), at, problems);
      }
    } else {
      problems.push_back(fmt::format("{}: removed or renamed", at));
    }
  }
}

void compare(const capnp::ParsedSchema& was, const capnp::ParsedSchema& now,
             const std::string& where, std::vector<std::string>& problems) {
  const auto wp = was.getProto();
  if (wp.which() != now.getProto().which()) {
    problems.push_back(fmt::format("{}: changed kind", where));
    return;
  }
  if (wp.isStruct()) compare_struct(was.asStruct(), now.asStruct(), where, problems);
  if (wp.isEnum()) {
    const auto old_values = was.asEnum().getEnumerants();
    const auto new_values = now.asEnum().getEnumerants();
    for (uint i = 0; i < old_values.size(); ++i) {
      const std::string name = old_values[i].getProto().getName();
      if (i >= new_values.size() || std::string(new_values[i].getProto().getName().cStr()) != name)
        problems.push_back(
            fmt::format("{}.{}: enumerant @{} removed, renamed or moved", where, name, i));
    }
  }
  if (wp.isConst() && was.asConst().getType() != now.asConst().getType())
    problems.push_back(fmt::format("{}: constant retyped", where));
  for (const auto& child : was.getAllNested()) {
    const std::string name = short_name(child);
    const std::string leaf = name.substr(name.rfind('.') + 1);
    KJ_IF_MAYBE (c, now.findNested(leaf)) {
      compare(child, *c, where + "." + leaf, problems);
    } else {
      problems.push_back(fmt::format("{}.{}: removed or renamed", where, leaf));
    }
  }
}

// Every schema file of `snapshot` against the file of the same name in schemas/.
std::vector<std::string> evolution_problems(const fs::path& snapshot, const fs::path& current) {
  auto disk = kj::newDiskFilesystem();
  const auto& root = disk->getRoot();
  auto open = [&](const fs::path& p) {
    return root.openSubdir(kj::Path::parse(fs::absolute(p).lexically_normal().string().substr(1)));
  };
  auto include = open(MEGACPP_CAPNP_INCLUDE);
  const kj::ReadableDirectory* import_path[] = {include.get()};
  auto old_dir = open(snapshot), new_dir = open(current);
  capnp::SchemaParser old_parser, new_parser;
  std::vector<std::string> problems;
  for (const auto& entry : fs::directory_iterator(snapshot)) {
    if (entry.path().extension() != ".capnp") continue;
    const std::string file = entry.path().filename().string();
    if (!fs::exists(current / file)) {
      problems.push_back(file + ": removed");
      continue;
    }
    const auto was = old_parser.parseFromDirectory(*old_dir, kj::Path::parse(file), import_path);
    const auto now = new_parser.parseFromDirectory(*new_dir, kj::Path::parse(file), import_path);
    compare(was, now, file, problems);
  }
  return problems;
}

TEST(SchemaEvolution, EverySchemaIsAnAdditiveEvolutionOfEverySnapshot) {
  const fs::path source(MEGACPP_SOURCE_DIR);
  const fs::path snapshots = source / "tests" / "schema_snapshots";
  size_t checked = 0;
  for (const auto& v : fs::directory_iterator(snapshots)) {
    const auto problems = evolution_problems(v.path(), source / "schemas");
    EXPECT_TRUE(problems.empty()) << "schemas/ against " << v.path().filename().string()
                                  << ": not additive:\n  "
                                  << fmt::format("{}", fmt::join(problems, "\n  "));
    ++checked;
  }
  EXPECT_GE(checked, 1u);
  // The current format version has its snapshot.
  EXPECT_TRUE(fs::is_directory(snapshots / fmt::format("v{}", megacpp::schema::SCHEMA_VERSION)));
}

// The check fails when it should: a removed (renamed) field, a renumbered one, a retyped one, a
// renamed enumerant and a field moved into a union are each named; additions are not.
TEST(SchemaEvolution, NonAdditiveChangesAreNamed) {
  const fs::path tmp = fs::temp_directory_path() / fmt::format("megacpp-schema-{}", ::getpid());
  fs::remove_all(tmp);
  fs::create_directories(tmp / "old");
  fs::create_directories(tmp / "new");
  auto write = [](const fs::path& p, const std::string& text) {
    FILE* f = std::fopen(p.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs(text.c_str(), f);
    std::fclose(f);
  };
  write(tmp / "old" / "x.capnp", R"(@0xd3a5b4e2f1c0b9a8;
enum Color { red @0; green @1; }
struct S {
  a @0 :UInt32;
  b @1 :Text;
  c @2 :Float64;
  d @3 :Color;
  e @4 :Bool;
  union { u @5 :Void; v @6 :UInt8; }
}
)");
  write(tmp / "new" / "x.capnp", R"(@0xd3a5b4e2f1c0b9a8;
enum Color { red @0; blue @1; yellow @2; }
struct S {
  x @0 :UInt32;
  added @1 :UInt64;
  c @2 :Float32;
  dd @3 :Color;
  union { u @5 :Void; v @6 :UInt8; e @4 :Bool; }
  b @7 :Text;
}
)");
  const auto problems = evolution_problems(tmp / "old", tmp / "new");
  const std::string all = fmt::format("{}", fmt::join(problems, "\n"));
  EXPECT_NE(all.find("x.capnp.S.a: removed or renamed"), std::string::npos) << all;
  EXPECT_NE(all.find("x.capnp.S.b: renumbered @1 -> @7"), std::string::npos) << all;
  EXPECT_NE(all.find("x.capnp.S.c: retyped Float64 -> Float32"), std::string::npos) << all;
  EXPECT_NE(all.find("x.capnp.S.d: removed or renamed"), std::string::npos) << all;
  EXPECT_NE(all.find("x.capnp.S.e: moved into a union"), std::string::npos) << all;
  EXPECT_NE(all.find("x.capnp.Color.green: enumerant @1"), std::string::npos) << all;
  EXPECT_EQ(all.find("added"), std::string::npos) << all;  // additions are fine
  EXPECT_EQ(all.find("yellow"), std::string::npos) << all;
  fs::remove_all(tmp);
}

}  // namespace
