"""``python -m bagua_algos.compat {path,install,uninstall}``.

- ``path``: print the directory to put on PYTHONPATH so ``import bagua`` resolves to the
  compatibility package (``PYTHONPATH=$(python -m bagua_algos.compat path) torchrun ...``);
- ``install``: make ``import bagua`` work everywhere in this environment (torchrun, plain
  python, ``python -m bagua.distributed.launch``) with a ``.pth`` file in site-packages.
  Refused when a real Bagua is installed. A ``.pth`` entry goes after site-packages on
  ``sys.path``, so a real Bagua installed later still wins: nothing is ever shadowed;
- ``uninstall``: remove that file.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig

from . import compat_path, find_real_bagua

PTH_NAME = "bagua_algos_compat.pth"


def pth_file() -> str:
    return os.path.join(sysconfig.get_paths()["purelib"], PTH_NAME)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bagua_algos.compat", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["path", "install", "uninstall"])
    args = parser.parse_args(argv)
    if args.action == "path":
        print(compat_path())
        return 0
    target = pth_file()
    if args.action == "uninstall":
        if os.path.exists(target):
            os.remove(target)
            print(f"removed {target}")
        else:
            print(f"nothing to remove ({target} does not exist)")
        return 0
    real = find_real_bagua()
    if real is not None:
        print(f"a real Bagua is installed ({real.origin}); the compatibility package is not needed", file=sys.stderr)
        return 1
    with open(target, "w") as f:
        f.write(compat_path() + "\n")
    print(f"wrote {target}: `import bagua` now resolves to bagua-algos' compatibility package")
    return 0


if __name__ == "__main__":
    sys.exit(main())
