"""`make run` builds only what a run executes.

The quick start's `make run` must reach training fast on a fresh 2-core machine, so it builds
the `megacpp` command, the stage executables and the plugins `megacpp run` loads, not the tests
and benchmarks (`make test` builds those). Checked on the real Makefile and build tree:
`make -n run` names its build targets, every one of them exists in the build, and the compile
commands ninja would run for them touch no source under tests/ or bench/.
"""
import os
import re
import subprocess
import unittest

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BUILD = os.environ["MEGACPP_BUILD_DIR"]


class MakeRun(unittest.TestCase):
    def test_make_run_builds_only_what_a_run_executes(self):
        dry = subprocess.run(["make", "-n", "--no-print-directory", "run", "BUILD=" + BUILD],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        self.assertEqual(dry.returncode, 0, dry.stdout + dry.stderr)
        builds = [l for l in dry.stdout.splitlines() if "cmake --build" in l]
        self.assertEqual(len(builds), 1, dry.stdout)
        m = re.search(r"--target (.*)$", builds[0])
        self.assertIsNotNone(m, "make run builds every target: " + builds[0])
        targets = m.group(1).split()
        self.assertIn("megacpp", targets)
        self.assertIn("megacpp-trainer", targets)
        listed = subprocess.run(["ninja", "-C", BUILD, "-t", "targets", "all"],
                                capture_output=True, text=True, timeout=120)
        known = {l.split(":")[0] for l in listed.stdout.splitlines()}
        for t in targets:
            self.assertIn(t, known, "make run names a target the build does not have: " + t)
        commands = subprocess.run(["ninja", "-C", BUILD, "-t", "commands"] + targets,
                                  capture_output=True, text=True, timeout=120)
        self.assertEqual(commands.returncode, 0, commands.stderr)
        for line in commands.stdout.splitlines():
            for folder in ("/tests/", "/bench/"):
                self.assertNotIn(ROOT + folder, line.split(" -o ")[0].split(" -c ")[-1],
                                 "make run would compile " + line[-200:])


if __name__ == "__main__":
    unittest.main()
