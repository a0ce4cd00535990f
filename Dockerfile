# manyeyes: the attention API and browser UI on the built-in MiniLM, tiny-gpt and tiny-llama.
#
#   CPU (default):  docker build -t manyeyes .
#                   docker run --stop-timeout 35 -p 8000:8000 manyeyes
#   CUDA:           docker build --build-arg TORCH_VARIANT=cu126 -t manyeyes:cuda .
#                   docker run --stop-timeout 35 --gpus all -p 8000:8000 manyeyes:cuda
#
# --stop-timeout 35: docker stop's default 10 s cut the server's 30 s drain short (README, Container).
#
# torch is pinned to the README's version; TORCH_VARIANT picks its build from PyTorch's index
# (cpu, cu126, ...). CUDA wheels carry their own CUDA runtime, so both targets share one slim
# base; the GPU needs only the host's driver (NVIDIA Container Toolkit).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY manyeyes ./manyeyes
COPY app ./app
COPY model ./model
COPY templates ./templates
COPY static ./static
# A wheel, not an editable install: the image runs exactly what pip users get.
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/manyeyes \
    PORT=8000
# torch first, from the chosen index, so pyproject's torch range is met and nothing else pulls a build.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"
COPY --from=build /wheels /wheels
# The pin again, so that no dependency's range can swap that build for another one from PyPI.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" /wheels/manyeyes-*.whl && rm -rf /wheels

# A numeric, unprivileged user: Kubernetes' runAsNonRoot can verify it without a passwd lookup.
RUN groupadd --system --gid 10001 manyeyes \
    && useradd --system --no-log-init --uid 10001 --gid 10001 --create-home --home-dir /home/manyeyes manyeyes
USER 10001:10001
WORKDIR /home/manyeyes

EXPOSE 8000
# Ready, not merely alive: /readyz answers 200 only once every model is loaded and warmed up. On
# the port the server listens on (`docker run -e PORT=9000`): a port written twice, in the CMD and
# here, failed the health check of any image run with the CMD's port changed.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(f'http://127.0.0.1:{os.environ[\"PORT\"]}/readyz', timeout=4)"]
# Inside a container the server must listen beyond loopback; publish the port deliberately.
# exec: the server is PID 1 and gets docker stop's SIGTERM, which drains it.
CMD ["sh", "-c", "exec manyeyes serve --host 0.0.0.0 --port \"$PORT\""]
