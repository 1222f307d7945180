"""Object stores through pyarrow's own filesystems (`pyarrow.fs.S3FileSystem` / `GcsFileSystem` via
`FileSystem.from_uri`): pyarrow is a core dependency already and reads the usual AWS_* variables
(AWS_ENDPOINT_URL, AWS_REGION, keys, profiles), so fsspec / s3fs would add two packages for nothing.

Every failure is a `StoreError`: one line naming the URL and what is wrong (no bucket, no
credentials, unreachable endpoint), which callers turn into a JobError for the key that named it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

from batchinfer.jobs.spec.urls import url_scheme

# where the AWS SDK finds credentials besides the instance metadata service (probed only through boto3,
# last: pyarrow's probe off EC2 costs seconds of timeouts before a confusing error)
CREDENTIAL_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE",
                        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI")


class StoreError(Exception):
    """An object-store URL that cannot be used; the message is one line naming the URL."""


@dataclass(frozen=True)
class Store:
    url: str                    # as the user wrote it, without a trailing slash
    filesystem: pafs.FileSystem
    path: str                   # "bucket/key/prefix" as pyarrow names it

    def child(self, relative: str) -> str:
        return f"{self.path}/{relative}" if relative else self.path


def has_aws_credentials() -> bool:
    if any(os.environ.get(name) for name in CREDENTIAL_VARIABLES):
        return True
    shared = os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.join("~", ".aws", "credentials")
    if Path(shared).expanduser().is_file() or os.environ.get("AWS_EC2_METADATA_DISABLED", "").lower() == "false":
        return True
    return _botocore_finds_credentials()


def _botocore_finds_credentials() -> bool:
    """With the `s3` extra, AWS's whole chain: config-file profiles (SSO, credential_process, assumed
    roles) and an instance role; its metadata probe (about a second off EC2, skipped under
    AWS_EC2_METADATA_DISABLED=true) runs only when nothing cheaper above found credentials."""
    try:
        import boto3
        from botocore.exceptions import BotoCoreError
    except ImportError:
        return False
    try:
        return boto3.session.Session().get_credentials() is not None
    except BotoCoreError:
        return False


def open_store(url: str) -> Store:
    """The filesystem and path of `url` (s3:// or gs://), checked to have credentials and a bucket."""
    url = url.rstrip("/")
    scheme = url_scheme(url)
    if scheme == "s3" and not has_aws_credentials():
        raise StoreError(f"{url}: no AWS credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
                         "AWS_PROFILE, or a profile in ~/.aws/config; an instance role needs boto3 "
                         "or AWS_EC2_METADATA_DISABLED=false)")
    uri = "gs" + url[len(scheme):] if scheme == "gcs" else url
    try:
        filesystem, path = pafs.FileSystem.from_uri(uri)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise StoreError(f"{url}: {first_line(exc)}") from None
    path = path.rstrip("/")
    bucket = path.split("/", 1)[0]
    if not bucket:
        raise StoreError(f"{url}: no bucket in the URL")
    if info(Store(url, filesystem, bucket), "").type == pafs.FileType.NotFound:
        raise StoreError(f"{url}: bucket {bucket} does not exist (or these credentials cannot see it)")
    return Store(url, filesystem, path)


def info(store: Store, relative: str) -> pafs.FileInfo:
    try:
        return store.filesystem.get_file_info(store.child(relative))
    except (pa.ArrowException, OSError) as exc:
        raise StoreError(f"{store.url}: {first_line(exc)}") from None


def first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
