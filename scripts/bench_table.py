"""Print the markdown table of an ``omnishm bench --json`` document: python scripts/bench_table.py FILE."""

from __future__ import annotations

import json
import signal
import sys
from types import SimpleNamespace

from omnishm.bench import format_table


def main(path: str) -> int:
    with open(path) as f:
        doc = json.load(f)
    m = doc["machine"]
    print(f"omnishm bench ({doc['mode']}, device {doc.get('device', 'cpu')}), {doc['date']}, {m['cpu']}, "
          f"{m['cores']} cores, torch {m['torch']}, {doc['seconds']}s\n")
    rows = []
    for f in doc["figures"]:
        r = SimpleNamespace(**f)
        r.value, r.reference = SimpleNamespace(**f["value"]), SimpleNamespace(**f["reference"])
        rows.append(r)
    print(format_table(rows))
    for fig, err in doc["errors"].items():
        print(f"\nfigure {fig} FAILED: {err}")
    return 1 if doc["errors"] else 0


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the table quietly, as cat would
    sys.exit(main(sys.argv[1]))
