// A job's CURVE keys (ZeroMQ's CurveZMQ, Z85 text): the key pair of the job controller's
// server socket and the one client key pair every node agent of the job presents, generated
// per job and kept in a key file only the job's user can read. DESIGN.md "The control channel
// across hosts".
//
// Failure: a key file that cannot be created (it exists, the directory is not writable) or
// read, that another user owns, that group or others may read, or that is not a key file, is
// Error{kInvalidArgument} with one line naming the file and what to do; a failed
// zmq_curve_keypair is Error{kZmq}.
#pragma once

#include <array>
#include <filesystem>
#include <string>
#include <string_view>

namespace megacpp::ipc {

// A Z85-encoded CURVE key pair: 40 characters each (32 bytes of key).
struct CurveKeyPair {
  std::string public_key;
  std::string secret_key;
  bool operator==(const CurveKeyPair&) const = default;
};

// The job's keys. One client pair for the whole job rather than one per node: every node runs
// as the job's user and reads the same file (or the same engine secret), so per-node pairs kept
// together would fence nothing off, and the keys can be made before the scheduler has settled
// how many nodes join (torchrun's elastic range). The ZAP handler takes a set of client keys,
// so per-node pairs delivered per node are a change of this file, not of the protocol.
struct JobKeys {
  CurveKeyPair server;  // the job controller's ROUTER: its secret stays with the controller
  CurveKeyPair client;  // every node agent's DEALER
  bool operator==(const JobKeys&) const = default;
};

// Fresh keys from zmq_curve_keypair (libsodium's randomness): distinct on every call.
JobKeys generate_job_keys();

// RUN/job.keys, where `megacpp run` keeps a job's keys unless told another path.
std::filesystem::path job_keys_path(const std::filesystem::path& run_dir);

// Writes `keys` to `path`, which must not exist: a temporary file created with
// O_CREAT|O_EXCL and mode 0600 (never readable by anyone else, not even while it is written),
// fsynced, then linked to `path` (link(2) refuses to replace an existing file) and the
// directory fsynced. A crash leaves no key file or a complete one.
void write_job_keys(const std::filesystem::path& path, const JobKeys& keys);

// Reads a key file written by write_job_keys. Refused, like ssh refuses an unprotected private
// key: a file group or others may read or write, one another user owns, a symbolic link.
JobKeys read_job_keys(const std::filesystem::path& path);

// The prefix of every key a job across nodes writes to node 0's c10d store (the membership and
// the ranks' rendezvous): "megacpp-job-" and 32 hex digits of a keyed BLAKE2b of the client
// secret key. Every node derives the same prefix from the same key file, so no second secret
// travels; one-way, so the prefix (which the store's plain-text traffic and its listKeys give
// away) tells nothing of the key. Distinct jobs get distinct prefixes.
std::string job_store_prefix(const JobKeys& keys);

// Seals a job's records on node 0's store (supervisor/rendezvous.h SealedRecords): a keyed
// BLAKE2b (32 bytes, hex) of a text under a key derived from the job's client secret key with
// its own context (not the store prefix's), so only a holder of the keys makes a valid seal.
class RecordSealer {
 public:
  explicit RecordSealer(const JobKeys& keys);
  std::string operator()(std::string_view text) const;

 private:
  std::array<unsigned char, 32> key_{};
};

}  // namespace megacpp::ipc
