"""Object-store inputs and outputs (jobs/inputs/remote.py, jobs/outdir/remote_folder.py) against a real
S3-protocol server on localhost (moto in server mode) and a local http.server: Parquet / CSV / a glob
from s3, https input, output to s3 with a killed run resumed exactly once, the lock on the bucket,
and bad URLs / buckets / credentials as one-line exit-2 errors."""
from __future__ import annotations

import functools
import http.server
import io
import json
import os
import signal
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest

# Both come with the test extra (moto[server], boto3): missing, this file fails rather than skips.
import boto3  # noqa: E402
import moto.server as moto_server  # noqa: E402

from tests.job_process import demo_cache, keys, run_in_this_process, start_run, wait_for  # noqa: E402,F401
from tests.jobs_fixtures import job_entry, rag_table, write_job_file  # noqa: E402

BUCKET = "bi-data"


@pytest.fixture(scope="module")
def s3_endpoint():
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(s3_endpoint, monkeypatch, tmp_path):
    """A fresh bucket on the server, the AWS_* variables pointing at it; → a boto3 client."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # never probe an instance role from a test
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    for bucket in client.list_buckets().get("Buckets", []):
        objects = client.list_objects_v2(Bucket=bucket["Name"]).get("Contents", [])
        for entry in objects:
            client.delete_object(Bucket=bucket["Name"], Key=entry["Key"])
        client.delete_bucket(Bucket=bucket["Name"])
    client.create_bucket(Bucket=BUCKET)
    return client


def put_parquet(client, key: str, table: pa.Table) -> None:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    client.put_object(Bucket=BUCKET, Key=key, Body=sink.getvalue())


def remote_keys(client, prefix: str) -> list[str]:
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    names = (entry["Key"][len(prefix):] for entry in listed)
    return sorted(name for name in names if name and not name.endswith("/"))  # not pyarrow's folder markers


def remote_parts(client, prefix: str) -> pa.Table:
    tables = [pq.read_table(io.BytesIO(client.get_object(Bucket=BUCKET, Key=prefix + name)["Body"].read()))
              for name in remote_keys(client, prefix) if name.startswith("part-")]
    return pa.concat_tables(tables)


def write_job(folder: Path, input_url: str, output="out/rag", sampling=None, **extra) -> None:
    entry = job_entry(model="demo", input=input_url, engine={"device": "cpu", "max_running": 3},
                      sampling=sampling or {"max_tokens": 2, "seed": 7, "ignore_eos": True},
                      output={"path": output, "flush_rows": 3}, **extra)
    write_job_file(folder, [entry])


def local_generated(folder: Path) -> list:
    table = pq.read_table(folder / "out" / "rag").sort_by("row_index")
    return list(zip(table["row_index"].to_pylist(), table["generated_text"].to_pylist()))


def generated_from(folder: Path, input_url: str) -> list:
    """Run a job over `input_url` in `folder` (made here) → its (row, text) pairs."""
    folder.mkdir(exist_ok=True)
    write_job(folder, input_url)
    result = run_in_this_process(folder)
    assert result.exit_code == 0, result.output
    return local_generated(folder)


def one_error_line(result) -> str:
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def test_parquet_csv_and_glob_inputs_from_s3(s3, tmp_path, demo_cache):  # noqa: F811
    table = rag_table(7)
    put_parquet(s3, "qa/rag.parquet", table)
    expected = generated_from(tmp_path, "s3://bi-data/qa/rag.parquet")
    assert [row for row, _ in expected] == list(range(7))
    recorded = json.loads((tmp_path / "out" / "rag" / "_job.json").read_text())
    assert [entry["file"] for entry in recorded["fingerprint"]["input"]] == ["rag.parquet"]

    sink = io.BytesIO()
    pcsv.write_csv(table.drop(["extra"]), sink)
    s3.put_object(Bucket=BUCKET, Key="csv/rows.csv", Body=sink.getvalue())
    assert generated_from(tmp_path / "csv", "s3://bi-data/csv/rows.csv") == expected

    put_parquet(s3, "split/a/0.parquet", table.slice(0, 4))
    put_parquet(s3, "split/b/1.parquet", table.slice(4))
    s3.put_object(Bucket=BUCKET, Key="split/b/notes.txt", Body=b"not an input")
    assert generated_from(tmp_path / "glob", "s3://bi-data/split/**/*.parquet") == expected


def test_https_input(tmp_path, demo_cache):  # noqa: F811
    served = tmp_path / "served"
    served.mkdir()
    pq.write_table(rag_table(5), served / "rag.parquet")
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        write_job(tmp_path, f"http://127.0.0.1:{server.server_port}/rag.parquet")
        result = run_in_this_process(tmp_path)
        assert result.exit_code == 0, result.output
        assert [row for row, _ in local_generated(tmp_path)] == list(range(5))
        write_job(tmp_path, f"http://127.0.0.1:{server.server_port}/missing.parquet")
        line = one_error_line(run_in_this_process(tmp_path))
        assert "jobs.rag.input: " in line and "/missing.parquet: HTTP 404" in line
    finally:
        server.shutdown()


@pytest.mark.parametrize("case", ["missing_object", "missing_bucket", "no_credentials", "bad_scheme",
                                  "output_scheme", "output_bucket", "broken_csv"])
def test_bad_urls_are_one_line(case, s3, tmp_path, demo_cache, monkeypatch):  # noqa: F811
    url, output, expected = {
        "missing_object": ("s3://bi-data/nothing.parquet", "out/rag", "jobs.rag.input: no such object: s3://bi-data/nothing"),
        "missing_bucket": ("s3://no-such-bucket/qa.parquet", "out/rag", "jobs.rag.input: s3://no-such-bucket/qa.parquet: "
                                                                        "bucket no-such-bucket does not exist"),
        "no_credentials": ("s3://bi-data/qa.parquet", "out/rag", "jobs.rag.input: s3://bi-data/qa.parquet: no AWS credentials"),
        "bad_scheme": ("ftp://host/qa.parquet", "out/rag", "jobs.rag.input: ftp://host/qa.parquet: not a supported URL"),
        "output_scheme": ("s3://bi-data/qa.parquet", "gs://b/out", "jobs.rag.output.path: gs://b/out: only s3://"),
        "broken_csv": ("s3://bi-data/bad.csv", "out/rag",
                       "jobs.rag.input: s3://bi-data/bad.csv: not a readable CSV file (line 3: expected 3 fields, got 4"),
        "output_bucket": ("s3://bi-data/qa.parquet", "s3://no-such-bucket/out",
                          "jobs.rag.output.path: s3://no-such-bucket/out: bucket no-such-bucket does not exist"),
    }[case]
    put_parquet(s3, "qa.parquet", rag_table(3))
    s3.put_object(Bucket=BUCKET, Key="bad.csv", Body=b"qid,document,question\na,x,y\nb,x,y,extra\n")
    if case == "no_credentials":
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    write_job(tmp_path, url, output=output)
    line = one_error_line(run_in_this_process(tmp_path))
    assert expected in line, line
    assert not (tmp_path / "out").exists()
    if output.startswith("s3://"):  # nothing staged either
        from batchinfer.jobs.spec.urls import staging_folder
        assert not staging_folder(output).exists()


def test_output_to_s3_locked_killed_and_resumed_exactly_once(s3, tmp_path, demo_cache, monkeypatch):  # noqa: F811
    """A run writing to s3 holds the bucket's lock (a second run elsewhere is refused), is killed with
    SIGKILL mid-job, and a rerun from an empty staging folder resumes from the bucket alone."""
    rows, prefix = 12, "out/rag/"
    put_parquet(s3, "qa/rag.parquet", rag_table(rows))
    write_job(tmp_path, "s3://bi-data/qa/rag.parquet", output="s3://bi-data/out/rag",
              sampling={"max_tokens": 3, "seed": 7, "ignore_eos": True, "n": 2})
    first = start_run(tmp_path, demo_cache)
    try:
        wait_for(lambda: any(name.startswith("_parts/") for name in remote_keys(s3, prefix)), first)
        assert first.poll() is None, first.stderr.read()
        assert "_lock.json" in remote_keys(s3, prefix)

        import batchinfer.jobs.spec.job_file as job_file
        with monkeypatch.context() as patch:  # a second host: its own staging folder, only the bucket shared
            patch.setattr(job_file, "staging_folder", lambda url: tmp_path / "other-host-staging")
            line = one_error_line(run_in_this_process(tmp_path))
        assert f"jobs.rag.output.path: s3://bi-data/out/rag is in use by pid {first.pid}" in line, line
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGKILL)
        first.wait()
    assert first.returncode == -signal.SIGKILL
    done_before = remote_parts(s3, prefix).num_rows
    assert 0 < done_before < rows * 2

    import shutil
    shutil.rmtree(demo_cache / "outputs")  # the rerun knows only what the bucket holds
    result = run_in_this_process(tmp_path)
    assert result.exit_code == 0, result.output
    names = remote_keys(s3, prefix)
    assert "_lock.json" not in names and "_stats.json" in names and "_job.json" in names
    assert not any(name.startswith("_work") for name in names)
    table = remote_parts(s3, prefix)
    assert keys(table) == [(row, sample) for row in range(rows) for sample in range(2)]  # each exactly once
    stats = json.loads(s3.get_object(Bucket=BUCKET, Key=prefix + "_stats.json")["Body"].read())
    assert stats["status"] == "done"


def test_remote_lock_staleness_and_take_over(s3, monkeypatch):
    """The lock object of another host: refused while fresh by the server's clock, taken over once
    stale by a conditional PUT; its old holder's next heartbeat finds the lock lost; release leaves
    another run's lock alone."""
    import time

    from batchinfer.jobs.outdir import remote_lock
    from batchinfer.jobs.outdir.lock import OutputBusy
    from batchinfer.jobs.outdir.remote_lock import RemoteLock

    folder = "s3://bi-data/out/locked"
    elsewhere = remote_lock.this_process()
    with monkeypatch.context() as patch:
        patch.setattr(remote_lock, "this_process", lambda: elsewhere.__class__(
            **{**elsewhere.__dict__, "host": "other-host", "token": "theirs"}))
        theirs = RemoteLock.acquire(folder)
    with pytest.raises(OutputBusy, match="in use by pid .* on host other-host"):
        RemoteLock.acquire(folder, stale_after=60)
    time.sleep(2.1)  # Last-Modified has whole seconds
    mine = RemoteLock.acquire(folder, stale_after=1)
    assert theirs.beat() is False  # taken over: the old holder must stop
    theirs.release()  # If-Match fails: our lock stays
    body = json.loads(s3.get_object(Bucket=BUCKET, Key="out/locked/_lock.json")["Body"].read())
    assert body["token"] == mine.holder.token
    assert mine.beat() is True
    mine.release()
    assert remote_keys(s3, "out/locked/") == []


