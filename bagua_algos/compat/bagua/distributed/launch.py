"""``python -m bagua.distributed.launch``: bagua-algos' launcher (Bagua's flags, torchrun underneath)."""

from bagua_algos.launcher import main

if __name__ == "__main__":
    main(prog="bagua.distributed.launch")
