"""How the replica's idle OpenMP worker waits: sleep at once unless the operator says otherwise.

libgomp reads its environment once, when torch loads it, so this runs before torch is imported.
A replica runs all its torch work on one thread (engine_thread.py), one OpenMP pool, and libgomp
lets such a pool's idle worker spin ≈ 300,000 times before it sleeps. On CPUs the replica has to
itself that keeps the worker awake between a step's parallel regions: at 4/s the replica used
1.85 of 2 CPUs instead of 1.3 and served 1.18× the tokens/s (docs/inference.md). On CPUs it
shares (two replicas on one small VM, a test suite beside it) spinning workers take each other's
CPU: two replicas generating at once on 2 vCPUs took 8.6–9.1 s against 3.5 s sleeping at once.
So the default is the safe one, and a replica with dedicated CPUs opts in with libgomp's own
knob, ``GOMP_SPINCOUNT=300000`` (or any ``OMP_WAIT_POLICY``/``GOMP_SPINCOUNT`` of its own).
"""

from __future__ import annotations

from collections.abc import MutableMapping

#: libgomp's own settings; an operator who set either keeps exactly what they set.
OPERATOR_KNOBS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def default_wait_policy(environ: MutableMapping[str, str]) -> str | None:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` unless the operator chose a policy; returns what was set."""
    if any(knob in environ for knob in OPERATOR_KNOBS):
        return None
    environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return "PASSIVE"
