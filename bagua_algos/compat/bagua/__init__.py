"""Placeholder of the compatibility package ``bagua`` (scripts written for Bagua do
``import bagua.torch_api as bagua``); its contents are written separately.

``python -m bagua_algos.launch`` puts the directory above this one
(:func:`bagua_algos.compat.compat_path`) first on the workers' PYTHONPATH when no
real Bagua is installed.
"""
