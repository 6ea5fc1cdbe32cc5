"""Hosts on one machine for the multinode tests: one network namespace per host, each with an
`eth0` (a veth pair whose other end is on a bridge in the root namespace) and one address on a
private /24, loopback up. Root only (CAP_SYS_ADMIN and CAP_NET_ADMIN).

A set of hosts is named by its prefix ([a-z][a-z0-9]{0,7}): namespaces `<prefix>-<host>`, the
bridge `<prefix>br`, the root ends of the veths `<prefix>v<index>`, and its state directory
`$TMPDIR/megacpp-netns-<prefix>` (the hosts file, an empty resolv.conf, state.json). The /24 is
derived from the prefix and moved on while it overlaps an address or route of the root namespace,
so two runs with different prefixes never collide. The bridge holds .1 (`roothost`: the test
process and anything it starts outside the namespaces); host i holds .(10 + i). No host has a default
route and nothing is forwarded: traffic goes only to loopback and to the set's own addresses.

Contracts:
- `up` first removes a set left with the same prefix (a crashed run) and any set whose owning
  process has died; `down` is idempotent and removes every namespace, link, process left in a
  namespace and the state directory, and /run/netns itself once it is empty.
- A command in a host (`argv`, `popen`, `run`) runs under `nsenter --net` (not `ip netns exec`,
  which mounts a fresh /sys and hides /sys/fs/cgroup, fatal to slurmd) in a private UTS and mount
  namespace: its hostname is the host's name, /etc/hosts lists every host, /etc/resolv.conf is
  empty so a name lookup fails at once instead of waiting 10 s for an unreachable resolver.
- `cut` sets the host's link down; `loss` drops PCT % of the packets through the host's eth0
  in both directions with an nftables table inside its namespace (`numgen random`; this
  machine's kernel has no sch_netem); `heal` undoes both.

Command line (scripts/netns-hosts.sh runs this): up N [--prefix P] | down | cut HOST |
loss HOST PCT | heal HOST | exec HOST CMD... | show; --prefix defaults to `mnsh`.
"""
import argparse
import fcntl
import hashlib
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

NETNS_DIR = "/run/netns"
PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")
LOSS_TABLE = "megacpp_loss"
DEFAULT_CLI_PREFIX = "mnsh"


class HostsError(Exception):
    """A step of setting hosts up failed; the message names the command and its output."""


