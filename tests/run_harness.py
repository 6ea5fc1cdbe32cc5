"""A `megacpp run` driven from a test: the tiny recipe on real stage processes, with its run
directory, launch contract and manifest read as the run goes. Shared by the chaos suite and
the supervisor contract tests; and what the resume, recovery, export and checkpoint-kill tests
read back from a run directory. MEGACPP_BIN names the binary (set by ctest).
"""
import json
import os
import struct
import subprocess
import sys
import time

MEGACPP = os.environ["MEGACPP_BIN"]


def pids_of(pattern):
    p = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return [int(x) for x in p.stdout.split()]


class Run:
    """Starts at construction; every wait is bounded and fails the test with the run's output."""

    def __init__(self, tmp, steps=60, extra=(), env=None, ranks=2, recipe="tiny"):
        self.dir = os.path.join(tmp, "run")
        e = dict(os.environ)
        e.update(env or {})
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [MEGACPP, "run", recipe, "--ranks", str(ranks), "--steps", str(steps), "--run-dir", self.dir,
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


# ------------------------------------------------------------------ run directories, read back

RECIPE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "recipes")


def megacpp(args, env=None, timeout=600):
    """`megacpp ARGS` to completion; the CompletedProcess (text), whatever its status."""
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([MEGACPP] + list(args), capture_output=True, text=True, timeout=timeout,
                          env=e)


def tiny_recipe(tmp, every, batch=None):
    """recipes/tiny.toml with checkpoint_every = `every` (and batch_size = `batch`), written to
    tmp; returns its path."""
    with open(os.path.join(RECIPE_DIR, "tiny.toml")) as f:
        text = f.read()
    text = text.replace("checkpoint_every = 20", "checkpoint_every = %d" % every)
    name = "ck%d" % every
    if batch is not None:
        text = text.replace("batch_size = 16 ", "batch_size = %d " % batch)
        name += "-b%d" % batch
    path = os.path.join(tmp, name + ".toml")
    with open(path, "w") as f:
        f.write(text)
    return path


def manifest(run_dir):
    with open(os.path.join(run_dir, "manifest.json")) as f:
        return json.load(f)


def steps_done(run_dir):
    """manifest.stepsCompleted, 0 while there is no (readable) manifest."""
    try:
        return manifest(run_dir).get("stepsCompleted", 0)
    except (OSError, ValueError):
        return 0


def losses(run_dir):
    """[(step, loss)] of the run's telemetry receipt."""
    with open(os.path.join(run_dir, "receipts", "bench_telemetry.json")) as f:
        return [(s["step"], s["loss"]) for s in json.load(f)["steps"]]


def data_section(path):
    """A safetensors file's tensor bytes (after its header)."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    return raw[8 + n:]


def final_bytes(run_dir, step, world):
    """The tensor bytes of every rank file of checkpoint `step`."""
    step_dir = os.path.join(run_dir, "checkpoints", "step_%08d" % step)
    return [data_section(os.path.join(step_dir, "rank_%d.safetensors" % r)) for r in range(world)]


def trainer_pid(run_dir, rank):
    """The pid of the run's trainer `rank`, or None."""
    found = pids_of("megacpp-trainer --run-dir %s --rank %d" % (run_dir, rank))
    return found[0] if found else None
