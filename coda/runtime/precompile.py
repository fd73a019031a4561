"""Compile a step's kernels before the step, in parallel worker processes (issue 31, "first use without a stall").

Design: a *dry run* -> *recipes* -> *spawned workers* -> *the disk cache* -> *the real step loads*. Under
:func:`recording` (what ``coda.precompile`` runs the user's step in) every kernel-compile point -- ``coda.gemm``'s
``_compiled``, ``coda.kernels.ce_grad`` and the row kernels (``coda.kernels.row_kernel``) -- compiles and launches nothing: it records a
:class:`Recipe` and returns a no-op callable, so the step runs its host code (argument checks, config choice, torch
ops on unwritten outputs: shapes never depend on values) and meets every kernel it needs. A recipe is what another
process needs to compile exactly the same kernel and store it under exactly the same key: the kind of kernel, its
compile-time parameters (config, epilogue object, dtypes, argument signature, max active clusters), the arch, the
key the runtime computed, and one :class:`ArgSpec` per argument -- a tensor's element type, which shapes and
strides are dynamic (the static ones' values), memory space, assumed alignment and its printed form, a stream's
handle, a scalar's type. A worker (``multiprocessing``'s "spawn": the parent holds a CUDA context) imports cutlass
once, with ``CUTE_DSL_ARCH`` set to the parent's arch (no GPU needed), rebuilds the arguments as fake tensors of
the very MLIR types the runtime's ``from_dlpack(...).mark_layout_dynamic(...)`` tensors have (a subclass whose
``str`` is the runtime tensor's, since the DSL names the host function after its arguments' ``str``: the stored
object is then byte-identical to the one the parent would compile, tests/test_precompile.py), checks that it
computes the recipe's key, and stores the compiled object in ``<cache dir>/kernels/`` (``compile_cache``); recipes
whose object is already there are skipped. Epilogues travel by pickle: a traced epilogue's sympy expressions are
rebuilt under ``sympy.evaluate(False)`` (no re-simplification) without its Python function, and the worker checks
a structural fingerprint of the epilogue (every expression as a DAG) against the parent's; a recipe that
cannot be pickled, or that a worker could not compile, is compiled in the parent. The real step then finds every
kernel on disk (``how == "disk"``) and links it, compiling nothing. In the background (:class:`Background`, for a
step that torch.compile compiles meanwhile) the workers' kernels are registered in flight: a compile point that
meets one (``compile_cache.cached``) waits for its worker and loads the object; what a worker could not compile
is left to the step.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import os
import pickle
import threading
import time
import warnings
from typing import Any, Optional

_lock = threading.Lock()
_recorder: Optional["Recorder"] = None  # process-wide: the autograd engine runs CUDA backward ops in its own threads
_inflight: dict = {}  # kernel key -> threading.Event: a background precompile's worker is compiling it


def wait_inflight(key: str) -> None:
    """Block until a background precompile (:class:`Background`) is done with ``key``, if it is compiling it: the
    compile point then loads the worker's object instead of building the kernel a second time."""
    ev = _inflight.get(key)
    if ev is not None:
        ev.wait()


# ----------------------------------------------------------------------------------------------- argument specs
@dataclasses.dataclass(frozen=True)
class ArgSpec:
    """One argument of a compiled function, as metadata. ``kind``: "tensor", "stream", "scalar" or "none";
    tensors: ``dtype`` (cutlass type name), ``shape`` / ``stride`` (None where dynamic, else the static value),
    ``memspace`` (cutlass AddressSpace name), ``align`` (assumed bytes; None: the element size), ``stride32`` and
    ``text`` (``str`` of the runtime tensor, the DSL's host-function name is made of it); a stream: ``value`` (its
    handle); a scalar: ``dtype`` and ``value``."""
    kind: str
    dtype: str = ""
    shape: tuple = ()
    stride: tuple = ()
    memspace: str = ""
    align: Optional[int] = None
    stride32: bool = False
    text: str = ""
    value: Any = None

    def signature(self) -> tuple:
        """What decides the compiled code (not the name, handle or value)."""
        if self.kind == "tensor":
            return (self.dtype, self.shape, self.stride, self.memspace, self.align, self.stride32)
        return (self.kind, self.dtype)


