"""End-to-end: a branch (`--from CKPT`) at another world size continues its parent's data order.

A parent trains 8 steps at world 2 (batch 16 per rank, checkpoints every 4), tracing what each
rank trained on (MEGACPP_TRACE_BATCHES). A branch from its step-4 checkpoint at world 1 must
train step 5 on the windows the parent's step 5 would have started with (the parent's rank 0
rows of step 5), and one at world 4 on the parent's steps 5 and 6 (ranks 0-1, then 2-3): no
window skipped or repeated. The branch's first step used to start at step x its own world x
batch, so world 1 repeated the parent's step 3 and world 4 skipped ahead.
"""
import os
import shutil
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import run_harness  # noqa: E402

ROWS, ROW_TOKENS = 16, 65  # tiny: batch_size 16, seq_len 64 (+1 target)
BATCH_BYTES = ROWS * ROW_TOKENS * 8  # int64 tokens


def batches(run_dir, rank):
    with open(os.path.join(run_dir, "logs", "batches-%d.bin" % rank), "rb") as f:
        raw = f.read()
    return [raw[i:i + BATCH_BYTES] for i in range(0, len(raw), BATCH_BYTES)]


class BranchData(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="megacpp-branch-")
        cls.recipe = run_harness.tiny_recipe(cls.tmp, 4)
        cls.data = os.path.join(cls.tmp, "data")
        cls.parent = os.path.join(cls.tmp, "parent")
        p = cls.train(cls.parent, 2, 8)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    @classmethod
    def train(cls, run_dir, ranks, steps, extra=()):
        return run_harness.megacpp(
            ["run", cls.recipe, "--ranks", str(ranks), "--steps", str(steps), "--run-dir", run_dir,
             "--data-dir", cls.data, "--progress", "none"] + list(extra),
            env={"MEGACPP_TRACE_BATCHES": "8"})

    def branch(self, name, ranks):
        run_dir = os.path.join(self.tmp, name)
        ckpt = os.path.join(self.parent, "checkpoints", "step_00000004")
        p = self.train(run_dir, ranks, 6, ["--from", ckpt])
        self.assertEqual(p.returncode, 0, p.stdout[-2000:] + p.stderr[-2000:])
        return run_dir

    def test_a_branch_at_world_1_takes_the_parents_next_windows(self):
        run_dir = self.branch("w1", 1)
        parent0 = batches(self.parent, 0)
        self.assertEqual(len(parent0), 8)
        first = batches(run_dir, 0)[0]
        self.assertTrue(first == parent0[4], "the branch's step 5 is not the parent's step 5 "
                        "(rank 0 rows); it is the parent's step %s" %
                        [i + 1 for i, b in enumerate(parent0) if b == first])

    def test_a_branch_at_world_4_takes_the_parents_next_two_steps(self):
        run_dir = self.branch("w4", 4)
        parent = [batches(self.parent, r) for r in (0, 1)]
        got = [batches(run_dir, r)[0] for r in range(4)]
        want = [parent[0][4], parent[1][4], parent[0][5], parent[1][5]]
        for r in range(4):
            self.assertTrue(got[r] == want[r], "branch rank %d's step 5 is not the parent's "
                            "window run it continues" % r)


if __name__ == "__main__":
    unittest.main()
