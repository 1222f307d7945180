"""A written checkpoint's files get the mode any new file gets (the umask), not safetensors' 0600."""
from __future__ import annotations

import os
import stat

import pytest

from batchinfer.models.checkpoint_writer import write_random_checkpoint
from batchinfer.models.presets import PRESETS


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_written_checkpoint_files_honour_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        folder = write_random_checkpoint(tmp_path / "ckpt", PRESETS["tiny"])
    finally:
        os.umask(old)
    for name in ("model.safetensors", "config.json"):
        assert stat.S_IMODE((folder / name).stat().st_mode) == mode, name
