// The typed-failure enums of common.capnp: their names (each enumerant's $Json.name, the
// word the JSON files carry) and the one conversion between megacpp::ErrorKind (core) and
// schema::ErrorKind (wire).
#pragma once

#include <optional>
#include <string_view>

#include "core/error.h"
#include "schemas/common.capnp.h"
#include "schemas/manifest.capnp.h"

namespace megacpp::schemas {

// The enumerant's JSON name ("peer_failure", "first_failure", "" for none, ...); the raw
// number as text is not returned: an unknown value (a newer writer) names as "unknown".
std::string_view name(schema::FailureKind kind);
std::string_view name(schema::FailureRole role);
std::string_view name(schema::ProcessState state);
std::string_view name(schema::ErrorKind kind);
std::string_view name(schema::ChildReason reason);
std::string_view name(schema::RunState state);
std::string_view name(schema::FailureReport report);  // "launched", "ok", "interrupted", ...

// The reverse, for the obsolete Text fields of journals written before the enums and the
// failure dump's errorKind; nullopt for a name that is no enumerant's.
std::optional<schema::FailureKind> failure_kind_named(std::string_view name);
std::optional<schema::ErrorKind> error_kind_named(std::string_view name);
std::optional<schema::FailureRole> failure_role_named(std::string_view name);
std::optional<schema::ChildReason> child_reason_named(std::string_view name);

// megacpp::ErrorKind <-> schema::ErrorKind, one to one over the core kinds; a foreign kind
// (capnp, c10, std, unknown) has no core counterpart.
schema::ErrorKind to_schema(ErrorKind kind);
std::optional<ErrorKind> from_schema(schema::ErrorKind kind);

}  // namespace megacpp::schemas