def spec_of(arg: Any) -> ArgSpec:
    """The :class:`ArgSpec` of one runtime argument of a compiled function (a ``from_dlpack`` cute tensor, a
    ``cuda.CUstream``, a cutlass scalar or None)."""
    if arg is None:
        return ArgSpec("none")
    if type(arg).__name__ == "CUstream":
        return ArgSpec("stream", value=int(arg))
    if hasattr(arg, "dynamic_shapes_mask"):
        shape = tuple(None if dyn else int(s) for dyn, s in zip(arg.dynamic_shapes_mask, arg.shape))
        stride = tuple(None if dyn else int(s) for dyn, s in zip(arg.dynamic_strides_mask, arg.stride))
        return ArgSpec("tensor", arg.element_type.__name__, shape, stride, arg.memspace.name,
                       arg.__cache_key__[1], bool(getattr(arg, "_use_32bit_stride", False)), str(arg))
    if hasattr(arg, "value") and type(arg).__module__.startswith("cutlass"):
        return ArgSpec("scalar", type(arg).__name__, value=arg.value)
    raise TypeError(f"coda.precompile: cannot describe a kernel argument of type {type(arg).__name__}")


def arg_signature(specs) -> tuple:
    return tuple(s.signature() for s in specs)


_Named = None


def _named_fake_class():
    """A cutlass fake tensor whose ``str`` is the runtime tensor's (the DSL's ``_FakeArray`` subclasses it too)."""
    global _Named
    if _Named is None:
        from cutlass.cute.runtime import _FakeTensor

        class NamedFakeTensor(_FakeTensor):
            def __init__(self, text: str, *args, **kw):
                super().__init__(*args, **kw)
                self._text = text

            def __str__(self) -> str:
                return self._text

        _Named = NamedFakeTensor
    return _Named


def build_arg(spec: ArgSpec) -> Any:
    """The compile-time stand-in of ``spec``: a fake tensor of the runtime tensor's MLIR type (each dynamic extent
    its own symbol, as ``from_dlpack`` gives), a stream of the same handle, a scalar of the same type and value."""
    if spec.kind == "none":
        return None
    if spec.kind == "stream":
        import cuda.bindings.driver as cuda
        return cuda.CUstream(spec.value)
    import cutlass
    if spec.kind == "scalar":
        return getattr(cutlass, spec.dtype)(spec.value)
    import cutlass.cute as cute
    from cutlass.base_dsl.enums import AddressSpace
    stride_sym = cute.sym_int32 if spec.stride32 else cute.sym_int64
    shape = tuple(cute.sym_int32() if s is None else s for s in spec.shape)
    stride = tuple(stride_sym() if s is None else s for s in spec.stride)
    return _named_fake_class()(spec.text, getattr(cutlass, spec.dtype), shape, stride=stride,
                               memspace=AddressSpace[spec.memspace], assumed_align=spec.align,
                               use_32bit_stride=spec.stride32)


# ------------------------------------------------------------------------------------------- kinds of kernels
def _gemm_key(params: tuple, arch: str, specs) -> str:
    from .keys import kernel_key
    cfg, epi, in_dtype, out_dtype, arg_sig, max_clusters = params
    return kernel_key(arch, max_clusters, cfg, epi, in_dtype, out_dtype, arg_sig)


def _gemm_build(params: tuple, args: list, arch: str, specs, options: Optional[str] = None):
    from . import compile_cache
    cfg, epi, in_dtype, out_dtype, arg_sig, max_clusters = params
    return compile_cache.compile_kernel(cfg, epi, in_dtype, out_dtype, arg_sig, args, max_clusters, arch, options)


