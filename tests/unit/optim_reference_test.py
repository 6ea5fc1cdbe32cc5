"""Checks of tools/optim_reference.py, the float64 reference for the distributed optimizer."""

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import unittest
from unittest import mock

import torch
from safetensors.torch import load_file, save_file

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(REPO, "tools", "optim_reference.py")

_spec = importlib.util.spec_from_file_location("optim_reference", SCRIPT)
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)

F64 = torch.float64


def randn(shape, seed):
    return torch.randn(shape, dtype=F64, generator=torch.Generator().manual_seed(seed))


ADAMW_HP = {"lr": 0.01, "betas": [0.8, 0.95], "eps": 1e-8, "weight_decay": 0.1}
MUON_HP = {"lr": 0.02, "momentum": 0.95, "beta2": 0.95, "weight_decay": 0.2,
           "ns_method": "polar_express", "ns_steps": 5}


def make_spec(params, world_size=1, steps=4, muon=None):
    return {"world_size": world_size, "steps": steps,
            "hyperparameters": {"adamw": ADAMW_HP, "muon": muon or MUON_HP},
            "params": params}


class AdamWTest(unittest.TestCase):
    def test_matches_torch_adamw_single_rank(self):
        shape, steps = (8, 5), 20
        spec = make_spec([{"name": "w", "shape": list(shape), "optimizer": "adamw",
                           "init": {"seed": 3, "std": 0.5}}], steps=steps)
        grads = {f"step{s}.rank0.w": randn(shape, 100 + s) for s in range(steps)}
        out = ref.run(spec, grads)

        p = torch.nn.Parameter(out["initial.w"].clone())
        opt = torch.optim.AdamW([p], lr=ADAMW_HP["lr"], betas=tuple(ADAMW_HP["betas"]),
                                eps=ADAMW_HP["eps"], weight_decay=ADAMW_HP["weight_decay"],
                                foreach=False)
        for s in range(steps):
            p.grad = grads[f"step{s}.rank0.w"].clone()
            opt.step()
        st = opt.state[p]
        torch.testing.assert_close(out["w"], p.detach(), rtol=0, atol=1e-12)
        torch.testing.assert_close(out["w.exp_avg"], st["exp_avg"], rtol=0, atol=1e-12)
        torch.testing.assert_close(out["w.exp_avg_sq"], st["exp_avg_sq"], rtol=0, atol=1e-12)
        self.assertEqual(out["w.step"].item(), steps)
        self.assertGreater((out["w"] - out["initial.w"]).abs().max().item(), 1e-3)


class OrthogonalizeTest(unittest.TestCase):
    # Singular-value bands after 5 iterations on well-conditioned (aspect >= 2) Gaussian
    # matrices: Polar Express lands in about [0.86, 1.14], classic Newton-Schulz in about
    # [0.68, 1.18] (its coefficients deliberately stop short of converging).
    BANDS = {"polar_express": (0.75, 1.2), "newton_schulz": (0.6, 1.25)}

    def test_singular_values_near_one(self):
        for method, (lo, hi) in self.BANDS.items():
            for i, shape in enumerate([(64, 32), (32, 96), (128, 16), (40, 100)]):
                with self.subTest(method=method, shape=shape):
                    x = randn(shape, 7 + i) * 3.7
                    s = torch.linalg.svdvals(ref.orthogonalize(x, method, 5))
                    self.assertGreater(s.min().item(), lo)
                    self.assertLess(s.max().item(), hi)
                    # Input scale is irrelevant (normalised first; the epsilon is negligible here).
                    s2 = torch.linalg.svdvals(ref.orthogonalize(x * 10.0, method, 5))
                    torch.testing.assert_close(s, s2, rtol=1e-6, atol=1e-6)

    def test_polar_express_beats_newton_schulz(self):
        x = randn((64, 32), 11)
        pe = torch.linalg.svdvals(ref.orthogonalize(x, "polar_express", 5))
        ns = torch.linalg.svdvals(ref.orthogonalize(x, "newton_schulz", 5))
        self.assertLess((pe - 1).abs().max().item(), (ns - 1).abs().max().item())


