"""``python -m coda.check --arch sm_90a``: compile every GEMM variant on this machine (no GPU needed), check that the
PTX issues ``wgmma.mma_async`` and that ``ptxas -v`` reports no spills; print a table; exit 1 on any failure.

Kernels are traced with fake tensors (dynamic M, N, K, L), so what is checked is exactly the code ``coda.gemm`` runs.

Where no ``ptxas`` on PATH can read the DSL's PTX (none installed, or an older toolkit than the DSL's compiler: on
a machine with a driver the DSL may emit a newer ``.version`` than the CUDA 13.0 ptxas reads), registers and the
stack frame come from the cubin the DSL itself built (its ELF ``.nv.info`` attributes, what ``cuobjdump
-res-usage`` prints): spills live in the stack frame, so a frame of 0 bytes means none (a nonzero frame is reported
as spilled bytes, local arrays included). ``row["spill_check"]`` says which was used.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time

from .config import GemmConfig, all_configs
from .kernels.epilogue import IDENTITY, Epilogue


def fake_args(epi: Epilogue, in_dtype: str = "bf16", out_dtype: str = "bf16", majors=("k", "k")):
    """Fake (shape-symbolic) tensors in the kernel's argument order: A, B, D, then the epilogue's tensors.
    ``majors``: the contiguous dim of A and B, "k" (K-major, the default) or "mn" (M / N contiguous)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor
    dt = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": cutlass.Float32}
    M, L = cute.sym_int32(), cute.sym_int32()
    N, K = cute.sym_int32(divisibility=8), cute.sym_int32(divisibility=8)

    def mat(d, r, c, major="k"):
        order = (1, 0, 2) if major == "k" else (0, 1, 2)
        return make_fake_compact_tensor(dt[d], (r, c, L), stride_order=order, assumed_align=16)

    def f32(*shape, order=None):
        return make_fake_compact_tensor(cutlass.Float32, shape, stride_order=order, assumed_align=16)

    xs = []
    for op in epi.operands:
        xs.append({"vec_n": lambda: f32(N), "vec_m": lambda: f32(M, L, order=(0, 1)),
                   "scalar": lambda: f32(1), "tile": lambda: mat(out_dtype, M, N)}[op.kind]())
    xs += [mat(out_dtype, M, N) for _ in epi.outputs]
    for r in epi.kernel_reductions():
        xs.append(f32(M if r.axis == "n" else N, cute.sym_int32(), L, order=(0, 1, 2)))
    return [mat(in_dtype, M, K, majors[0]), mat(in_dtype, N, K, majors[1]), mat(out_dtype, M, N)], xs


def compile_variant(cfg: GemmConfig, epi: Epilogue = IDENTITY, in_dtype="bf16", out_dtype="bf16",
                    arch="sm_90a", majors=("k", "k"), count=(), even=(False, False),
                    sass: bool = False) -> dict:
    """Compile one variant for ``arch``; returns {'ok', 'seconds', 'wgmma', 'registers', 'spill_bytes', 'error'}
    and, for each PTX instruction prefix in ``count`` (e.g. ``"sin.approx"``), row['count'][prefix] = how many
    times it occurs in the PTX. ``even``: the kernel's (M, N) whole-tile flags (``GemmSm90``). ``sass``: also
    row['sass'] = {opcode: count} of the cubin's SASS (``nvdisasm`` on PATH; else absent); row['ptx_instructions']:
    the PTX's instruction lines."""
    import cutlass.cute as cute
    import cutlass.runtime as crt
    from .kernels.gemm_sm90 import GemmSm90
    row = dict(config=cfg.name, epilogue=epi.name, dtypes=f"{in_dtype}->{out_dtype}", majors="".join(majors)
               if majors != ("k", "k") else "", ok=False, seconds=0.0,
               wgmma=0, registers=None, spill_bytes=None, error="")
    with tempfile.TemporaryDirectory() as d:
        try:
            t = time.time()
            (a, b, c), xs = fake_args(epi, in_dtype, out_dtype, majors)
            from cutlass.cute.runtime import make_fake_compact_tensor
            import cutlass
            if cfg.sched == "dynamic":  # the tile counter (kernels/schedule.py), after the epilogue's tensors
                xs.append(make_fake_compact_tensor(cutlass.Int32, (2,), assumed_align=16))
            if cfg.splits > 1:  # the split-K workspace and flags (kernels/split_k.py), after the epilogue's tensors
                xs += [make_fake_compact_tensor(cutlass.Float32, (1 << 20,), assumed_align=16),
                       make_fake_compact_tensor(cutlass.Int32, (1024,), assumed_align=16)]
            cute.compile(GemmSm90(cfg, epi, even=even), a, b, c, 132 // (cfg.cluster_m * cfg.cluster_n),
                         crt.make_fake_stream(), *xs,
                         options=f"--gpu-arch={arch} --keep-ptx --keep-cubin --dump-dir={d}")
            row["seconds"] = time.time() - t
            ptx, cubin = ([os.path.join(d, f) for f in os.listdir(d) if f.endswith(ext)] for ext in (".ptx", ".cubin"))
            if len(ptx) != 1:
                raise RuntimeError(f"expected one PTX file, found {len(ptx)}")
            text = open(ptx[0]).read()
            row["wgmma"] = text.count("wgmma.mma_async")
            if sass and shutil.which("nvdisasm") and len(cubin) == 1:
                row["sass"] = sass_histogram(cubin[0])
            row["count"] = {c: len(re.findall(r"^\s*(?:@!?%p\d+\s+)?" + re.escape(c), text, re.M)) for c in count}
            row["ptx_instructions"] = len(re.findall(r"^\s*(?:@!?%p\d+\s+)?[a-z][a-z0-9_.:]*[\s;]", text, re.M))
            out = _ptxas_v(ptx[0], arch)
            if out is not None:
                row["registers"] = int(re.search(r"Used (\d+) registers", out).group(1))
                row["spill_bytes"] = sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", out))
                row["spill_check"] = "ptxas -v"
            else:
                if len(cubin) != 1:
                    raise RuntimeError(f"no ptxas reads this PTX and expected one cubin, found {len(cubin)}")
                row["registers"], row["spill_bytes"] = cubin_resources(open(cubin[0], "rb").read())
                row["spill_check"] = "cubin"
            problems = []
            if row["wgmma"] == 0:
                problems.append("no wgmma.mma_async in the PTX")
            if row["spill_bytes"]:
                problems.append(f"{row['spill_bytes']} bytes of spills")
            row["ok"], row["error"] = not problems, "; ".join(problems)
        except subprocess.CalledProcessError as e:  # ptxas failed on the PTX (not for its .version)
            fatal = [ln for ln in (e.stderr or "").splitlines() if "fatal" in ln]
            row["error"] = f"ptxas failed: {(fatal[0] if fatal else (e.stderr or '').strip())[-200:]}"
        except Exception as e:  # reported in the table
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    return row


