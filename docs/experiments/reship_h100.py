"""Rebuild autotune/shipped/h100_sxm.json from its recorded sources and drops (as
test_the_converter_makes_the_shipped_file does), plus the stores given on the command line (new sources), then
the provenance note from $RESHIP_NOTE (else the file's)."""
import json
import os
import sys

from coda.autotune import ship
from coda.autotune.__main__ import main as cli_main

path = ship.SHIPPED_DIR / "h100_sxm.json"
doc = json.loads(path.read_text())
srcs = [s["file"] for s in doc["provenance"]["sources"]] + sys.argv[1:]
drops = [x for x in doc["provenance"]["skipped"] if x.get("dropped")]
note = os.environ.get("RESHIP_NOTE") or doc["provenance"].get("note", "")
path.unlink()
rc = cli_main([*sum((["--ship-from", s] for s in srcs), []), "--gpu", doc["gpu"]["name"], "--sm-count", "132",
               "--cutlass-dsl", doc["cutlass_dsl"], "--note", note, *sum((["--drop", f"{x['key']}={x['why']}"] for x in drops), [])])
sys.exit(rc)
