"""What CODA's memory-bound row kernels share (``coda.kernels.rope_grad``, ``coda.kernels.embedding_adamw``): the
16-byte row view the kernels read through, and the launch path -- compile once per variant (disk cache, dry runs:
``coda.runtime.precompile.compiled_variant``), then a ``coda._launch.Plan`` per (shapes, strides, dtypes) so that
later calls only write the data pointers and the stream."""

import threading

import torch

from coda.runtime import precompile

VEC = 8  # 16-bit elements per 16-byte access


def rows(t):
    """(R, C) ``t`` (a cute tensor, inside a ``cute.jit`` function) with a row stride the compiler knows to be a
    multiple of 8 elements (16-byte chunks)."""
    import cutlass.cute as cute
    ld = cute.assume(t.stride[0], divby=VEC)
    return cute.make_tensor(t.iterator, cute.make_layout((t.shape[0], t.shape[1]), stride=(ld, 1)))


class Launcher:
    """The launches of one row kernel (``kind``: its module's name under ``coda.kernels``, whose
    ``compile_kernel(*params, fake=False, args=...)`` builds a variant). ``layout``: per view (the kernel's tensor
    arguments in order, the stream inserted fourth) its (assumed alignment in bytes, leading dim) for
    ``from_dlpack(...).mark_layout_dynamic``."""

    MAX_PLANS = 64  # shapes that change every call (e.g. varying sequence lengths): keep the table small

    def __init__(self, kind: str, layout: tuple):
        self.kind, self.layout = kind, layout
        self.compiled: dict = {}
        self.plans: dict = {}
        self.lock = threading.Lock()

    def cute_args(self, views: list, handle: int) -> list:
        """The DSL arguments of a call on ``views``: each marked with its ``layout`` entry, the stream fourth (the
        argument order of ``coda._launch.Plan``)."""
        import cuda.bindings.driver as cuda
        from cutlass.cute.runtime import from_dlpack
        args = [from_dlpack(v, assumed_align=a).mark_layout_dynamic(leading_dim=ld)
                for v, (a, ld) in zip(views, self.layout)]
        args.insert(3, cuda.CUstream(handle))
        return args

    def __call__(self, views: list, params: tuple) -> None:
        """Run the variant ``params`` (e.g. the element type) on ``views``: the first call of a (shapes, strides,
        dtypes) goes through the DSL's marshalling and leaves a plan, later calls only write the pointers."""
        from coda import _launch
        dev = views[0].device
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        handle = _launch.stream_handle(index)
        key = tuple(_launch.tensor_sig(v) for v in views)
        dry = precompile.recorder() is not None  # a dry run (coda.runtime.precompile): no plan is used or made
        plan = None if dry else self.plans.get(key)
        if plan is not None:
            plan.launch([v.data_ptr() for v in views], handle)
            return
        cute_args = self.cute_args(views, handle)
        fn = precompile.compiled_variant(self.kind, params, cute_args, dev, self.compiled, self.lock)
        with torch.cuda.device(dev):
            fn(*cute_args)
        if dry:
            return
        try:
            plan = _launch.Plan(fn, cute_args, views, handle)
        except _launch.PlanError:
            return  # the DSL marshals differently: every call takes the path above
        if len(self.plans) >= self.MAX_PLANS:
            self.plans.clear()
        self.plans[key] = plan
