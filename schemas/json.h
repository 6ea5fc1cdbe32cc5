// JSON for every human-read durable file (launch contract, manifest, receipts, checkpoint
// manifests), through Cap'n Proto's JSON codec: the schema defines the shape, key order is
// the schema's field order (stable), and unknown keys are ignored on read so old readers
// accept newer files. 64-bit integer fields are encoded as strings by the codec; our
// schemas use 32-bit integers or Float64 where a person will read the number.
#pragma once

#include <capnp/dynamic.h>
#include <capnp/message.h>

#include <filesystem>
#include <string>
#include <string_view>

namespace megacpp::schemas {

std::string to_json(capnp::DynamicStruct::Reader root);  // pretty, ends with '\n'
// Throws Error{kCorruption} naming `what` when the text is not valid for the schema.
void from_json(std::string_view json, capnp::DynamicStruct::Builder root, std::string_view what);

template <typename Reader>
std::string to_json(Reader root) {
  return to_json(capnp::DynamicStruct::Reader(capnp::toDynamic(root)));
}

// A JSON document decoded into an owned Cap'n Proto message. Non-copyable, non-movable
// (the message's segments are referenced by every reader handed out).
template <typename T>
class JsonDocument {
 public:
  JsonDocument(std::string_view json, std::string_view what) {
    from_json(json, capnp::toDynamic(message_.initRoot<T>()), what);
  }
  JsonDocument(const JsonDocument&) = delete;
  JsonDocument& operator=(const JsonDocument&) = delete;
  typename T::Reader get() { return message_.getRoot<T>().asReader(); }
  typename T::Builder builder() { return message_.getRoot<T>(); }

 private:
  capnp::MallocMessageBuilder message_;
};

// Reads and decodes a JSON file; throws Error{kSystem} if unreadable, {kCorruption} if malformed.
template <typename T>
class JsonFile : public JsonDocument<T> {
 public:
  explicit JsonFile(const std::filesystem::path& path);
};

std::string read_json_text(const std::filesystem::path& path);

template <typename T>
JsonFile<T>::JsonFile(const std::filesystem::path& path)
    : JsonDocument<T>(read_json_text(path), path.string()) {}

}  // namespace megacpp::schemas
