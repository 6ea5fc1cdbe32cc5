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
