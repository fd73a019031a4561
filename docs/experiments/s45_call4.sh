#!/bin/bash
# Session 45, call 4 (H100): issue 30's acceptance run -- examples/llama_train.py --grad-check --compile
# --compile-fused (preset small): loss and every parameter's gradient of stock bf16, stock + compile bf16 and fused +
# compile bf16 against stock float64; prints the loss line, the max row and the largest ratio of fused + compile's
# error to stock bf16's over the parameters (the 2x rule).
cd "$(dirname "$0")/../.." || exit 1
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
timeout ${GC_S:-170} python examples/llama_train.py --device cuda --grad-check --compile --compile-fused \
    > "$OUT/gradcheck.txt" 2>&1; echo "rc=$?"
grep -E "^loss:|^parameter|^max" "$OUT/gradcheck.txt"
python3 - "$OUT/gradcheck.txt" <<'PY'
import sys
rows = [l.split() for l in open(sys.argv[1]) if l.startswith(("model.", "lm_head"))]
r = [(float(x[3]) / float(x[1]), x[0]) for x in rows if len(x) == 4]
print(f"{len(r)} parameters; fused+compile / stock bf16 error: max {max(r)[0]:.3f} ({max(r)[1]})" if r else "no rows")
PY
