"""Packages: batchinfer/ plus the top-level kernels/, cache/ and jobs/ folders installed inside it as
batchinfer.kernels etc. (the folders keep their place; the installed names cannot collide with
PyPI's top-level `kernels` or `cache`). Everything else is in pyproject.toml."""
from setuptools import find_packages, setup

LAYERS = ("kernels", "cache", "jobs")
layer_packages = find_packages(include=[f"{name}*" for name in LAYERS])
setup(
    packages=find_packages(include=["batchinfer*"]) + [f"batchinfer.{name}" for name in layer_packages],
    package_dir={f"batchinfer.{name}": name for name in LAYERS},
)
