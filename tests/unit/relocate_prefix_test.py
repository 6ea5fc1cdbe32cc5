"""scripts/relocate-prefix.sh (device-prep's last step) on a prefix built here: a tool in
usr/bin needing a library in usr/lib/<multiarch> that needs one in lib/<multiarch>, as Debian's
packages lie once unpacked. Without LD_LIBRARY_PATH the tool cannot start before the relocation;
after it, it starts, also once the prefix is moved elsewhere (the GPU machine unpacks the carried
copy at another path) and after a second relocation; links and non-ELF files are left alone."""
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "relocate-prefix.sh"
MULTI = "x86_64-linux-gnu"
# No LD_LIBRARY_PATH: what the prefix needs must come from its files' own run paths.
ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}


def cc(*args: str) -> None:
    subprocess.run(["cc", *args], check=True)


def runs(tool: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(tool)], capture_output=True, text=True, env=ENV)


with tempfile.TemporaryDirectory() as d:
    src, prefix = Path(d) / "src", Path(d) / "prefix"
    src.mkdir()
    usr_lib, lib, bin_ = prefix / "usr/lib" / MULTI, prefix / "lib" / MULTI, prefix / "usr/bin"
    for p in (usr_lib, lib, bin_):
        p.mkdir(parents=True)
    (src / "b.c").write_text("int b(void) { return 41; }\n")
    (src / "a.c").write_text("int b(void);\nint a(void) { return b() + 1; }\n")
    (src / "tool.c").write_text("int a(void);\nint main(void) { return a() == 42 ? 0 : 3; }\n")
    cc("-shared", "-fPIC", "-Wl,-soname,libb.so.1", "-o", str(lib / "libb.so.1"), str(src / "b.c"))
    cc("-shared", "-fPIC", "-Wl,-soname,liba.so.1", "-o", str(usr_lib / "liba.so.1"),
       str(src / "a.c"), f"-L{lib}", "-l:libb.so.1")
    cc("-o", str(bin_ / "tool"), str(src / "tool.c"), f"-L{usr_lib}", "-l:liba.so.1",
       f"-Wl,-rpath-link,{lib}")
    (usr_lib / "liba.so").symlink_to("liba.so.1")
    (bin_ / "script").write_text("#!/bin/sh\necho not an ELF file\n")

    r = runs(bin_ / "tool")
    assert r.returncode != 0 and "liba.so.1" in r.stderr, (r.returncode, r.stderr)

    subprocess.run(["bash", str(SCRIPT), str(prefix), MULTI], check=True, env=ENV)
    r = runs(bin_ / "tool")
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert (usr_lib / "liba.so").is_symlink()
    assert (bin_ / "script").read_text() == "#!/bin/sh\necho not an ELF file\n"

    # Carried elsewhere: the run paths are relative to each file.
    moved = Path(d) / "elsewhere" / "prefix"
    moved.parent.mkdir()
    shutil.move(str(prefix), str(moved))
    r = runs(moved / "usr/bin/tool")
    assert r.returncode == 0, (r.returncode, r.stderr)

    # Idempotent.
    subprocess.run(["bash", str(SCRIPT), str(moved), MULTI], check=True, env=ENV)
    r = runs(moved / "usr/bin/tool")
    assert r.returncode == 0, (r.returncode, r.stderr)
    liba = moved / "usr/lib" / MULTI / "liba.so.1"
    rpath = subprocess.run(["patchelf", "--print-rpath", str(liba)], capture_output=True,
                           text=True, check=True).stdout.strip()
    assert rpath == f"$ORIGIN:$ORIGIN/../../../lib/{MULTI}", rpath

print("relocate_prefix: a tool of the prefix starts without LD_LIBRARY_PATH, moved and re-run")
