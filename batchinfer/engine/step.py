"""One engine step: schedule → run → postprocess.

`EngineStep.run` asks the scheduler for the step's prefill chunks and decode rows, runs one
forward over them (`ModelRunner`: a mixed forward, or a prefill then a decode forward), and
hands the logits to the `Postprocessor`, which draws the tokens and finishes sequences. With
`overlap_decode` a decode step's tokens stay in flight (`DecodeOverlap`) and are read while the
next step's forward runs.
"""
from __future__ import annotations

import contextlib
import time

import torch

from batchinfer.engine.decode_rows import decode_rows
from batchinfer.engine.draws import read_now
from batchinfer.engine.host_copy import upload
from batchinfer.engine.model_runner import DecodeRows, ModelRunner
from batchinfer.engine.overlap import DecodeOverlap
from batchinfer.engine.postprocess import Postprocessor, draws_from_host_tokens
from batchinfer.engine.scheduler import Scheduler
from batchinfer.engine.side_stream import SideStream
from batchinfer.engine.sequence import Sequence
from batchinfer.engine.stats import StatsTally
from batchinfer.engine.step_batch import logits_rows, sequence_chunk
from batchinfer.cache.state_cache import StateCache


class EngineStep:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, cache: StateCache, post: Postprocessor,
                 overlap: DecodeOverlap, tally: StatsTally, device: torch.device, *, mixed_step: bool,
                 overlap_decode: bool, concurrent_prefill: bool = False) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.cache = cache  # mirrors each decode row's ReplaySSM ring cursor
        self.post = post
        self.overlap = overlap
        self.tally = tally
        self.device = device
        self.mixed_step = mixed_step            # one forward per step over prefill and decode
        self.overlap_decode = overlap_decode    # leave each decode step's tokens in flight
        # the prefill forward on a second stream beside the decode forward (None: one after the other)
        self.side = SideStream(device) if concurrent_prefill and not mixed_step else None

    def run(self) -> list[Sequence]:
        """One step; returns the sequences it finished. The scheduler plans it, the model runs
        one forward over the prefill chunks and the decode rows (`_mixed`; a step with only one
        kind, or without mixed_step: a prefill forward, then a decode forward), and the
        postprocessor turns drawn tokens into progress."""
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        done = []
        if plan.needs_host_tokens:  # decode slots ran short: preempting needs every token read
            done += self.post.accept(*self.overlap.take())
            self.scheduler.schedule_rest(plan)
        done += self._fail(plan.failed)
        if self.mixed_step and plan.prefill and plan.decode:
            done += self._mixed(plan.prefill, plan.decode)
            # No device sync: with steps in flight the step's wall time is the GPU's.
            self.tally.add(mixed_seconds=time.perf_counter() - started)
            return done
        if self.side is not None and plan.prefill and plan.decode:
            done += self._concurrent(plan.prefill, plan.decode)
            # No device sync: the decode rows' tokens stay in flight as after `_decode`.
            self.tally.add(concurrent_steps=1, concurrent_seconds=time.perf_counter() - started)
            return done
        prefill_seconds = 0.0
        if plan.prefill:
            with self._timed("prefill_seconds") as timing:  # syncs: a decode step in flight finishes too
                done += self._prefill(plan.prefill)
            prefill_seconds = timing["seconds"]
        if plan.decode:
            done += self._decode(plan.decode)
            # With steps in flight the host waits on the previous step here, so wall time per
            # step is the GPU's time per step (a device sync would stop the overlap).
            self.tally.add(decode_seconds=time.perf_counter() - started - prefill_seconds)
        else:
            done += self.post.accept(*self.overlap.take())
        return done

    def abandon(self) -> None:
        """Drop the step in flight and every sequence (a generate call closed early or failed)."""
        self.overlap.clear()
        self.scheduler.abandon()

    @staticmethod
    def _fail(seqs: list[Sequence]) -> list[Sequence]:
        for seq in seqs:
            seq.finish("error")
        return seqs

    # ---- run -------------------------------------------------------------------------------
    def _prefill(self, items: list[tuple[Sequence, int]]) -> list[Sequence]:
        """Run one prefill forward over (sequence, new tokens) chunks; sample where a chunk ends
        its sequence's tokens, score where a chunk holds a scoring sequence's continuation."""
        chunks = [sequence_chunk(seq, n) for seq, n in items]
        logits = self._prefill_forward(chunks)  # [N, V]: num_logits rows per chunk
        self.scheduler.advance(items)
        rows = logits_rows(items, chunks)
        done = self.post.score(rows.scored, logits) if rows.scored else []
        if rows.sampled:
            if rows.scored:
                logits = logits[upload(torch.tensor(rows.sample_rows, dtype=torch.int64), logits.device)]
            done += self.post.accept(rows.sampled, *read_now(self.post.draw(rows.sampled, logits)))
        return done

    def _prefill_forward(self, chunks: list) -> torch.Tensor:
        """Logits [N, V] of a prefill forward: on the side stream when there is one, for every prefill
        (its activations then always come from that stream's memory, not from both streams' in turn)."""
        if self.side is None:
            return self.runner.prefill(chunks)
        with self.side.launch():
            logits = self.runner.prefill(chunks)
        return self.side.join(logits)

    def _mixed(self, items: list[tuple[Sequence, int]], decode: list[Sequence]) -> list[Sequence]:
        """One forward over the prefill chunks, then the decode rows (each a one-token segment).
        The chunks that end their sequence's tokens draw beside the decode rows, and the step
        stays in flight as a decode step does (`launch_draw`)."""
        decode = sorted(decode, key=lambda seq: seq.priority)  # plan (DFS) order: sharers adjacent
        chunks = [sequence_chunk(seq, n) for seq, n in items]
        rows = decode_rows(decode, self.overlap.step)
        logits = self.runner.mixed(chunks, rows)  # [N_prefill + B, V]
        self._count_decode(decode, rows, mixed=True)
        self.scheduler.advance(items + [(seq, 1) for seq in decode])
        step = logits_rows(items, chunks, decode)
        done = self.post.score(step.scored, logits) if step.scored else []
        if step.scored and step.sampled:
            logits = logits[upload(torch.tensor(step.sample_rows, dtype=torch.int64), logits.device)]
        return done + self.launch_draw(step.sampled, logits)

    def _concurrent(self, items: list[tuple[Sequence, int]], decode: list[Sequence]) -> list[Sequence]:
        """The decode forward on this stream and the prefill forward on the side stream, at the
        same time (`SideStream` states why that is as correct as one after the other); joined
        before the prefill's tokens are drawn. The decode forward is issued first: its graph
        replay is one launch, so its kernels are queued before the prefill's (the orders compared:
        `benchmarks/step_cost.py --concurrent`). The decode rows' tokens then stay in flight as
        after `_decode`."""
        decode, decode_logits = self._decode_forward(decode)
        done = self._prefill(items)  # its forward on the side stream
        self.scheduler.advance([(seq, 1) for seq in decode])
        return done + self.launch_draw(decode, decode_logits)

    def _decode(self, seqs: list[Sequence]) -> list[Sequence]:
        """Run one decode step and draw its tokens on the device (`launch_draw`)."""
        seqs, logits = self._decode_forward(seqs)
        self.scheduler.advance([(seq, 1) for seq in seqs])
        return self.launch_draw(seqs, logits)

    def _decode_forward(self, seqs: list[Sequence]) -> tuple[list[Sequence], torch.Tensor]:
        """The decode forward over `seqs` in plan (DFS) order, sharers adjacent: (that order, logits [B, V])."""
        seqs = sorted(seqs, key=lambda seq: seq.priority)
        rows = decode_rows(seqs, self.overlap.step)
        logits = self.runner.decode(rows)  # [B, V]
        self._count_decode(seqs, rows)
        return seqs, logits

    def launch_draw(self, seqs: list[Sequence], logits: torch.Tensor) -> list[Sequence]:
        """Draw `seqs`' tokens from their logits rows on the device and read the step in flight
        meanwhile; with overlap this step's tokens then stay in flight (`DecodeOverlap`), so the
        GPU never waits for the host's bookkeeping; otherwise they are read at once."""
        post = self.post
        if not seqs:
            return post.accept(*self.overlap.take())
        if draws_from_host_tokens(seqs):
            # Read the step in flight first (its tokens landed before this forward began), so the
            # grammar matchers and penalties see every earlier token; the masks are then filled
            # while this step's forward still runs, and its own tokens can stay in flight.
            done = post.accept(*self.overlap.take())
            draw = post.draw(seqs, logits)
        else:
            draw = post.draw(seqs, logits)  # tokens [B] on the device
            done = post.accept(*self.overlap.take())
        if not self.overlap_decode:
            return done + post.accept(seqs, *read_now(draw))
        self.overlap.launch(seqs, draw)
        return done

    def _count_decode(self, seqs: list[Sequence], rows: DecodeRows, mixed: bool = False) -> None:
        """A decode step's counters (`mixed`: the decode rows of a mixed step), ReplaySSM ring folds
        included (the cache mirrors every row's ring cursor; a full ring is folded into the
        state snapshot by the step's kernel)."""
        steps = dict(mixed_steps=1, mixed_seq_steps=len(seqs)) if mixed else \
            dict(decode_steps=1, decode_seq_steps=len(seqs))
        self.tally.add(**steps, decode_context_tokens=sum(rows.positions) + len(seqs),
                       decode_shared_kv_tokens=sum(rows.shared_with_prev),
                       replayssm_flushes=self.cache.ring_steps([seq.handle for seq in seqs]))

    @contextlib.contextmanager
    def _timed(self, stat: str):
        start, timing = time.perf_counter(), {}
        yield timing
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # GPU work is asynchronous: bill it to its phase
        timing["seconds"] = time.perf_counter() - start
        self.tally.add(**{stat: timing["seconds"]})
