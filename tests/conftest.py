"""Shared test set-up.

The Triton kernels run on the CPU under Triton's interpreter; it must be switched on before
``triton`` is first imported, so it is set here, before any test module imports the kernels.
"""

import os

import pytest

_HAS_CUDA_DRIVER = os.path.exists("/dev/nvidiactl")
if not _HAS_CUDA_DRIVER:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402  (after TRITON_INTERPRET)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
