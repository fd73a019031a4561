"""coda.bench.ab_files: each round runs the command on the checkout as it is, then with the old files copied over
it, and always puts the new files back."""
import subprocess
import sys

import pytest


def _run(tmp_path, cmd, rounds=2):
    return subprocess.run([sys.executable, "-m", "coda.bench.ab_files", "old", str(rounds), "--", *cmd],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)


@pytest.fixture
def checkout(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "k.py").write_text("new\n")
    (tmp_path / "old" / "pkg").mkdir(parents=True)
    (tmp_path / "old" / "pkg" / "k.py").write_text("old\n")
    return tmp_path


def test_alternates_and_restores(checkout):
    show = [sys.executable, "-c", "import sys; print(sys.argv[1], open('pkg/k.py').read().strip())", "{ab}{round}"]
    p = _run(checkout, show)
    assert p.returncode == 0, p.stderr
    seen = [ln for ln in p.stdout.splitlines() if not ln.startswith("===")]
    assert seen == ["new1 new", "old1 old", "new2 new", "old2 old"]
    assert (checkout / "pkg" / "k.py").read_text() == "new\n"


def test_failure_restores_and_fails(checkout):
    p = _run(checkout, [sys.executable, "-c", "import sys; sys.exit(open('pkg/k.py').read() == 'old\\n')"], rounds=1)
    assert p.returncode != 0                                   # the old side's command failed
    assert (checkout / "pkg" / "k.py").read_text() == "new\n"


def test_refuses_a_file_the_checkout_lacks(checkout):
    (checkout / "old" / "pkg" / "gone.py").write_text("x\n")
    p = _run(checkout, [sys.executable, "-c", "pass"])
    assert p.returncode != 0 and "gone.py" in p.stderr
