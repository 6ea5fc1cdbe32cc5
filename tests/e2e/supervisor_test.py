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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from run_harness import MEGACPP, Run, pids_of  # noqa: E402


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
        run = Run(self.tmp, steps=400)
        launch = run.launch()
        # The revision comes from a bounded `git` child (capture_output), not popen/pclose.
        self.assertRegex(launch["provenance"]["gitRevision"], r"^[0-9a-f]{40}$")
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
        # SIGTERM is a graceful stop: the step in flight is checkpointed, exit 128 + 15.
        run.proc.send_signal(signal.SIGTERM)
        self.assertEqual(run.finish(60), 143)


    def test_killed_supervisor_with_a_private_socket_dir(self):
        # A run directory too deep for ipc:// paths: the sockets live in /tmp/megacpp-XXXXXX.
        deep = os.path.join(self.tmp, *(["d" * 40] * 3))
        os.makedirs(deep)
        run = Run(deep, steps=400)
        launch = run.launch()
        self.assertTrue(launch["sockDir"].startswith("/tmp/megacpp-"), launch["sockDir"])
        self.assertEqual(launch["shmPrefix"], "/megacpp-%s-g0-" % launch["runId"])
        run.wait_steps(2)
        os.kill(run.proc.pid, signal.SIGKILL)
        run.proc.wait()
        deadline = time.monotonic() + 5
        while pids_of(run.dir) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertEqual(pids_of(run.dir), [], "stages outlived the supervisor")
        self.assertTrue(glob.glob("/dev/shm" + launch["shmPrefix"] + "*"))
        self.status_orphaned(run.dir)
        self.assertEqual(glob.glob("/dev/shm" + launch["shmPrefix"] + "*"), [])
        self.assertFalse(os.path.exists(launch["sockDir"]), launch["sockDir"])

    def test_unkillable_process_is_named_and_the_run_ends(self):
        # MEGACPP_TEST_UNKILLABLE makes the supervisor's teardown signals to the data loader
        # no-ops: to the supervisor it survives SIGTERM and SIGKILL like a process in
        # uninterruptible sleep, and no exit of it ever arrives (its loop runs until told to
        # stop). Every wait for it must be bounded. PR_SET_PDEATHSIG ends it once the
        # supervisor has exited.
        grace = 0.5
        run = Run(self.tmp, steps=400, extra=["--teardown-grace-s", str(grace)],
                  env={"MEGACPP_TEST_UNKILLABLE": "data_loader-0",
                       "MEGACPP_FAULT": "trainer:1:backward:3:throw"})
        launch = run.launch()
        t0 = time.monotonic()
        self.assertEqual(run.finish(timeout=90), 1)
        self.assertLess(time.monotonic() - t0, 60)
        m = run.manifest()
        self.assertEqual(m["state"], "error")
        self.assertEqual((m["error"]["kind"], m["error"]["stage"], m["error"]["rank"]),
                         ("exception", "trainer", 1), m["error"])
        states = {"%s-%d" % (s["stage"], s["rank"]): s["state"] for s in m["stages"]}
        self.assertEqual(states["dataLoader-0"], "unkillable", states)
        self.assertEqual([n for n, st in states.items() if st == "unkillable"], ["dataLoader-0"])
        self.assertIn("data_loader-0", run.out)
        self.assertIn("unkillable", run.out)
        # What the supervisor owns is still released.
        self.assertEqual(glob.glob("/dev/shm" + launch["shmPrefix"] + "*"), [])
        self.assertFalse(os.path.exists(launch["sockDir"]))

    def test_detection_of_a_death_is_not_claimed(self):
        # No kernel interface gives an unprivileged parent the time a child exited; the reap
        # time is all the supervisor has, so a death's detection delay is marked not measured
        # rather than reported as a measured 0.
        run = Run(self.tmp, steps=400)
        run.wait_steps(2)
        os.kill(run.pid("trainer", 1), signal.SIGKILL)
        self.assertEqual(run.finish(60), 1)
        e = run.manifest()["error"]
        self.assertEqual((e["kind"], e["stage"], e["rank"]), ("signaled", "trainer", 1), e)
        self.assertIs(e["detectionMeasured"], False, e)
        self.assertEqual(e["detectionSeconds"], 0, e)
        self.assertIn("detection delay not measured", run.out)
        s = subprocess.run([MEGACPP, "status", run.dir], capture_output=True, text=True, timeout=60)
        self.assertIn("detection delay not measured", s.stdout)

    def test_detection_of_a_silence_is_measured_and_collectives_aborted(self):
        # Rank 1 stopped, rank 0 waits on it in a collective. Before any signal the teardown
        # asks rank 0 (not the stopped rank 1, which cannot answer) to abort its group; rank 0
        # answers from its control thread although its own thread is stuck in the collective.
        run = Run(self.tmp, steps=400, extra=["--heartbeat-timeout-s", "2", "--hang-budget-s", "2"])
        run.wait_steps(2)
        victim = run.pid("trainer", 1)
        os.kill(victim, signal.SIGSTOP)
        try:
            self.assertEqual(run.finish(60), 1)
        finally:
            try:
                os.kill(victim, signal.SIGKILL)
            except OSError:
                pass
        e = run.manifest()["error"]
        self.assertEqual((e["kind"], e["stage"], e["rank"]), ("heartbeat_lost", "trainer", 1), e)
        self.assertIs(e["detectionMeasured"], True, e)
        self.assertGreaterEqual(e["detectionSeconds"], 2.0, e)
        aborted = e.get("collectivesAborted", [])
        self.assertEqual([a["rank"] for a in aborted], [0], e)
        self.assertIs(aborted[0]["answered"], True, aborted)
        self.assertIs(aborted[0]["hadGroup"], True, aborted)
        self.assertIs(aborted[0].get("ok"), True, aborted)
        self.assertGreaterEqual(aborted[0]["replySeconds"], 0, aborted)
        self.assertIn("collectives of rank(s) 0 aborted before any signal", run.out)

    # --- orphan reconciliation trusts nothing in launch.json ------------------------------
    RUN_ID = "2026-01-02T03-04-05-a1b2c3"

    def orphan(self, **launch):
        """A run directory whose supervisor is gone and whose journal never finished."""
        run_dir = os.path.join(self.tmp, "run")
        os.makedirs(os.path.join(run_dir, "journal"))
        gone = subprocess.Popen(["true"])
        gone.wait()
        contract = {"schemaVersion": 1, "runId": self.RUN_ID, "world": 2, "steps": 10,
                    "runDir": run_dir, "supervisorPid": gone.pid, "supervisorStartTicks": "1"}
        contract.update(launch)
        with open(os.path.join(run_dir, "launch.json"), "w") as f:
            json.dump(contract, f)
        return run_dir

    def shm(self, name):
        path = "/dev/shm/" + name
        with open(path, "w") as f:
            f.write("canary")
        self.addCleanup(lambda: os.path.exists(path) and os.unlink(path))
        return path

    def status_orphaned(self, run_dir):
        s = subprocess.run([MEGACPP, "status", run_dir], capture_output=True, text=True, timeout=60)
        self.assertEqual(s.returncode, 0, s.stderr)
        self.assertIn("orphaned", s.stdout)
        with open(os.path.join(run_dir, "manifest.json")) as f:
            self.assertEqual(json.load(f)["state"], "orphaned")
        return s

    def test_hostile_launch_contract_touches_nothing_of_others(self):
        tag = os.urandom(4).hex()
        # Another run's segment, and one any prefix-of-a-name match would catch. The hostile
        # prefix is the canary's own rather than "/": were the defect back, "/" would unlink
        # every segment of this user, concurrent runs' included.
        canary = self.shm("megacpp-canary-%s-ring-0" % tag)
        own = self.shm("megacpp-%s-g0-ring-0" % self.RUN_ID)
        elsewhere = os.path.join(self.tmp, "precious")
        os.makedirs(elsewhere)
        with open(os.path.join(elsewhere, "keep"), "w") as f:
            f.write("canary")
        run_dir = self.orphan(shmPrefix="/megacpp-canary-%s-" % tag, sockDir=elsewhere)
        self.status_orphaned(run_dir)
        self.assertTrue(os.path.exists(canary), "an unrelated shm segment was unlinked")
        self.assertTrue(os.path.exists(os.path.join(elsewhere, "keep")),
                        "a directory outside the run was deleted")
        self.assertFalse(os.path.exists(own), "the run's own segment (from its id) was left")

    def test_hostile_run_id_removes_no_segment(self):
        canary = self.shm("megacpp-canary-%s" % os.urandom(4).hex())
        run_dir = self.orphan(runId="/../canary", shmPrefix="/megacpp-canary-")
        self.status_orphaned(run_dir)
        self.assertTrue(os.path.exists(canary))

    def private_sock_dir(self, marker):
        d = "/tmp/megacpp-" + os.urandom(3).hex()
        os.mkdir(d, 0o700)
        self.addCleanup(shutil.rmtree, d, True)
        if marker is not None:
            with open(os.path.join(d, "run-id"), "w") as f:
                f.write(marker)
        open(os.path.join(d, "control"), "w").close()
        return d

    def test_private_socket_dir_removed_only_when_it_names_the_run(self):
        theirs = self.private_sock_dir("2026-01-02T03-04-05-ffffff")
        run_dir = self.orphan(shmPrefix="/megacpp-%s-g0-" % self.RUN_ID, sockDir=theirs)
        self.status_orphaned(run_dir)
        self.assertTrue(os.path.exists(os.path.join(theirs, "control")),
                        "another run's socket directory was removed")
        shutil.rmtree(os.path.join(self.tmp, "run"))
        ours = self.private_sock_dir(self.RUN_ID)
        run_dir = self.orphan(shmPrefix="/megacpp-%s-g0-" % self.RUN_ID, sockDir=ours)
        self.status_orphaned(run_dir)
        self.assertFalse(os.path.exists(ours), "the run's own socket directory was left")

    def test_own_socket_dir_in_the_run_is_removed(self):
        run_dir = self.orphan(shmPrefix="/megacpp-%s-g0-" % self.RUN_ID)
        os.mkdir(os.path.join(run_dir, "sock"), 0o700)
        open(os.path.join(run_dir, "sock", "control"), "w").close()
        with open(os.path.join(run_dir, "launch.json")) as f:
            contract = json.load(f)
        contract["sockDir"] = os.path.join(run_dir, "sock")
        with open(os.path.join(run_dir, "launch.json"), "w") as f:
            json.dump(contract, f)
        self.status_orphaned(run_dir)
        self.assertFalse(os.path.exists(os.path.join(run_dir, "sock")))


if __name__ == "__main__":
    unittest.main(verbosity=2)
