"""`environ_set(values)`: os.environ with some variables set for a block, restored after (a
spawned worker inherits the environment as it is when it starts; a benchmark's job switches a
model-level setting for that job alone)."""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator, Mapping


@contextmanager
def environ_set(values: Mapping[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
