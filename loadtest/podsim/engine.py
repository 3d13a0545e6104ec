"""The simulated inference engine: continuous batching over a paged KV cache, without sockets.

It models what a gateway can observe of vLLM's scheduler, not the maths:

* **KV cache.** Capacity is a number of blocks of ``block_size`` (16) tokens, derived from the MIG
  profile's memory at :data:`KV_BLOCKS_PER_GB` (``--kv-blocks`` overrides). A running sequence
  holds ``ceil((prompt + generated) / 16)`` blocks, growing by one as it crosses a block boundary.
* **Admission.** FIFO waiting queue; the head is admitted when fewer than ``max_num_seqs`` are
  running and its blocks (plus a 1 % watermark while others run) are free. No overtaking.
* **Preemption.** When a decoding sequence needs a block and none is free, the newest running
  sequence goes back to the *front* of the waiting queue, releasing its blocks (vLLM V1's
  recompute preemption); on readmission it re-prefills prompt + generated tokens, then continues.
* **Timing.** Prefill (time to first token) is ``ttft_ms + tokens * prefill_ms_per_token`` after
  admission. Decoding runs in global steps, one token per decoding sequence per step, every
  ``itl_ms + itl_per_seq_ms * running`` -- the batch effect. A sequence that joined the batch less
  than half a step ago sits that step out, so its first inter-token gap is about one step too.
  ``ttft_jitter`` (a log-normal sigma, 0 = none) spreads each prefill around that, drawn from an RNG
  seeded by ``seed``, so two pods can share a latency distribution without sharing every draw.

Output is delivered through two callbacks on each :class:`Sequence`: ``emit(seq)`` after each
token but the last, and ``finish(seq)`` with the last one (``seq.generated`` tokens exist then).
Callbacks may call :meth:`Engine.abort` on their own sequence. The engine needs only a clock with
``time()`` and ``call_at()`` -- an asyncio loop, or a fake one in unit tests.
"""

from __future__ import annotations

import random
import re
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

BLOCK_SIZE = 16
# KV blocks per GB of slice memory: Llama-3-8B keeps 128 KiB of KV per token (32 layers x 8 KV heads
# x 128 dims x K and V x 2 bytes), i.e. 512 blocks of 16 tokens per GB; about half of a slice's memory
# is left for KV once weights and activations are in, hence 256.
KV_BLOCKS_PER_GB = 256
# Without a MIG profile the pod is taken to own a whole 80 GB GPU.
FULL_GPU_GB = 80
WATERMARK_FRACTION = 0.01

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
FINISHED_REASONS = ("stop", "length", "abort", "error")

NEW, WAITING, PREFILL, DECODING, FINISHED, ABORTED = range(6)
STATE_NAMES = ("new", "waiting", "prefill", "decoding", "finished", "aborted")

_MIG_PROFILE = re.compile(r"^(\d+)g\.(\d+)gb(?:\+[a-z0-9]+)*$")


def parse_mig_profile(profile: str) -> tuple[int, int]:
    """``"1g.10gb"`` -> (compute slices, memory GB); ValueError for anything else."""
    match = _MIG_PROFILE.match(profile.strip().lower())
    if not match:
        raise ValueError(f"not a MIG profile like '1g.10gb' or '3g.40gb': {profile!r}")
    return int(match.group(1)), int(match.group(2))


def kv_blocks_for(profile: str | None) -> int:
    """KV-cache capacity in blocks for a MIG profile (or a whole GPU when there is none)."""
    memory_gb = parse_mig_profile(profile)[1] if profile else FULL_GPU_GB
    return memory_gb * KV_BLOCKS_PER_GB


class Handle(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    """The part of an asyncio event loop the engine uses."""

    def time(self) -> float: ...

    def call_at(self, when: float, callback: Callable[..., Any], *args: Any) -> Handle: ...


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Capacity and speed of the simulated engine."""

    kv_blocks: int = FULL_GPU_GB * KV_BLOCKS_PER_GB
    block_size: int = BLOCK_SIZE
    max_num_seqs: int = 256
    ttft_ms: float = 50.0
    prefill_ms_per_token: float = 0.01
    itl_ms: float = 15.0
    itl_per_seq_ms: float = 0.02
    ttft_jitter: float = 0.0
    seed: int | None = None


class Histogram:
    """Bucket counts (non-cumulative, last one is +Inf) and a sum; observed without locks."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Count one observation."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)


