"""Object-store URLs in a job file: which `input` / `output.path` values are URLs, and the local
staging folder an `s3://` output is written in before it is uploaded (jobs/outdir/remote_folder.py).

A URL is never resolved against the job file's folder; a local path never contains `://`.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Optional

INPUT_SCHEMES = ("s3", "gs", "gcs", "http", "https")
OUTPUT_SCHEMES = ("s3",)  # a conditional PUT for the lock: see jobs/outdir/remote_lock.py


def url_scheme(text: str) -> str:
    """`s3` for `s3://bucket/key`; '' for a local path."""
    head, sep, _rest = text.partition("://")
    return head.lower() if sep and head.isalnum() else ""


def is_url(text: str) -> bool:
    return bool(url_scheme(str(text)))


def output_url_problem(url: str) -> Optional[str]:
    """Why `url` cannot be an output folder here (None: it can): a scheme other than s3://, or an s3://
    one without boto3, the optional `s3` extra the lock's conditional writes go through."""
    if url_scheme(url) not in OUTPUT_SCHEMES:
        return f"{url}: only s3:// output folders are supported (the output lock needs S3's conditional PUT)"
    try:
        import boto3  # noqa: F401
    except ImportError:
        return f"{url}: an s3:// output needs boto3 for its lock: pip install 'batchinfer[s3]'"
    return None


def cache_root() -> Path:
    root = os.environ.get("BATCHINFER_CACHE_DIR") or os.path.join("~", ".cache", "batchinfer")
    return Path(root).expanduser()


def staging_folder(url: str) -> Path:
    """The local mirror of remote output folder `url` (one per URL and cache folder)."""
    return cache_root() / "outputs" / hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:24]
