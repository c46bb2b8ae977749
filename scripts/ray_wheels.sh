#!/usr/bin/env bash
# Ray Serve for the lent GPU machines (no network there): the wheels packed here into two
# carry folders of at most 64 MiB, then joined and installed there in two back-to-back calls.
#   here:  bash scripts/ray_wheels.sh pack [DOWNLOAD_DIR]    # -> .rw1/ and .rw2/ (git-ignored)
#   call 1 (carry .rw1): bash scripts/ray_wheels.sh stash .rw1
#   call 2 (carry .rw2): bash scripts/ray_wheels.sh stash .rw2 && bash scripts/ray_wheels.sh install
#   then:  PYTHONPATH=/tmp/site RAY_AUTH_MODE=disabled python3 benchmarks/scale.py ...
set -euo pipefail
cd "$(dirname "$0")/.."
# on the machine already (device KINDS.md, "Python packages already there"), or not needed there
HAVE="aiohappyeyeballs aiohttp aiosignal annotated_doc anyio attrs certifi charset_normalizer click filelock
frozenlist grpcio h11 idna jinja2 markupsafe msgpack multidict numpy packaging prometheus_client propcache
protobuf pyyaml requests six typing_extensions urllib3 uvloop wrapt yarl py_spy"
case "${1:-}" in
  pack)
    src=${2:-/work/rw}
    [ -f "$src"/ray-2.60.0-*.whl ] || pip download "ray[serve]==2.60.0" grpcio==1.84.0 grpcio-health-checking==1.84.0 \
      grpcio-reflection==1.84.0 --python-version 3.12 --platform manylinux2014_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --only-binary=:all: -d "$src"
    # the OTLP exporter, for server_overhead.py --trace (the server's spans)
    ls "$src"/opentelemetry_exporter_otlp_proto_grpc-*.whl >/dev/null 2>&1 || pip download --no-deps \
      opentelemetry-exporter-otlp-proto-grpc==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2 \
      opentelemetry-exporter-otlp-common==0.66b2 \
      --python-version 3.12 --only-binary=:all: -d "$src"
    rm -rf .rw1 .rw2 && mkdir .rw1 .rw2
    for w in "$src"/*.whl; do
      name=$(basename "$w" | cut -d- -f1 | tr 'A-Z-' 'a-z_')
      case " $(echo $HAVE) " in *" $name "*) continue ;; esac
      [ "$name" = ray ] && continue
      if [ $(du -cm .rw1/* 2>/dev/null | tail -1 | cut -f1) -lt 10 ]; then cp "$w" .rw1/; else cp "$w" .rw2/; fi
    done
    split -b 40000000 "$src"/ray-2.60.0-*.whl .rw1/ray.part.
    mv .rw1/ray.part.ab .rw2/ && basename "$src"/ray-2.60.0-*.whl > .rw2/ray.name
    du -sm .rw1 .rw2 ;;
  stash) mkdir -p ~/rw && cp "$2"/* ~/rw/ ;;
  install)
    cat ~/rw/ray.part.* > ~/rw/"$(cat ~/rw/ray.name)" && rm ~/rw/ray.part.*
    pip install -q --no-index --no-deps --target /tmp/site ~/rw/*.whl && echo "ray installed in /tmp/site" ;;
  *) echo "usage: $0 pack [DIR] | stash DIR | install" >&2; exit 2 ;;
esac
