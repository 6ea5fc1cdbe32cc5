"""End-to-end: every committed run fixture collects to its expected manifest and receipts,
byte for byte, for every run format version ever committed (tests/fixtures/runs/v<N>/).

A fixture is a real run reduced to what `megacpp collect` reads (launch.json, journal/,
failures/, attempts/) with expected/ as the collector of its version folded it
(tests/fixtures/make_run_fixtures.py). Each case is copied to a fresh directory and collected
twice: both passes must write exactly the expected bytes. A run of a newer format than this
build reads is refused by name, in one line, with nothing written.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
import run_harness  # noqa: E402

FIXTURES = os.path.join(HERE, "..", "fixtures", "runs")


def cases():
    for version in sorted(os.listdir(FIXTURES)):
        for name in sorted(os.listdir(os.path.join(FIXTURES, version))):
            yield version, name, os.path.join(FIXTURES, version, name)


class Fixtures(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="megacpp-fixtures-")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_every_fixture_collects_byte_for_byte(self):
        seen = set()
        for version, name, src in cases():
            with self.subTest(version=version, case=name):
                seen.add(name)
                d = os.path.join(self.tmp, version, name)
                shutil.copytree(src, d, ignore=shutil.ignore_patterns("expected"))
                expected = os.path.join(src, "expected")
                wanted = [os.path.relpath(os.path.join(root, f), expected)
                          for root, _, files in os.walk(expected) for f in files]
                for n in range(2):
                    p = run_harness.megacpp(["collect", d])
                    self.assertEqual(p.returncode, 0, p.stderr)
                    for rel in wanted:
                        with open(os.path.join(expected, rel), "rb") as f, \
                                open(os.path.join(d, rel), "rb") as g:
                            self.assertEqual(g.read(), f.read(), "%s/%s pass %d: %s differs"
                                             % (version, name, n + 1, rel))
        for name in ("ok", "failed", "interrupted", "orphaned", "restarts", "resumed"):
            self.assertIn(name, seen)

    def test_collect_all_folds_every_run_and_names_the_ones_it_cannot(self):
        runs = os.path.join(self.tmp, "all")
        for version, name, src in cases():
            shutil.copytree(src, os.path.join(runs, version + "-" + name),
                            ignore=shutil.ignore_patterns("expected"))
        # A run whose receipts folder is a symlink out of it: refused, nothing written there.
        outside = os.path.join(self.tmp, "outside")
        os.makedirs(outside)
        evil = os.path.join(runs, "zz-escape")
        shutil.copytree(os.path.join(FIXTURES, "v1", "ok"), evil,
                        ignore=shutil.ignore_patterns("expected"))
        os.symlink(outside, os.path.join(evil, "receipts"))
        n = len(os.listdir(runs))
        p = run_harness.megacpp(["collect", "--all", runs, "--jobs", "2"])
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        self.assertRegex(p.stdout, r"^collected %d of %d runs under .* \d+ changed, 0 unchanged, "
                         r"1 not collected\n$" % (n - 1, n))
        self.assertIn("zz-escape: ", p.stderr)
        self.assertIn("leads outside the run directory", p.stderr)
        self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)
        self.assertEqual(os.listdir(outside), [])
        for version, name, src in cases():
            with open(os.path.join(src, "expected", "manifest.json"), "rb") as f, \
                    open(os.path.join(runs, version + "-" + name, "manifest.json"), "rb") as g:
                self.assertEqual(g.read(), f.read(), name)
        # A second pass changes nothing.
        p = run_harness.megacpp(["collect", "--all", runs])
        self.assertRegex(p.stdout, r" 0 changed, %d unchanged, 1 not collected" % (n - 1))
        # A journal that is a symlink out of its run is refused too.
        os.remove(os.path.join(evil, "receipts"))
        j = os.path.join(evil, "journal", "trainer-0.journal")
        shutil.move(j, os.path.join(outside, "trainer-0.journal"))
        os.symlink(os.path.join(outside, "trainer-0.journal"), j)
        p = run_harness.megacpp(["collect", evil])
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn("leads outside the run directory", p.stderr)
        for bad in (["collect", os.path.join(self.tmp, "nowhere")], ["collect", "--all", os.path.join(self.tmp, "nowhere")]):
            p = run_harness.megacpp(bad)
            self.assertEqual(p.returncode, 2, (bad, p.stdout, p.stderr))
            self.assertEqual(len(p.stderr.strip().splitlines()), 1, (bad, p.stderr))

    def test_collect_needs_neither_torch_nor_the_stage_binaries(self):
        # `megacpp` links no torch (its run loads libmegacpp_store.so beside it): copied alone to
        # a folder with no torch library and no stage binary, it collects a fixture exactly,
        # and `run` is refused in one line naming the missing library.
        lone = os.path.join(self.tmp, "lone")
        os.makedirs(lone)
        exe = os.path.join(lone, "megacpp")
        shutil.copy2(run_harness.MEGACPP, exe)
        ldd = subprocess.run(["ldd", exe], capture_output=True, text=True).stdout
        self.assertNotRegex(ldd, r"libtorch|libc10", ldd)
        src = os.path.join(FIXTURES, "v1", "ok")
        d = os.path.join(self.tmp, "ok")
        shutil.copytree(src, d, ignore=shutil.ignore_patterns("expected"))
        env = dict(os.environ, LD_LIBRARY_PATH="")
        p = subprocess.run([exe, "collect", d], capture_output=True, text=True, env=env)
        self.assertEqual(p.returncode, 0, p.stderr)
        with open(os.path.join(src, "expected", "manifest.json"), "rb") as f, \
                open(os.path.join(d, "manifest.json"), "rb") as g:
            self.assertEqual(g.read(), f.read())
        for cmd in (["list", self.tmp], ["compare", d, d], ["status", d], ["plan", "tiny"]):
            p = subprocess.run([exe] + cmd, capture_output=True, text=True, env=env)
            self.assertEqual(p.returncode, 0, (cmd, p.stderr))
        p = subprocess.run([exe, "run", "tiny", "--run-dir", os.path.join(self.tmp, "r")],
                           capture_output=True, text=True, env=env)
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn("libmegacpp_store.so does not load", p.stderr)
        self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.tmp, "r")))

    def test_a_corrupt_manifest_is_one_line_and_collect_rebuilds_it(self):
        src = os.path.join(FIXTURES, "v1", "ok")
        d = os.path.join(self.tmp, "corrupt")
        shutil.copytree(src, d, ignore=shutil.ignore_patterns("expected"))
        # The receipts as collected, so that what every command meets is the manifest itself.
        shutil.copytree(os.path.join(src, "expected", "receipts"), os.path.join(d, "receipts"))
        with open(os.path.join(d, "manifest.json"), "w") as f:
            f.write("{garbage")
        for cmd in (["status", d], ["compare", d, d], ["report", d, "--out", os.path.join(self.tmp, "rep")]):
            p = run_harness.megacpp(cmd)
            self.assertNotEqual(p.returncode, 0, cmd)
            self.assertEqual(len(p.stderr.strip().splitlines()), 1, (cmd, p.stderr))
            self.assertIn("manifest.json", p.stderr, cmd)
            self.assertNotIn("receipts", p.stderr, cmd)
        # The manifest is derived: collect folds it again from the journals, exactly.
        p = run_harness.megacpp(["collect", d])
        self.assertEqual(p.returncode, 0, p.stderr)
        with open(os.path.join(src, "expected", "manifest.json"), "rb") as f, \
                open(os.path.join(d, "manifest.json"), "rb") as g:
            self.assertEqual(g.read(), f.read())

    def test_a_newer_format_is_refused_by_name(self):
        src = os.path.join(FIXTURES, "v1", "ok")
        d = os.path.join(self.tmp, "newer")
        shutil.copytree(src, d, ignore=shutil.ignore_patterns("expected"))
        with open(os.path.join(d, "launch.json")) as f:
            launch = json.load(f)
        launch["schemaVersion"] = 1000
        with open(os.path.join(d, "launch.json"), "w") as f:
            json.dump(launch, f)
        p = run_harness.megacpp(["collect", d])
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn("run format version 1000", p.stderr)
        self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)
        self.assertFalse(os.path.exists(os.path.join(d, "manifest.json")))


if __name__ == "__main__":
    unittest.main()
