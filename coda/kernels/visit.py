"""Helpers of ``GemmSm90``'s epilogue (phase 3b, ``kernels/gemm_sm90.py``) and of the epilogue warps
(``kernels/epilogue_wg.py``), traced inside the kernel: which accumulator register holds which sub-tile element,
the static coordinate groups of thread 0's registers, the hook's calls per element or per column pair, and the
masking and combining of reductions."""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute

from .epilogue import odd_key


class EpilogueVisit:
    """Mixed into ``GemmSm90``: uses its ``cfg``, ``epi``, ``epi_tile``, ``epi_threads``, ``pair_mode`` and
    ``even``."""

    @cute.jit
    def _store_if(self, t, idx, val, pred):
        if pred:
            t[idx] = val

    # -- helpers traced inside the epilogue ---------------------------------------------------------------------
    @staticmethod
    def _combine(op, a, b):
        return a + b if op == "sum" else cute.arch.fmax(a, b, nan=True)

    def _acc_map(self, tiled_mma, c_sub, n_v, n_epi, epi_n=None):
        """acc_of[e][v]: the accumulator register holding sub-tile e's register v (sub-tiles of ``epi_n`` columns,
        default the config's). Matched through thread 0's static coordinates (the accumulator and the sub-tile
        registers are the same values, reindexed)."""
        epi_n = epi_n or self.cfg.epi_n
        c_acc = tiled_mma.get_slice(0).partition_C(cute.make_identity_tensor((self.cfg.tile_m, self.cfg.tile_n)))
        where = {}
        for j in range(cute.size(c_acc)):
            r, c = c_acc[j]
            where[(int(r), int(c))] = j
        out = []
        for e in range(n_epi):
            out.append([where[(c_sub[v][0], c_sub[v][1] + e * epi_n)] for v in range(n_v)])
        return out

    @staticmethod
    def _static_coords(c, n_v):
        """[(row, col)] of a static coordinate tensor's first n_v registers, as Python ints."""
        return [(int(c[v][0]), int(c[v][1])) for v in range(n_v)]

    @staticmethod
    def _groups(c_static, n_v):
        """Group register indices by the static row / column of thread 0's sub-tile coordinates."""
        rows, cols = {}, {}
        for v in range(n_v):
            r, c = c_static[v]
            rows.setdefault(int(r), []).append(v)
            cols.setdefault(int(c), []).append(v)
        return [rows[k] for k in sorted(rows)], [cols[k] for k in sorted(cols)]

    def _check_affine(self, epi, c_static, n_v):
        ident = cute.make_identity_tensor(self.epi_tile)
        for t in sorted({1, 31, 32, 63, self.epi_threads - 1}):
            c_t = self._static_coords(epi["tiled"].get_slice(t).partition_S(ident), n_v)
            for v in range(n_v):
                for i in (0, 1):
                    if c_t[v][i] - c_t[0][i] != c_static[v][i] - c_static[0][i]:
                        raise RuntimeError(f"epilogue coordinates are not affine in (thread, register): "
                                           f"thread {t}, register {v}")

    def _visit_all(self, rD, lazy, n_v):
        """Call the hook on every element; returns {key: [value per register]}."""
        out = {}
        for v in range(n_v):
            res = self.epi.visit(rD[v], lazy.env(v))
            self._mask_reductions(res, lazy, v)
            for key, val in res.items():
                out.setdefault(key, []).append(val)
        return out

    def _visit_pairs(self, rD, lazy, c_static, n_v):
        """Call the hook once per column pair (2j, 2j+1): in the accumulator fragment a thread holds both columns
        of a pair in consecutive registers (checked on thread 0's static coordinates). Operands are indexed by the
        pair j (VecN of N/2, TileMN of M x N/2). Returns {key: [one value per pair]}, or for a 2 -> 2 epilogue
        {output: [one value per register]} (the main output and each extra one: the pair's two values)."""
        out = {}
        for p in range(n_v // 2):
            (r0, c0), (r1, c1) = c_static[2 * p], c_static[2 * p + 1]
            if r0 != r1 or c1 != c0 + 1 or c0 % 2:
                raise RuntimeError(f"registers {2 * p}, {2 * p + 1} are not a column pair: {(r0, c0)}, {(r1, c1)}")
            res = self.epi.visit((rD[2 * p], rD[2 * p + 1]), lazy.env(2 * p, pair=True))
            self._mask_reductions(res, lazy, 2 * p)
            # a reduction has one value per pair, kept in the even register, the neutral element in the odd one:
            # the per-row and per-column reductions then run over registers as usual (_reduce_m skips odd columns)
            for r in self.epi.reductions:
                out.setdefault(r.name, []).extend([res.pop(r.name), self._neutral(r.op)])
            if cutlass.const_expr(self.pair_mode == "full"):
                for k in ("out", *self.epi.outputs):
                    out.setdefault(k, []).extend([res[k], res[odd_key(k)]])
            else:
                for key, val in res.items():
                    out.setdefault(key, []).append(val)
        return out

    @staticmethod
    def _neutral(op):
        return cutlass.Float32(0.0 if op == "sum" else -math.inf)

    def _mask_reductions(self, res, lazy, v):
        """Reduction values of out-of-range elements -> the neutral element, along the reduced axis only (axis n
        masks padded columns, axis m padded rows): a padded row's (column's) own partial is never stored. No mask
        along an even axis (``even``)."""
        for r in self.epi.reductions:
            if cutlass.const_expr(self.even[r.axis == "n"]):
                continue
            res[r.name] = cutlass.select_(r.spec.inside(lazy, v), cutlass.Float32(res[r.name]), self._neutral(r.op))
