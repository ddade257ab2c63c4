"""`make stubs LANG=…` (scripts/stubs.sh): protos/ bundled with the Google API protos they import, so
stubs generate with plain protoc / grpc_tools, and what comes out compiles."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import ROOT

pytestmark = pytest.mark.timeout(600)

SCRIPT = ROOT / "scripts" / "stubs.sh"
JAVA_JARS = ["protobuf", "grpc-api", "grpc-stub", "grpc-protobuf", "grpc-protobuf-lite", "guava"]
#: javax.annotation.Generated, which grpc-java's generated code carries (gone from the JDK since 11).
JAVAX_ANNOTATION = "geronimo-annotation-1.3-spec"


def stubs(language: str, out: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "-s", "stubs", f"LANG={language}", f"OUT={out}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_the_bundle_holds_our_protos_and_the_google_api_files_they_import(tmp_path: Path) -> None:
    done = stubs("python", tmp_path)
    assert done.returncode == 0, done.stderr
    bundle = tmp_path / "proto"
    assert {p.name for p in (bundle / "google" / "api").iterdir()} == {"annotations.proto", "http.proto"}
    assert {p.name for p in (ROOT / "protos" / "llmmesh" / "v1").glob("*.proto")} == {
        p.name for p in (bundle / "llmmesh" / "v1").glob("*.proto")
    }


def test_python_stubs_import_and_build_a_router_request(tmp_path: Path) -> None:
    done = stubs("python", tmp_path)
    assert done.returncode == 0, done.stderr
    script = (
        "from llmmesh.v1 import router_pb2, router_pb2_grpc\n"
        "r = router_pb2.ChatRequest(session_id='s', session_must_exist=True)\n"
        "assert router_pb2.ChatRequest.FromString(r.SerializeToString()) == r\n"
        "stub = router_pb2_grpc.RouterStub(__import__('grpc').insecure_channel('x:1'))\n"
        "print(' '.join(sorted(m for m in vars(stub) if not m.startswith('_'))))\n"
    )
    rpcs = re.findall(r"^\s*rpc (\w+)\(", (ROOT / "protos/llmmesh/v1/router.proto").read_text(), re.M)
    ran = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path / "python")},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    # Every RPC of the Router service has its method on the stub.
    assert ran.stdout.split() == sorted(rpcs) and "ChatStream" in rpcs


GO_EXAMPLE = """package main

import (
	"context"
	"fmt"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	llmmeshv1 "llmmesh/v1"
)

func main() {
	conn, _ := grpc.Dial("127.0.0.1:50051", grpc.WithInsecure())
	router := llmmeshv1.NewRouterClient(conn)
	ctx := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer key")
	reply, err := router.Complete(ctx, &llmmeshv1.ChatRequest{
		Messages: []*llmmeshv1.ChatMessage{{Role: "user", Content: "What is llm-mesh?"}},
		Sampling: &llmmeshv1.SamplingParams{XMaxTokens: &llmmeshv1.SamplingParams_MaxTokens{MaxTokens: 64}},
	})
	fmt.Println(reply, err)
}
"""


def go_env(tmp_path: Path) -> dict[str, str]:
    # The Go build cache stays where the gateway build warmed it ($HOME/.cache/go-build).
    return {
        **os.environ,
        "GO111MODULE": "off",
        "GOPROXY": "off",
        "CGO_ENABLED": "0",
        "GOPATH": f"{tmp_path / 'go'}:/usr/share/gocode",
    }


def test_go_stubs_build_and_vet_or_the_missing_tool_is_named(tmp_path: Path) -> None:
    env = {**os.environ}
    done = stubs("go", tmp_path, env)
    if shutil.which("protoc-gen-go") is None or shutil.which("protoc") is None:
        # No Go plugin on this machine: the script says exactly which and how to get it.
        assert done.returncode != 0
        assert "not found: apt-get install" in done.stderr
        return
    assert done.returncode == 0, done.stderr
    generated = sorted(p.name for p in (tmp_path / "go" / "src" / "llmmesh" / "v1").glob("*.go"))
    assert "router.pb.go" in generated
    for command in (["go", "build", "llmmesh/v1"], ["go", "vet", "llmmesh/v1"]):
        ran = subprocess.run(
            command, cwd=tmp_path, env=go_env(tmp_path), capture_output=True, text=True, timeout=400
        )
        assert ran.returncode == 0, ran.stderr
    router = (tmp_path / "go" / "src" / "llmmesh" / "v1" / "router.pb.go").read_text()
    assert "func NewRouterClient(" in router and "ChatStream(ctx context.Context" in router
    # docs/clients.md's Go call compiles against them.
    example = tmp_path / "go" / "src" / "example" / "main.go"
    example.parent.mkdir(parents=True)
    example.write_text(GO_EXAMPLE)
    ran = subprocess.run(
        ["go", "vet", "example"],
        cwd=tmp_path,
        env=go_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert ran.returncode == 0, ran.stderr


def test_java_sources_carry_the_messages_and_the_router_service(tmp_path: Path) -> None:
    done = stubs("java", tmp_path)
    assert done.returncode == 0, done.stderr
    java = tmp_path / "java" / "llmmesh" / "v1"
    assert (java / "RouterOuterClass.java").exists()
    if shutil.which("protoc-gen-grpc-java") or shutil.which("grpc_java_plugin"):
        assert "public static RouterStub newStub(" in (java / "RouterGrpc.java").read_text()
    else:
        assert "protoc-gen-grpc-java not found" in done.stderr


def java_classpath() -> str | None:
    jars = [Path(f"/usr/share/java/{name}.jar") for name in [*JAVA_JARS, JAVAX_ANNOTATION]]
    return ":".join(map(str, jars)) if all(j.exists() for j in jars) else None


@pytest.mark.full
def test_java_stubs_compile_with_javac(tmp_path: Path) -> None:
    """Full only: javac over ~20k generated lines takes a minute on two cores."""
    classpath = java_classpath()
    assert shutil.which("javac") and classpath, "needs a JDK and Debian's libprotobuf-java libgrpc-java"
    done = stubs("java", tmp_path)
    assert done.returncode == 0, done.stderr
    sources = [str(p) for p in (tmp_path / "java").rglob("*.java")]
    ran = subprocess.run(
        ["javac", "-nowarn", "-d", str(tmp_path / "classes"), "-cp", classpath, *sources],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    assert (tmp_path / "classes" / "llmmesh" / "v1" / "RouterGrpc.class").exists()
