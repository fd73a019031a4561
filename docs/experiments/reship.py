"""``python docs/experiments/reship.py FILE [STORE ...]``: rebuild ``autotune/shipped/FILE.json`` (h100_sxm, h200)
from its recorded sources and drops (as test_the_converter_makes_the_shipped_file does), plus the tuning stores
given after it (new sources); the provenance note from $RESHIP_NOTE, else the file's. Session 51 re-converted both
files this way when K = 0 passes became shippable."""
import json
import os
import sys

from coda.autotune import ship
from coda.autotune.__main__ import main as cli_main

path = ship.SHIPPED_DIR / f"{sys.argv[1]}.json"
doc = json.loads(path.read_text())
srcs = [s["file"] for s in doc["provenance"]["sources"]] + sys.argv[2:]
drops = [x for x in doc["provenance"]["skipped"] if x.get("dropped")]
note = os.environ.get("RESHIP_NOTE") or doc["provenance"].get("note", "")
path.unlink()
gpu = doc["gpu"]  # (tuner-table rows do not name their GPU)
rc = cli_main([*sum((["--ship-from", s] for s in srcs), []), "--gpu", gpu["name"], "--sm-count", str(gpu["sm_count"]),
               "--cutlass-dsl", doc["cutlass_dsl"], "--note", note,
               *sum((["--drop", f"{x['key']}={x['why']}"] for x in drops), [])])
sys.exit(rc)
