# syntax=docker/dockerfile:1.7
# llm-mesh router (the public front door). Build from the repository root:
#   docker build -f deploy/docker/router.Dockerfile -t llm-mesh/router:dev .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# The CPU build of torch first: a bare `torch` requirement pulls the multi-GB CUDA build.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY services ./services
# Generated code is never committed: build it here from protos/, then install it with the rest.
RUN pip install grpcio-tools googleapis-common-protos \
    && python -m services.common.protogen \
    && pip install .
# The default model's tokenizer and chat template (never its weights): with `--policy prefix`
# the router hashes prompts into the replicas' KV blocks with them (docs/router.md, "Prompt
# hashes"). A pool serving another model mounts its tokenizer and sets LLMMESH_TOKENIZER.
RUN python -m services.inference.fetch_model --out /models/SmolLM2-135M-Instruct

FROM ${PYTHON_IMAGE} AS runtime
RUN useradd --system --uid 10001 --user-group --home-dir /home/llmmesh --create-home llmmesh
COPY --from=build /opt/venv /opt/venv
COPY --from=build /models/SmolLM2-135M-Instruct/tokenizer.json \
    /models/SmolLM2-135M-Instruct/tokenizer_config.json \
    /models/SmolLM2-135M-Instruct/chat_template.jinja \
    /models/SmolLM2-135M-Instruct/
COPY deploy/docker/grpc_health_check.py /usr/local/bin/grpc_health_check.py
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    HF_HOME=/tmp/hf \
    LLMMESH_HOST=0.0.0.0 \
    LLMMESH_PORT=50051 \
    LLMMESH_HTTP_PORT=8000 \
    LLMMESH_METRICS_PORT=9090 \
    LLMMESH_TOKENIZER=/models/SmolLM2-135M-Instruct
USER 10001:10001
WORKDIR /home/llmmesh
# 8000: the OpenAI-compatible HTTP front (docs/openai.md).
EXPOSE 50051 8000 9090
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "/usr/local/bin/grpc_health_check.py", "127.0.0.1:50051"]
# SIGTERM drains: health goes NOT_SERVING, in-flight work finishes, then the process exits.
STOPSIGNAL SIGTERM
ENTRYPOINT ["python", "-m", "services.router"]
