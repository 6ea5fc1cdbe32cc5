#include "schemas/json.h"

#include <capnp/compat/json.h>
#include <kj/exception.h>

#include "core/error.h"
#include "core/util.h"
#include "schemas/common.capnp.h"

namespace megacpp::schemas {

namespace {

// The enums whose enumerants carry $Json.name: registered by annotation so the codec writes
// and reads "peer_failure", not "peerFailure". Only the enum types are registered (not the
// root struct), so every struct keeps the codec's default encoding.
void handle_annotated_enums(capnp::JsonCodec& codec) {
  codec.handleByAnnotation<schema::FailureKind>();
  codec.handleByAnnotation<schema::FailureRole>();
  codec.handleByAnnotation<schema::ProcessState>();
  codec.handleByAnnotation<schema::ErrorKind>();
  codec.handleByAnnotation<schema::ChildReason>();
}

bool hex4(std::string_view s, size_t at, uint32_t& value) {
  if (at + 4 > s.size()) return false;
  value = 0;
  for (size_t i = at; i < at + 4; ++i) {
    const char c = s[i];
    uint32_t digit;
    if (c >= '0' && c <= '9') {
      digit = static_cast<uint32_t>(c - '0');
    } else if (c >= 'a' && c <= 'f') {
      digit = static_cast<uint32_t>(c - 'a' + 10);
    } else if (c >= 'A' && c <= 'F') {
      digit = static_cast<uint32_t>(c - 'A' + 10);
    } else {
      return false;
    }
    value = value << 4 | digit;
  }
  return true;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | cp >> 6);
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | cp >> 12);
    out += static_cast<char>(0x80 | (cp >> 6 & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | cp >> 18);
    out += static_cast<char>(0x80 | (cp >> 12 & 0x3F));
    out += static_cast<char>(0x80 | (cp >> 6 & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// Cap'n Proto 0.9's JSON decoder reads the hex letters of a \uXXXX escape as 0-5 instead of
// 10-15 (fixed upstream by capnproto pull request 1552, 2022), so "\u000e" — how its own encoder
// writes 0x0E — decodes to 0x04, and "\u00e9" is not "é". The escapes it gets wrong are rewritten
// before decoding: ASCII to the raw byte ('\\' keeps its short escape), anything above to the code
// point's UTF-8 (a surrogate pair is one code point; a lone surrogate is refused). Escapes of
// digits only below 0x80 are left as they are. Backslashes only appear inside JSON strings, so a
// scan that steps over every other escape finds exactly the \u escapes.
std::string fix_unicode_escapes(std::string_view json, std::string_view what) {
  std::string out;
  out.reserve(json.size());
  for (size_t i = 0; i < json.size(); ++i) {
    if (json[i] != '\\' || i + 1 == json.size()) {
      out += json[i];
      continue;
    }
    uint32_t cp = 0;
    if (json[i + 1] != 'u' || !hex4(json, i + 2, cp)) {
      out.append(json.substr(i, 2));  // another escape, or a broken one the decoder refuses
      ++i;
      continue;
    }
    size_t len = 6;
    if (cp >= 0xD800 && cp <= 0xDFFF) {
      uint32_t low = 0;
      if (cp > 0xDBFF || i + 7 >= json.size() || json[i + 6] != '\\' || json[i + 7] != 'u' ||
          !hex4(json, i + 8, low) || low < 0xDC00 || low > 0xDFFF) {
        MEGACPP_FAIL(ErrorKind::kCorruption,
                     "{}: not a valid document: a lone UTF-16 surrogate \\u{:04x} at byte {}", what,
                     cp, i);
      }
      cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
      len = 12;
    }
    const std::string_view escape = json.substr(i, len);
    if (cp < 0x80 && escape.find_first_of("abcdefABCDEF", 2) == std::string_view::npos) {
      out.append(escape);
    } else if (cp == '\\') {
      out += "\\\\";
    } else {
      append_utf8(out, cp);
    }
    i += len - 1;
  }
  return out;
}

}  // namespace

std::string to_json(capnp::DynamicStruct::Reader root) {
  capnp::JsonCodec codec;
  codec.setPrettyPrint(true);
  handle_annotated_enums(codec);
  kj::String text = codec.encode(root);
  std::string out(text.cStr(), text.size());
  out.push_back('\n');
  return out;
}

void from_json(std::string_view json, capnp::DynamicStruct::Builder root, std::string_view what) {
  capnp::JsonCodec codec;
  handle_annotated_enums(codec);
  std::string fixed;
  if (json.find("\\u") != std::string_view::npos) {
    fixed = fix_unicode_escapes(json, what);
    json = fixed;
  }
  try {
    codec.decode(kj::ArrayPtr<const char>(json.data(), json.size()), root);
  } catch (const kj::Exception& e) {
    MEGACPP_FAIL(ErrorKind::kCorruption, "{}: not a valid document: {}", what,
                 e.getDescription().cStr());
  }
}

std::string read_json_text(const std::filesystem::path& path) {
  return read_file(path);
}

}  // namespace megacpp::schemas