def _named(name: str):
    def key(params: tuple, arch: str, specs) -> str:
        from .keys import named_kernel_key
        return named_kernel_key(name, arch, params, arg_signature(specs))

    def build(params: tuple, args: list, arch: str, specs, options: Optional[str] = None):
        import importlib

        from . import compile_cache
        mod = importlib.import_module(f"coda.kernels.{name}")
        k = key(params, arch, specs) if compile_cache.enabled() else None
        return compile_cache.cached(k, lambda: mod.compile_kernel(*params, fake=False, args=args, options=options))
    return key, build


# kind -> (key(params, arch, specs), build(params, args, arch, specs, options) -> (fn, how)): the compile points'
# own paths (``specs``: the ArgSpecs of the runtime's arguments, ``args`` may be their fake stand-ins; options
# None: the runtime's, the arch then comes from the device or CUTE_DSL_ARCH)
KINDS: dict = {"gemm": (_gemm_key, _gemm_build), "ce_grad": _named("ce_grad"), "rope_grad": _named("rope_grad"),
         "embedding_adamw": _named("embedding_adamw")}


def load_or_compile(kind: str, params: tuple, args: list, arch: str) -> tuple:
    """``(fn, how)`` of a compile point outside a dry run: the disk cache, else compiled and stored."""
    return KINDS[kind][1](params, args, arch, [spec_of(a) for a in args])


def compiled_variant(kind: str, key: tuple, args: list, device, memory: dict, lock):
    """The compile point of a kernel with its own ``compile_kernel(*key, fake=False, args=args)``
    (``coda.kernels.ce_grad``, ``coda.kernels.rope_grad``): ``memory[key]``, else :func:`load_or_compile` (kept
    in ``memory``); in a dry run its recipe is recorded and a no-op returned."""
    from .keys import device_info
    rec = recorder()
    if rec is not None:
        return rec.add(kind, key, args, device_info(device).arch, in_memory=key in memory, label=f"{kind} {key}")
    fn = memory.get(key)
    if fn is None:
        with lock:
            fn = memory.get(key)
            if fn is None:
                fn = memory[key] = load_or_compile(kind, key, args, device_info(device).arch)[0]
    return fn


# ---------------------------------------------------------------------------------------------------- recipes
@dataclasses.dataclass
class Recipe:
    """Everything another process needs to compile one kernel and store it under ``key`` (module docstring)."""
    kind: str
    params: tuple
    args: tuple  # ArgSpec per argument, in call order
    arch: str
    key: str
    label: str = ""
    fingerprint: str = ""  # structural fingerprint of the params' epilogue (checked by the worker)


def _noop(*args, **kwargs) -> None:
    return None


class Recorder:
    """The recipes met by a dry run (one per key, in order), and how many compile points were met. ``dispatcher``:
    ``coda.ops`` calls go through torch's dispatcher meanwhile (``ops._common.call``), as in a compiled graph."""

    def __init__(self, dispatcher: bool = False):
        self.dispatcher = dispatcher
        self.recipes: list = []
        self.keys: set = set()
        self.in_memory: set = set()  # keys already compiled in this process (nothing to do)
        self.calls = 0
        self._lock = threading.Lock()

    def pending(self) -> list:
        """The recipes of kernels not compiled in this process yet."""
        return [r for r in self.recipes if r.key not in self.in_memory]

    def add(self, kind: str, params: tuple, args, arch: str, in_memory: bool = False, label: str = ""):
        """Record the kernel a compile point needs; returns the no-op callable it launches instead."""
        specs = tuple(spec_of(a) for a in args)
        key = KINDS[kind][0](params, arch, specs)
        with self._lock:
            self.calls += 1
            if key in self.keys:
                return _noop
            self.keys.add(key)
            if in_memory:
                self.in_memory.add(key)
            epi = next((p for p in params if _is_epilogue(p)), None)
            self.recipes.append(Recipe(kind, tuple(params), specs, arch, key, label or kind,
                                       structure_fingerprint(epi) if epi is not None else ""))
        return _noop


