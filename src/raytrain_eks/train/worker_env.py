"""The environment of the training workers: what they need from the driver's, passed explicitly (Ray's workers
inherit the raylet's environment, not the driver's). Example: ``worker_environment(cfg, "run-1", use_gpu=True)``
holds ``PYTORCH_CUDA_ALLOC_CONF`` and the compile cache's folder."""

from __future__ import annotations

import getpass
import os
import re
from collections.abc import Mapping

from raytrain_eks.config import Config
from raytrain_eks.train.fabric_gate import nccl_env
from raytrain_eks.train.faults import ENV as FAULT_ENV
from raytrain_eks.train.faults import SLOW_WRITE_ENV
from raytrain_eks.train.preemption import DISABLED_ENV as METADATA_OFF_ENV
from raytrain_eks.train.preemption import ENDPOINT_ENV as METADATA_ENV
from raytrain_eks.train.staged import CACHE_ENV as MODEL_CACHE_ENV
from raytrain_eks.train.staged import is_staged_location
from raytrain_eks.train.watchdog import ENV as WATCHDOG_ENV
from raytrain_eks.train.watchdog import nccl_trace_env

# PyTorch's caching allocator on the GPU workers: segments that grow in place instead of a new block per size, which
# keeps the memory reserved beyond what is allocated small when shapes vary (packed batches, loss chunks, gathered
# layers); see the CUDA semantics notes of PyTorch's documentation. A value the user exports is kept.
CUDA_ALLOC_CONF = ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def compile_cache_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables that keep what torch.compile compiled: the inductor's FX graph cache and AOT autograd's cache,
    both on (torch 2.13's defaults, set so that no site default turns them off), in one folder per user on each
    node, ``/tmp/raytrain-eks-<user>/inductor``. The folder outlives the worker processes, so a worker group Ray
    Train restarts, or the next run on the node, loads the compiled layers rather than compiling them again. A value
    the user set in ``environ`` is kept (``TORCHINDUCTOR_CACHE_DIR``, or ``TORCHINDUCTOR_FX_GRAPH_CACHE=0``)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a container's user without a passwd entry (torch names it by its uid too)
        user = f"uid{os.getuid()}"
    # /tmp, not this process's temp folder: the path is chosen here but used on every node, and a driver on macOS
    # has a per-user temp folder the Linux nodes lack.
    default = f"/tmp/raytrain-eks-{re.sub(r'[^A-Za-z0-9._-]', '_', user)}/inductor"
    wanted = {
        "TORCHINDUCTOR_CACHE_DIR": default,
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
    }
    return {name: environ.get(name) or value for name, value in wanted.items()}


def worker_environment(cfg: Config, nccl_name: str, *, use_gpu: bool, watchdog: str | None = None) -> dict[str, str]:
    """The environment the training workers get. Workers inherit the raylet's environment, not the driver's, so
    what they need is passed explicitly: the staged model's offline switch, NCCL's evidence file (``nccl_name``
    names it) unless the fabric requirement is ``any``, the allocator setting on GPU workers, the compile cache
    (:func:`compile_cache_environment`), the watchdog's board (``watchdog``: its actor's name; on GPU workers the
    NCCL flight recorder with it), the instance metadata service's endpoint and off switch where the driver's
    environment sets them (:mod:`.preemption`), and the test faults."""
    env: dict[str, str] = compile_cache_environment(os.environ)
    if is_staged_location(cfg.training.model_id):  # read from where it is staged: no worker asks the Hub
        env["HF_HUB_OFFLINE"] = "1"
        if os.environ.get(MODEL_CACHE_ENV):
            env[MODEL_CACHE_ENV] = os.environ[MODEL_CACHE_ENV]
    if cfg.fabric.require != "any":
        env.update(nccl_env(nccl_name))
    if use_gpu:
        name, default = CUDA_ALLOC_CONF
        env[name] = os.environ.get(name) or default
    if watchdog:
        env[WATCHDOG_ENV] = watchdog
        if use_gpu:
            env.update(nccl_trace_env(watchdog))
    for fault in (FAULT_ENV, SLOW_WRITE_ENV, METADATA_ENV, METADATA_OFF_ENV):  # a local run's metadata service too
        if os.environ.get(fault):
            env[fault] = os.environ[fault]
    if os.environ.get(METADATA_ENV) and not os.environ.get(METADATA_OFF_ENV):
        # An endpoint named to the driver is asked, even by workers of a Ray started with the service turned off.
        env[METADATA_OFF_ENV] = "false"
    return env
