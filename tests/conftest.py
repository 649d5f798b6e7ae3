"""Test-wide setup: ``gpu`` tests run only where a Hopper (sm_90) GPU is visible; each session compiles from an
empty TorchInductor cache."""

import os

import pytest
import torch


def hopper_visible() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture(autouse=True, scope="session")
def fresh_inductor_cache(tmp_path_factory):
    """Every test session compiles from an empty TorchInductor cache: an entry written by an earlier build of
    tilela's custom ops (another schema) would otherwise be replayed for a graph that calls them with their default
    arguments, whose cache key is the same."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("inductor"))


def pytest_collection_modifyitems(config, items):
    if hopper_visible():
        return
    skip = pytest.mark.skip(reason="needs a Hopper (sm_90) GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