def test_openai_batch_file_from_s3_to_s3(s3, tmp_path, demo_cache):  # noqa: F811
    from batchinfer.jobs.formats.openai_batch import OUTPUT_NAME

    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": "demo", "prompt": f"Once upon a time {i}", "max_tokens": 2}})
             for i in range(3)]
    s3.put_object(Bucket=BUCKET, Key="batch/requests.jsonl", Body=("\n".join(lines) + "\n").encode())
    write_job_file(tmp_path, [{"name": "b", "model": "demo", "input": "s3://bi-data/batch/requests.jsonl",
                               "engine": {"device": "cpu"}, "sampling": {"seed": 7},
                               "output": {"path": "s3://bi-data/out/b", "format": "openai"}}])
    result = run_in_this_process(tmp_path)
    assert result.exit_code == 0, result.output
    written = s3.get_object(Bucket=BUCKET, Key=f"out/b/{OUTPUT_NAME}")["Body"].read().decode().splitlines()
    assert [json.loads(line)["custom_id"] for line in written] == ["r0", "r1", "r2"]


def test_mirror_drops_unrecorded_parts_and_never_mirrors_a_vanished_staging_folder(s3, tmp_path):
    """A part uploaded without its record (a kill between the two) is not synced down and is deleted
    under the lock; a staging folder deleted under a run is an error, not an emptied bucket folder."""
    import shutil

    from batchinfer.jobs.outdir.object_store import StoreError, open_store
    from batchinfer.jobs.outdir.remote_folder import Mirror

    for key, body in {"out/m/_job.json": b"{}", "out/m/part-00000.parquet": b"p0",
                      "out/m/_parts/part-00000.parquet.json": b"{}", "out/m/part-00001.parquet": b"p1"}.items():
        s3.put_object(Bucket=BUCKET, Key=key, Body=body)
    staging = tmp_path / "staging"
    mirror = Mirror(open_store("s3://bi-data/out/m"), staging)
    mirror.pull(clean_remote=False)
    local = sorted(p.relative_to(staging).as_posix() for p in staging.rglob("*") if p.is_file())
    assert local == ["_job.json", "_parts/part-00000.parquet.json", "part-00000.parquet"]
    assert "part-00001.parquet" in remote_keys(s3, "out/m/")  # unlocked: the bucket is left alone
    mirror.pull(clean_remote=True)
    assert "part-00001.parquet" not in remote_keys(s3, "out/m/")
    (staging / "part-00002.parquet").write_bytes(b"p2")
    mirror.push()
    assert "part-00002.parquet" in remote_keys(s3, "out/m/")
    shutil.rmtree(staging)
    with pytest.raises(StoreError, match="staging folder .* is gone"):
        mirror.push()
    assert len(remote_keys(s3, "out/m/")) == 4


