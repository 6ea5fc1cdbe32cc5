"""Integration: a real Prometheus scrapes a real `megacpp run` (README.md "Metrics").

Starts `megacpp run tiny --ranks 2` with /metrics on an ephemeral loopback port, points a
Prometheus at the endpoint the supervisor wrote to launch.json (scrape every 1 s), waits until
every stage reads megacpp_stage_up 1, checks the live text with `promtool check metrics`, kills
trainer-1 with SIGKILL and waits until Prometheus sees megacpp_stage_up{stage="trainer",rank="1"}
at 0 (the supervisor keeps serving for --metrics-linger-s after teardown). Only loopback
addresses; every wait is bounded; every process started here is cleaned up in `finally`.

Exit status: 0 pass, 1 fail, 77 skipped (prometheus / promtool not installed).
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

MEGACPP = os.environ.get("MEGACPP_BIN", "")
STAGES = ["checkpointer-0", "collector-0", "data_loader-0", "trainer-0", "trainer-1"]
LINGER_S = 15


class Failure(Exception):
    pass


def log(msg):
    sys.stderr.write(f"[prometheus_scrape] {msg}\n")
    sys.stderr.flush()


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, timeout=5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.headers, r.read().decode()


def wait_for(what, predicate, timeout_s, interval_s=0.25, alive=None):
    """Polls predicate() until it returns a truthy value; raises Failure after timeout_s."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        if alive is not None:
            alive()
        try:
            last = predicate()
        except (OSError, ValueError, KeyError) as e:  # not up yet / not written yet
            last = e
        if last and not isinstance(last, Exception):
            return last
        time.sleep(interval_s)
    raise Failure(f"timed out after {timeout_s} s waiting for {what}; last: {last!r}")


