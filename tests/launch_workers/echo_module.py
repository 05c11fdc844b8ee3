"""Worker for tests/test_launch.py, run with ``-m echo_module OUT_FILE ARGS...``
(the directory of this file is put on PYTHONPATH by the test).

Prints a marker line and writes its argv, rank variables and whole environment as JSON.
"""

import json
import os
import sys


def main():
    args = sys.argv[1:]
    # --set_additional_flag puts --local_rank=N before the script's own args
    out_file = next(a for a in args if not a.startswith("--local_rank="))
    print(f"echo_module running as {__name__} rank={os.environ.get('RANK')}", flush=True)
    record = {
        "name": __name__,
        "argv": args,
        "RANK": os.environ.get("RANK"),
        "WORLD_SIZE": os.environ.get("WORLD_SIZE"),
        "NODE_RANK": os.environ.get("NODE_RANK"),
        "environ": dict(os.environ),
    }
    with open(out_file, "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
