@0xaa2d2917901b498b;
# DATASET/dataset.json: what `megacpp prepare` wrote (data/dataset_manifest.h reads,
# validates and writes it). It holds no timestamp, host or thread count: the same inputs and
# options give the same bytes. Byte counts are UInt64 (strings in the JSON, see json.h);
# token and document counts fit 32 bits (an llm.c shard holds at most INT32_MAX tokens).
using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("megacpp::schema");

struct DatasetTokenizer {
  kind @0 :Text;       # "byte" | "sentencepiece-bpe" | "sentencepiece-unigram"
  file @1 :Text;       # name inside the dataset directory (tokenizer.model); empty for byte
  xxh3 @2 :Text;       # XXH3-64 hex of that file; empty for byte
  vocabSize @3 :UInt32;
}

struct DatasetInput {
  path @0 :Text;       # relative to the input root it was found under
  bytes @1 :UInt64;
  xxh3 @2 :Text;       # XXH3-64 hex of the file's bytes
  documents @3 :UInt32;  # 1, or 0 when skipped
  skipped @4 :Text;    # why the file is not in the dataset; empty when it is
}

struct DatasetShard {
  file @0 :Text;       # name inside the dataset directory (train_000000.bin)
  split @1 :Text;      # "train" | "val"
  tokens @2 :UInt32;
  documents @3 :UInt32;  # documents that start in this shard (its EOS tokens)
  bytes @4 :UInt64;    # llm.c header + tokens × tokenWidth
  xxh3 @5 :Text;       # XXH3-64 hex of the whole file
}

struct DatasetManifest {
  schemaVersion @0 :UInt32;
  format @1 :Text;     # "llmc"
  tokenWidth @2 :UInt32;  # bytes per token in the shards: 2 or 4
  vocabSize @3 :UInt32;
  eosId @4 :UInt32;    # starts every document
  documents @5 :UInt32;
  skippedFiles @6 :UInt32;
  tokenizer @7 :DatasetTokenizer;
  inputs @8 :List(DatasetInput);
  shards @9 :List(DatasetShard);
}
