# syntax=docker/dockerfile:1
# ampd image: built on NVIDIA's CUDA devel image with the same Debian/Ubuntu
# packages as scripts/install-deps.sh, run on the matching runtime image with
# only the shared libraries the two binaries link. Ubuntu 24.04 ships the
# Abseil (20220623) and gRPC (1.51) that Debian 12, the development platform,
# does.
#
#   docker build -t ampd:0.1.0 .
#   docker run --gpus all -p 50051:50051 -p 9464:9464 -v ampd-state:/var/lib/ampd ampd:0.1.0
ARG CUDA_VERSION=12.6.3

# ---- build ------------------------------------------------------------------
FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu24.04 AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive
COPY scripts/install-deps.sh /tmp/install-deps.sh
RUN /tmp/install-deps.sh && rm -rf /var/lib/apt/lists/*

WORKDIR /src
COPY . .
# AMPD_CUDA=ON: the image exists to run on GPUs, so a missing nvcc must fail
# the build rather than silently produce a CPU-only server.
RUN cmake --preset dev -DCMAKE_BUILD_TYPE=Release -DAMPD_CUDA=ON \
      -DAMPD_BUILD_TESTS=OFF -DAMPD_BUILD_BENCHMARKS=OFF -DAMPD_SHARED_KERNELS=OFF \
 && cmake --build --preset dev --target ampd ampctl

# The binaries, and the packages owning every shared library they link (the
# CUDA ones are already in the runtime image, the others are installed there).
RUN mkdir -p /out/bin \
 && for t in ampd ampctl; do \
      f="$(find build/dev -type f -name "$t" -perm -u+x -not -path '*/CMakeFiles/*' | head -n 1)"; \
      if [ -z "$f" ]; then echo "no $t binary under build/dev" >&2; exit 1; fi; \
      install -m 0755 "$f" "/out/bin/$t"; \
    done \
 && ldd /out/bin/ampd /out/bin/ampctl | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u \
    | while read -r lib; do \
        real="$(readlink -f "$lib")"; \
        dpkg -S "$real" 2>/dev/null || dpkg -S "${real#/usr}" 2>/dev/null \
          || { echo "no package owns $real" >&2; exit 1; }; \
      done \
    | cut -d: -f1 | sort -u > /out/runtime-packages.txt \
 && cat /out/runtime-packages.txt

# ---- runtime ----------------------------------------------------------------
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu24.04
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive
COPY --from=build /out/runtime-packages.txt /tmp/runtime-packages.txt
RUN apt-get update -qq \
 && xargs -a /tmp/runtime-packages.txt apt-get install -y -qq --no-install-recommends \
 && rm -rf /var/lib/apt/lists/* /tmp/runtime-packages.txt

# A fixed numeric uid, so Kubernetes' runAsNonRoot can verify it and the
# state volume's owner is the same in every container.
RUN groupadd --system --gid 10001 ampd \
 && useradd --system --uid 10001 --gid ampd --home-dir /var/lib/ampd --shell /usr/sbin/nologin ampd \
 && install -d -o ampd -g ampd -m 0750 /var/lib/ampd
COPY --from=build /out/bin/ampd /out/bin/ampctl /usr/local/bin/

USER 10001:10001
EXPOSE 50051 9464
VOLUME /var/lib/ampd
# State dicts and checkpoints move whole models through freshly allocated
# host buffers; glibc's malloc backing them with transparent huge pages cuts
# the page faults of each such buffer 512-fold (measured: GetStateDict and
# LoadStateDict 2.5x faster on a VM where faults are expensive).
ENV GLIBC_TUNABLES=glibc.malloc.hugetlb=1
# The standard grpc.health.v1 service, queried through ampctl (the image has
# no grpc_health_probe). start-period: restoring jobs from the state
# directory can take a while.
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
  CMD ["ampctl", "--server=127.0.0.1:50051", "health"]
ENTRYPOINT ["ampd", "--listen=0.0.0.0:50051", "--metrics-listen=0.0.0.0:9464", "--state-dir=/var/lib/ampd", "--device=auto"]
