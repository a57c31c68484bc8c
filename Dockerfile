# The image the chart runs: `weir` with the subcommands operator, router, sidecar and
# engine (the reference engine). SGLang itself runs from its own image beside the sidecar.
#
#   docker build -t ghcr.io/weir-dev/weir:0.1.0 .
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY controlplane controlplane
COPY engine_sidecar engine_sidecar
COPY fleetsim fleetsim
COPY operator operator
COPY weir weir
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
LABEL org.opencontainers.image.title="weir" \
      org.opencontainers.image.description="Weir: a control plane for LLM inference fleets" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir /wheels/*.whl
# The chart runs every container as this user, with a read-only root filesystem.
RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin weir
USER 10001:10001
ENTRYPOINT ["weir"]
CMD ["--help"]
