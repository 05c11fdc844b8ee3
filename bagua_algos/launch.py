"""``python -m bagua_algos.launch``: see :mod:`bagua_algos.runtime.launch`."""

from bagua_algos.runtime.launch import main

if __name__ == "__main__":
    main()
