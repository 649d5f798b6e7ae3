"""Test-wide setup: ``gpu`` tests run only where a Hopper (sm_90) GPU is visible; each session compiles from an
empty TorchInductor cache; benchmarks/smem_banks.py, inverse_latency.py, ncu_regions.py and sass_groups.py are the
fixtures of their names."""

import importlib.util
import os
from pathlib import Path

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


def benchmark_script(name: str):
    """benchmarks/<name>.py (a script beside the benchmarks, not a module of the package), loaded."""
    path = Path(__file__).parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def smem_banks():
    return benchmark_script("smem_banks")


@pytest.fixture(scope="session")
def inverse_latency():
    return benchmark_script("inverse_latency")


@pytest.fixture(scope="session")
def ncu_regions():
    return benchmark_script("ncu_regions")


@pytest.fixture(scope="session")
def sass_groups():
    return benchmark_script("sass_groups")


def pytest_collection_modifyitems(config, items):
    if hopper_visible():
        return
    skip = pytest.mark.skip(reason="needs a Hopper (sm_90) GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
