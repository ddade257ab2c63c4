"""`python -m tests.support.faulty_replica`: the real inference replica with one injected fault.

Sampling raises for the token at index ``FAULT_TOKEN_INDEX`` of any request seeded with
``FAULT_SEED`` — a stand-in for any bug or numeric fault in one row's sampling. Every
other request runs on the unmodified engine, so a test can check that the fault stays
that request's own. Test-only: nothing in ``services/`` knows about it.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from services.inference import __main__ as replica_main
from services.inference.openmp_policy import default_wait_policy

# As the real replica does, before torch loads (``sampler`` imports it): openmp_policy.py.
default_wait_policy(os.environ)

from services.inference import sampler  # noqa: E402

FAULT_SEED = 0xBAD5EED
FAULT_TOKEN_INDEX = 5

_real_sample_row = sampler.sample_row
_fault_key = sampler.draw_key(FAULT_SEED, FAULT_TOKEN_INDEX)


def _faulty_sample_row(row: Any, params: sampler.SamplingParams, key: int) -> int:
    if params.seed == FAULT_SEED and key == _fault_key:
        raise RuntimeError("injected fault in this row's sampling")
    return _real_sample_row(row, params, key)


if __name__ == "__main__":
    sampler.sample_row = _faulty_sample_row
    replica_main.main(sys.argv[1:])
