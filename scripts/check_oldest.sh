#!/usr/bin/env bash
# The training and command-line tests against the oldest releases the cluster ranges admit
# (raytrain_eks.k8s.job.OLDEST_CHECKED: the AWS Ray Train DLC's transformers 5.13.0, tokenizers 0.22.2, datasets
# 5.0.0, pydantic 2.13.4 and typer 0.26.8), every other package as this checkout's .venv has it. Builds a virtual
# environment of its own (default /tmp/raytrain-eks-oldest; needs the package index for those releases, the
# pydantic-core their pydantic takes, and a huggingface_hub below 2, which transformers 5.13 requires):
#
#   bash scripts/check_oldest.sh [VENV]
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-/tmp/raytrain-eks-oldest}"
wanted="$(.venv/bin/python -c 'from raytrain_eks.k8s.job import OLDEST_CHECKED as o; print(" ".join(f"{k}=={v}" for k, v in o.items()))')"
reqs="$(mktemp)"
trap 'rm -f "$reqs"' EXIT
# This environment's versions, less this package, the releases replaced (and pydantic's core, which follows pydantic),
# with a huggingface_hub transformers 5.13 takes, and the Kubernetes client at a release that takes that pydantic (it
# runs only where the tool deploys from, never on the workers; kubernetes 37 asks for pydantic>=2.13.5), and the fsspec
# datasets 5.0.0 takes (at most 2026.4.0, the image's).
names="$(.venv/bin/python -c 'from raytrain_eks.k8s.job import OLDEST_CHECKED as o; print("|".join(o))')"
.venv/bin/pip freeze --exclude-editable |
    grep -viE "^(raytrain-eks|$names|pydantic[-_]core|huggingface[-_]hub|kubernetes|fsspec)[=@ ]" >"$reqs"
printf '%s\n' $wanted "huggingface_hub>=1.31,<2" kubernetes fsspec >>"$reqs"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q -r "$reqs"
"$venv/bin/pip" install -q --no-deps -e .
"$venv/bin/python" -c 'import importlib.metadata as md, sys; print(*(f"{n} {md.version(n)}" for n in sys.argv[1:]), sep=", ")' ${names//|/ }
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider \
    tests/test_loss_architectures.py tests/test_host_syncs.py tests/test_loss.py tests/test_packing.py \
    tests/test_model_start.py tests/test_memory_estimate.py tests/test_chat_templates.py tests/test_data_formats.py \
    tests/test_precision.py tests/test_lora.py tests/test_export.py tests/test_main_job.py tests/test_optimizer.py \
    tests/test_staged_model.py tests/test_config.py tests/test_data_sources_hf.py
