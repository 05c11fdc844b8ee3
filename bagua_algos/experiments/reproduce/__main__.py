"""``python -m bagua_algos.experiments.reproduce``: the command line of the package."""

import sys

from bagua_algos.experiments.reproduce.cli import main

sys.exit(main())
