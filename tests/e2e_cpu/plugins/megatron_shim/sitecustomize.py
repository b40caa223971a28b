"""Test-only: installs the megatron-core CPU shim (tests/megatron_cpu_shim.py) in every process of a train.py run
that imports megatron, so that `--train-backend megatron` runs end to end on CPU (tests/e2e_cpu/
test_context_parallel_train.py).

Python imports `sitecustomize` at start-up from the first folder of PYTHONPATH that has one; the test puts this
folder first for train.py, and Ray's workers inherit the driver's PYTHONPATH. The shim must be in place before any
megatron module is imported (it turns TorchDynamo off before megatron-core's fused functions are decorated), so an
import hook installs it when `megatron` or slime's Megatron backend is first imported (whichever comes first:
the backend checks for CUDA before it imports megatron, and the shim replaces that check). An hf engine server
(`python -m slime.backends.hf_engine`) never gets it: the shim's device redirections are for megatron-core's code
only.
"""

import importlib.abc
import sys


class _InstallShimFirst(importlib.abc.MetaPathFinder):
    def __init__(self):
        self.installing = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in ("megatron", "slime.backends.megatron_utils") or self.installing:
            return None
        self.installing = True
        sys.meta_path.remove(self)
        from tests import megatron_cpu_shim

        megatron_cpu_shim.install()
        return None  # the regular finders do the import (of a module the shim may have imported already)


if "slime.backends.hf_engine" not in sys.orig_argv:
    sys.meta_path.insert(0, _InstallShimFirst())