def test_an_upload_cut_short_never_leaves_a_part_under_its_name(s3, tmp_path, monkeypatch):
    """A signal while a part is uploaded (the push before a commit): its final key must not appear,
    as pyarrow completes a stream closed during unwinding with what it was given."""
    from batchinfer.jobs.outdir import remote_folder
    from batchinfer.jobs.outdir.object_store import open_store

    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "part-00000.parquet").write_bytes(b"x" * 4096)
    mirror = remote_folder.Mirror(open_store("s3://bi-data/out/cut"), staging)

    class CutShort(io.BytesIO):
        def read(self, size=-1):
            if self.tell():
                raise KeyboardInterrupt
            return super().read(1024)

    monkeypatch.setattr(remote_folder, "open", lambda path, mode: CutShort(Path(path).read_bytes()), raising=False)
    with pytest.raises(KeyboardInterrupt):
        mirror.push()
    assert "part-00000.parquet" not in remote_keys(s3, "out/cut/")


def test_s3_output_without_boto3_is_one_line(s3, tmp_path, demo_cache):  # noqa: F811
    """boto3 is the optional `s3` extra: without it an s3:// output is refused at validation (the
    import made to fail in a real process), naming output.path and the extra; nothing written."""
    import subprocess
    import sys

    from batchinfer.jobs.spec.urls import staging_folder
    from tests.job_process import REPO_ROOT

    put_parquet(s3, "qa.parquet", rag_table(3))
    write_job(tmp_path, "s3://bi-data/qa.parquet", output="s3://bi-data/out/nob")
    script = ("import sys; sys.modules['boto3'] = None; sys.argv = ['batchinfer', 'run', 'jobs.yaml']; "
              "from batchinfer.cli import main; main()")
    env = {**os.environ, "BATCHINFER_CACHE_DIR": str(demo_cache),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, (done.returncode, done.stdout, done.stderr)
    assert lines[0].startswith("error: ") and "jobs.rag.output.path: s3://bi-data/out/nob" in lines[0], lines[0]
    assert "pip install 'batchinfer[s3]'" in lines[0], lines[0]
    assert remote_keys(s3, "out/nob/") == [] and not staging_folder("s3://bi-data/out/nob").exists()


def test_output_lock_takes_credentials_from_a_config_profile(s3, tmp_path, monkeypatch):
    """No keys in the environment or a credentials file: a profile of the config file whose keys come
    from a credential_process (as SSO, web identity and instance roles, beyond a hand-signer's reach)
    opens the output folder and takes its lock."""
    import sys

    from batchinfer.jobs.outdir.object_store import open_store
    from batchinfer.jobs.outdir.remote_lock import RemoteLock

    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    process = tmp_path / "keys.py"
    process.write_text('import json; print(json.dumps({"Version": 1, "AccessKeyId": "testing", '
                       '"SecretAccessKey": "testing"}))\n')
    config = tmp_path / "config"
    config.write_text(f"[default]\ncredential_process = {sys.executable} {process}\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    open_store("s3://bi-data/out/profiled")
    lock = RemoteLock.acquire("s3://bi-data/out/profiled")
    assert remote_keys(s3, "out/profiled/") == ["_lock.json"]
    lock.release()
    assert remote_keys(s3, "out/profiled/") == []


def test_show_reads_an_s3_output_folder_without_writing(s3, tmp_path, demo_cache):  # noqa: F811
    """`batchinfer show s3://...`: the job's stats, samples from the part records, and a live lock
    holder, read from the bucket alone (nothing written there or staged); not an output: one line."""
    from click.testing import CliRunner

    from batchinfer.cli import main
    from batchinfer.jobs.outdir.remote_lock import RemoteLock
    from batchinfer.jobs.spec.urls import staging_folder

    put_parquet(s3, "qa.parquet", rag_table(3))
    write_job(tmp_path, "s3://bi-data/qa.parquet", output="s3://bi-data/out/shown")
    assert run_in_this_process(tmp_path).exit_code == 0
    import shutil
    shutil.rmtree(staging_folder("s3://bi-data/out/shown"))
    lock = RemoteLock.acquire("s3://bi-data/out/shown")  # a run holding it now
    try:
        before = remote_keys(s3, "out/shown/")
        shown = CliRunner().invoke(main, ["show", "s3://bi-data/out/shown"])
        assert shown.exit_code == 0, shown.output
        text = " ".join(shown.output.split())
        assert "job rag: done" in text and "on disk: 3 samples in 1 parts of 3 input rows" in text, text
        assert f"running: held by pid {os.getpid()}" in text, text
        assert remote_keys(s3, "out/shown/") == before
        assert not staging_folder("s3://bi-data/out/shown").exists()
    finally:
        lock.release()
    refused = CliRunner().invoke(main, ["show", "s3://bi-data/nothing-here"])
    assert refused.exit_code == 2 and refused.output.count("\n") == 1, refused.output
    assert "error: s3://bi-data/nothing-here: not a batchinfer output folder" in refused.output, refused.output
