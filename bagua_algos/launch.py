"""``python -m bagua_algos.launch``: see :mod:`bagua_algos.launcher`."""

from bagua_algos.launcher import main

if __name__ == "__main__":
    main()
