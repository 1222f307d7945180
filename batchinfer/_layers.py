"""Import batchinfer.kernels / .cache / .jobs from the checkout's top-level folders."""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

LAYER_PACKAGES = ("kernels", "cache", "jobs")


class _CheckoutLayerFinder(importlib.abc.MetaPathFinder):
    """Finds `batchinfer.<layer>` in `<checkout>/<layer>/`; its submodules follow its __path__."""

    def __init__(self, package: str, checkout: Path) -> None:
        self._folders = {f"{package}.{name}": checkout / name for name in LAYER_PACKAGES}

    def find_spec(self, fullname, path=None, target=None):
        folder = self._folders.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)])


def install_checkout_layers(package: str, package_path: list[str]) -> None:
    """Installed (a wheel), the layer packages are real subfolders and nothing is needed; in a
    checkout they are the package folder's siblings, found by a finder placed before the rest."""
    here = Path(package_path[0])
    if (here / "kernels" / "__init__.py").is_file():
        return
    checkout = here.parent
    if not all((checkout / name / "__init__.py").is_file() for name in LAYER_PACKAGES):
        return
    if not any(isinstance(f, _CheckoutLayerFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _CheckoutLayerFinder(package, checkout))
