"""Bagua compatibility package: ``import bagua.torch_api as bagua`` runs on bagua-algos.

This directory is put on the workers' ``PYTHONPATH`` by ``python -m bagua_algos.launch``
(and by ``python -m bagua_algos.compat install`` for torchrun or plain python) only when
no real Bagua is installed: a real Bagua is never shadowed. Scripts and algorithm files
written for Bagua 0.9 then run unchanged on the plugin's runtime, on CPU (gloo) and GPU
(NCCL). Without a GPU, torch.cuda's stream and event calls that Bagua's own code makes
become no-ops (see ``bagua_algos.runtime.cuda_fallback``).
"""

from bagua_algos.runtime import cuda_fallback as _cuda_fallback

_cuda_fallback.install()

from . import torch_api  # noqa: E402,F401

__version__ = "0.9.2+bagua_algos"