def recorder() -> Optional[Recorder]:
    """The active dry run's recorder, or None (the compile points' one check)."""
    return _recorder


@contextlib.contextmanager
def recording(dispatcher: bool = False):
    """A dry run: compile points record recipes and return no-op callables (nothing compiled, nothing launched);
    launch plans are neither used nor made. Process-wide (every thread); not reentrant. ``dispatcher``: see
    :class:`Recorder`."""
    global _recorder
    rec = Recorder(dispatcher)
    with _lock:
        if _recorder is not None:
            raise RuntimeError("coda.precompile: a dry run is already recording (dry runs do not nest)")
        _recorder = rec
    try:
        yield rec
    finally:
        with _lock:
            _recorder = None


@contextlib.contextmanager
def paused():
    """Compile points work normally inside (e.g. the autotuner timing kernels on a miss during a dry run)."""
    global _recorder
    with _lock:
        prev, _recorder = _recorder, None
    try:
        yield
    finally:
        with _lock:
            _recorder = prev


# ------------------------------------------------------------------------------------------------ pickling
def _is_epilogue(obj: Any) -> bool:
    from coda.kernels.epilogue import Epilogue
    return isinstance(obj, Epilogue)


def _structure(obj: Any, out: list, depth: int = 0) -> None:
    import sympy as sp
    if depth > 20:
        out.append("...")
    elif isinstance(obj, sp.Basic):  # the DSL's DAG key: no srepr (it sorts Add / Mul arguments, asking sympy's
        # assumptions, which can raise InconsistentAssumptions on an unevaluated -1*0.0; and its tree grows
        # exponentially with reused subexpressions)
        from coda.dsl import _dag_key
        out.append(repr(_dag_key([obj])[0]))
    elif isinstance(obj, dict):
        for k in sorted(obj, key=repr):
            out.append(repr(k))
            _structure(obj[k], out, depth + 1)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = sorted(obj, key=repr) if isinstance(obj, (set, frozenset)) else obj
        out.append(f"{type(obj).__name__}[")
        for x in items:
            _structure(x, out, depth + 1)
        out.append("]")
    elif callable(obj) and not isinstance(obj, type):
        out.append("<callable>")
    else:
        out.append(repr(obj))


def structure_fingerprint(epi: Any) -> str:
    """sha256 over the epilogue's class and every attribute (sympy expressions as DAGs; its Python function
    left out): equal in a worker iff the unpickled epilogue emits the same code."""
    out = [f"{type(epi).__module__}.{type(epi).__qualname__}"]
    for name in sorted(vars(epi)):
        if name != "fn":
            out.append(name)
            _structure(vars(epi)[name], out)
    return hashlib.sha256("\x00".join(out).encode()).hexdigest()


def _traced_elsewhere(*args, **kwargs):
    """The ``fn`` of an epilogue unpickled in a worker: it was traced in the parent."""
    raise RuntimeError("this epilogue was traced in another process; its Python function is not here")


def _restore_epilogue(cls: type, state: dict):
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return obj


class _Pickler(pickle.Pickler):
    """Pickles a traced epilogue (``coda.dsl.DslEpilogue``) by its state without its Python function (a closure
    or a local function would not pickle; the kernel is generated from the expressions)."""

    def reducer_override(self, obj):
        if _is_epilogue(obj) and callable(vars(obj).get("fn")):
            state = dict(vars(obj))
            state["fn"] = _traced_elsewhere  # (a function, as fn was: not part of the key's fingerprint)
            return _restore_epilogue, (type(obj), state)
        return NotImplemented


def dumps(recipe: Recipe) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(recipe)
    return buf.getvalue()


