"""One recurrent GDN step per sequence: Triton in `decode.py` (tile and persistent
variants, the launch by batch size); `reference` is the torch maths (kernels/ref/gdn.py)."""
from batchinfer.kernels.gdn_decode.decode import (DEFAULT_LAUNCH, LARGE_BATCH_LAUNCH, SMALL_BATCH_LAUNCH, DecodeLaunch,
                                           as_decode_launch, gdn_decode, launch_for_batch)
from batchinfer.kernels.ref import gdn as reference

__all__ = ["DEFAULT_LAUNCH", "DecodeLaunch", "LARGE_BATCH_LAUNCH", "SMALL_BATCH_LAUNCH", "as_decode_launch",
           "gdn_decode", "launch_for_batch", "reference"]
