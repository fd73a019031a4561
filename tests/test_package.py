"""Packaging: a cheap ``import coda``, the installed package layout, and the pinned CuTeDSL version."""
import importlib
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run_outside_repo(code: str, tmp_path) -> dict:
    """Run ``code`` in a fresh interpreter from a directory outside the repo; it prints one JSON object."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_is_fast_and_does_not_import_cutlass(tmp_path):
    res = _run_outside_repo(
        """
        import json, sys, time
        t = time.perf_counter()
        import coda
        dt = time.perf_counter() - t
        print(json.dumps({"seconds": dt, "cutlass": any(m == "cutlass" or m.startswith("cutlass.")
                                                        for m in sys.modules),
                          "version": coda.__version__}))
        """,
        tmp_path,
    )
    assert res["seconds"] < 2.0, res
    assert not res["cutlass"], "import coda must not import cutlass"
    assert res["version"] == "0.1.0"


def test_subpackages_import():
    for name in ("coda.kernels", "coda.epilogues", "coda.ops", "coda.autotune", "coda.reference"):
        assert importlib.import_module(name).__doc__


def test_lazy_public_names():
    import coda

    assert {"gemm", "GemmConfig", "reference", "__version__", "ops", "nn", "autotune", "fuse"} <= set(dir(coda))
    assert coda.ops is importlib.import_module("coda.ops") and coda.autotune is importlib.import_module("coda.autotune")
    assert coda.reference is importlib.import_module("coda.reference")
    assert coda.GemmConfig is importlib.import_module("coda.config").GemmConfig
    with pytest.raises(AttributeError):
        coda.no_such_name


def test_gemm_attribute_is_the_function_even_after_importing_the_submodule(tmp_path):
    # ``import coda.gemm`` sets the package attribute to the submodule; coda.gemm must stay the function.
    res = _run_outside_repo(
        """
        import json, sys, types
        import coda
        fake = types.ModuleType("coda.gemm")
        def gemm(a, b, **kw):
            return "fn"
        fake.gemm = gemm
        sys.modules["coda.gemm"] = fake
        coda.gemm = fake  # what the import system does after importing the submodule
        print(json.dumps({"callable": coda.gemm is gemm}))
        """,
        tmp_path,
    )
    assert res["callable"]


def test_installed_layout_has_no_generic_top_level_names(tmp_path):
    res = _run_outside_repo(
        """
        import importlib.util, json
        import coda.ops, coda.epilogues, coda.autotune
        print(json.dumps({
            "generic": [n for n in ("ops", "epilogues", "autotune") if importlib.util.find_spec(n) is not None],
            "ops_parent": coda.ops.__name__,
        }))
        """,
        tmp_path,
    )
    assert res["generic"] == [], f"generic top-level packages importable: {res['generic']}"
    assert res["ops_parent"] == "coda.ops"


def _load_pyproject() -> dict:
    text = (ROOT / "pyproject.toml").read_text()
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            deps = re.findall(r'"(nvidia-cutlass-dsl[^"]*)"', text)
            return {"project": {"dependencies": deps}}
    return tomllib.loads(text)


def test_pyproject_pins_cutlass_dsl():
    deps = [d.replace(" ", "") for d in _load_pyproject()["project"]["dependencies"]]
    assert "nvidia-cutlass-dsl>=4.8.1,<4.9" in deps, deps


# the model-level modules of coda/ (built on coda.ops and coda.epilogues: the top layer, in coda/ for their import path) and the package
# root (it wires the layers: coda._tune_on_miss); every other module of coda/ is the core
TOP_LAYER = {"__init__.py", "nn.py", "nn_attention.py", "fuse.py", "distributed.py", "tensor_parallel.py", "optim.py"}


def _imported_names(path):
    import ast
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):  # "from coda import autotune" names coda.autotune
            yield node.module or ""
            yield from (f"{node.module or ''}.{a.name}" for a in node.names)


def test_core_imports_nothing_above_it():
    """No module of the core (coda/ but its top layer and coda/bench/: the kernels, the runtime, coda.gemm, the
    DSL, the reference) imports coda.autotune, coda.ops or coda.epilogues (issue 27: coda.gemm asked
    coda.autotune for configs; now coda.runtime.select)."""
    root = pathlib.Path(__file__).resolve().parents[1] / "coda"
    files = [f for f in root.glob("*.py") if f.name not in TOP_LAYER]
    files += [*root.glob("kernels/*.py"), *root.glob("runtime/*.py")]
    assert any(f.name == "gemm.py" for f in files)
    for f in files:
        for n in _imported_names(f):
            assert not n.startswith(("coda.autotune", "coda.ops", "coda.epilogues", "autotune", "ops", "epilogues")), \
                (str(f), n)


def test_runtime_layer_imports_nothing_above_it():
    """coda/runtime (kernel keys, stores, compile cache) sits below coda.autotune, coda.ops and coda.epilogues: no
    import statement in it names them; coda.autotune.keys / .store / .compile_cache are the runtime's modules
    themselves (aliases), and importing the runtime imports neither torch nor cutlass."""
    import ast
    import pathlib
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parents[1] / "coda" / "runtime"
    for f in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for n in names:
                assert not n.startswith(("coda.autotune", "coda.ops", "coda.epilogues", "autotune", "ops")), (f, n)
    import coda.autotune.compile_cache
    import coda.autotune.keys
    import coda.autotune.store
    import coda.runtime.compile_cache
    import coda.runtime.keys
    import coda.runtime.store
    assert sys.modules["coda.autotune.keys"] is coda.runtime.keys
    assert sys.modules["coda.autotune.store"] is coda.runtime.store
    assert sys.modules["coda.autotune.compile_cache"] is coda.runtime.compile_cache
    code = ("import sys, coda.runtime.keys, coda.runtime.store, coda.runtime.compile_cache; "
            "print(sorted(m for m in ('torch', 'cutlass') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
