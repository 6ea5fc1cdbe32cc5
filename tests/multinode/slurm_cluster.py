"""A real Slurm cluster on one machine for the multinode tests (Debian's slurmctld, slurmd and
munge; root only): N hosts node0..node{N-1} of netns_hosts.py, one slurmd in each, slurmctld in
a host of its own (`ctl`, so two clusters on one machine never share a port), one munged for the
cluster with a key generated for it. The recipe and its pitfalls: shared/notes/
slurm-on-one-machine.md and DESIGN.md "Hosts on one machine".

Every file the cluster writes is under its hosts' state directory
($TMPDIR/megacpp-netns-<prefix>/slurm: slurm.conf, the munge key, sockets, spool, state, pid and
log files); clients find it through SLURM_CONF (`env()`), nothing under /etc is read or written.
The packages' own installation wrote /etc/munge/munge.key and /var/{lib,log}/{munge,slurm},
which the cluster does not use.

Contracts: `up` returns once `sinfo` shows every node idle (bounded: SlurmError after
UP_BOUND_S, with the daemons' logs' tails); `down` kills every daemon it started (slurmctld,
each slurmd with its steps and tasks, munged), waits for them to exit, then removes the hosts.
Clients (`srun`, `sbatch`, `sinfo`, `scontrol`) run in the root namespace, or inside a node.

Command line (scripts/slurm-cluster.sh runs this): up N [--prefix P] | down [--prefix P] |
env [--prefix P] (the SLURM_CONF line to export); --prefix defaults to `mnslurm`.
"""
import argparse
import os
import pwd
import shutil
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import netns_hosts  # noqa: E402
from netns_hosts import Hosts  # noqa: E402

UP_BOUND_S = 30.0
SLURMCTLD_PORT = 6817  # the default; its own namespace, so never shared
DEFAULT_CLI_PREFIX = "mnslurm"
BINARIES = ("slurmctld", "slurmd", "srun", "sbatch", "sinfo", "scontrol", "munged", "mungekey")

SLURM_CONF = """\
ClusterName=megacpp
SlurmctldHost=ctl({ctl_addr})
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmdPidFile={d}/run/slurmd-%n.pid
SlurmdLogFile={d}/log/slurmd-%n.log
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmctldLogFile={d}/log/slurmctld.log
PlugStackConfig={d}/plugstack.conf
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout=10
MessageTimeout=10
InactiveLimit=0
KillWait=5
MinJobAge=30
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class SlurmError(Exception):
    """The cluster did not come up; the message carries what the daemons logged."""


def missing_binaries():
    return [b for b in BINARIES if shutil.which(b) is None and not os.path.exists("/usr/sbin/" + b)]


def require_slurm():
    """The Slurm tests' check after require_root: the packages scripts/setup.sh installs."""
    missing = missing_binaries()
    if missing:
        print("the Slurm tests need Debian's slurmctld, slurmd, slurm-client and munge (missing: %s): "
              "run `bash scripts/setup.sh`" % " ".join(missing), file=sys.stderr)
        sys.exit(1)