def loads(data: bytes) -> Recipe:
    """Unpickle a recipe; sympy objects are rebuilt as they were (no evaluation, no re-simplification)."""
    import sympy
    with sympy.evaluate(False):
        return pickle.loads(data)


# ---------------------------------------------------------------------------------------------- compiling
class RecipeError(RuntimeError):
    """A recipe that does not reproduce its key or its epilogue in this process."""


def compile_recipe(recipe: Recipe) -> str:
    """Compile ``recipe`` here and store it under its key; returns ``"disk"`` (already stored) or ``"compiled"``.
    Raises :class:`RecipeError` if this process computes another key or epilogue structure (another CODA source,
    an epilogue that did not survive pickling)."""
    from . import compile_cache
    epi = next((p for p in recipe.params if _is_epilogue(p)), None)
    if epi is not None and structure_fingerprint(epi) != recipe.fingerprint:
        raise RecipeError(f"{recipe.label}: the epilogue differs after unpickling")
    key = KINDS[recipe.kind][0](recipe.params, recipe.arch, recipe.args)
    if key != recipe.key:
        raise RecipeError(f"{recipe.label}: this process computes key {key[:12]}, the recipe says "
                          f"{recipe.key[:12]} (another CODA source or cutlass-dsl?)")
    if compile_cache.stored(key):
        return "disk"
    args = [build_arg(s) for s in recipe.args]
    import torch  # a process without a GPU (or CUTE_DSL_ARCH) is told the arch; the object is the same
    options = None if os.environ.get("CUTE_DSL_ARCH") or torch.cuda.is_available() else f"--gpu-arch={recipe.arch}"
    _, how = KINDS[recipe.kind][1](recipe.params, args, recipe.arch, recipe.args, options)
    if not compile_cache.stored(key):
        raise RecipeError(f"{recipe.label}: compiled but not stored (see the warning above)")
    return how


def _worker_init(arch: str) -> None:
    """Spawned worker: compile for the parent's arch without a GPU (none is visible: no CUDA context, no device
    memory taken; the environment it was started with says so already); import cutlass once."""
    os.environ["CUTE_DSL_ARCH"] = arch
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import cutlass.cute  # noqa: F401


def _worker_compile(payload: bytes) -> tuple:
    """(index, how or None, seconds, error) of one pickled ``(index, recipe)``."""
    t = time.perf_counter()
    i = -1
    try:
        i, data = payload
        how = compile_recipe(loads(data))
        return i, how, time.perf_counter() - t, ""
    except Exception as e:
        msg = str(e).splitlines()[0][:300] if str(e) else ""
        return i, None, time.perf_counter() - t, f"{type(e).__name__}: {msg}"


def worker_count(n_recipes: int, workers: Optional[int] = None) -> int:
    """Worker processes for ``n_recipes``: ``workers``, else ``CODA_COMPILE_WORKERS``, else min(n, cores - 1, 8);
    0 = none."""
    if workers is None:
        env = os.environ.get("CODA_COMPILE_WORKERS", "").strip()
        if env:
            try:
                workers = int(env)
            except ValueError:
                raise ValueError(f"CODA_COMPILE_WORKERS: expected an integer >= 0, got {env!r}") from None
            if workers < 0:
                raise ValueError(f"CODA_COMPILE_WORKERS: expected an integer >= 0, got {env!r}")
        else:
            workers = min(8, max((os.cpu_count() or 2) - 1, 1))
    return max(0, min(int(workers), n_recipes))


