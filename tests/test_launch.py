"""The launchers' entry into a compiled kernel (kernels.hopper.launch.launch_function), without a GPU: fake kernels
standing in for TileLang's JIT kernels."""

from types import SimpleNamespace

from tilela.kernels.hopper.launch import launch_function


def _main(*args):
    return args


def test_launch_function_is_the_compiled_modules_main():
    """A kernel compiled in this process: its TVM Executable's module after jit(), whose main the launchers call."""
    executable = SimpleNamespace(jit=lambda: SimpleNamespace(main=_main))
    kernel = SimpleNamespace(adapter=SimpleNamespace(_get_executable=lambda: executable))
    assert launch_function(kernel) is _main


def test_launch_function_keeps_a_kernel_without_an_executable():
    """An adapter with no executable to reach (another execution backend): the kernel's own call."""
    kernel = SimpleNamespace(adapter=SimpleNamespace())
    assert launch_function(kernel) is kernel
