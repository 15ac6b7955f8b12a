"""Where the job's step spends its time on the GPU: CPU time inside train_step, the gap between steps, a profile."""

import json
import tempfile
import time
from pathlib import Path

import gpu_check
import torch

import raytrain_eks.train.loop as L

orig = L.train_step
rows = []
prof_out = {}
last = [None]


def wrapped(*a, **k):
    n = len(rows) + 1
    t0 = time.perf_counter()
    gap = None if last[0] is None else t0 - last[0]
    if n in (8, 9, 10):
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            r = orig(*a, **k)
            torch.cuda.synchronize()
        ka = p.key_averages()
        cuda_total = sum(e.self_device_time_total for e in ka) / 1e3
        cpu_top = sorted(ka, key=lambda e: -e.self_cpu_time_total)[:12]
        prof_out[n] = {
            "gpu_kernel_ms": round(cuda_total, 1),
            "top_self_cpu_ms": {e.key[:60]: round(e.self_cpu_time_total / 1e3, 1) for e in cpu_top},
            "top_gpu_ms": {
                e.key[:60]: round(e.self_device_time_total / 1e3, 1)
                for e in sorted(ka, key=lambda e: -e.self_device_time_total)[:8]
            },
        }
    else:
        r = orig(*a, **k)
    t1 = time.perf_counter()
    if n not in (8, 9, 10):
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    rows.append(
        {
            "step": n,
            "cpu_in_step_ms": round((t1 - t0) * 1e3, 1),
            "gpu_wait_ms": round((t2 - t1) * 1e3, 1),
            "gap_before_ms": None if gap is None else round(gap * 1e3, 1),
        }
    )
    last[0] = time.perf_counter()
    return r


L.train_step = wrapped
args = gpu_check.parse_args([])
with tempfile.TemporaryDirectory() as work:
    res = gpu_check.check_qwen_step(args, Path(work))
print(json.dumps({"qwen_step": res}), flush=True)
for r in rows:
    print(r)
for n, v in prof_out.items():
    print(n, json.dumps(v))
