#!/usr/bin/env bash
# Fills .whl/ (git-ignored through .git/info/exclude) with what benchmarks/cuda_session.sh needs on a lent device
# machine and its image does not hold: remat's own wheel and, at uv.lock's versions, the packages its commands
# import that the image lacks (pydantic, SQLAlchemy, Alembic, ...) or holds at other versions (transformers and the
# huggingface_hub it needs). Run it here, where pip reaches the registry, before the device call:
#
#     bash benchmarks/cuda_wheels.sh            # then run(command="OUT=$OUT bash benchmarks/cuda_session.sh", carry=[".whl"])
#
# The list is what the session's six sections imported from site-packages in a CPU rehearsal (docs/benchmarks.md,
# "Preparing a device session"), less the image's packages (the device library's KINDS.md). PYVER=3.11 fetches
# wheels for this machine's Python instead, to rehearse the session in an environment holding only the image's
# packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${PYVER:-3.12}
CARRIED=(alembic annotated-types httpcore2 httpx2 huggingface-hub mako opentelemetry-api platformdirs pydantic
         pydantic-core pydantic-settings python-dotenv redis sqlalchemy transformers truststore typing-inspection)

grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl
mkdir -p .whl
uv build --wheel --out-dir .whl --quiet

locked=$(uv export --frozen --no-hashes --no-emit-project --all-extras --all-groups --format requirements-txt)
pins=()
for name in "${CARRIED[@]}"; do
    pin=$(grep -i -m1 "^${name}==" <<< "$locked" | cut -d' ' -f1) || true
    [ -n "$pin" ] || { echo "cuda_wheels: $name is not in uv.lock" >&2; exit 1; }
    pins+=("$pin")
done
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    "${platforms[@]}" -d .whl "${pins[@]}"
ls .whl
du -sh .whl