class ModelStats:
    """Per-model counters, plain attributes so the token path pays no metric-library cost."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.preemptions = 0
        self.aborts = 0  # podsim's own: clients that went away mid-request
        self.success = dict.fromkeys(FINISHED_REASONS, 0)
        self.faults: dict[str, int] = {}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(REQUEST_LATENCY_BUCKETS)
        self.queue_time = Histogram(REQUEST_LATENCY_BUCKETS)

    def count_fault(self, name: str) -> None:
        """Record that a fault knob fired."""
        self.faults[name] = self.faults.get(name, 0) + 1


def _noop(_seq: Sequence) -> None:
    return None


class Sequence:
    """One request inside the engine."""

    __slots__ = (
        "admitted_at",
        "arrival",
        "blocks",
        "emit",
        "extra_delay",
        "final_reason",
        "finish",
        "generated",
        "handle",
        "last_emit",
        "limit",
        "preemptions",
        "prompt_tokens",
        "state",
        "stats",
    )

    def __init__(
        self,
        stats: ModelStats,
        prompt_tokens: int,
        limit: int,
        *,
        final_reason: str = "length",
        extra_delay_s: float = 0.0,
        emit: Callable[[Sequence], None] = _noop,
        finish: Callable[[Sequence], None] = _noop,
    ) -> None:
        if limit < 1:
            raise ValueError("a sequence generates at least one token")
        self.stats = stats
        self.prompt_tokens = prompt_tokens
        self.limit = limit  # tokens to generate in all; the last one carries final_reason
        self.final_reason = final_reason
        self.extra_delay = extra_delay_s  # added to the first prefill only
        self.emit = emit
        self.finish = finish
        self.generated = 0
        self.state = NEW
        self.blocks = 0
        self.arrival = 0.0
        self.admitted_at: float | None = None
        self.last_emit = 0.0
        self.handle: Handle | None = None
        self.preemptions = 0

    @property
    def state_name(self) -> str:
        return STATE_NAMES[self.state]

    def __repr__(self) -> str:
        return (
            f"<Sequence {self.stats.model} {self.state_name} prompt={self.prompt_tokens} "
            f"generated={self.generated}/{self.limit} blocks={self.blocks}>"
        )


class Engine:
    """Continuous batching with a FIFO queue, paged KV blocks and recompute preemption."""

    def __init__(self, config: EngineConfig, clock: Clock) -> None:
        if config.kv_blocks < 1 or config.block_size < 1 or config.max_num_seqs < 1:
            raise ValueError("kv_blocks, block_size and max_num_seqs must be positive")
        self.config = config
        self.total_blocks = config.kv_blocks
        self.free_blocks = config.kv_blocks
        self._clock = clock
        self._bs = config.block_size
        self._max_seqs = config.max_num_seqs
        self._watermark = int(config.kv_blocks * WATERMARK_FRACTION)
        self._ttft_s = config.ttft_ms / 1000.0
        self._prefill_s = config.prefill_ms_per_token / 1000.0
        self._itl_s = config.itl_ms / 1000.0
        self._itl_seq_s = config.itl_per_seq_ms / 1000.0
        self._jitter = config.ttft_jitter
        self._rng = random.Random(config.seed)
        self._waiting: deque[Sequence] = deque()
        self._running: dict[Sequence, None] = {}  # admission order, prefilling and decoding
        self._decoding = 0
        self._step_handle: Handle | None = None
        self._step_at = 0.0
        self.steps = 0

    # --- inspection ---------------------------------------------------------------------------

    @property
    def running(self) -> list[Sequence]:
        return list(self._running)

    @property
    def waiting(self) -> list[Sequence]:
        return list(self._waiting)

    def kv_usage(self) -> float:
        """Fraction of KV blocks in use, 0..1."""
        return (self.total_blocks - self.free_blocks) / self.total_blocks

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` tokens."""
        return -(-tokens // self._bs)

    def max_tokens_in_cache(self) -> int:
        """The longest sequence the cache can hold at all."""
        return self.total_blocks * self._bs

    def step_interval(self) -> float:
        """Seconds between decode steps at the current batch size."""
        return self._itl_s + self._itl_seq_s * len(self._running)

    def counts_by_model(self) -> dict[str, tuple[int, int]]:
        """model -> (running, waiting), for the gauges."""
        counts: dict[str, list[int]] = {}
        for seq in self._running:
            counts.setdefault(seq.stats.model, [0, 0])[0] += 1
        for seq in self._waiting:
            counts.setdefault(seq.stats.model, [0, 0])[1] += 1
        return {model: (r, w) for model, (r, w) in counts.items()}

    # --- requests -----------------------------------------------------------------------------

    def submit(self, seq: Sequence) -> None:
        """Queue a new sequence; it is admitted at once if there is room."""
        if seq.state != NEW:
            raise ValueError(f"{seq!r} was already submitted")
        if self.blocks_for(seq.prompt_tokens + seq.limit) > self.total_blocks:
            raise ValueError(
                f"prompt + max tokens ({seq.prompt_tokens + seq.limit}) exceed the KV cache "
                f"({self.max_tokens_in_cache()} tokens)"
            )
        now = self._clock.time()
        seq.arrival = now
        seq.last_emit = now
        seq.state = WAITING
        self._waiting.append(seq)
        self._admit(now)

    def abort(self, seq: Sequence) -> bool:
        """Drop a sequence wherever it is; False if it had already finished or left."""
        state = seq.state
        if state == WAITING:
            self._waiting.remove(seq)
        elif state in (PREFILL, DECODING):
            self._release(seq)
        else:
            return False
        seq.state = ABORTED
        self._admit(self._clock.time())
        return True

    def shutdown(self) -> list[Sequence]:
        """Stop all timers and abort everything; returns the sequences that were live."""
        live = [*self._running, *self._waiting]
        for seq in live:
            if seq.handle is not None:
                seq.handle.cancel()
                seq.handle = None
            seq.state = ABORTED
            self.free_blocks += seq.blocks
            seq.blocks = 0
        self._running.clear()
        self._waiting.clear()
        self._decoding = 0
        if self._step_handle is not None:
            self._step_handle.cancel()
            self._step_handle = None
        return live

    # --- scheduling ---------------------------------------------------------------------------

    def _release(self, seq: Sequence) -> None:
        """Take a running sequence out of the batch and free its blocks."""
        del self._running[seq]
        self.free_blocks += seq.blocks
        seq.blocks = 0
        if seq.state == PREFILL:
            if seq.handle is not None:
                seq.handle.cancel()
                seq.handle = None
        else:
            self._decoding -= 1

    def _admit(self, now: float) -> None:
        waiting, running = self._waiting, self._running
        while waiting and len(running) < self._max_seqs:
            seq = waiting[0]
            need = -(-(seq.prompt_tokens + seq.generated + 1) // self._bs)
            reserve = self._watermark if running else 0
            if need + reserve > self.free_blocks:
                break
            waiting.popleft()
            self.free_blocks -= need
            seq.blocks = need
            seq.state = PREFILL
            running[seq] = None
            if seq.admitted_at is None:
                seq.admitted_at = now
                seq.stats.queue_time.observe(now - seq.arrival)
            delay = self._ttft_s + (seq.prompt_tokens + seq.generated) * self._prefill_s + seq.extra_delay
            seq.extra_delay = 0.0
            if self._jitter:
                delay *= self._rng.lognormvariate(0.0, self._jitter)
            seq.handle = self._clock.call_at(now + delay, self._prefill_done, seq)

    def _preempt(self, victim: Sequence) -> None:
        self._release(victim)
        victim.state = WAITING
        victim.preemptions += 1
        victim.stats.preemptions += 1
        self._waiting.appendleft(victim)

    def _prefill_done(self, seq: Sequence) -> None:
        seq.handle = None
        now = self._clock.time()
        seq.state = DECODING
        self._decoding += 1
        generated = seq.generated = seq.generated + 1
        stats = seq.stats
        stats.generation_tokens += 1
        if generated == 1:
            stats.prompt_tokens += seq.prompt_tokens
            stats.ttft.observe(now - seq.arrival)
        else:  # the first token after a preemption: the whole gap counts as inter-token latency
            stats.itl.observe(now - seq.last_emit)
        seq.last_emit = now
        if generated >= seq.limit:
            self._complete(seq, now)
            self._admit(now)
        else:
            seq.emit(seq)
        self._ensure_stepping(now)

    def _complete(self, seq: Sequence, now: float) -> None:
        self._release(seq)
        seq.state = FINISHED
        stats = seq.stats
        stats.success[seq.final_reason] += 1
        stats.e2e.observe(now - seq.arrival)
        seq.finish(seq)

    def _ensure_stepping(self, now: float) -> None:
        if self._step_handle is None and self._decoding > 0:
            self._step_at = now + self.step_interval()
            self._step_handle = self._clock.call_at(self._step_at, self._step)

    def _grow(self, seq: Sequence) -> bool:
        """One more block for ``seq``, preempting the newest sequences; False if ``seq`` itself went."""
        running = self._running
        while self.free_blocks < 1:
            victim = next(reversed(running))
            self._preempt(victim)
            if victim is seq:
                return False
        self.free_blocks -= 1
        seq.blocks += 1
        return True

    def _step(self) -> None:
        """One decode step: a token for every decoding sequence that is due."""
        self._step_handle = None
        self.steps += 1
        now = self._clock.time()
        interval = self.step_interval()
        half = interval * 0.5
        tokens_per_block = self._bs
        decoding, bisect, itl_bounds = DECODING, bisect_left, ITL_BUCKETS
        last_gap, last_bucket = -1.0, 0  # most sequences in a step share one gap: bisect once
        finished = False
        for seq in list(self._running):
            if seq.state != decoding:
                continue  # prefilling, or preempted/aborted earlier in this step
            gap = now - seq.last_emit
            if gap < half:
                continue
            if seq.prompt_tokens + seq.generated >= seq.blocks * tokens_per_block and not self._grow(seq):
                continue
            generated = seq.generated = seq.generated + 1
            seq.last_emit = now
            stats = seq.stats
            stats.generation_tokens += 1
            if gap != last_gap:
                last_gap, last_bucket = gap, bisect(itl_bounds, gap)
            itl = stats.itl
            itl.counts[last_bucket] += 1
            itl.sum += gap
            if generated >= seq.limit:
                self._complete(seq, now)
                finished = True
            else:
                seq.emit(seq)
        if finished or self._waiting:
            self._admit(now)
        if self._decoding > 0:
            when = self._step_at + interval
            self._step_at = when if when > now else now
            self._step_handle = self._clock.call_at(self._step_at, self._step)
