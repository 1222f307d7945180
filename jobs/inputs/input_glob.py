"""Input discovery for a glob: each real file once, symlink loops never followed.

`glob.glob(..., recursive=True)` follows symlinked folders under `**` without remembering
where it has been: a link back to an ancestor makes it list the same file once per level
until the path is too long (41 times on Linux), and two such links make it exponential.
This walk has glob's rules (`*`, `?`, `[...]` within one name, `**` as zero or more
folders, names starting with a dot only matched by a pattern that starts with one) but
never descends through a link into a folder it is already inside, and keeps one path per
real file.
"""
from __future__ import annotations

import os
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Iterator

GLOB_CHARS = set("*?[")


def has_glob(text: str) -> bool:
    return bool(GLOB_CHARS & set(text))


def _entries(folder: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(folder) as entries:
            return list(entries)
    except OSError:  # unreadable or vanished folders match nothing, as in glob
        return []


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()  # follows a symlink: a linked folder is searched (once, see _walk)
    except OSError:
        return False


def _name_matches(name: str, part: str) -> bool:
    if name.startswith(".") and not part.startswith("."):
        return False
    return fnmatchcase(name, part)


def _walk(folder: Path, parts: tuple[str, ...], chain: frozenset[str]) -> Iterator[Path]:
    """Paths under `folder` matching `parts`; `chain`: the real folders `**` is inside (a loop goes back to one)."""
    if not parts:
        yield folder
        return
    part, rest = parts[0], parts[1:]
    if part == "**":
        real = os.path.realpath(folder)
        if real in chain:  # a link back to a folder this `**` is already searching
            return
        chain = chain | {real}
        yield from _walk(folder, rest, chain)  # zero folders
        for entry in sorted(_entries(folder), key=lambda entry: entry.name):
            if entry.name.startswith("."):
                continue
            if _is_dir(entry):
                yield from _walk(Path(entry.path), parts, chain)
            elif not rest:  # a trailing `**` matches the files in every folder too
                yield Path(entry.path)
        return
    if not has_glob(part):
        child = folder / part
        if rest == () or child.is_dir():
            yield from _walk(child, rest, chain)
        return
    for entry in sorted(_entries(folder), key=lambda entry: entry.name):
        if _name_matches(entry.name, part) and (not rest or _is_dir(entry)):
            yield from _walk(Path(entry.path), rest, chain)


def glob_files(pattern: str) -> list[Path]:
    """Files matching `pattern`, sorted, one path per real file (the first in sorted order)."""
    path = Path(pattern)
    parts = path.parts
    first = next(i for i, part in enumerate(parts) if has_glob(part))
    root = Path(*parts[:first]) if first else Path(".")
    return unique_files(p for p in _walk(root, tuple(parts[first:]), frozenset()) if p.is_file())


def unique_files(paths: Iterator[Path]) -> list[Path]:
    """Sorted paths, each real file kept once (two links to one file are one input)."""
    seen: set[str] = set()
    kept = []
    for path in sorted(paths):
        real = os.path.realpath(path)
        if real not in seen:
            seen.add(real)
            kept.append(path)
    return kept