class QkvSplitTest(unittest.TestCase):
    def test_split_orthogonalises_each_slice(self):
        g = randn((96, 32), 5)
        x = ref.orthogonalize_split(g, [32, 32, 32], "polar_express", 5)
        for i in range(3):
            torch.testing.assert_close(x[32 * i:32 * (i + 1)],
                                       ref.orthogonalize(g[32 * i:32 * (i + 1)],
                                                         "polar_express", 5),
                                       rtol=0, atol=0)

    def test_split_changes_result(self):
        shape, steps = (96, 32), 3
        grads = {f"step{s}.rank0.qkv": randn(shape, 20 + s) for s in range(steps)}
        common = {"name": "qkv", "shape": list(shape), "optimizer": "muon",
                  "init": {"seed": 4, "std": 0.1}}
        split = ref.run(make_spec([dict(common, qkv_split_sizes=[64, 16, 16])], steps=steps),
                        grads)
        whole = ref.run(make_spec([dict(common, qkv_split_sizes=None)], steps=steps), grads)
        torch.testing.assert_close(split["initial.qkv"], whole["initial.qkv"], rtol=0, atol=0)
        # Momentum is elementwise and unaffected; the update is not.
        torch.testing.assert_close(split["qkv.momentum_buffer"], whole["qkv.momentum_buffer"],
                                   rtol=0, atol=0)
        self.assertGreater((split["qkv"] - whole["qkv"]).abs().max().item(), 1e-4)

    def test_bad_split_rejected(self):
        spec = make_spec([{"name": "qkv", "shape": [96, 32], "optimizer": "muon",
                           "qkv_split_sizes": [32, 32]}])
        with self.assertRaises(ValueError):
            ref.run(spec, {})


class TorchMuonTest(unittest.TestCase):
    """The reference's Muon against torch.optim.Muon (torch 2.11), an independent implementation,
    on what the two share: Nesterov momentum, classic Newton-Schulz (3.4445, -4.7750, 2.0315) on
    the wide orientation, and the lr scale sqrt(max(1, rows/cols)). Not shared, so off here:
    variance reduction (torch has none) and weight decay (torch decays by lr * wd, uncautious;
    ours by the scaled lr, cautious, as nanochat). torch orthogonalises in bfloat16; its
    Tensor.bfloat16 is patched to the identity so both run in float64. They then differ only
    in the normalisation's epsilon (X / (|X|_F + 1e-7) against X / max(|X|_F, 1e-7)), ~1e-9
    here; a wrong lr scale, coefficient or orientation moves parameters by ~1e-3 or more."""

    LR, MOMENTUM, STEPS = 0.02, 0.95, 6

    def run_both(self, shape, split):
        p_ref = randn(shape, 60) * 0.5
        slices = [p_ref[i:j].clone() for i, j in _bounds(split or [shape[0]])]
        params = [torch.nn.Parameter(s) for s in slices]
        opt = torch.optim.Muon(params, lr=self.LR, weight_decay=0.0, momentum=self.MOMENTUM,
                               nesterov=True, ns_steps=5)
        mom = torch.zeros(shape, dtype=F64)
        sec = torch.zeros(ref.muon_second_moment_shape(shape, split), dtype=F64)
        for s in range(self.STEPS):
            g = randn(shape, 70 + s)
            ref.muon_step(g, p_ref, mom, sec, lr=self.LR, momentum=self.MOMENTUM, beta2=0.95,
                          weight_decay=0.0, ns_method="newton_schulz", ns_steps=5,
                          qkv_split_sizes=split, variance_reduction=False)
            for prm, (i, j) in zip(params, _bounds(split or [shape[0]])):
                prm.grad = g[i:j].clone()
            with mock.patch.object(torch.Tensor, "bfloat16", lambda t: t):
                opt.step()
        return p_ref, torch.cat([prm.detach() for prm in params]), randn(shape, 60) * 0.5

    def test_whole_matrices_match(self):
        for shape in [(64, 32), (16, 48), (32, 32)]:
            with self.subTest(shape=shape):
                mine, theirs, initial = self.run_both(shape, None)
                torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-8)
                self.assertGreater((mine - initial).abs().max().item(), 1e-2)

    def test_qkv_slices_move_as_separate_parameters(self):
        # GQA-like slices of different aspect: q (64 x 32) takes sqrt(2) * lr, k and v
        # (16 x 32) take lr; the fused (96 x 32) matrix would have taken sqrt(3) * lr.
        mine, theirs, _ = self.run_both((96, 32), [64, 16, 16])
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-8)


def _bounds(split):
    out, at = [], 0
    for n in split:
        out.append((at, at + n))
        at += n
    return out


