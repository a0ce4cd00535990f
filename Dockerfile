# manyeyes: the attention API and browser UI on the built-in MiniLM (and tiny-gpt).
# CPU image; for a GPU, start from a CUDA base with a CUDA torch build and pass --device cuda.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /srv/manyeyes

# torch first, from the CPU index, so the range in pyproject does not pull a CUDA build.
RUN pip install torch --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY app ./app
COPY model ./model
COPY templates ./templates
COPY static ./static
RUN pip install -e .

RUN useradd --system --uid 10001 manyeyes
USER manyeyes
EXPOSE 8000
# Inside a container the server must listen beyond loopback; publish the port deliberately.
CMD ["manyeyes", "serve", "--host", "0.0.0.0", "--port", "8000"]
