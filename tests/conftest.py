"""Test-wide setup: ``gpu`` tests run only where a Hopper (sm_90) GPU is visible."""

import pytest
import torch


def hopper_visible() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def pytest_collection_modifyitems(config, items):
    if hopper_visible():
        return
    skip = pytest.mark.skip(reason="needs a Hopper (sm_90) GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
