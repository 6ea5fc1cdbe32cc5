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
