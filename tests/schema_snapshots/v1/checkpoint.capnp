@0xed9c9014950d38b7;
# RUN/checkpoints/step_NNNNNNNN/checkpoint.json.
using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("megacpp::schema");

struct CheckpointFile {
  name @0 :Text;
  bytes @1 :UInt64;
  xxh3 @2 :Text;
  tensors @3 :UInt32;
}

struct CheckpointManifest {
  schemaVersion @0 :UInt32;
  runId @1 :Text;
  step @2 :UInt32;
  world @3 :UInt32;
  createdAt @4 :Text;
  recipeHash @5 :Text;
  files @6 :List(CheckpointFile);
  # XXH3-64 of this file as written with selfXxh3 empty, so one flipped byte of checkpoint.json
  # itself is caught too (empty in checkpoints written before it: not checked).
  selfXxh3 @7 :Text;
  # The model's execution layout (DESIGN.md "Hybrid recipes"): the recipe's mode and its
  # tensor-parallel degree. Empty / 0 in checkpoints written before them: author_dp, 1.
  mode @8 :Text;
  tensorParallel @9 :UInt32;
  # A node's part of a job's checkpoint (a job across nodes: each node's checkpointer commits
  # its own ranks): files are ranks firstRank .. firstRank + ranks - 1 of world. ranks 0, as in
  # checkpoints written before the fields and on one node: every rank of world.
  firstRank @10 :UInt32;
  ranks @11 :UInt32;
}