def sass_histogram(cubin: str) -> dict:
    """{opcode (without modifiers): count} of a cubin's SASS instructions (``nvdisasm``), and "total"."""
    text = subprocess.run(["nvdisasm", "-c", cubin], capture_output=True, text=True, check=True).stdout
    hist: dict = {}
    for m in re.finditer(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", text, re.M):
        hist[m.group(1)] = hist.get(m.group(1), 0) + 1
    hist["total"] = sum(hist.values())
    return hist


def _ptxas_v(ptx: str, arch: str):
    """``ptxas -v``'s report for the PTX file, or None where no ptxas on PATH reads it (none installed, or one that
    predates the PTX's ``.version``); other ptxas errors raise ``CalledProcessError``."""
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        return None
    r = subprocess.run([ptxas, f"-arch={arch}", "-v", ptx, "-o", os.devnull], capture_output=True, text=True)
    if r.returncode and "Unsupported .version" in r.stderr:
        return None
    if r.returncode:
        raise subprocess.CalledProcessError(r.returncode, r.args, r.stdout, r.stderr)
    return r.stderr


EIATTR_FRAME_SIZE, EIATTR_REGCOUNT = 0x11, 0x2F  # .nv.info attributes (EIFMT_SVAL payload: symbol index, value)


def nv_info_attributes(elf: bytes):
    """(offset, format, attribute, size or value) of every entry of a cubin's ``.nv.info`` section (64-bit
    little-endian ELF); an EIFMT_SVAL entry (format 4) is followed by ``size`` bytes of payload."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF (cubin)")
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names = heads[shstrndx][4]
    for h in heads:
        if elf[names + h[0]:elf.index(b"\0", names + h[0])] != b".nv.info":
            continue
        p, end = h[4], h[4] + h[5]
        while p < end:
            fmt, attr, val = struct.unpack_from("<BBH", elf, p)
            yield p, fmt, attr, val
            p += 4 + (val if fmt == 4 else 0)


def cubin_resources(elf: bytes) -> tuple:
    """(registers, stack frame bytes) of the kernel in a cubin, the largest over its functions, read from the
    ``.nv.info`` section's REGCOUNT and FRAME_SIZE attributes."""
    regs, frame = {}, {}
    for p, fmt, attr, _ in nv_info_attributes(elf):
        if fmt == 4 and attr in (EIATTR_REGCOUNT, EIATTR_FRAME_SIZE):
            sym, v = struct.unpack_from("<II", elf, p + 4)
            (regs if attr == EIATTR_REGCOUNT else frame)[sym] = v
    if not regs:
        raise ValueError("no register count in the cubin's .nv.info")
    return max(regs.values()), max(frame.values(), default=0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--dtypes", default="bf16->bf16,fp16->fp16,bf16->fp32")
    args = ap.parse_args(argv)
    if args.arch != "sm_90a":
        print(f"only sm_90a is supported (wgmma, setmaxnreg), got {args.arch}")
        return 2
    rows = []
    for cfg in all_configs():
        for pair in args.dtypes.split(","):
            i, o = pair.split("->")
            rows.append(compile_variant(cfg, IDENTITY, i, o, args.arch))
            r = rows[-1]
            print(f"{'ok  ' if r['ok'] else 'FAIL'} {r['config']:28s} {r['dtypes']:12s} {r['seconds']:5.2f}s "
                  f"wgmma={r['wgmma']:3d} regs={r['registers']} spills={r['spill_bytes']} "
                  f"({r.get('spill_check', '-')}) {r['error']}", flush=True)
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(bad)} passed, {len(bad)} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
