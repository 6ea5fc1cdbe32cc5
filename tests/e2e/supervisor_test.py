"""Supervisor contracts on real runs: what a run exposes to the network, what `megacpp status`
may remove when it reconciles an orphan, that no process the supervisor cannot reap makes
`megacpp run` wait forever, and what the manifest claims about a death's detection time.
"""
import glob
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

MEGACPP = os.environ["MEGACPP_BIN"]


def pids_of(pattern):
    p = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return [int(x) for x in p.stdout.split()]


def listening_sockets():
    """{socket inode: (address, port)} of every TCP listener in this network namespace."""
    out = {}
    for path, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            with open(path) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != "0A":  # TCP_LISTEN
                continue
            hexaddr, hexport = f[1].split(":")
            raw = bytes.fromhex(hexaddr)
            # /proc prints the address as host-order 32-bit words.
            words = [raw[i:i + 4][::-1] for i in range(0, len(raw), 4)]
            addr = b"".join(words)
            if v6:
                text = str(ipaddress.IPv6Address(addr))
            else:
                text = ".".join(str(b) for b in addr)
            out[int(f[9])] = (text, int(hexport, 16))
    return out


def socket_inodes(pid):
    inodes = set()
    for fd in glob.glob("/proc/%d/fd/*" % pid):
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:["):-1]))
    return inodes


class Run:
    def __init__(self, tmp, steps=400, extra=(), env=None):
        self.dir = os.path.join(tmp, "run")
        e = dict(os.environ)
        e.update(env or {})
        self.proc = subprocess.Popen(
            [MEGACPP, "run", "tiny", "--ranks", "2", "--steps", str(steps), "--run-dir", self.dir,
             "--data-dir", os.path.join(tmp, "data"), "--progress", "none"] + list(extra),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=e)
        self.out = ""

    def launch(self):
        deadline = time.monotonic() + 60
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

    def finish(self, timeout):
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


class SupervisorTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="megacpp-sup-")

    def tearDown(self):
        for p in pids_of(self.tmp):
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_nothing_listens_outside_loopback(self):
        run = Run(self.tmp)
        launch = run.launch()
        run.wait_steps(2)
        tree = [run.proc.pid] + pids_of(run.dir)
        listeners = listening_sockets()
        mine = {}
        for pid in tree:
            for inode in socket_inodes(pid):
                if inode in listeners:
                    mine[inode] = (pid,) + listeners[inode]
        # The TCPStore (launch.json's storePort) and /metrics listen at least; Gloo may too.
        ports = {port for _, _, port in mine.values()}
        self.assertIn(launch["storePort"], ports, mine)
        for pid, addr, port in mine.values():
            self.assertIn(addr, ("127.0.0.1", "::1"),
                          "pid %d listens on %s:%d, reachable from the network" % (pid, addr, port))
        run.proc.send_signal(signal.SIGTERM)
        self.assertEqual(run.finish(60), 1)


if __name__ == "__main__":
    unittest.main(verbosity=2)
