"""The job launcher: ``python -m bagua_algos.launch`` and, under Bagua's names,
``python -m bagua.distributed.launch`` / ``bagua.distributed.run``, over torchrun's
elastic agent (docs/elastic.md, "Launchers and rendezvous").

- :mod:`.launch`  the parser, its checks and the translation to torchrun's command
                  line (``torchrun_argv``), the workers' environment, ``main`` and
                  ``run_main``;
- :mod:`.flags`   the flags as data (``FLAGS``, ``ENTRY_DEFAULTS``, ``RDZV_CONF_KEYS``);
- :mod:`.report`  the one line on stderr when a job or its rendezvous fails.

Above the runtime and the compatibility package's finder (``bagua_algos.compat``:
where the package ``bagua`` is, whether a real Bagua is installed), whose directory
it puts on the workers' path; the package ``bagua`` in turn runs this launcher as
``bagua.distributed.launch`` and ``.run``.
"""

from .launch import main, run_main

__all__ = ["main", "run_main"]
