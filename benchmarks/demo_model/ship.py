"""Copy a trained checkpoint into the package as `model: demo` (batchinfer/demo_checkpoint/).

    python -m benchmarks.demo_model.ship CKPT

Copies the five Hugging Face files (not train_state/), refuses more than 16 MB, then loads the
result through `demo_checkpoint()` and prints its accuracy on 32 fresh questions (CPU, fp32).
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

MAX_BYTES = 16 * 10**6


def main(argv=None) -> None:
    from batchinfer import demo, demo_task
    from batchinfer.engine.config import EngineConfig
    from benchmarks.demo_model.evaluate import evaluate

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path)
    args = p.parse_args(argv)
    files = [args.checkpoint / name for name in demo.SHIPPED_DEMO_FILES]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise SystemExit(f"error: {args.checkpoint}: missing {', '.join(missing)}")
    size = sum(f.stat().st_size for f in files)
    if size > MAX_BYTES:
        raise SystemExit(f"error: {args.checkpoint}: {size / 1e6:.1f} MB, more than the 16 MB the package ships")
    target = demo.SHIPPED_DEMO_DIR
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir()
    for f in files:
        shutil.copyfile(f, target / f.name)
    assert demo.shipped_demo_checkpoint() == target
    rows = demo_task.held_out_rows(seed=123, n_docs=4, questions_per_doc=8)
    result = evaluate(target, rows, EngineConfig(device="cpu", dtype="float32"))
    print(f"shipped {size / 1e6:.1f} MB into {target}; accuracy {result.accuracy:.3f} on {result.n} fresh questions")


if __name__ == "__main__":
    main()
