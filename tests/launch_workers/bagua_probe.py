"""Worker for tests/test_bagua_compat.py: which ``bagua`` would a Bagua script get?

Usage: bagua_probe.py OUT_FILE
Writes OUT_FILE (JSON): the worker's PYTHONPATH and the file of ``import bagua``
(or the error it raised).
"""

import json
import os
import sys


def main():
    record = {"PYTHONPATH": os.environ.get("PYTHONPATH")}
    try:
        import bagua
    except ImportError as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
    else:
        record["file"] = os.path.realpath(bagua.__file__)
        record["fake"] = bool(getattr(bagua, "FAKE_REAL_BAGUA", False))
    with open(sys.argv[1], "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
