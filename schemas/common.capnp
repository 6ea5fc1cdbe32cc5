@0xea6f9595883342d2;
# Shared enums. Schemas only ever add fields and enumerants (old files stay readable).
using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("megacpp::schema");

const schemaVersion :UInt32 = 1;

enum StageKind {
  supervisor @0;
  dataLoader @1;
  trainer @2;
  collector @3;
  checkpointer @4;
}

enum Phase {
  startup @0;      # process start to first useful work (budget: generous)
  waitBatch @1;    # trainer waiting on its ring
  forward @2;
  backward @3;
  optimizer @4;    # includes the gradient all-reduce
  snapshot @5;     # copying state into the staging region
  idle @6;         # a service stage with nothing to do
  shutdown @7;
  produce @8;      # data loader filling rings
  write @9;        # checkpointer writing / collector folding
}