@dataclasses.dataclass
class Summary:
    """What :func:`compile_recipes` (``coda.precompile``) did."""
    found: int = 0  # distinct kernels the dry run met
    cached: int = 0  # already in memory or on disk
    compiled: int = 0  # compiled and stored now (workers or the parent)
    in_parent: int = 0  # of those, compiled in this process (unpicklable recipe, or a worker failed)
    failed: int = 0  # could not be compiled ahead (the step compiles them as before)
    workers: int = 0
    seconds: float = 0.0
    errors: list = dataclasses.field(default_factory=list)
    kinds: dict = dataclasses.field(default_factory=dict)  # kind of kernel -> how many found ("gemm", "ce_grad", ...)

    def count(self, how: Optional[str], err: str = "") -> bool:
        """Tally one kernel's outcome (``how``: "compiled" or "disk"; None: not compiled, ``err`` says why);
        whether it is stored."""
        if how is None:
            self.errors.append(err)
            return False
        self.compiled += how == "compiled"
        self.cached += how == "disk"
        return True

    def __str__(self) -> str:
        s = (f"coda.precompile: {self.found} kernels, {self.cached} cached, {self.compiled} compiled "
             f"({self.workers} workers, {self.in_parent} in this process), {self.seconds:.1f} s")
        return s + (f"; {self.failed} failed: {self.errors[0]}" if self.failed else "")


