#!/usr/bin/env python3
"""Writes the seed corpora of tests/fuzz/corpus/ (llm.c shards and Megatron idx+bin pairs in
the targets' input layouts). The dataset.json seeds are what `megacpp prepare` wrote, kept as
files; this script only derives their variants. Run from anywhere; rewrites the seeds."""
import json
import pathlib
import struct

ROOT = pathlib.Path(__file__).resolve().parent / "corpus"

# Option byte of the shard targets: bits 0-2 vocabulary (0, 2, 257, 50257, 65535, 65536,
# 65537, 128256), bit 3 no checksum, bits 4-5 EOS (0, 256, 50256, 128001; llm.c target only).
V0, V257, V50257, V128256 = 0, 2, 3, 7
EOS256, EOS50256, EOS128001 = 1 << 4, 2 << 4, 3 << 4
NO_CHECKSUM = 1 << 3


def llmc(tokens, width, count=None, magic=None, version=None):
    header = [0] * 256
    header[0] = magic if magic is not None else (20240520 if width == 2 else 20240801)
    header[1] = version if version is not None else (1 if width == 2 else 7)
    header[2] = len(tokens) if count is None else count
    body = struct.pack("<256i", *header)
    return body + b"".join(struct.pack("<H" if width == 2 else "<I", t) for t in tokens)


def megatron(seqs, docs, code, modes=False, ptr_shift=0):
    """seqs: token lists (sequences); docs: document index (sequence numbers)."""
    w = 2 if code == 8 else 4
    binary, lens, ptrs = b"", [], []
    for s in seqs:
        ptrs.append(len(binary) + (ptr_shift if ptrs else 0))
        lens.append(len(s))
        binary += b"".join(struct.pack("<H" if w == 2 else "<i", t) for t in s)
    idx = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, code, len(seqs), len(docs))
    idx += struct.pack(f"<{len(lens)}i", *lens) + struct.pack(f"<{len(ptrs)}q", *ptrs)
    idx += struct.pack(f"<{len(docs)}q", *docs)
    if modes:
        idx += bytes(len(seqs))
    return idx, binary


def megatron_input(opt, idx, binary):
    return bytes([opt]) + struct.pack("<I", len(idx)) + idx + binary


def write(target, name, data):
    assert len(data) < 4096, (target, name, len(data))
    d = ROOT / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data)


def main():
    t = "fuzz_llmc_shard"
    byte_doc = [256, *b"hello world\n", 256, *b"zz\n"]
    write(t, "u16_byte_level", bytes([V257 | EOS256]) + llmc(byte_doc, 2))
    write(t, "u16_gpt2", bytes([V50257 | EOS50256]) + llmc([50256, 15496, 995, 50256, 40, 716], 2))
    write(t, "u32_llama3",
          bytes([V128256 | EOS128001]) + llmc([128000, 9906, 1917, 128001, 128000, 40], 4))
    write(t, "u16_empty", bytes([V0]) + llmc([], 2))
    write(t, "u16_no_checksum", bytes([V0 | NO_CHECKSUM | EOS256]) + llmc(byte_doc, 2))
    # Near-valid: refused on open.
    write(t, "u16_truncated", bytes([V50257]) + llmc([1, 2, 3, 4, 5], 2, count=8))
    write(t, "u16_token_over_vocab", bytes([V257 | EOS256]) + llmc([256, 300, 7], 2))
    write(t, "u32_bad_version", bytes([V128256]) + llmc([1, 2], 4, version=1))
    write(t, "header_only_short", bytes([V0]) + llmc([], 2)[:512])

    t = "fuzz_megatron_index"
    write(t, "u16_three_docs",
          megatron_input(V50257, *megatron([[50256, 15496, 995], [40, 716], [11]], [0, 1, 2, 3], 8)))
    write(t, "i32_two_docs",
          megatron_input(V128256, *megatron([[128000, 9906], [128000, 40, 1917]], [0, 1, 2], 4)))
    # Documents of several sequences, an empty last sequence.
    write(t, "u16_multi_sequence_docs",
          megatron_input(V257, *megatron([[1, 2], [3], [4, 5, 6], [7], []], [0, 2, 5], 8)))
    write(t, "u16_multimodal_modes",
          megatron_input(V0 | NO_CHECKSUM, *megatron([[1, 2], [3]], [0, 1, 2], 8, modes=True)))
    write(t, "u16_empty", megatron_input(V0, *megatron([], [0], 8)))
    # Near-valid: refused on open.
    write(t, "u16_gap_between_sequences",
          megatron_input(V0, *megatron([[1, 2], [3]], [0, 1, 2], 8, ptr_shift=2)))
    idx, binary = megatron([[1, 2, 3], [4]], [0, 1, 2], 8)
    write(t, "u16_bin_truncated", megatron_input(V0, idx, binary[:-2]))
    write(t, "u16_doc_index_short", megatron_input(V0, *megatron([[1, 2], [3]], [0, 1], 8)))
    write(t, "u16_token_over_vocab", megatron_input(V257, *megatron([[256, 999]], [0, 1], 8)))

    t = "fuzz_dataset_manifest"
    base = json.loads((ROOT / t / "prepare_byte_level.json").read_text())

    def variant(name, edit):
        m = json.loads(json.dumps(base))
        edit(m)
        write(t, name, json.dumps(m, indent=1).encode())

    def sentencepiece(m):
        m["vocabSize"] = m["tokenizer"]["vocabSize"] = 1024
        m["eosId"] = 2
        m["tokenizer"].update(kind="sentencepiece-bpe", file="tokenizer.model",
                              xxh3="0123456789abcdef")

    def wide(m):
        m["tokenWidth"] = 4
        m["vocabSize"] = m["tokenizer"]["vocabSize"] = 128256
        for s in m["shards"]:
            s["bytes"] = str(1024 + 4 * s["tokens"])

    variant("sentencepiece_bpe.json", sentencepiece)
    variant("u32_tokens.json", wide)
    # Near-valid: refused on read.
    variant("eos_not_below_vocab.json", lambda m: m.update(eosId=m["vocabSize"]))
    variant("shard_path_escape.json", lambda m: m["shards"][0].update(file="../x.bin"))
    variant("shard_bytes_wrong.json", lambda m: m["shards"][0].update(bytes="1057"))
    text = (ROOT / t / "prepare_byte_level.json").read_bytes()
    write(t, "truncated.json", text[: len(text) // 2])


if __name__ == "__main__":
    main()
