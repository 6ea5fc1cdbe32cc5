"""End-to-end: `megacpp report` writes one self-contained page whose plots render.

Three fixture runs (ok, restarts, failed; tests/fixtures/runs/v1) and a fresh run of tiny that
evaluates every 2 steps are collected and reported together. The page loads nothing (no src, no
href, no script); it has one loss and one tokens/s plot with a line per run, and on the loss plot
a second, dashed line of the fresh run's validation losses; it marks the restarted run's second
attempt, names the failed run's first failure, lists each run's stages and the fresh run's
validation loss. Headless Chromium (Debian's `chromium`, installed by `make test`'s set-up) then
takes a screenshot, and the test decodes the PNG and counts the pixels of each run's line colour
and of the validation line's: each line must have been drawn.
"""
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import unittest
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
import run_harness  # noqa: E402

FIXTURES = os.path.join(HERE, "..", "fixtures", "runs", "v1")
COLOURS = {"ok": (0x1f, 0x77, 0xb4), "restarts": (0xd6, 0x27, 0x28), "failed": (0x2c, 0xa0, 0x2c),
           "fresh": (0x94, 0x67, 0xbd), "fresh val": (0x3f, 0x00, 0x7d)}


def png_pixels(path):
    """(width, height, rows of RGB tuples) of an 8-bit RGB or RGBA non-interlaced PNG."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", chunk)
            assert depth == 8 and colour in (2, 6) and interlace == 0, (depth, colour, interlace)
            bpp = 4 if colour == 6 else 3
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows, prev = [], bytearray(stride)
    for y in range(height):
        ftype = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if ftype == 1:
                line[i] = (line[i] + a) & 255
            elif ftype == 2:
                line[i] = (line[i] + b) & 255
            elif ftype == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif ftype == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pr = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                line[i] = (line[i] + pr) & 255
        rows.append([tuple(line[x * bpp:x * bpp + 3]) for x in range(width)])
        prev = line
    return width, height, rows


class Report(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="megacpp-report-")
        cls.runs = []
        for name in ("ok", "restarts", "failed"):
            d = os.path.join(cls.tmp, name)
            shutil.copytree(os.path.join(FIXTURES, name), d, ignore=shutil.ignore_patterns("expected"))
            p = run_harness.megacpp(["collect", d])
            assert p.returncode == 0, p.stderr
            cls.runs.append(d)
        # A run that evaluates: tiny with eval_every = 2 over 12 steps (6 validation points).
        with open(os.path.join(run_harness.RECIPE_DIR, "tiny.toml")) as f:
            text = f.read()
        assert "eval_every = 10 " in text
        recipe = os.path.join(cls.tmp, "tiny-eval.toml")
        with open(recipe, "w") as f:
            f.write(text.replace("eval_every = 10 ", "eval_every = 2 "))
        fresh = os.path.join(cls.tmp, "fresh")
        p = run_harness.megacpp(["run", recipe, "--ranks", "2", "--steps", "12", "--run-dir", fresh,
                                 "--data-dir", os.path.join(cls.tmp, "data"), "--progress", "none"])
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        cls.runs.append(fresh)
        cls.out = os.path.join(cls.tmp, "report")
        cls.p = run_harness.megacpp(["report"] + cls.runs + ["--out", cls.out])
        with open(os.path.join(cls.out, "index.html")) as f:
            cls.html = f.read()

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_the_page_is_self_contained_and_complete(self):
        self.assertEqual(self.p.returncode, 0, self.p.stderr)
        self.assertIn("index.html", self.p.stdout)
        self.assertNotRegex(self.html, r"\b(src|href)\s*=|<script|@import|url\(")
        self.assertEqual(self.html.count("<svg"), 2)
        self.assertEqual(len(re.findall(r'<polyline [^>]*class="series"', self.html)), 8)
        self.assertEqual(len(re.findall(r'<polyline [^>]*class="validation"', self.html)), 1)
        self.assertEqual(self.html.count("<circle "), 6)  # a dot per evaluation
        self.assertIn("fresh val</text>", self.html)
        self.assertRegex(self.html, r"<th>validation</th><td>loss \d\.\d{4} after step 12, best")
        self.assertEqual(self.html.count('class="attempt"'), 2)  # restarts' attempt 1, both plots
        self.assertIn("first failure: <b>signaled</b> in trainer-1", self.html)
        for name in ("ok", "restarts", "failed", "fresh"):
            self.assertIn(">%s</h2>" % name, self.html)
        self.assertIn("attempts: #0 launch", self.html)

    def test_the_plots_render_in_chromium(self):
        chromium = shutil.which("chromium") or shutil.which("chromium-browser")
        self.assertIsNotNone(chromium, "chromium is missing: run `make test` (its set-up installs it)")
        shot = os.path.join(self.tmp, "shot.png")
        p = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu",
                            "--hide-scrollbars", "--window-size=1000,760", "--screenshot=" + shot,
                            "file://" + os.path.join(self.out, "index.html")],
                           capture_output=True, text=True, timeout=120)
        self.assertTrue(os.path.exists(shot), p.stderr[-2000:])
        width, height, rows = png_pixels(shot)
        self.assertEqual((width, height), (1000, 760))
        counts = {name: 0 for name in COLOURS}
        for row in rows:
            for px in row:
                for name, colour in COLOURS.items():
                    if all(abs(px[i] - colour[i]) <= 24 for i in range(3)):
                        counts[name] += 1
        # Each run's lines (two plots, 2.5 px wide) and its legend swatches: hundreds of pixels
        # of its colour. The ok run's loss line lies under the restarted run's (equal losses),
        # but its tokens/s line does not. The validation line: dashes between six dots, and its
        # legend swatch.
        for name, n in counts.items():
            self.assertGreater(n, 200, "%s: %d pixels of its colour (%s)" % (name, n, counts))


if __name__ == "__main__":
    unittest.main()
