"""Hosts as network namespaces (netns_hosts.py), the ground every multinode test stands on: two
hosts reach each other on their addresses and nothing else; `cut` and `loss 100` make a TCP
connect between them time out and `heal` restores it; `loss 50` drops some packets, not all; two
sets side by side do not collide; `down` leaves no namespace, link, process or file behind, also
after a run that died without tearing down. Root only (label multinode)."""
import os
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import netns_hosts  # noqa: E402
from netns_hosts import Hosts  # noqa: E402

PORT = 47001
LISTEN = ("import socket\ns = socket.socket()\ns.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
          "s.bind(('0.0.0.0', %d))\ns.listen(16)\nprint('listening', flush=True)\n"
          "while True:\n    s.accept()[0].close()\n" % PORT)
# Prints ok or the error's name; exit 0 only on a completed connect.
CONNECT = ("import socket, sys\ntry:\n    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()\n"
           "    print('ok')\nexcept OSError as e:\n    print(type(e).__name__, e.errno)\n    sys.exit(1)\n")


def leftovers(prefix):
    """What of a set named prefix the system still holds: namespaces, links, its state directory."""
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    found = [n for n in ns if n.startswith(prefix + "-")]
    found += [ln.split(":")[1].strip() for ln in links.splitlines() if ln.split(":")[1].strip().startswith(prefix)]
    if os.path.exists(netns_hosts.state_dir(prefix)):
        found.append(netns_hosts.state_dir(prefix))
    return found


class NetnsHosts(unittest.TestCase):
    def connect(self, hosts, src, dst, timeout=1.0):
        p = hosts.run(src, [sys.executable, "-c", CONNECT, hosts.addr(dst), str(PORT), str(timeout)],
                      capture_output=True, text=True, timeout=30)
        return p.stdout.strip() or p.stderr.strip()

    def wait_connect(self, hosts, src, dst, bound_s=5.0):
        deadline = time.monotonic() + bound_s
        while True:
            r = self.connect(hosts, src, dst)
            if r == "ok" or time.monotonic() > deadline:
                return r
            time.sleep(0.1)

    def ping(self, hosts, src, addr, count=1, interval="0.2"):
        p = hosts.run(src, ["ping", "-n", "-q", "-c", str(count), "-i", interval, "-W", "1", addr],
                      capture_output=True, text=True, timeout=60)
        return p

    def test_hosts_reach_each_other_and_faults_cut_and_heal(self):
        t0 = time.monotonic()
        with Hosts(2) as hosts:
            t_up = time.monotonic() - t0
            # Both ways on their addresses, and each host's name resolves to its address.
            for a, b in (("node0", "node1"), ("node1", "node0")):
                p = self.ping(hosts, a, hosts.addr(b))
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            p = hosts.run("node0", ["sh", "-c", "hostname; getent hosts node1"], capture_output=True, text=True)
            self.assertEqual(p.stdout.split()[:2], ["node0", hosts.addr("node1")], p.stdout + p.stderr)
            # Nothing outside the set: no route off the bridge's /24.
            r = hosts.run("node0", [sys.executable, "-c", CONNECT, "192.0.2.2", "22", "1"],
                          capture_output=True, text=True).stdout.strip()
            self.assertEqual(r, "OSError 101", "a host reached outside its /24: " + r)

            listener = hosts.popen("node1", [sys.executable, "-c", LISTEN], stdout=subprocess.PIPE, text=True)
            self.assertEqual(listener.stdout.readline().strip(), "listening")
            self.assertEqual(self.connect(hosts, "node0", "node1"), "ok")

            hosts.cut("node1")
            t = time.monotonic()
            r = self.connect(hosts, "node0", "node1")
            self.assertNotEqual(r, "ok", "connect through a cut link")
            self.assertIn(r.split()[0], ("TimeoutError", "OSError"), r)
            hosts.heal("node1")
            self.assertEqual(self.wait_connect(hosts, "node0", "node1"), "ok", "heal did not restore the link")
            t_cut = time.monotonic() - t

            hosts.loss("node1", 100)
            r = self.connect(hosts, "node0", "node1")
            self.assertEqual(r.split()[0], "TimeoutError", "loss 100: " + r)
            hosts.heal("node1")
            self.assertEqual(self.wait_connect(hosts, "node0", "node1"), "ok", "heal did not lift the loss")

            hosts.loss("node1", 50)  # per direction: a ping comes back 1 time in 4
            p = self.ping(hosts, "node0", hosts.addr("node1"), count=40, interval="0.01")
            got = int(p.stdout.split(" received")[0].rsplit(",", 1)[1])
            self.assertTrue(0 < got < 40, p.stdout)
            hosts.heal("node1")

            prefix = hosts.prefix
            t = time.monotonic()
        t_down = time.monotonic() - t
        self.assertIsNotNone(listener.poll(), "the listener outlived its host")
        listener.stdout.close()
        self.assertEqual(leftovers(prefix), [])
        print("up %.2f s, cut+heal %.2f s, down %.2f s" % (t_up, t_cut, t_down))

    def test_two_sets_side_by_side(self):
        with Hosts(2) as a, Hosts(2) as b:
            self.assertNotEqual(a.subnet, b.subnet)
            for h in (a, b):
                p = self.ping(h, "node0", h.addr("node1"))
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            # One set's hosts do not reach the other's.
            p = self.ping(a, "node0", b.addr("node1"))
            self.assertNotEqual(p.returncode, 0, "set %s reached set %s" % (a.prefix, b.prefix))

    def test_down_after_a_crashed_run(self):
        # A run killed with its hosts up (SIGKILL: no teardown), with a process left in a host.
        code = ("import sys, time; sys.path.insert(0, %r); from netns_hosts import Hosts\n"
                "h = Hosts(2).up(); h.popen('node1', ['sleep', '600'])\n"
                "print(h.prefix, flush=True); time.sleep(600)\n" % os.path.dirname(os.path.abspath(__file__)))
        crashed = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            prefix = crashed.stdout.readline().strip()
            self.assertTrue(prefix, "the crashing run did not bring its hosts up")
            sleeper = None
            deadline = time.monotonic() + 10
            while sleeper is None and time.monotonic() < deadline:
                for pid in netns_hosts._ns_pids(prefix + "-node1"):
                    try:
                        with open("/proc/%d/comm" % pid) as f:
                            if f.read().strip() == "sleep":
                                sleeper = pid
                    except OSError:
                        pass  # a set-up step (mount, hostname) that has just exited
                time.sleep(0.02)
            self.assertIsNotNone(sleeper, "no process in the crashed run's host")
        finally:
            crashed.kill()
            crashed.wait()
            crashed.stdout.close()
        self.assertNotEqual(leftovers(prefix), [])
        # Any later set's `up` reaps it: its owner is dead.
        with Hosts(2):
            self.assertEqual(leftovers(prefix), [])
            self.assertFalse(netns_hosts._alive(sleeper), "a process outlived its host")
        # And `down` with the prefix is idempotent.
        netns_hosts.down(prefix)
        self.assertEqual(leftovers(prefix), [])


if __name__ == "__main__":
    netns_hosts.require_root()
    unittest.main()
