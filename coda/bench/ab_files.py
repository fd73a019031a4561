"""``python -m coda.bench.ab_files OLD_DIR ROUNDS -- COMMAND...``: A/B a code change on one machine by swapping files.

OLD_DIR holds the earlier versions of some files of this checkout at their repository paths (e.g.
``OLD_DIR/coda/kernels/gemm_sm90.py``). Each round runs COMMAND on the checkout as it is ("new"), then with OLD_DIR's
files copied over it ("old"), then puts the new files back (also on Ctrl-C or a failure). ``{ab}`` in COMMAND becomes
``new`` / ``old`` and ``{round}`` the round number (e.g. for ``--out``). Kernel caches stay valid: the compile cache's
key hashes ``coda/kernels/*.py`` (``coda.runtime.compile_cache``), so each side loads its own kernels.
Used for the step report before / after a kernel change (docs/NOTES.md, session 29).
"""
import pathlib
import shutil
import subprocess
import sys


def files(old_dir: pathlib.Path):
    return [p.relative_to(old_dir) for p in sorted(old_dir.rglob("*")) if p.is_file()]


def run(cmd, ab, rnd):
    argv = [a.replace("{ab}", ab).replace("{round}", str(rnd)) for a in cmd]
    print(f"=== round {rnd} {ab}: {' '.join(argv)}", flush=True)
    return subprocess.run(argv).returncode


def main(argv):
    if len(argv) < 4 or argv[2] != "--":
        raise SystemExit(__doc__.splitlines()[0])
    old_dir, rounds, cmd = pathlib.Path(argv[0]), int(argv[1]), argv[3:]
    rel = files(old_dir)
    for r in rel:
        if not r.exists():
            raise SystemExit(f"{old_dir / r}: no file {r} in this checkout")
    saved = {r: r.read_bytes() for r in rel}
    rc = 0
    for rnd in range(1, rounds + 1):
        rc |= run(cmd, "new", rnd)
        try:
            for r in rel:
                shutil.copyfile(old_dir / r, r)
            rc |= run(cmd, "old", rnd)
        finally:
            for r, b in saved.items():
                r.write_bytes(b)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
