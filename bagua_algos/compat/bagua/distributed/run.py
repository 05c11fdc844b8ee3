"""``python -m bagua.distributed.run``: Bagua 0.9's elastic launcher's flags and defaults
(``--nnodes MIN:MAX``, ``--rdzv_backend c10d``, ``--max_restarts 3`` ...), run by
torchrun's elastic agent (see :mod:`bagua_algos.launcher`)."""

from bagua_algos.launcher import run_main

if __name__ == "__main__":
    run_main()
