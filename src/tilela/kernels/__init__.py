"""Kernels by architecture: hopper/ (sm_90a, TileLang). Importing this package needs no TileLang."""
