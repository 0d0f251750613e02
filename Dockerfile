# kvbandit's container image: one static binary on an empty base (no shell,
# no package manager, no libc), run as an unprivileged user.
#
# `make image` builds it with buildah, offline: it first builds the binary
# (CGO_ENABLED=0, stamped with the version) into bin/image/linux-ARCH/ and
# copies the host's CA bundle (for TLS to etcd, NATS or the API server
# without a CA file) to bin/image/, then runs
#   buildah build --platform linux/ARCH --build-arg VERSION=… --build-arg COMMIT=… --build-arg DATE=… -f Dockerfile .
# podman build reads this file the same way once bin/image is there. See
# README.md, "Container image".
FROM scratch

ARG TARGETOS=linux
ARG TARGETARCH
ARG VERSION=unknown
ARG COMMIT=unknown
ARG DATE=unknown

LABEL org.opencontainers.image.title="kvbandit" \
      org.opencontainers.image.description="KV-cache-aware endpoint picker (Envoy ext_proc) for vLLM and SGLang workers" \
      org.opencontainers.image.source="https://github.com/kvbandit/kvbandit" \
      org.opencontainers.image.url="https://github.com/kvbandit/kvbandit" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${COMMIT}" \
      org.opencontainers.image.created="${DATE}"

COPY bin/image/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY bin/image/${TARGETOS}-${TARGETARCH}/kvbandit /kvbandit

# The chart and manifests run it as 65532 too (runAsNonRoot).
USER 65532:65532
# ext_proc, gRPC health, /metrics: serve's defaults.
EXPOSE 9002 9003 9090
ENTRYPOINT ["/kvbandit"]
CMD ["help"]
