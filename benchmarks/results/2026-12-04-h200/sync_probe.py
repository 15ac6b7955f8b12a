"""Which way of summing the output projection's gradient in fp32 syncs, and how fast each is (device probe)."""

import json
import time
import traceback
import warnings

import torch
import torch.nn.functional as F

import raytrain_eks.train.model as M

dev = torch.device("cuda", 0)
T, H, V = 4094, 1536, 151936
g = torch.Generator(device=dev).manual_seed(0)
h0 = torch.randn(T, H, device=dev, generator=g).bfloat16()
w0 = (0.02 * torch.randn(V, H, device=dev, generator=g)).bfloat16()
y = torch.randint(0, V, (T,), device=dev, generator=g)
y[:100] = -100


def count_syncs(fn):
    n = [0]
    where = {}

    def rec(message, *a, **k):
        if "synchroniz" in str(message):
            n[0] += 1
            fr = traceback.extract_stack()[-3:-1]
            key = " | ".join(f"{f.name}:{f.lineno}" for f in fr)
            where[key] = where.get(key, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = rec
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return out, n[0], dict(sorted(where.items(), key=lambda kv: -kv[1])[:3])


res = {}
# single ops
a = torch.randn(1000, 441, device=dev).bfloat16()
b = torch.randn(441, 1536, device=dev).bfloat16()
o = torch.zeros(1000, 1536, device=dev)
for name, fn in {
    "mm_out_dtype": lambda: torch.mm(a, b, out_dtype=torch.float32),
    "mm_out_dtype_noncontig": lambda: torch.mm(
        torch.randn(441, 1000, device=dev).bfloat16().t(), b, out_dtype=torch.float32
    ),
    "addmm_out_dtype_out": lambda: torch.addmm(o, a, b, out_dtype=torch.float32, out=o),
    "addmm_out_dtype": lambda: torch.addmm(o, a, b, out_dtype=torch.float32),
    "iadd": lambda: o.add_(o),
    "mm_bf16": lambda: a @ b,
}.items():
    try:
        _, n, where = count_syncs(fn)
        res[name] = {"syncs": n, "where": where}
    except Exception as e:
        res[name] = {"error": str(e)[:160]}
print(json.dumps(res), flush=True)

piece = M.GRAD_PIECE_ELEMENTS // H


def v_current(out, a, b):
    out += torch.mm(a, b, out_dtype=torch.float32)


def v_addmm(out, a, b):
    torch.addmm(out, a, b, out_dtype=torch.float32, out=out)


def v_fp32(out, a, b):
    out.addmm_(a.float(), b.float())


def v_bf16(out, a, b):
    out += (a @ b).float()


orig = M._add_product
ref = None
variants = {"current": v_current, "addmm_out": v_addmm, "fp32_upcast": v_fp32, "bf16_then_add": v_bf16}
for maxl in (2**26, 2**28):
    for name, fn in variants.items():
        M._add_product = fn

        def step(maxl=maxl):
            h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
            loss = M.chunked_cross_entropy(h, w, y, max_logits=maxl)
            loss.backward()
            return loss.detach(), h.grad, w.grad

        try:
            step()
            torch.cuda.synchronize()
            (_loss, gh, gw), n, where = count_syncs(step)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            for _ in range(5):
                step()
            torch.cuda.synchronize()
            dt = (time.perf_counter() - t) / 5
            peak = torch.cuda.max_memory_allocated() / 2**30
            if ref is None:
                hh, ww = h0.float().requires_grad_(), w0.float().requires_grad_()
                F.cross_entropy(F.linear(hh, ww), y, reduction="sum").backward()
                ref = ww.grad
            err = float((gw.float() - ref).abs().max() / ref.abs().max())
            res[f"{name}@{maxl}"] = {
                "syncs": n,
                "where": where,
                "ms": round(dt * 1e3, 1),
                "peak_gib": round(peak, 2),
                "w_grad_rel_err": err,
            }
        except Exception as e:
            res[f"{name}@{maxl}"] = {"error": str(e)[:200]}
        print(f"{name}@{maxl}", res[f"{name}@{maxl}"], flush=True)
M._add_product = orig


def plain():
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    F.cross_entropy(F.linear(h, w).float(), y, reduction="sum").backward()


plain()
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(5):
    plain()
torch.cuda.synchronize()
res["plain_full_logits_ms"] = round((time.perf_counter() - t) / 5 * 1e3, 1)
print(json.dumps(res))
