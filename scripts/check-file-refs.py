#!/usr/bin/env python3
"""Every source file a comment or a document names exists.

Scans the tree's sources, scripts, build files and documents for names ending in .cpp, .h,
.py or .capnp (outside #include lines, which the compiler checks) and fails for one that is
not a file of the tree. A name is found when it is a path from the root, a path from the
naming file's folder, or the tail of a file's path ("trainer/optim.h", "knobs.h"); "a.h/b.cpp"
names both; "x.capnp.h" is the header generated from x.capnp.

What the tree names but does not hold is listed below with its reason: headers and scripts of
other projects (EXTERNAL) and names a test makes up for its own temporary trees (SYNTHETIC).

Usage: check-file-refs.py [SOURCE_DIR]   (exit 0: every name found; 1: each missing one printed)
Run by ctest as `file_refs` (tests/unit/CMakeLists.txt).
"""
import re
import sys
from pathlib import Path

# Other projects' files, named where megacpp builds against them or follows their code.
EXTERNAL = {
    "nccl.h", "cuda_runtime.h", "cuda_runtime_api.h", "crt/host_config.h", "cuda.h",  # CUDA toolkit
    "torch/torch.h", "gloo/algorithm.h",                                     # LibTorch
    "capnp/compat/json.capnp", "capnp/blob.h", "blob.h",                     # Cap'n Proto
    "nanochat/adamw.py", "nanochat/muon.py", "nanochat/optim.py",            # nanochat
    "megatron/core/datasets/indexed_dataset.py",                             # Megatron-LM
    "dev/data/data_common.py",                                               # llm.c
    "OUT/prefix/usr/include/capnp/blob.h",  # device-prep.sh: a path on the GPU machine
    "openssl/opensslconf.h",                # OpenSSL's, in device-prep's prefix
}

# (naming file, name): files a test writes into its own temporary tree.
SYNTHETIC = {
    ("tests/unit/checkpointer_test.cpp", "check.py"),
    ("tests/unit/schema_evolution_test.cpp", "x.capnp"),
    ("tests/unit/file_refs_test.py", "*"),
    ("tests/unit/layering_test.py", "*"),
    ("scripts/check-file-refs.py", "*"),  # this docstring's examples
}

SCANNED_SUFFIXES = {".cpp", ".h", ".cu", ".cuh", ".py", ".md", ".capnp", ".txt", ".sh",
                    ".cmake", ".toml"}
SCANNED_NAMES = {"Makefile"}
# A name: path segments, then the extension; not preceded by what makes it part of a longer
# token, a template (${x}_test.cpp, <module>_test.cpp), a glob (*.cpp) or a system include
# (<x.h>).
NAME = re.compile(r"(?<![\w./${}*<>-])((?:[\w.-]+/)*[\w-]+(?:\.[\w-]+)*\.(?:cpp|h|py|capnp))(?![\w/])")
INCLUDE_LINE = re.compile(r"^\s*#\s*include\s*[<\"].*$", re.M)
EXT = re.compile(r"\.(cpp|h|py|capnp)$")


def skipped(rel_parts: tuple[str, ...]) -> bool:
    top = rel_parts[0]
    # tests/schema_snapshots/ holds frozen copies of old schemas: their comments name the files
    # of their day.
    return top.startswith(".") or top.startswith("build") or top == "runs" or \
        "__pycache__" in rel_parts or rel_parts[:2] == ("tests", "schema_snapshots")


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent)
    files = [p for p in root.rglob("*")
             if p.is_file() and not skipped(p.relative_to(root).parts)]
    paths = {p.relative_to(root).as_posix() for p in files}

    def exists(name: str, folder: str) -> bool:
        if name.endswith(".capnp.h"):
            name = name[: -len(".h")]
        if name in paths or (folder and f"{folder}/{name}" in paths):
            return True
        return any(p.endswith("/" + name) for p in paths)

    errors = []
    named = 0
    for p in sorted(files):
        rel = p.relative_to(root).as_posix()
        if p.suffix not in SCANNED_SUFFIXES and p.name not in SCANNED_NAMES:
            continue
        if (rel, "*") in SYNTHETIC:
            continue
        text = INCLUDE_LINE.sub("", p.read_text(errors="replace"))
        folder = p.parent.relative_to(root).as_posix()
        folder = "" if folder == "." else folder
        for m in NAME.finditer(text):
            whole = m.group(1)
            # "mamba.h/mamba.cpp": two names.
            parts = re.split(r"(?<=\.h)/|(?<=\.cpp)/|(?<=\.py)/|(?<=\.capnp)/", whole)
            for name in parts:
                if not EXT.search(name):
                    continue
                named += 1
                if name in EXTERNAL or (rel, name) in SYNTHETIC:
                    continue
                if not exists(name, folder):
                    line = text.count("\n", 0, m.start(1)) + 1
                    errors.append(f"{rel}:{line}: names {name}, which is not a file of the tree "
                                  f"(renamed or removed? name what exists now)")
    for e in errors:
        print(e)
    if not errors:
        print(f"file_refs: {named} file names checked, every one exists")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
