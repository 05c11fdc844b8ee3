"""``python -m bagua_algos.experiments COMMAND ...``: the same as ``bagua-algos``."""

from bagua_algos.experiments.cli import main

raise SystemExit(main())
