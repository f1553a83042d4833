# syntax=docker/dockerfile:1.7
# Images for the node daemon and the operator, from one workspace build context.
#   docker build --target daemon   -t moe-daemon .
#   docker build --target operator -t moe-operator .

ARG RUST_VERSION=1.95
ARG CUDA_RUNTIME_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# ---- build: the whole workspace once, with cached registry and target dirs ------------------------
# hwloc for the CPU kernels: linked dynamically; libudev-dev only because hwlocality-sys queries
# pkg-config with --static, which puts hwloc's private -ludev on the link line.
FROM rust:${RUST_VERSION}-bookworm AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends pkg-config libhwloc-dev libudev-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p moe-daemon -p moe-operator \
 && mkdir -p /out \
 && cp target/release/moe-daemon target/release/moe-operator /out/

# ---- daemon: CUDA runtime base (cuBLAS, NVRTC); the daemon opens CUDA libraries at run time --------
# (cudarc dynamic loading; libcuda comes from the host driver via the NVIDIA container toolkit).
FROM ${CUDA_RUNTIME_IMAGE} AS daemon
RUN apt-get update \
 && apt-get install -y --no-install-recommends libhwloc15 ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 65532 --user-group --no-create-home --shell /usr/sbin/nologin moe
COPY --from=build /out/moe-daemon /usr/local/bin/moe-daemon
ENV NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 65532:65532
EXPOSE 8000
ENTRYPOINT ["moe-daemon"]
CMD ["serve", "--help"]

# ---- operator: small glibc base, non-root -------------------------------------------------------
FROM gcr.io/distroless/cc-debian12:nonroot AS operator
COPY --from=build /out/moe-operator /usr/local/bin/moe-operator
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/moe-operator"]
CMD ["run"]
