#!/usr/bin/env python3
"""The layering check: no #include from a lower layer to a higher one.

LAYERS is the one table. Each key is a module: a top-level folder ("ipc"), or a file stem
inside one ("core/clock" names core/clock.h and core/clock.cpp) where the files of a folder
are layered among themselves. Its value lists the modules it may include besides itself; a
listed folder admits everything under it. A file belongs to the most specific module that
covers it; an include belongs to the module that covers its target. Adding a folder (a
checkpoint library, a commands folder) is one row: name it and what it may include. A source
folder with no row fails the check, so a new folder cannot skip it. The table itself must be
acyclic (checked), which is what "lower" means.

Usage: check-layers.py [SOURCE_DIR]   (exit 0: clean; 1: each violation printed)
Run by ctest as `layering` (tests/unit/CMakeLists.txt); DESIGN.md "Layout additions" explains.
"""
import re
import sys
from pathlib import Path

ANY = "*"  # the tops: may include every layer

# fmt: off
LAYERS = {
    # core/, lowest, layered file by file: clock < error < fd, knobs < util.
    "core/clock":  [],
    "core/error":  ["core/clock"],
    "core/fd":     ["core/error"],
    "core/knobs":  ["core/error"],
    "core/util":   ["core/clock", "core/error", "core/fd", "core/knobs"],
    "core":        ["core/clock", "core/error", "core/fd", "core/knobs", "core/util"],
    # The planes' vocabularies and transports.
    "schemas":     ["core"],
    "ipc":         ["core", "schemas"],
    "recipes":     ["core", "schemas"],
    "ops":         ["core"],
    # The CUDA driver API loaded at run time and the device staging over it (torch-free).
    "gpu":         ["core"],
    "data":        ["core", "schemas", "recipes"],
    "prepare":     ["core", "schemas", "recipes", "data"],
    # The checkpoint library (format, storage, store, reader, verify, export, resume choice).
    "checkpoint":  ["core", "schemas"],
    # The processes: stage processes, then the supervisor that launches them: its process
    # primitives and failure rules, the run-directory commands (no live job), the node agent
    # and its link, then the job controller (every other file of supervisor/).
    "stages":      ["core", "schemas", "ipc", "recipes", "data", "ops", "gpu", "checkpoint"],
    "supervisor/process":  ["core", "schemas"],
    "supervisor/failure_policy": ["core", "schemas"],
    "supervisor/placement": ["core"],
    # Node 0's store and its clients (through the dlopen'd plugin), and a job's membership
    # over them: torch-free, below the job controller that will call join_job.
    "supervisor/rendezvous": ["core", "supervisor/process"],
    "supervisor/membership": ["core", "supervisor/placement", "supervisor/rendezvous"],
    "supervisor/commands": ["core", "schemas", "ipc", "stages", "supervisor/process"],
    # The node agent owns one host's processes and decides nothing: it hears the job controller
    # only through the link's commands, so it includes no controller header (supervisor.h,
    # detail/job_controller.h): the controller can then move to another host.
    "supervisor/node_agent_link": ["core", "schemas"],
    "supervisor/node_agent": ["core", "schemas", "ipc", "supervisor/process",
                              "supervisor/failure_policy", "supervisor/node_agent_link"],
    "supervisor":  ["core", "schemas", "ipc", "recipes", "data", "ops", "gpu", "prepare", "checkpoint",
                    "stages", "supervisor/process", "supervisor/commands",
                    "supervisor/placement", "supervisor/rendezvous",
                    "supervisor/membership", "supervisor/failure_policy",
                    "supervisor/node_agent_link", "supervisor/node_agent"],
    # Programs and tests over all of it.
    "tools":       [ANY],
    "bench":       [ANY],
    "tests":       [ANY],
}
# fmt: on

SOURCE_SUFFIXES = {".h", ".hpp", ".cpp", ".cc", ".cu", ".cuh"}
# Top-level folders that hold no sources of the layered tree.
NOT_SOURCE = {"cmake", "recipes_data", "scripts", "runs"}
INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


def module_of(rel: str) -> str | None:
    """The most specific LAYERS key covering `rel` (a path relative to the source root)."""
    stem = rel.rsplit(".", 1)[0] if "." in rel.rsplit("/", 1)[-1] else rel
    parts = stem.split("/")
    for n in range(len(parts), 0, -1):
        key = "/".join(parts[:n])
        if key in LAYERS:
            return key
    return None


def covers(allowed: str, module: str) -> bool:
    return module == allowed or module.startswith(allowed + "/")


def check_table() -> list[str]:
    errors = []
    for module, allowed in LAYERS.items():
        for a in allowed:
            if a != ANY and a not in LAYERS:
                errors.append(f"LAYERS: {module} may include {a}, which has no row")
    # Acyclic: a depth-first walk never meets a module still on its own path.
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def walk(module: str, path: list[str]) -> None:
        state[module] = 1
        for a in LAYERS.get(module, []):
            if a == ANY:
                continue
            if state.get(a) == 1:
                cycle = path[path.index(a):] + [module, a] if a in path else [module, a]
                errors.append("LAYERS: a cycle: " + " -> ".join(dict.fromkeys(cycle)) + f" -> {a}")
            elif state.get(a) is None:
                walk(a, path + [module])
        state[module] = 2

    for module in LAYERS:
        if state.get(module) is None:
            walk(module, [])
    return errors


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent)
    errors = check_table()
    checked = 0
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        top = rel.split("/", 1)[0]
        if top.startswith(".") or top.startswith("build") or top in NOT_SOURCE:
            continue
        if path.suffix not in SOURCE_SUFFIXES or not path.is_file():
            continue
        own = module_of(rel)
        if own is None:
            errors.append(f"{rel}: its folder {top}/ has no row in LAYERS "
                          f"(scripts/check-layers.py): add one saying what it may include")
            continue
        allowed = LAYERS[own]
        text = path.read_text(errors="replace")
        for m in INCLUDE.finditer(text):
            target = m.group(1)
            if (root / target).exists() or target.split("/", 1)[0] in LAYERS:
                target_rel = target
            else:
                local = (path.parent / target).resolve()
                if not local.exists() or root.resolve() not in local.parents:
                    continue  # a system or third-party header
                target_rel = local.relative_to(root.resolve()).as_posix()
            dep = module_of(target_rel)
            checked += 1
            if dep is None or dep == own or ANY in allowed:
                continue
            if covers(own, dep) and own.count("/") == 0:
                continue  # a folder's own files below its finer rows (core/*.cpp helpers)
            if not any(covers(a, dep) for a in allowed):
                line = text.count("\n", 0, m.start(1)) + 1
                errors.append(f"{rel}:{line}: includes \"{target}\": {own} may include only "
                              f"{', '.join(allowed) or 'nothing'} (a lower layer including a "
                              f"higher one; see DESIGN.md \"Layout additions\")")
    for e in errors:
        print(e)
    if not errors:
        print(f"layering: {checked} includes checked, none from a lower layer to a higher one")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
