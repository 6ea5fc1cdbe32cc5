"""scripts/check-file-refs.py on this tree (every named file exists) and on small trees."""
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check-file-refs.py"


def run(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(root)], capture_output=True, text=True)


def expect(files: dict[str, str], rc: int, needle: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        for rel, text in files.items():
            p = Path(d) / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
        r = run(Path(d))
        assert r.returncode == rc, (files, r.stdout, r.stderr)
        assert needle in r.stdout, (needle, r.stdout)


r = run(ROOT)
assert r.returncode == 0, r.stdout + r.stderr

# A comment naming a file that was renamed: file and line named.
expect({"ipc/ring.cpp": "// see\n// ipc/ring.h for the contract\n"}, 1,
       "ipc/ring.cpp:2: names ipc/ring.h")
# A document naming a removed script.
expect({"README.md": "Run `scripts/old.py`.\n"}, 1, "README.md:1: names scripts/old.py")
# Found: from the root, from the naming file's folder, as a tail, as a pair, generated.
expect({"stages/trainer/optim.h": "", "stages/trainer/optim.cpp": "",
        "schemas/control.capnp": "",
        "DESIGN.md": "`stages/trainer/optim.h`, trainer/optim.cpp, optim.h/optim.cpp\n",
        "stages/trainer/x.cpp": "// optim.h and schemas/control.capnp.h\n"}, 0, "every one exists")
# Not names of files: an #include (the compiler's), a template, a glob, a system header.
expect({"a/b.cpp": '#include "gone.h"\n# ${t}_test.cpp *.cpp <sys/gone.h>\n'}, 0,
       "every one exists")
print("file_refs_test: ok")
