# The CPU image of the service: one image runs the scheduler, a worker, the model writer, the
# OpenAI-compatible gateway and the load test (docker/entrypoint.sh picks by its first argument). See docs/DOCKER.md.
#
# Two stages, so that what only the build needs (extra CA certificates, a local wheelhouse,
# pip's work files) never reaches the image the services run in.

FROM python:3.11-slim-bookworm AS build
# Locally added CA certificates (docker/prepare_build_context.sh fills the folder on machines
# whose TLS goes through their own CA; empty otherwise), trusted by pip in this stage only.
COPY docker/ca-certificates/ /usr/local/share/ca-certificates/
RUN update-ca-certificates >/dev/null
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv
COPY docker/wheelhouse/ /tmp/wheelhouse/
COPY requirements.txt /tmp/requirements.txt
# torch first, in a layer of its own: it is most of the image. The CPU build comes from the
# wheelhouse when it holds one, else from PyTorch's CPU index (PyPI's default build bundles
# CUDA, several GB that a CPU image never uses); pass --build-arg TORCH_INDEX_URL= to use only
# the default index.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN /opt/venv/bin/pip install --find-links /tmp/wheelhouse \
        ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} \
        "$(grep -E '^torch==' /tmp/requirements.txt)"
RUN /opt/venv/bin/pip install -r /tmp/requirements.txt

FROM python:3.11-slim-bookworm
# An unprivileged user; /models belongs to it so a new named volume mounted there does too.
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/llm llm \
    && mkdir /models && chown llm:llm /models
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    MODEL_DIR=/models/tiny-qwen3
WORKDIR /app
COPY common/ common/
COPY worker_svc/ worker_svc/
COPY scheduler_svc/ scheduler_svc/
COPY tools/ tools/
COPY gateway/ gateway/
COPY docker/entrypoint.sh docker/entrypoint.sh
# The code is read-only for the service user, so compile it once here instead of at each start.
RUN python -m compileall -q common worker_svc scheduler_svc tools gateway
USER llm
EXPOSE 50051 50061 8000
ENTRYPOINT ["/app/docker/entrypoint.sh"]
CMD ["scheduler"]
