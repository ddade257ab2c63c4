"""Helpers for tests of the router's OpenAI HTTP front: its port, its base URL, an API-keys file."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import yaml

from services.router.admission.auth import hash_key
from tests.support.processes import ServiceProcess

HTTP_RE = re.compile(r"llm-mesh router http on (\S+):(\d+)")


def http_base(router: ServiceProcess, timeout: float = 30.0) -> str:
    """``http://host:port`` of a started router's HTTP front, from the line it prints."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in router.lines:
            if m := HTTP_RE.search(line):
                return f"http://127.0.0.1:{m.group(2)}"
        time.sleep(0.05)
    raise TimeoutError("the router printed no 'http on' line:\n" + router.output())


def keys_file(path: Path, keys: dict[str, dict[str, object]]) -> Path:
    """A keys file: ``{api_key: {"tenant": ..., other record fields}}``, stored hashed."""
    records = [
        {"id": f"key-{i}", "sha256": hash_key(k), **fields} for i, (k, fields) in enumerate(keys.items())
    ]
    path.write_text(yaml.safe_dump({"keys": records}))
    return path


README = Path(__file__).resolve().parents[2] / "README.md"
#: The base URL the README's snippets use: `llm-mesh up`'s default HTTP port.
README_BASE = "http://127.0.0.1:8000"


def readme_block(language: str, containing: str) -> str:
    """The README's first fenced ``language`` block that contains ``containing``, as written there."""
    text = README.read_text()
    for block in text.split(f"```{language}\n")[1:]:
        code = block.split("```", 1)[0]
        if containing in code:
            return code
    raise AssertionError(f"README has no {language} block with {containing!r}")


def load_tool_texts(stream: bytes) -> str:
    """A chat stream's answer as the load tools' readers take it (SGLang's bench_serving and
    llmperf read line by line, `vllm bench serve` event by event): empty lines skipped, every
    other one ``data: <JSON>`` or ``data: [DONE]``, nothing else (an AssertionError otherwise)."""
    text = ""
    for line in stream.split(b"\n"):
        if not line.strip():
            continue
        assert line.startswith(b"data: "), line
        payload = line[len(b"data: ") :]
        if payload != b"[DONE]":
            choices = json.loads(payload)["choices"]
            text += (choices[0]["delta"].get("content") or "") if choices else ""
    return text
