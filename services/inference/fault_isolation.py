"""A step's fault confined to the chunks that cause it: the failed forward run again in halves.

A forward that raises is run again on the step's chunks in halves, in order,
until the chunks that fail alone are found; only an engine-wide failure (out of
memory, the device lost, or every chunk failing alone) is ``EngineFailure``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from services.inference.outputs import SampledToken
from services.inference.sampler import RowFault
from services.inference.scheduler import ScheduledSequence

# The engine's logger: these lines were always the engine's.
log = logging.getLogger("llmmesh.inference.engine")


class EngineFailure(Exception):
    """The engine itself failed (out of memory, device lost): no request of the step can go on."""


def is_engine_wide(exc: BaseException) -> bool:
    """Failures that are the device's or the process's, not one request's: never bisected."""
    return isinstance(exc, (MemoryError, torch.OutOfMemoryError, torch.AcceleratorError))


#: What a step computed for one scheduled chunk: its drawn token (with its logprobs when the
#: request asked), None (a mid-prompt chunk, nothing drawn), or why the engine failed on it.
ChunkResult = int | SampledToken | RowFault | None

#: One forward over some of the step's chunks: one result per chunk, in order.
RunChunks = Callable[[Seq[ScheduledSequence]], list[ChunkResult]]


def run_isolating_faults(run: RunChunks, chunks: list[ScheduledSequence]) -> list[ChunkResult]:
    """One result per chunk, in order; a forward that raises is narrowed to the chunks that
    fail alone (``EngineFailure`` when the failure is the engine's, not a chunk's)."""
    try:
        return run(chunks)
    except Exception as exc:
        if is_engine_wide(exc):
            raise EngineFailure(f"{type(exc).__name__}: {exc}") from exc
        log.warning("a step of %d chunks failed (%s); finding the chunks that fail alone", len(chunks), exc)
    results = _bisect(run, chunks)
    faults = [r for r in results if isinstance(r, RowFault) and not r.invalid_field]
    if len(chunks) > 1 and len(faults) == len(chunks):
        raise EngineFailure(f"every chunk of the step fails alone: {faults[0].reason}")
    return results


def _bisect(run: RunChunks, chunks: list[ScheduledSequence]) -> list[ChunkResult]:
    """Run ``chunks`` again in halves, first half first: a prefill chunk that fills blocks a
    later chunk of the step reads stays ahead of it. K/V writes and slab marks are
    positional, so running a chunk again writes what it wrote before."""
    if len(chunks) == 1:
        try:
            return run(chunks)
        except Exception as exc:
            if is_engine_wide(exc):
                raise EngineFailure(f"{type(exc).__name__}: {exc}") from exc
            log.exception("the engine fails on request %s alone; only it fails", chunks[0].seq.request_id)
            return [RowFault(f"the engine failed on this request: {type(exc).__name__}: {exc}", True)]
    middle = len(chunks) // 2
    results: list[ChunkResult] = []
    for half in (chunks[:middle], chunks[middle:]):
        try:
            results += run(half)
        except Exception as exc:
            if is_engine_wide(exc):
                raise EngineFailure(f"{type(exc).__name__}: {exc}") from exc
            results += _bisect(run, half)
    return results