class SlurmCluster:
    """N nodes; a context manager that brings the cluster up and always tears it down."""

    def __init__(self, n=2, prefix=None, owned=True, cpus=2):
        self.nodes = ["node%d" % i for i in range(n)]
        self.hosts = Hosts(prefix=prefix, names=["ctl"] + self.nodes, owned=owned)
        self.cpus = cpus
        self.procs = []

    @property
    def dir(self):
        return os.path.join(self.hosts.dir, "slurm")

    @property
    def conf(self):
        return os.path.join(self.dir, "slurm.conf")

    def env(self, extra=None):
        e = dict(os.environ)
        e["SLURM_CONF"] = self.conf
        e.update(extra or {})
        return e

    def run(self, argv, **kw):
        """A client command in the root namespace (srun, sbatch, sinfo, scontrol ...)."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        kw.setdefault("timeout", 60)
        return subprocess.run(argv, env=self.env(kw.pop("env", None)), **kw)

    def __enter__(self):
        self.hosts.__enter__()
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        try:
            self.hosts.__exit__(*exc)
        finally:
            self._reap()
        return False

    def up(self):
        self.hosts.up()
        try:
            self._start()
        except BaseException:
            self.down()
            raise
        return self

    def down(self):
        """Every daemon started here (and what runs in its nodes) gone, then the hosts: the
        hosts' teardown TERMs, waits for and KILLs what runs in the namespaces and munged."""
        self.hosts.down()
        self._reap()

    def _reap(self):
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []

    def _start(self):
        d = self.dir
        munge = pwd.getpwnam("munge")
        for sub in ("state", "spool", "run", "log", "munge-key", "munge-run"):
            os.makedirs(os.path.join(d, sub), exist_ok=True)
        os.chmod(d, 0o755)
        # munged refuses a socket directory others cannot traverse and a key others can read.
        key_dir, run_dir = os.path.join(d, "munge-key"), os.path.join(d, "munge-run")
        key = os.path.join(key_dir, "munge.key")
        subprocess.run(["mungekey", "-c", "-k", key], check=True, capture_output=True)
        for path, mode in ((key_dir, 0o700), (run_dir, 0o755), (key, 0o400)):
            os.chown(path, munge.pw_uid, munge.pw_gid)
            os.chmod(path, mode)
        self.munge_socket = os.path.join(run_dir, "munge.socket.2")
        with open(os.path.join(d, "plugstack.conf"), "w"):
            pass  # Debian's /etc/slurm/plugstack.conf is not read
        nodes = "\n".join("NodeName=%s NodeAddr=%s NodeHostname=%s CPUs=%d RealMemory=1000 State=UNKNOWN"
                          % (n, self.hosts.addr(n), n, self.cpus) for n in self.nodes)
        with open(self.conf, "w") as f:
            f.write(SLURM_CONF.format(d=d, ctl_addr=self.hosts.addr("ctl"), munge_socket=self.munge_socket,
                                      nodes=nodes, ctld_port=SLURMCTLD_PORT))

        def log(name):
            return open(os.path.join(d, "log", name + ".out"), "w")

        with log("munged") as out:
            self.procs.append(subprocess.Popen(
                ["munged", "-F", "-S", self.munge_socket, "--key-file=" + key,
                 "--pid-file=" + os.path.join(run_dir, "munged.pid"),
                 "--log-file=" + os.path.join(run_dir, "munged.log"),
                 "--seed-file=" + os.path.join(run_dir, "munged.seed")],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                user=munge.pw_uid, group=munge.pw_gid, extra_groups=[]))
        self._wait(lambda: os.path.exists(self.munge_socket), 10, "munged's socket")
        env = self.env()
        with log("slurmctld") as out:
            self.procs.append(self.hosts.popen("ctl", ["slurmctld", "-D", "-c"], env=env, stdout=out,
                                               stderr=subprocess.STDOUT, start_new_session=True))
        # A slurmd (and sinfo) that finds slurmctld not yet listening retries a second later:
        # the nodes start once its port accepts.
        self._wait(self._ctld_listens, UP_BOUND_S, "slurmctld listening")
        for n in self.nodes:
            with log("slurmd-" + n) as out:
                self.procs.append(self.hosts.popen(n, ["slurmd", "-D", "-N", n], env=env, stdout=out,
                                                   stderr=subprocess.STDOUT, start_new_session=True))
        self._wait(self.all_idle, UP_BOUND_S, "every node idle in sinfo")

    def _ctld_listens(self):
        try:
            socket.create_connection((self.hosts.addr("ctl"), SLURMCTLD_PORT), timeout=0.5).close()
            return True
        except OSError:
            return False

    def wait_job(self, job_id, bound_s=120.0):
        """The job's final JobState (COMPLETED, FAILED, CANCELLED ...), polled every 50 ms;
        SlurmError when it is still pending or running after bound_s."""
        deadline = time.monotonic() + bound_s
        while time.monotonic() < deadline:
            p = self.run(["scontrol", "show", "job", "-o", job_id], timeout=10)
            state = next((f.split("=", 1)[1] for f in p.stdout.split() if f.startswith("JobState=")), "")
            if state and state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED"):
                return state
            time.sleep(0.05)
        raise SlurmError("Slurm cluster %s: job %s still %s after %.0f s" % (self.hosts.prefix, job_id, state, bound_s))

    def node_states(self):
        p = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=10)
        return dict(line.split() for line in p.stdout.splitlines() if len(line.split()) == 2)

    def all_idle(self):
        states = self.node_states()
        return sorted(states) == sorted(self.nodes) and set(states.values()) == {"idle"}

    def _wait(self, ready, bound_s, what):
        deadline = time.monotonic() + bound_s
        while time.monotonic() < deadline:
            if ready():
                return
            dead = [p for p in self.procs if p.poll() is not None]
            if dead:
                break
            time.sleep(0.05)
        tails = []
        for name in sorted(os.listdir(os.path.join(self.dir, "log"))):
            with open(os.path.join(self.dir, "log", name), errors="replace") as f:
                tails.append("--- %s\n%s" % (name, "".join(f.readlines()[-8:])))
        raise SlurmError("Slurm cluster %s: no %s within %.0f s\n%s"
                         % (self.hosts.prefix, what, bound_s, "\n".join(tails)))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="slurm-cluster.sh", description="A Slurm cluster of namespace nodes (root).")
    ap.add_argument("--prefix", default=DEFAULT_CLI_PREFIX)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--prefix", default=argparse.SUPPRESS)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("up", parents=[common]).add_argument("n", type=int)
    sub.add_parser("down", parents=[common])
    sub.add_parser("env", parents=[common])
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("slurm-cluster: needs root (network namespaces, Slurm and munge daemons)", file=sys.stderr)
        return 1
    if args.cmd == "down":
        netns_hosts.down(args.prefix)
        return 0
    c = SlurmCluster(prefix=args.prefix, owned=False)
    if args.cmd == "env":
        print("export SLURM_CONF=%s" % c.conf)
        return 0
    if missing_binaries():
        print("slurm-cluster: missing %s: run `bash scripts/setup.sh`" % " ".join(missing_binaries()), file=sys.stderr)
        return 1
    c = SlurmCluster(args.n, prefix=args.prefix, owned=False)
    t0 = time.monotonic()
    try:
        c.up()
    except (SlurmError, netns_hosts.HostsError) as e:
        print("slurm-cluster: %s" % e, file=sys.stderr)
        return 1
    print("slurm-cluster: %d nodes idle in %.2f s; export SLURM_CONF=%s" % (args.n, time.monotonic() - t0, c.conf))
    return 0


if __name__ == "__main__":
    sys.exit(main())