def compile_recipes(recipes, workers: Optional[int] = None, background: bool = False):
    """Compile the recipes not yet stored, in spawned worker processes (:func:`worker_count`), into the disk cache.
    Never raises for a recipe that fails (the step then compiles it as before; counted in ``failed``).
    ``background``: return a :class:`Background` as soon as the workers are started (recipes that cannot go to a
    worker are left to the step); else the :class:`Summary` when all is done."""
    from . import compile_cache
    t0 = time.perf_counter()
    recipes = list(recipes)
    for r in recipes:
        if not isinstance(r, Recipe):
            raise TypeError(f"coda.precompile: expected Recipe objects, got {type(r).__name__}")
    s = Summary(found=len(recipes))
    for r in recipes:
        s.kinds[r.kind] = s.kinds.get(r.kind, 0) + 1

    def nothing_to_start():  # the summary as it stands: no worker compiles anything
        s.seconds = time.perf_counter() - t0
        return Background(s, [], [], None, [], t0) if background else s
    if not compile_cache.enabled() or not compile_cache._usable():
        why = "CODA_COMPILE_CACHE=0" if not compile_cache.enabled() else "the cache dir is not usable"
        if recipes:
            warnings.warn(f"coda.precompile: {why}; the kernels compile in the step", compile_cache.CacheFileWarning,
                          stacklevel=2)
        return nothing_to_start()
    todo = [r for r in recipes if not compile_cache.stored(r.key)]
    s.cached = len(recipes) - len(todo)
    n = worker_count(len(todo), workers)
    if n == 0:  # no workers: a dry run only; the step compiles what is missing
        return nothing_to_start()
    payloads, parent = [], []
    for i, r in enumerate(todo):
        try:
            payloads.append((i, dumps(r)))
        except Exception:  # e.g. a hand-written epilogue holding a lambda
            parent.append(r)
    s.workers = min(n, len(payloads))
    if background:
        s.failed += len(parent)  # not compiled ahead: the step compiles them
        started = _start_workers(payloads, s.workers, todo[0].arch) if payloads else (None, [])
        return Background(s, todo, payloads, *started, t0)
    if payloads:
        for i, how, _, err in _run_workers(payloads, s.workers, todo[0].arch):
            if not s.count(how, err):
                parent.append(todo[i] if i >= 0 else None)
    for r in parent:
        if r is None:
            continue
        try:
            how = compile_recipe(r)
            s.in_parent += how == "compiled"
            s.count(how)
        except Exception as e:
            s.failed += 1
            s.errors.append(f"{r.label}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    s.seconds = time.perf_counter() - t0
    return s


def _run_workers(payloads: list, n: int, arch: str) -> list:
    """Results of :func:`_worker_compile` over ``payloads`` in ``n`` spawned processes, started with no GPU visible
    and ``CUTE_DSL_ARCH`` = ``arch`` (from their first line: the main script they import again included). A pool
    that breaks (a worker killed, a script without ``if __name__ == "__main__":``) gives every unfinished payload an
    error (the parent then compiles it) instead of hanging."""
    return _collect(payloads, *_start_workers(payloads, n, arch))


def _start_workers(payloads: list, n: int, arch: str) -> tuple:
    """(executor, futures): the pool started and every payload submitted -- the worker processes are spawned here,
    under the environment they must inherit (set for this call only) -- or (None, []) if the pool failed."""
    import concurrent.futures as cf
    import multiprocessing as mp
    try:
        ex = cf.ProcessPoolExecutor(n, mp_context=mp.get_context("spawn"), initializer=_worker_init, initargs=(arch,))
        with _environ(CUTE_DSL_ARCH=arch, CUDA_VISIBLE_DEVICES=""):  # what the workers inherit
            return ex, [ex.submit(_worker_compile, p) for p in payloads]
    except Exception as e:
        warnings.warn(f"coda.precompile: the compile workers failed ({type(e).__name__}: {e}); compiling in this "
                      "process", RuntimeWarning, stacklevel=3)
        return None, []


def _collect(payloads: list, ex, futures: list, on_result=None) -> list:
    """The results of ``futures`` as they finish (``on_result(result)`` for each, failures included), then the
    pool shut down; an unfinished payload gets an error result."""
    import concurrent.futures as cf
    results, done = [], set()
    try:
        for f in cf.as_completed(futures):
            try:
                res = f.result()
            except Exception as e:  # BrokenProcessPool: the rest fail alike
                warnings.warn(f"coda.precompile: a compile worker failed ({type(e).__name__}: {e}); compiling "
                              "the rest in this process", RuntimeWarning, stacklevel=3)
                break
            results.append(res)
            done.add(res[0])
            if on_result is not None:
                on_result(res)
    finally:
        if ex is not None:
            ex.shutdown(wait=True, cancel_futures=True)
    rest = [(i, None, 0.0, "worker pool failed") for i, _ in payloads if i not in done]
    for res in rest:
        if on_result is not None:
            on_result(res)
    return results + rest


class Background:
    """A precompile whose workers run while the caller goes on (``coda.precompile(..., background=True)``): the
    kernels being compiled are registered in flight, so a compile point that meets one waits for its worker and
    loads the object (instead of compiling it again beside the worker); one that failed in its worker is compiled
    by the step, as without a precompile. :meth:`wait` returns the :class:`Summary`."""

    def __init__(self, summary: "Summary", todo: list, payloads: list, ex, futures: list, t0: float):
        self.summary, self._t0 = summary, t0
        self._events = {todo[i].key: threading.Event() for i, _ in payloads}
        with _lock:
            _inflight.update(self._events)
        self._thread = threading.Thread(target=self._run, args=(todo, payloads, ex, futures), daemon=True,
                                        name="coda.precompile")
        self._thread.start()

    def _run(self, todo, payloads, ex, futures) -> None:
        s = self.summary
        try:
            _collect(payloads, ex, futures, on_result=lambda res: self._finished(todo, res))
        finally:
            for key, ev in self._events.items():  # nothing may wait forever
                ev.set()
                with _lock:
                    if _inflight.get(key) is ev:
                        del _inflight[key]
            s.seconds = time.perf_counter() - self._t0

    def _finished(self, todo, res) -> None:
        i, how, _, err = res
        if not self.summary.count(how, err):
            self.summary.failed += 1  # the step compiles it
        if 0 <= i < len(todo):
            ev = self._events.get(todo[i].key)
            if ev is not None:
                ev.set()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: Optional[float] = None) -> "Summary":
        self._thread.join(timeout)
        return self.summary

    def __str__(self) -> str:
        return str(self.summary) if self.done() else (f"coda.precompile: {self.summary.found} kernels, "
                                                       f"{len(self._events)} compiling in the background")


@contextlib.contextmanager
def _environ(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