def stage_pids(run_dir):
    """pid -> argv of the stage processes of this run (found through /proc, not by name)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        argv = [a.decode(errors="replace") for a in argv if a]
        if len(argv) >= 3 and os.path.basename(argv[0]).startswith("megacpp-") and \
                "--run-dir" in argv and argv[argv.index("--run-dir") + 1] == run_dir:
            out[int(entry)] = argv
    return out


def trainer_pid(run_dir, rank):
    for pid, argv in stage_pids(run_dir).items():
        if os.path.basename(argv[0]) == "megacpp-trainer" and "--rank" in argv and \
                argv[argv.index("--rank") + 1] == str(rank):
            return pid
    return None


def stop(proc, name, grace_s=10):
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        log(f"{name} ignored SIGTERM for {grace_s} s; SIGKILL")
        proc.kill()
        proc.wait(timeout=grace_s)


def tail(path, n=3000):
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return "(none)"


def main():
    prometheus = shutil.which("prometheus") or ("/usr/bin/prometheus" if os.path.exists("/usr/bin/prometheus") else None)
    promtool = shutil.which("promtool") or ("/usr/bin/promtool" if os.path.exists("/usr/bin/promtool") else None)
    if prometheus is None or promtool is None:
        print("SKIP: prometheus/promtool not installed (Debian package prometheus)")
        return 77
    if not MEGACPP or not os.access(MEGACPP, os.X_OK):
        raise Failure(f"MEGACPP_BIN={MEGACPP!r} is not an executable")

    tmp = tempfile.mkdtemp(prefix="megacpp-prom-")
    run_dir = os.path.join(tmp, "run")
    megacpp = prom = None
    megacpp_log = os.path.join(tmp, "megacpp.log")
    prom_log = os.path.join(tmp, "prometheus.log")
    ok = False
    try:
        with open(megacpp_log, "wb") as out:
            megacpp = subprocess.Popen(
                [MEGACPP, "run", "tiny", "--ranks", "2", "--steps", "400", "--run-dir", run_dir,
                 "--metrics-addr", "127.0.0.1:0", "--metrics-linger-s", str(LINGER_S),
                 "--progress", "none"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

        def megacpp_alive():
            if megacpp.poll() is not None:
                raise Failure(f"megacpp exited early with {megacpp.returncode}:\n{tail(megacpp_log)}")

        def endpoint():
            with open(os.path.join(run_dir, "launch.json")) as f:
                return json.load(f).get("metricsEndpoint")

        url = wait_for("launch.json metricsEndpoint", endpoint, 60, alive=megacpp_alive)
        log(f"endpoint {url}")
        target = urllib.parse.urlparse(url)
        if target.hostname != "127.0.0.1" or target.path != "/metrics" or not target.port:
            raise Failure(f"unexpected metricsEndpoint {url!r}")

        # The live text: exact content type, and promtool has nothing to say about it.
        status, headers, body = http_get(url)
        if status != 200 or headers.get("Content-Type") != "text/plain; version=0.0.4; charset=utf-8":
            raise Failure(f"GET {url}: {status} {headers.get('Content-Type')!r}")
        check = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True,
                               text=True, timeout=30)
        if check.returncode != 0 or check.stdout or check.stderr:
            raise Failure(f"promtool check metrics: rc {check.returncode}\n{check.stdout}{check.stderr}\n"
                          f"--- text ---\n{body}")

        prom_port = free_port()
        config = os.path.join(tmp, "prometheus.yml")
        with open(config, "w") as f:
            f.write("global:\n"
                    "  scrape_interval: 1s\n"
                    "  scrape_timeout: 1s\n"
                    "  evaluation_interval: 1m\n"
                    "scrape_configs:\n"
                    "  - job_name: megacpp\n"
                    f"    metrics_path: {target.path}\n"
                    "    static_configs:\n"
                    f"      - targets: ['127.0.0.1:{target.port}']\n")
        api = f"http://127.0.0.1:{prom_port}"
        with open(prom_log, "wb") as out:
            prom = subprocess.Popen(
                [prometheus, f"--config.file={config}", f"--storage.tsdb.path={os.path.join(tmp, 'tsdb')}",
                 f"--web.listen-address=127.0.0.1:{prom_port}"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

        def prom_alive():
            if prom.poll() is not None:
                raise Failure(f"prometheus exited with {prom.returncode}:\n{tail(prom_log)}")

        def query(expr):
            _, _, text = http_get(f"{api}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
            reply = json.loads(text)
            if reply.get("status") != "success":
                raise ValueError(reply)
            return reply["data"]["result"]

        def stage_up():
            return {f'{r["metric"]["stage"]}-{r["metric"]["rank"]}': r["value"][1]
                    for r in query("megacpp_stage_up")}

        def both_alive():
            megacpp_alive()
            prom_alive()

        wait_for("prometheus ready", lambda: http_get(f"{api}/-/ready")[0] == 200, 30, alive=prom_alive)
        seen = {}

        def all_up():
            seen.update(stage_up())
            return all(seen.get(s) == "1" for s in STAGES)

        wait_for(f"megacpp_stage_up == 1 for {STAGES} (seen {seen})", all_up, 30, alive=both_alive)
        log(f"all stages up: {seen}")
        if [r["value"][1] for r in query('up{job="megacpp"}')] != ["1"]:
            raise Failure("Prometheus does not report the megacpp target up")
        if not query('megacpp_build_info == 1'):
            raise Failure("megacpp_build_info missing")

        pid = trainer_pid(run_dir, 1)
        if pid is None:
            raise Failure(f"no trainer-1 process for {run_dir}: {stage_pids(run_dir)}")
        log(f"SIGKILL trainer-1 (pid {pid})")
        os.kill(pid, signal.SIGKILL)

        def trainer1_down():
            up = stage_up()
            return up.get("trainer-1") == "0" and up

        up = wait_for('megacpp_stage_up{stage="trainer",rank="1"} == 0', trainer1_down, 30,
                      alive=prom_alive)
        log(f"after the kill: {up}")
        exits = query('megacpp_stage_exits_total{stage="trainer",reason="signaled"}')
        if not exits or float(exits[0]["value"][1]) < 1:
            # The scrape that saw up=0 may predate the exit counter by one scrape.
            wait_for('megacpp_stage_exits_total{stage="trainer",reason="signaled"} >= 1',
                     lambda: query('megacpp_stage_exits_total{stage="trainer",reason="signaled"} >= 1'),
                     10, alive=prom_alive)

        stop(prom, "prometheus")
        try:
            rc = megacpp.wait(timeout=LINGER_S + 60)
        except subprocess.TimeoutExpired:
            raise Failure(f"megacpp still running {LINGER_S + 60} s after the kill:\n{tail(megacpp_log)}")
        if rc == 0:
            raise Failure(f"megacpp exited 0 after trainer-1 was killed:\n{tail(megacpp_log)}")
        log(f"megacpp exited {rc}")
        left = stage_pids(run_dir)
        if left:
            raise Failure(f"stage processes outlived the run: {left}")
        ok = True
        return 0
    finally:
        stop(prom, "prometheus")
        stop(megacpp, "megacpp", grace_s=LINGER_S + 15)
        for pid in stage_pids(run_dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not ok:
            log(f"megacpp output:\n{tail(megacpp_log)}")
            log(f"prometheus output:\n{tail(prom_log, 1500)}")
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Failure as e:
        log(f"FAIL: {e}")
        sys.exit(1)
