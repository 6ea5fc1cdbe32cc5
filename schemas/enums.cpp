#include "schemas/enums.h"

#include <capnp/schema.h>

namespace megacpp::schemas {

namespace {

// capnp/compat/json.capnp: annotation name @0xfa5b1fd61c2e7c3d (field, enumerant, ...) :Text.
constexpr uint64_t kJsonNameAnnotationId = 0xfa5b1fd61c2e7c3dull;

// The enumerant's $Json.name when it has one, else its schema name.
template <typename E>
std::string_view json_name(E value) {
  const auto enumerants = capnp::Schema::from<E>().getEnumerants();
  const auto raw = static_cast<uint16_t>(value);
  if (raw >= enumerants.size()) return "unknown";
  auto e = enumerants[raw];
  for (auto a : e.getProto().getAnnotations()) {
    if (a.getId() == kJsonNameAnnotationId) {
      auto text = a.getValue().getText();
      return {text.cStr(), text.size()};
    }
  }
  auto text = e.getProto().getName();
  return {text.cStr(), text.size()};
}

template <typename E>
std::optional<E> named(std::string_view name) {
  const auto enumerants = capnp::Schema::from<E>().getEnumerants();
  for (uint16_t i = 0; i < enumerants.size(); ++i) {
    if (json_name(static_cast<E>(i)) == name) return static_cast<E>(i);
  }
  return std::nullopt;
}

}  // namespace

std::string_view name(schema::FailureKind kind) {
  return json_name(kind);
}
std::string_view name(schema::FailureRole role) {
  return json_name(role);
}
std::string_view name(schema::ProcessState state) {
  return json_name(state);
}
std::string_view name(schema::ErrorKind kind) {
  return json_name(kind);
}
std::string_view name(schema::ChildReason reason) {
  return json_name(reason);
}
std::string_view name(schema::RunState state) {
  return json_name(state);
}
std::string_view name(schema::FailureReport report) {
  return json_name(report);
}

std::optional<schema::FailureKind> failure_kind_named(std::string_view name) {
  return named<schema::FailureKind>(name);
}
std::optional<schema::ErrorKind> error_kind_named(std::string_view name) {
  return named<schema::ErrorKind>(name);
}
std::optional<schema::FailureRole> failure_role_named(std::string_view name) {
  return named<schema::FailureRole>(name);
}
std::optional<schema::ChildReason> child_reason_named(std::string_view name) {
  return named<schema::ChildReason>(name);
}

schema::ErrorKind to_schema(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInvalidArgument:
      return schema::ErrorKind::INVALID_ARGUMENT;
    case ErrorKind::kSystem:
      return schema::ErrorKind::SYSTEM;
    case ErrorKind::kZmq:
      return schema::ErrorKind::ZMQ;
    case ErrorKind::kProtocol:
      return schema::ErrorKind::PROTOCOL;
    case ErrorKind::kCorruption:
      return schema::ErrorKind::CORRUPTION;
    case ErrorKind::kTimeout:
      return schema::ErrorKind::TIMEOUT;
    case ErrorKind::kPeerFailure:
      return schema::ErrorKind::PEER_FAILURE;
    case ErrorKind::kInterrupted:
      return schema::ErrorKind::INTERRUPTED;
    case ErrorKind::kInternal:
      return schema::ErrorKind::INTERNAL;
    case ErrorKind::kDiverged:
      return schema::ErrorKind::DIVERGED;
  }
  return schema::ErrorKind::UNKNOWN;
}

std::optional<ErrorKind> from_schema(schema::ErrorKind kind) {
  switch (kind) {
    case schema::ErrorKind::INVALID_ARGUMENT:
      return ErrorKind::kInvalidArgument;
    case schema::ErrorKind::SYSTEM:
      return ErrorKind::kSystem;
    case schema::ErrorKind::ZMQ:
      return ErrorKind::kZmq;
    case schema::ErrorKind::PROTOCOL:
      return ErrorKind::kProtocol;
    case schema::ErrorKind::CORRUPTION:
      return ErrorKind::kCorruption;
    case schema::ErrorKind::TIMEOUT:
      return ErrorKind::kTimeout;
    case schema::ErrorKind::PEER_FAILURE:
      return ErrorKind::kPeerFailure;
    case schema::ErrorKind::INTERRUPTED:
      return ErrorKind::kInterrupted;
    case schema::ErrorKind::INTERNAL:
      return ErrorKind::kInternal;
    case schema::ErrorKind::DIVERGED:
      return ErrorKind::kDiverged;
    case schema::ErrorKind::CAPNP:
    case schema::ErrorKind::C10:
    case schema::ErrorKind::STD:
    case schema::ErrorKind::UNKNOWN:
    case schema::ErrorKind::NONE:
      return std::nullopt;
  }
  return std::nullopt;
}

}  // namespace megacpp::schemas