def _sh(argv, check=True, input_text=None):
    p = subprocess.run(argv, input=input_text, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise HostsError("%s: exit %d: %s" % (" ".join(argv), p.returncode, (p.stderr or p.stdout).strip()))
    return p


def state_dir(prefix):
    return os.path.join(tempfile.gettempdir(), "megacpp-netns-" + prefix)


def new_prefix():
    """A prefix for one test run: 't' and 7 random hex digits."""
    return "t" + secrets.token_hex(4)[:7]


def _proc_start(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _mentions(pid, needle):
    """Whether the process's command line or environment names `needle` (a state directory)."""
    for part in ("cmdline", "environ"):
        try:
            with open("/proc/%d/%s" % (pid, part), "rb") as f:
                if needle.encode() in f.read():
                    return True
        except OSError:
            pass
    return False


def terminate(pids, grace_s=5.0):
    """TERM, then KILL after grace_s whatever still runs; returns once every pid has exited (a
    zombie counts as exited). Blocks at most grace_s + 2 s."""
    pids = [p for p in set(pids) if p != os.getpid()]
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        for p in pids:
            try:
                os.kill(p, sig)
            except OSError:
                pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            pids = [p for p in pids if _alive(p)]
            if not pids:
                return
            time.sleep(0.02)


def _ns_pids(ns):
    p = _sh(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in p.stdout.split()] if p.returncode == 0 else []


def _root_networks():
    nets = []
    for line in _sh(["ip", "-4", "-o", "addr", "show"]).stdout.splitlines():
        m = re.search(r"inet (\S+)", line)
        if m:
            nets.append(ipaddress.ip_interface(m.group(1)).network)
    for line in _sh(["ip", "-4", "-o", "route", "show", "table", "all"]).stdout.splitlines():
        first = line.split()[0] if line.split() else ""
        if first in ("default", "broadcast", "local", "unreachable", "prohibit", "blackhole"):
            continue
        try:
            nets.append(ipaddress.ip_network(first, strict=False))
        except ValueError:
            pass
    return nets


def _choose_subnet(prefix):
    """10.A.B.0/24 with A in [100, 227] from the prefix's hash, moved on past any overlap."""
    h = int.from_bytes(hashlib.sha256(prefix.encode()).digest()[:4], "big")
    taken = _root_networks()
    for k in range(128 * 256):
        slot = (h + k) % (128 * 256)
        net = ipaddress.ip_network("10.%d.%d.0/24" % (100 + slot // 256, slot % 256))
        if not any(net.overlaps(t) for t in taken):
            return net
    raise HostsError("no free /24 in 10.100.0.0/9 for the hosts")


class Hosts:
    """Hosts as network namespaces; a context manager that brings them up and always tears them
    down. `names` are the host names (default node0..node{n-1})."""

    def __init__(self, n=2, prefix=None, names=None, owned=True):
        self.prefix = prefix or new_prefix()
        if not PREFIX_RE.match(self.prefix):
            raise HostsError("prefix %r: use 1-8 of [a-z0-9], starting with a letter" % self.prefix)
        self.names = list(names) if names else ["node%d" % i for i in range(n)]
        self.dir = state_dir(self.prefix)
        self.bridge = self.prefix + "br"
        self.owned = owned  # reaped by a later `up` once this process has died
        self.subnet = None

    # --- naming ------------------------------------------------------------------------
    def ns(self, host):
        return "%s-%s" % (self.prefix, host)

    def veth(self, host):
        return "%sv%d" % (self.prefix, self.names.index(host))

    def addr(self, host):
        return str(self.subnet.network_address + 10 + self.names.index(host))

    @property
    def bridge_addr(self):
        return str(self.subnet.network_address + 1)

    @property
    def hosts_file(self):
        return os.path.join(self.dir, "hosts")

    # --- lifetime ------------------------------------------------------------------------
    def __enter__(self):
        self._sigterm = signal.getsignal(signal.SIGTERM)
        # A test killed by ctest's timeout (SIGTERM first) still tears its hosts down.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        try:
            self.up()
        except BaseException:
            self.down()
            signal.signal(signal.SIGTERM, self._sigterm)
            raise
        return self

    def __exit__(self, *exc):
        try:
            self.down()
        finally:
            signal.signal(signal.SIGTERM, self._sigterm)
        return False

    def up(self):
        reap_stale()
        down(self.prefix)
        os.makedirs(self.dir, mode=0o755)
        os.chmod(self.dir, 0o755)  # munged (user munge) reaches its socket under it
        # Two runs' subnet choices see each other's bridge: a lock on the temp directory itself,
        # which leaves no file behind.
        lock = os.open(tempfile.gettempdir(), os.O_RDONLY)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.subnet = _choose_subnet(self.prefix)
            self._save()
            _sh(["ip", "link", "add", self.bridge, "type", "bridge"])
            _sh(["ip", "addr", "add", "%s/24" % self.bridge_addr, "dev", self.bridge])
            _sh(["ip", "link", "set", self.bridge, "up"])
        finally:
            os.close(lock)
        for h in self.names:
            ns = self.ns(h)
            _sh(["ip", "netns", "add", ns])
            _sh(["ip", "link", "add", self.veth(h), "type", "veth", "peer", "name", "eth0", "netns", ns])
            _sh(["ip", "link", "set", self.veth(h), "master", self.bridge, "up"])
            _sh(["ip", "-n", ns, "-b", "-"], input_text="addr add %s/24 dev eth0\nlink set lo up\nlink set eth0 up\n"
                % self.addr(h))
        with open(self.hosts_file, "w") as f:
            f.write("127.0.0.1 localhost\n%s roothost\n" % self.bridge_addr)
            f.writelines("%s %s\n" % (self.addr(h), h) for h in self.names)
        open(os.path.join(self.dir, "resolv.conf"), "w").close()
        return self

    def down(self):
        down(self.prefix)

    def _save(self):
        owner = {"pid": os.getpid(), "start": _proc_start(os.getpid())} if self.owned else None
        with open(os.path.join(self.dir, "state.json"), "w") as f:
            json.dump({"prefix": self.prefix, "subnet": str(self.subnet), "names": self.names, "owner": owner}, f)

    @classmethod
    def load(cls, prefix):
        """The hosts a CLI `up` (or a live test) made under prefix."""
        with open(os.path.join(state_dir(prefix), "state.json")) as f:
            st = json.load(f)
        h = cls(prefix=prefix, names=st["names"], owned=st["owner"] is not None)
        h.subnet = ipaddress.ip_network(st["subnet"])
        return h

    # --- commands in a host ----------------------------------------------------------------
    def argv(self, host, cmd):
        script = ('mount --bind "$1" /etc/hosts && mount --bind "$2" /etc/resolv.conf && '
                  'hostname "$3" && shift 3 && exec "$@"')
        return ["nsenter", "--net=%s/%s" % (NETNS_DIR, self.ns(host)), "unshare", "--uts", "--mount", "--",
                "sh", "-c", script, "sh", self.hosts_file, os.path.join(self.dir, "resolv.conf"), host] + list(cmd)

    def popen(self, host, cmd, **kw):
        return subprocess.Popen(self.argv(host, cmd), **kw)

    def run(self, host, cmd, **kw):
        return subprocess.run(self.argv(host, cmd), **kw)

    def pids(self, host):
        return _ns_pids(self.ns(host))

    def signal(self, host, sig, only=None):
        """Sends `sig` to every process of the host (those `only(pid)` accepts, when given); a
        process that exits meanwhile is skipped."""
        for pid in self.pids(host):
            if only is not None and not only(pid):
                continue
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    # --- faults ------------------------------------------------------------------------------
    def cut(self, host):
        _sh(["ip", "link", "set", self.veth(host), "down"])

    def loss(self, host, pct):
        pct = int(pct)
        if not 0 <= pct <= 100:
            raise HostsError("loss %s: PCT must be 0..100, not %d" % (host, pct))
        match = "numgen random mod 100 < %d " % pct if pct < 100 else ""
        rules = ("add table inet {t}\ndelete table inet {t}\ntable inet {t} {{\n"
                 "  chain in {{ type filter hook input priority 0; iifname \"eth0\" {m}drop; }}\n"
                 "  chain out {{ type filter hook output priority 0; oifname \"eth0\" {m}drop; }}\n}}\n"
                 ).format(t=LOSS_TABLE, m=match)
        _sh(["ip", "netns", "exec", self.ns(host), "nft", "-f", "-"], input_text=rules)

    def heal(self, host):
        _sh(["ip", "link", "set", self.veth(host), "up"])
        _sh(["ip", "netns", "exec", self.ns(host), "nft", "-f", "-"],
            input_text="add table inet {t}\ndelete table inet {t}\n".format(t=LOSS_TABLE))


def _is_mountpoint(path):
    """A bind mount of the same file system too (os.path.ismount compares devices only)."""
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == path for line in f)


def down(prefix):
    """Removes everything a set named prefix made, whether its run ended or crashed: the
    processes in its namespaces and those naming its state directory (TERM, waited for, then
    KILL), the namespaces, the links, the state directory; /run/netns once empty. Idempotent."""
    d = state_dir(prefix)
    names = [n for n in _sh(["ip", "netns", "list"], check=False).stdout.split()
             if n.startswith(prefix + "-")] if os.path.isdir(NETNS_DIR) else []
    pids = [p for ns in names for p in _ns_pids(ns)]
    if os.path.isdir(d):
        pids += [int(x) for x in os.listdir("/proc") if x.isdigit() and _mentions(int(x), d)]
    terminate(pids)
    for ns in names:
        _sh(["ip", "netns", "del", ns], check=False)
    link_re = re.compile(r"^%s(br|v\d+)$" % re.escape(prefix))
    for line in _sh(["ip", "-o", "link", "show"]).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if link_re.match(name):
            _sh(["ip", "link", "del", name], check=False)
    shutil.rmtree(d, ignore_errors=True)
    if os.path.isdir(NETNS_DIR) and not os.listdir(NETNS_DIR) and _is_mountpoint(NETNS_DIR):
        # `ip netns add` leaves this mount behind; umount refuses (EBUSY) if another run has just
        # added a namespace under it.
        if _sh(["umount", NETNS_DIR], check=False).returncode == 0:
            try:
                os.rmdir(NETNS_DIR)
            except OSError:
                pass


def reap_stale():
    """Tears down every set whose owning process has died (a test killed mid-run)."""
    base = tempfile.gettempdir()
    for entry in os.listdir(base):
        if not entry.startswith("megacpp-netns-"):
            continue
        try:
            with open(os.path.join(base, entry, "state.json")) as f:
                owner = json.load(f)["owner"]
        except (OSError, ValueError, KeyError):
            continue
        if owner and _proc_start(owner["pid"]) != owner["start"]:
            down(entry[len("megacpp-netns-"):])


def require_root():
    """The multinode tests' first call: not root is a failure with its reason (ctest -LE
    multinode leaves them out), never a silent skip."""
    if os.geteuid() != 0:
        print("multinode tests need root (network namespaces, veth pairs, a bridge, Slurm daemons): "
              "run them as root, or leave them out with `ctest -LE multinode`", file=sys.stderr)
        sys.exit(1)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="netns-hosts.sh", description="Hosts as network namespaces (root).")
    ap.add_argument("--prefix", default=DEFAULT_CLI_PREFIX)
    common = argparse.ArgumentParser(add_help=False)  # --prefix also after the command
    common.add_argument("--prefix", default=argparse.SUPPRESS)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("up", parents=[common]).add_argument("n", type=int)
    sub.add_parser("down", parents=[common])
    sub.add_parser("show", parents=[common])
    for name in ("cut", "heal"):
        sub.add_parser(name, parents=[common]).add_argument("host")
    lo = sub.add_parser("loss", parents=[common])
    lo.add_argument("host")
    lo.add_argument("pct", type=int)
    ex = sub.add_parser("exec", parents=[common])
    ex.add_argument("host")
    ex.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("netns-hosts: needs root (network namespaces, veth, bridge)", file=sys.stderr)
        return 1
    try:
        if args.cmd == "up":
            h = Hosts(args.n, prefix=args.prefix, owned=False).up()
            for name in h.names:
                print("%s %s %s" % (name, h.addr(name), h.ns(name)))
            return 0
        if args.cmd == "down":
            down(args.prefix)
            return 0
        h = Hosts.load(args.prefix)
        if args.cmd == "show":
            for name in h.names:
                print("%s %s %s" % (name, h.addr(name), h.ns(name)))
        elif args.cmd == "cut":
            h.cut(args.host)
        elif args.cmd == "heal":
            h.heal(args.host)
        elif args.cmd == "loss":
            h.loss(args.host, args.pct)
        elif args.cmd == "exec":
            os.execvp("nsenter", h.argv(args.host, args.command))
        return 0
    except FileNotFoundError:
        print("netns-hosts: no hosts under prefix %s (run `up N --prefix %s` first)" % (args.prefix, args.prefix),
              file=sys.stderr)
        return 1
    except (HostsError, ValueError) as e:
        print("netns-hosts: %s" % e, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
