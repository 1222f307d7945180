"""batchinfer: offline batch inference for GDN-hybrid language models."""
__version__ = "0.1.0"

from batchinfer._layers import install_checkout_layers

# kernels/, cache/ and jobs/ sit beside this folder in a checkout and are installed inside it
# (setup.py's package_dir), so they import as batchinfer.kernels etc. in both cases and never
# collide with PyPI's top-level `kernels` / `cache` / `jobs`.
install_checkout_layers(__name__, __path__)
