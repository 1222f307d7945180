"""The conditional S3 requests the remote output lock rests on (`remote_lock.py`), through boto3: a
PUT with `If-None-Match: *` or `If-Match: <etag>`, a GET, a DELETE with `If-Match`. pyarrow's
filesystem cannot send these headers. boto3 is the optional `s3` extra (`pip install 'batchinfer[s3]'`;
job validation refuses an s3:// output without it, jobs/spec/urls.py), so only this module imports it.

The client uses AWS's whole credential chain (keys, profiles, SSO, credential_process, web identity,
container and instance roles) and its settings (AWS_REGION, AWS_ENDPOINT_URL(_S3)); a custom endpoint
(MinIO and the like) is addressed path-style, as pyarrow does. Failures the caller cannot act on
(no credentials, no bucket, access denied, unreachable endpoint) are one-line `StoreError`s naming the URL.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime
from email.utils import parsedate_to_datetime
from typing import Any, Optional

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from batchinfer.jobs.outdir.object_store import StoreError, first_line

TIMEOUT_SECONDS = 30


@dataclass(frozen=True)
class Response:
    status: int                  # HTTP status (200 for any success)
    body: bytes
    etag: Optional[str]
    age_seconds: Optional[float]  # server's Date minus Last-Modified: the object's age on the server's clock


class S3Object:
    """One object named by an s3:// URL, with a client of its own (threads share none)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.bucket, _, self.key = url.split("://", 1)[1].partition("/")
        custom_endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        config = Config(connect_timeout=TIMEOUT_SECONDS, read_timeout=TIMEOUT_SECONDS,
                        s3={"addressing_style": "path"} if custom_endpoint else None)
        try:
            self._client = boto3.session.Session().client("s3", config=config)
        except BotoCoreError as exc:  # a bad profile or region setting
            raise StoreError(f"{url}: {first_line(exc)}") from None

    def put(self, body: bytes, if_none_match: bool = False, if_match: Optional[str] = None) -> Response:
        extra = {"IfNoneMatch": "*"} if if_none_match else {"IfMatch": if_match} if if_match is not None else {}
        return self._call(self._client.put_object, Body=body, **extra)

    def get(self) -> Response:
        return self._call(self._client.get_object)

    def delete(self, if_match: Optional[str] = None) -> Response:
        return self._call(self._client.delete_object, **({"IfMatch": if_match} if if_match is not None else {}))

    def _call(self, operation, **params: Any) -> Response:
        try:
            reply = operation(Bucket=self.bucket, Key=self.key, **params)
        except ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            code = exc.response.get("Error", {}).get("Code", "")
            if code == "NoSuchBucket":
                raise StoreError(f"{self.url}: bucket {self.bucket} does not exist "
                                 "(or these credentials cannot see it)") from None
            if status in (401, 403):
                raise StoreError(f"{self.url}: access denied ({status} {code}) to these AWS credentials") from None
            return Response(status, b"", None, None)
        except NoCredentialsError:
            raise StoreError(f"{self.url}: no AWS credentials (keys, a profile, SSO or an instance role; "
                             "see the AWS CLI's credential chain)") from None
        except BotoCoreError as exc:  # unreachable endpoint, bad settings
            raise StoreError(f"{self.url}: {first_line(exc)}") from None
        body = reply["Body"].read() if "Body" in reply else b""
        return Response(200, body, reply.get("ETag"), _age(reply))


def _age(reply: dict) -> Optional[float]:
    modified = reply.get("LastModified")
    date = reply.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    if not isinstance(modified, datetime) or not date:
        return None
    try:
        return max(0.0, (parsedate_to_datetime(date) - modified).total_seconds())
    except (TypeError, ValueError):
        return None