class MuonSemanticsTest(unittest.TestCase):
    def test_variance_reduction_preserves_each_slice_norm(self):
        # Step 1 from zero state, no weight decay: each slice's update has the Frobenius norm
        # of that slice's orthogonalised momentum (variance reduction is norm-preserving per
        # slice, not over the fused matrix).
        shape, split, mu = (96, 32), [64, 16, 16], 0.95
        p = randn(shape, 80)
        before = p.clone()
        g = randn(shape, 81)
        mom = torch.zeros(shape, dtype=F64)
        sec = torch.zeros(ref.muon_second_moment_shape(shape, split), dtype=F64)
        ref.muon_step(g, p, mom, sec, lr=0.02, momentum=mu, beta2=0.95, weight_decay=0.0,
                      ns_method="polar_express", ns_steps=5, qkv_split_sizes=split)
        nesterov = g.lerp(g * (1 - mu), mu)
        for i, j in _bounds(split):
            lr = 0.02 * max(1.0, (j - i) / 32) ** 0.5
            update = (before[i:j] - p[i:j]) / lr
            want = ref.orthogonalize(nesterov[i:j], "polar_express", 5).norm()
            self.assertAlmostEqual(update.norm().item(), want.item(), places=9)

    def test_muon_fits_a_teacher(self):
        # The cautious gate masks weight decay only. A gate on the update itself ((u * p) >= 0)
        # only ever lets |p| shrink: the student below then stays near its initial loss instead
        # of falling by orders of magnitude (DESIGN.md "Decisions": the cautious gate).
        gen = torch.Generator().manual_seed(1)
        t1 = torch.randn(64, 32, generator=gen, dtype=F64) / 32 ** 0.5
        t2 = torch.randn(32, 64, generator=gen, dtype=F64) / 8.0
        ws = [(torch.randn(64, 32, generator=gen, dtype=F64) * 0.02).requires_grad_(),
              (torch.randn(32, 64, generator=gen, dtype=F64) * 0.02).requires_grad_()]
        state = [(torch.zeros(w.shape, dtype=F64),
                  torch.zeros(ref.muon_second_moment_shape(w.shape), dtype=F64)) for w in ws]
        losses = []
        for _ in range(150):
            x = torch.randn(256, 32, generator=gen, dtype=F64)
            y = torch.relu(x @ t1.T) @ t2.T
            loss = ((torch.relu(x @ ws[0].T) @ ws[1].T - y) ** 2).mean()
            for w in ws:
                w.grad = None
            loss.backward()
            losses.append(loss.item())
            with torch.no_grad():
                for w, (mom, sec) in zip(ws, state):
                    ref.muon_step(w.grad, w, mom, sec, lr=0.02, momentum=0.95, beta2=0.95,
                                  weight_decay=0.1, ns_method="polar_express", ns_steps=5)
        self.assertLess(losses[-1], losses[0] / 10)


class NonFiniteTest(unittest.TestCase):
    PARAMS = [{"name": "a", "shape": [8, 4], "optimizer": "adamw", "init": {"seed": 1}}]

    def test_non_finite_gradient_is_refused_naming_the_element(self):
        g = torch.zeros(8, 4, dtype=F64)
        g[2, 3] = float("nan")
        with self.assertRaisesRegex(ValueError, r"step0\.rank1\.a.*\[2, 3\] \(nan\)"):
            ref.run(make_spec(self.PARAMS, world_size=2, steps=1), {"step0.rank1.a": g})

    def test_state_that_overflows_is_an_error(self):
        g = torch.zeros(8, 4, dtype=F64)
        g[5, 1] = 1e200  # finite, but its square is not
        with self.assertRaisesRegex(ValueError, r"step 0: a\.exp_avg_sq: .*\[5, 1\] \(inf\)"):
            ref.run(make_spec(self.PARAMS, world_size=1, steps=1), {"step0.rank0.a": g})


