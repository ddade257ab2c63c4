"""A CPU replica's KV cache and decode slab fit the memory its container may use."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.inference.memory_budget import (
    ACTIVATION_RESERVE_BYTES,
    MIB,
    container_memory_limit,
    memory_limit,
    physical_memory,
    plan_cpu_memory,
)

GIB = 1 << 30


def cgroup(tmp_path: Path, relative: str, text: str) -> Path:
    path = tmp_path / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return tmp_path


def test_the_limit_comes_from_cgroup_v2_or_v1_and_unlimited_means_none(tmp_path: Path) -> None:
    at_root = tmp_path / "proc-cgroup"
    at_root.write_text("0::/\n")

    def limit(root: Path) -> int | None:
        return container_memory_limit(root, at_root)

    assert limit(cgroup(tmp_path / "v2", "memory.max", "4294967296\n")) == 4 * GIB
    assert limit(cgroup(tmp_path / "v2max", "memory.max", "max\n")) is None
    assert limit(cgroup(tmp_path / "v1", "memory/memory.limit_in_bytes", "2147483648\n")) == 2 * GIB
    # cgroup v1 says "no limit" with a number near 2**63.
    assert limit(cgroup(tmp_path / "v1max", "memory/memory.limit_in_bytes", "9223372036854771712")) is None
    assert limit(tmp_path / "none") is None


def test_a_process_below_the_root_finds_its_own_cgroup(tmp_path: Path) -> None:
    # A systemd service, or a container without its own cgroup namespace.
    v2 = tmp_path / "v2-proc"
    v2.write_text("0::/system.slice/llm-mesh-inference.service\n")
    root = cgroup(tmp_path / "v2", "system.slice/llm-mesh-inference.service/memory.max", str(3 * GIB))
    assert container_memory_limit(root, v2) == 3 * GIB
    v1 = tmp_path / "v1-proc"
    v1.write_text("12:pids:/docker/abc\n9:memory:/docker/abc\n0::/docker/abc\n")
    root = cgroup(tmp_path / "v1", "memory/docker/abc/memory.limit_in_bytes", str(5 * GIB))
    cgroup(root, "memory/memory.limit_in_bytes", "9223372036854771712")
    assert container_memory_limit(root, v1) == 5 * GIB


def test_the_flag_wins_then_the_container_then_the_machine(tmp_path: Path) -> None:
    at_root = tmp_path / "proc-cgroup"
    at_root.write_text("0::/\n")
    limited = cgroup(tmp_path / "pod", "memory.max", str(4 * GIB))
    assert memory_limit(3000, limited, at_root).bytes == 3000 * MIB
    assert memory_limit(3000, limited, at_root).source == "--memory-limit-mib"
    assert memory_limit(None, limited, at_root).bytes == min(4 * GIB, physical_memory())
    assert memory_limit(None, limited, at_root).source == "the container's cgroup limit"
    assert memory_limit(None, tmp_path / "no-cgroup", at_root).bytes == physical_memory()
    assert memory_limit(None, tmp_path / "no-cgroup", at_root).source == "the machine's RAM"


def test_a_large_machine_keeps_the_full_defaults() -> None:
    plan = plan_cpu_memory(24 * GIB, resident=1 * GIB, kv_cache_wanted=4 * GIB, slab_wanted=1 * GIB)
    assert (plan.kv_cache_bytes, plan.slab_bytes) == (4 * GIB, 1 * GIB)


def test_a_4_gib_pod_shrinks_the_cache_and_slab_to_fit() -> None:
    resident = 1200 * MIB
    plan = plan_cpu_memory(4 * GIB, resident=resident, kv_cache_wanted=4 * GIB, slab_wanted=1 * GIB)
    # Everything the replica plans to hold stays within 90 % of the limit.
    assert resident + ACTIVATION_RESERVE_BYTES + plan.kv_cache_bytes + plan.slab_bytes <= 0.9 * 4 * GIB
    assert plan.slab_bytes == plan.available_bytes // 4
    assert plan.kv_cache_bytes == plan.available_bytes - plan.slab_bytes
    assert 1 * GIB < plan.kv_cache_bytes < 4 * GIB


def test_a_small_cache_leaves_the_slab_what_it_does_not_use() -> None:
    plan = plan_cpu_memory(4 * GIB, resident=1 * GIB, kv_cache_wanted=100 * MIB, slab_wanted=1 * GIB)
    assert plan.kv_cache_bytes == 100 * MIB
    assert plan.slab_bytes == 1 * GIB


@pytest.mark.parametrize("resident", [3 * GIB, 8 * GIB])
def test_no_room_at_all_plans_nothing_rather_than_a_negative_size(resident: int) -> None:
    plan = plan_cpu_memory(4 * GIB, resident=resident, kv_cache_wanted=4 * GIB, slab_wanted=1 * GIB)
    assert (plan.kv_cache_bytes, plan.slab_bytes, plan.available_bytes) == (0, 0, 0)


def test_memory_still_to_come_is_taken_from_the_kv_cache_before_it_is_sized(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The compiled decode step packs its own copy of the weights after the cache is sized: a
    # cache sized on today's RSS alone would take the memory that copy needs and pass the limit.
    import torch

    from services.inference import kv_sizing

    class Rss:
        rss = 1 * GIB

    monkeypatch.setattr(
        kv_sizing.psutil, "Process", lambda: type("P", (), {"memory_info": lambda self: Rss})()
    )
    monkeypatch.setattr(kv_sizing, "release_freed_heap", lambda: None)
    kv = kv_sizing.KVGeometry(30, 3, 64, 16, torch.bfloat16, 8192, 256)
    per_block = kv.bytes_per_block()
    blocks_now, slab_now = kv_sizing.fit_host_memory(kv, None, 4096, 256 * MIB)
    blocks_later, slab_later = kv_sizing.fit_host_memory(kv, None, 4096, 256 * MIB, to_come=512 * MIB)
    # Everything the compiled copy takes comes out of the cache and the slab, none from the limit.
    assert (blocks_now - blocks_later) * per_block + (slab_now - slab_later) >= 512 * MIB - per_block
    assert blocks_later * per_block + slab_later + 1 * GIB + 512 * MIB + ACTIVATION_RESERVE_BYTES <= 4 * GIB
