"""scripts/check-layers.py on this tree (clean) and on small trees that break each rule."""
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check-layers.py"


def run(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(root)], capture_output=True, text=True)


def tree(files: dict[str, str]) -> tempfile.TemporaryDirectory:
    d = tempfile.TemporaryDirectory()
    for rel, text in files.items():
        p = Path(d.name) / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return d


def expect(files: dict[str, str], rc: int, needle: str) -> None:
    with tree(files) as d:
        r = run(Path(d))
        assert r.returncode == rc, (files, r.stdout, r.stderr)
        assert needle in r.stdout, (needle, r.stdout)


# This repository: clean.
r = run(ROOT)
assert r.returncode == 0, r.stdout + r.stderr
assert "none from a lower layer" in r.stdout, r.stdout

# A lower folder including a higher one, named with file and line.
expect({"ipc/a.h": "#pragma once\n", "core/util.h": '\n#include "ipc/a.h"\n'}, 1,
       'core/util.h:2: includes "ipc/a.h"')
# Downwards is fine.
expect({"ipc/a.h": '#include "core/util.h"\n', "core/util.h": ""}, 0, "none from a lower")
# Inside core/: error below util (the cycle Error <-> clocks went through util.h).
expect({"core/error.cpp": '#include "core/util.h"\n', "core/util.h": ""}, 1,
       "core/error may include only core/clock")
# A relative include resolves to its folder's layer.
expect({"data/x.cpp": '#include "../stages/s.h"\n', "stages/s.h": ""}, 1,
       'data/x.cpp:1: includes "../stages/s.h"')
# A folder with no row fails.
expect({"cluster/agent.h": '#include "core/util.h"\n', "core/util.h": ""}, 1,
       "cluster/ has no row in LAYERS")
# The node agent includes no job-controller header; the job controller includes the agent.
expect({"supervisor/node_agent.cpp": '#include "supervisor/detail/job_controller.h"\n'}, 1,
       'supervisor/node_agent.cpp:1: includes "supervisor/detail/job_controller.h"')
expect({"supervisor/node_agent_link.h": '#include "supervisor/supervisor.h"\n'}, 1,
       "supervisor/node_agent_link may include only core, schemas")
expect({"supervisor/detail/job_controller.h": '#include "supervisor/node_agent.h"\n',
        "supervisor/node_agent.h": '#include "supervisor/node_agent_link.h"\n'}, 0,
       "none from a lower")
# System headers in quotes are not ours.
expect({"ops/k.cu": '#include "crt/host_defines.h"\n'}, 0, "none from a lower")
# The table must stay acyclic: a row that lets schemas include ipc (which includes schemas)
# is refused.
import importlib.util

spec = importlib.util.spec_from_file_location("check_layers", SCRIPT)
layers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(layers)
assert layers.check_table() == [], layers.check_table()
layers.LAYERS["schemas"] = ["core", "ipc"]
assert any("a cycle" in e and "ipc" in e for e in layers.check_table()), layers.check_table()
layers.LAYERS["schemas"] = ["core", "cluster"]
assert any("cluster, which has no row" in e for e in layers.check_table())
print("layering_test: ok")