class AveragingTest(unittest.TestCase):
    PARAMS = [{"name": "a", "shape": [8, 4], "optimizer": "adamw", "init": {"seed": 1}},
              {"name": "m", "shape": [16, 8], "optimizer": "muon", "init": {"seed": 2}}]

    def test_missing_rank_contributes_zero_and_divides_by_world(self):
        ga, gm = randn((8, 4), 30), randn((16, 8), 31)
        hb = randn((8, 4), 32)
        # W=3, step 0: only rank 1 has a gradient; step 1: ranks 0 and 2.
        dist = ref.run(make_spec(self.PARAMS, world_size=3, steps=2),
                       {"step0.rank1.a": ga, "step0.rank1.m": gm,
                        "step1.rank0.a": hb, "step1.rank2.a": 2 * hb,
                        "step1.rank0.m": gm, "step1.rank2.m": -gm})
        single = ref.run(make_spec(self.PARAMS, world_size=1, steps=2),
                         {"step0.rank0.a": ga / 3, "step0.rank0.m": gm / 3,
                          "step1.rank0.a": hb, "step1.rank0.m": torch.zeros(16, 8, dtype=F64)})
        for k in dist:
            torch.testing.assert_close(dist[k], single[k], rtol=0, atol=1e-15, msg=k)

    def test_no_gradient_anywhere_skips_the_parameter(self):
        grads_full = {f"step{s}.rank{r}.{n}": randn(shape, 40 + 7 * s + r + len(n))
                      for s in range(3) for r in range(2)
                      for n, shape in (("a", (8, 4)), ("m", (16, 8)))}
        # Same schedule with an extra step 1 in which no rank has any gradient.
        shifted = {}
        for k, v in grads_full.items():
            s, rest = k.split(".", 1)
            s = int(s[4:])
            shifted[f"step{s if s == 0 else s + 1}.{rest}"] = v
        a = ref.run(make_spec(self.PARAMS, world_size=2, steps=3), grads_full)
        b = ref.run(make_spec(self.PARAMS, world_size=2, steps=4), shifted, sample_every=1)
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)
        # After the skipped step, everything equals the step-1 snapshot (incl. AdamW's count).
        for k in ("a", "a.exp_avg", "a.exp_avg_sq", "a.step", "m", "m.momentum_buffer",
                  "m.second_momentum_buffer"):
            torch.testing.assert_close(b[f"sample1.{k}"], b[f"sample2.{k}"], rtol=0, atol=0)
        self.assertEqual(b["sample2.a.step"].item(), 1)

    def test_zero_gradient_is_not_a_missing_gradient(self):
        spec = make_spec(self.PARAMS, world_size=2, steps=1)
        out = ref.run(spec, {"step0.rank1.a": torch.zeros(8, 4, dtype=F64)})
        self.assertEqual(out["a.step"].item(), 1)
        # Weight decay still applied.
        torch.testing.assert_close(out["a"], out["initial.a"] * (1 - 0.01 * 0.1),
                                   rtol=0, atol=1e-15)
        torch.testing.assert_close(out["m"], out["initial.m"], rtol=0, atol=0)

    def test_stray_key_rejected(self):
        with self.assertRaises(ValueError):
            ref.run(make_spec(self.PARAMS, world_size=2, steps=1),
                    {"step0.rank2.a": torch.zeros(8, 4)})


class CliTest(unittest.TestCase):
    def test_cli_is_deterministic(self):
        with tempfile.TemporaryDirectory() as d:
            save_file({"qkv": randn((48, 16), 9).float()}, os.path.join(d, "init.safetensors"))
            spec = make_spec(
                [{"name": "wte", "shape": [32, 16], "optimizer": "adamw",
                  "init": {"seed": 1, "std": 0.02}, "lr_mul": 2.0, "wd_mul": 0.0},
                 {"name": "qkv", "shape": [48, 16], "optimizer": "muon",
                  "qkv_split_sizes": [16, 16, 16],
                  "init": {"file": "init.safetensors", "key": "qkv"}},
                 {"name": "mlp", "shape": [16, 64], "optimizer": "muon", "init": {"seed": 5}}],
                world_size=2, steps=8)
            pattern = [(True, False), (False, True), (True, True), (False, False)]
            grads = {}
            for s in range(8):
                for r in range(2):
                    if pattern[s % 4][r]:
                        for n, shape in (("wte", (32, 16)), ("qkv", (48, 16)), ("mlp", (16, 64))):
                            grads[f"step{s}.rank{r}.{n}"] = randn(shape, 1000 + 10 * s + r).float()
            with open(os.path.join(d, "spec.json"), "w") as f:
                json.dump(spec, f)
            save_file(grads, os.path.join(d, "grads.safetensors"))
            # Once through the real command line, once in-process (same entry point; a second
            # interpreter start would double the test's time).
            outs = []
            for i in range(2):
                path = os.path.join(d, f"out{i}.safetensors")
                argv = ["--spec", os.path.join(d, "spec.json"),
                        "--grads", os.path.join(d, "grads.safetensors"), "--out", path,
                        "--sample-every", "4"]
                if i == 0:
                    subprocess.run([sys.executable, SCRIPT] + argv, check=True)
                else:
                    self.assertEqual(ref.main(argv), 0)
                with open(path, "rb") as f:
                    outs.append(f.read())
            self.assertEqual(outs[0], outs[1])
            out = load_file(os.path.join(d, "out0.safetensors"))
            for k in ("sample4.wte", "sample8.qkv.momentum_buffer", "wte.exp_avg_sq",
                      "qkv.second_momentum_buffer", "mlp.second_momentum_buffer", "initial.qkv"):
                self.assertIn(k, out)
            self.assertEqual(tuple(out["qkv.second_momentum_buffer"].shape), (48, 1))
            self.assertEqual(tuple(out["mlp.second_momentum_buffer"].shape), (1, 64))
            self.assertEqual(out["wte.step"].item(), 6)  # 2 of 8 steps had no gradient
            self.assertTrue(all(v.dtype in (F64, torch.int64) for v in out.values()))
            torch.testing.assert_close(out["sample8.qkv"], out["qkv"], rtol=0, atol=0)


if __name__ == "__main__":
    unittest.main()
