"""Single signed S3 requests (AWS Signature V4, standard library only) for what pyarrow's filesystem
cannot say: a PUT with `If-None-Match: *` or `If-Match: <etag>` and a DELETE with `If-Match`, the
conditional writes the remote output lock rests on (`remote_lock.py`). boto3 would say them too, but
as a dependency of every install for three requests; this signs them with the same AWS_* settings
pyarrow reads: keys from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN or the shared
credentials file (AWS_PROFILE), AWS_REGION, AWS_ENDPOINT_URL(_S3) (path-style there, as for MinIO).
"""
from __future__ import annotations

import configparser
import hashlib
import hmac
import http.client
import os
import time
import urllib.parse
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Optional

from batchinfer.jobs.outdir.object_store import StoreError

TIMEOUT_SECONDS = 30


@dataclass(frozen=True)
class S3Object:
    """One object named by an s3:// URL, with what signing its requests needs."""

    url: str
    host: str           # host[:port]
    secure: bool
    path: str           # /bucket/key (path-style) or /key (virtual-hosted)
    region: str
    access_key: str
    secret_key: str = ""
    token: Optional[str] = None


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    etag: Optional[str]
    age_seconds: Optional[float]  # server's Date minus Last-Modified: the object's age on the server's clock


def _keys() -> tuple[str, str, Optional[str]]:
    access, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if access and secret:
        return access, secret, os.environ.get("AWS_SESSION_TOKEN")
    shared = Path(os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or "~/.aws/credentials").expanduser()
    parser = configparser.ConfigParser()
    try:
        parser.read(shared)
        section = parser[os.environ.get("AWS_PROFILE") or "default"]
        return section["aws_access_key_id"], section["aws_secret_access_key"], section.get("aws_session_token")
    except (KeyError, configparser.Error):
        raise StoreError("") from None


def s3_object(url: str) -> S3Object:
    """The object `url` names, signed with the environment's keys (StoreError naming the URL if none)."""
    try:
        access, secret, token = _keys()
    except StoreError:
        raise StoreError(f"{url}: the output lock needs AWS keys (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                         "or a profile in the shared credentials file)") from None
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    bucket, _, key = url.split("://", 1)[1].partition("/")
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        parsed = urllib.parse.urlsplit(endpoint)
        host, secure, path = parsed.netloc, parsed.scheme == "https", f"{parsed.path.rstrip('/')}/{bucket}/{key}"
    else:
        host, secure, path = f"{bucket}.s3.{region}.amazonaws.com", True, f"/{key}"
    return S3Object(url, host, secure, path, region, access, secret, token)


def _sign(target: S3Object, method: str, body: bytes, now: float) -> dict[str, str]:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    day = stamp[:8]
    headers = {"host": target.host, "x-amz-content-sha256": hashlib.sha256(body).hexdigest(), "x-amz-date": stamp}
    if target.token:
        headers["x-amz-security-token"] = target.token
    names = sorted(headers)
    canonical = "\n".join([method, urllib.parse.quote(target.path, safe="/~"), "",
                           "".join(f"{name}:{headers[name]}\n" for name in names), ";".join(names),
                           headers["x-amz-content-sha256"]])
    scope = f"{day}/{target.region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = ("AWS4" + target.secret_key).encode()
    for part in (day, target.region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={target.access_key}/{scope}, "
                                f"SignedHeaders={';'.join(names)}, Signature={signature}")
    return headers


def request(target: S3Object, method: str, body: bytes = b"", if_none_match: bool = False,
            if_match: Optional[str] = None) -> Response:
    """One request; StoreError when the endpoint cannot be reached or refuses the keys."""
    headers = _sign(target, method, body, time.time())
    if if_none_match:
        headers["if-none-match"] = "*"
    if if_match is not None:
        headers["if-match"] = if_match
    connection_class = http.client.HTTPSConnection if target.secure else http.client.HTTPConnection
    connection = connection_class(target.host, timeout=TIMEOUT_SECONDS)
    try:
        connection.request(method, urllib.parse.quote(target.path, safe="/~"), body=body, headers=headers)
        response = connection.getresponse()
        data = response.read()
    except OSError as exc:
        raise StoreError(f"{target.url}: cannot reach the S3 endpoint {target.host} ({exc})") from None
    finally:
        connection.close()
    if response.status in (401, 403):
        raise StoreError(f"{target.url}: access denied ({response.status}) to these AWS credentials")
    return Response(response.status, data, response.getheader("ETag"), _age(response))


def _age(response: http.client.HTTPResponse) -> Optional[float]:
    try:
        date, modified = response.getheader("Date"), response.getheader("Last-Modified")
        if not date or not modified:
            return None
        return max(0.0, (parsedate_to_datetime(date) - parsedate_to_datetime(modified)).total_seconds())
    except (TypeError, ValueError):
        return None
