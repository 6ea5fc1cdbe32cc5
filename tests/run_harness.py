"""A `megacpp run` driven from a test: the tiny recipe on real stage processes, with its run
directory, launch contract and manifest read as the run goes. Shared by the chaos suite and
the supervisor contract tests; MEGACPP_BIN names the binary (set by ctest).
"""
import json
import os
import subprocess
import sys
import time

MEGACPP = os.environ["MEGACPP_BIN"]


def pids_of(pattern):
    p = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return [int(x) for x in p.stdout.split()]


class Run:
    """Starts at construction; every wait is bounded and fails the test with the run's output."""

    def __init__(self, tmp, steps=60, extra=(), env=None, ranks=2):
        self.dir = os.path.join(tmp, "run")
        e = dict(os.environ)
        e.update(env or {})
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [MEGACPP, "run", "tiny", "--ranks", str(ranks), "--steps", str(steps), "--run-dir", self.dir,
             "--data-dir", os.path.join(tmp, "data"), "--progress", "none"] + list(extra),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=e)
        self.out = ""

    def launch(self, timeout=60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with open(os.path.join(self.dir, "launch.json")) as f:
                    return json.load(f)
            except (OSError, ValueError):
                time.sleep(0.05)
        raise AssertionError("no launch.json")

    def wait_steps(self, n, timeout=120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with open(os.path.join(self.dir, "manifest.json")) as f:
                    if json.load(f).get("stepsCompleted", 0) >= n:
                        return
            except (OSError, ValueError):
                pass
            if self.proc.poll() is not None:
                raise AssertionError("run ended before step %d:\n%s" % (n, self.proc.stdout.read()))
            time.sleep(0.05)
        raise AssertionError("step %d not reached" % n)

    def pid(self, stage, rank=0):
        exe = "megacpp-" + stage.replace("_", "-")
        found = pids_of("%s --run-dir %s --rank %d" % (exe, self.dir, rank))
        assert found, (stage, rank)
        return found[0]

    def finish(self, timeout=120):
        """The exit status of `megacpp run`; its output's tail goes to stderr for the log."""
        try:
            self.out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.out, _ = self.proc.communicate()
            raise AssertionError("megacpp run did not end within %ds:\n%s" % (timeout, self.out[-3000:]))
        sys.stderr.write(self.out[-1500:])
        return self.proc.returncode

    def manifest(self):
        with open(os.path.join(self.dir, "manifest.json")) as f:
            return json.load(f)
