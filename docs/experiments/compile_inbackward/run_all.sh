#!/bin/bash
# Re-runs every experiment; each prints its own results. ~2-3 min on CPU.
cd "$(dirname "$0")"
for v in inputs global buffers; do for m in eager compile; do python exp1.py $v $m 2>&1 | grep -E "^\[|RESULT|frames|graph_breaks"; done; done
python exp1b.py 2>&1 | grep -E "^==|graph_count|ERROR|max\|"
python exp1d.py 2>&1 | grep -E "eager fused|ERROR" | cut -c1-300
python exp1e.py 2>&1 | grep -E "fused|study\."
for m in eager compile compile_ca; do for u in py op; do python exp2.py $m $u 2>&1 | grep -E "^\[|stats|graph_breaks|matches|ERROR"; done; done
for m in ca trace_bw; do python exp3.py $m 2>&1 | grep -E "^\[|stats|graph_breaks|matches|ERROR"; done
python exp4.py 2>&1 | grep -E "aot_eager|auto_functionalized_v2 =|copy_"
