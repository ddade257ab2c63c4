"""Turning rounds of method runs into the printed table, the token check and the JSON document."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.timings import MethodRun, Summary

REFERENCE = "llm_mesh"

# Issue 2, done-when 6: throughput ratios on `uniform`, TTFT on `mixed`, same dtype, same run.
TOK_S_TARGETS = {"hf_static": 1.5, "hf_continuous": 3.0}
MIXED_TTFT_TARGET = 3.0  # hf_static TTFT p50 / llm_mesh TTFT p50


@dataclass(frozen=True)
class TokenCheck:
    """How many requests' token streams differ from the reference method's."""

    reference: str
    compared: dict[str, int]
    mismatches: dict[str, int]
    # request id -> index of the first differing token, per method (a few, for the report).
    first_divergence: dict[str, dict[str, int]]

    @property
    def total_mismatches(self) -> int:
        return sum(self.mismatches.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "reference": self.reference,
            "compared": self.compared,
            "mismatches": self.mismatches,
            "first_divergence": self.first_divergence,
        }


def check_tokens(runs: dict[str, MethodRun]) -> TokenCheck:
    """Compare every method's tokens with llm_mesh's (or the first method's when llm_mesh did not run)."""
    reference = REFERENCE if REFERENCE in runs else next(iter(runs))
    ref = runs[reference].timings
    compared: dict[str, int] = {}
    mismatches: dict[str, int] = {}
    divergence: dict[str, dict[str, int]] = {}
    for method, run in runs.items():
        if method == reference:
            continue
        ids = [rid for rid in run.timings if rid in ref and rid not in run.simulated]
        bad: dict[str, int] = {}
        for rid in ids:
            mine, theirs = run.timings[rid].token_ids, ref[rid].token_ids
            if mine != theirs:
                bad[rid] = next(
                    (i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b),
                    min(len(mine), len(theirs)),
                )
        compared[method] = len(ids)
        mismatches[method] = len(bad)
        divergence[method] = dict(list(bad.items())[:8])
    return TokenCheck(reference, compared, mismatches, divergence)


def ratios(results: dict[str, Summary]) -> dict[str, dict[str, float]]:
    """llm_mesh's advantage over each peer: tok/s as mesh/peer, TTFT and latency as peer/mesh."""
    if REFERENCE not in results:
        return {}
    mesh = results[REFERENCE]
    out: dict[str, dict[str, float]] = {}
    for method, peer in results.items():
        if method == REFERENCE:
            continue
        out[method] = {
            "tok_s": _div(mesh.tok_s, peer.tok_s),
            "ttft_p50": _div(peer.ttft_p50_s, mesh.ttft_p50_s),
            "latency_p50": _div(peer.latency_p50_s, mesh.latency_p50_s),
        }
    return out


def targets(workload: str, ratio_table: dict[str, dict[str, float]]) -> dict[str, dict[str, Any]]:
    """Which of issue 2's benchmark targets this run can judge, and whether each is met."""
    verdicts: dict[str, dict[str, Any]] = {}
    if workload == "uniform":
        for peer, goal in TOK_S_TARGETS.items():
            if peer in ratio_table:
                got = ratio_table[peer]["tok_s"]
                verdicts[f"tok_s_vs_{peer}"] = {"ratio": got, "target": goal, "met": got >= goal}
    elif workload == "mixed" and "hf_static" in ratio_table:
        got = ratio_table["hf_static"]["ttft_p50"]
        verdicts["ttft_p50_vs_hf_static"] = {
            "ratio": got,
            "target": MIXED_TTFT_TARGET,
            "met": got >= MIXED_TTFT_TARGET,
        }
    return verdicts


def _div(a: float, b: float) -> float:
    return round(a / b, 3) if b > 0 else float("inf")


def print_report(
    console: Console,
    document: dict[str, Any],
    results: dict[str, Summary],
    check: TokenCheck,
    notes: list[str],
) -> None:
    """The table a person reads: medians per method and llm_mesh's ratio against each."""
    rounds = document.get("rounds", 1)
    table = Table(
        title=f"{document['workload']} · {document['model']} · {document['dtype']} · {document['device']} · "
        f"median of {rounds} round(s)"
    )
    for column in ("method", "tok/s", "mesh ×", "TTFT p50", "TTFT p95", "lat p50", "lat p95", "tokens ≠"):
        table.add_column(column, justify="left" if column == "method" else "right")
    ratio_table = document.get("ratios", {})
    for method, summary in results.items():
        speedup = ratio_table.get(method, {}).get("tok_s")
        differing = (
            "ref"
            if method == check.reference
            else f"{check.mismatches.get(method, 0)}/{check.compared.get(method, 0)}"
        )
        table.add_row(
            method,
            f"{summary.tok_s:.1f}",
            "—" if speedup is None else f"{speedup:.2f}",
            f"{summary.ttft_p50_s:.2f}s",
            f"{summary.ttft_p95_s:.2f}s",
            f"{summary.latency_p50_s:.2f}s",
            f"{summary.latency_p95_s:.2f}s",
            differing,
        )
    console.print(table)
    console.print(
        f"token check vs {check.reference}: {check.total_mismatches} mismatching request(s) "
        f"({', '.join(f'{m} {check.mismatches[m]}/{check.compared[m]}' for m in check.mismatches) or 'nothing to compare'})"
    )
    for name, verdict in document.get("targets", {}).items():
        mark = "met" if verdict["met"] else "NOT met"
        console.print(f"target {name}: {verdict['ratio']:.2f} (goal ≥ {verdict['target']}) — {mark}")
    for note in notes:
        console.print(f"note: {note}")
