"""What the job needs on the cluster and what stays here, hermetic and fast.

- The job's runtime_env: the package first in ``py_modules``, then the unpacked packages it ships, and no ``pip``
  entry when nothing is left for pip; matplotlib is never among the cluster's requirements.
- A run on an image without matplotlib (the cluster image: submit does not ship it) writes its metrics and no
  report, saying where the report is drawn; ``raytrain-eks results`` draws it, plots and all, from the fetched
  metrics of such a run. With matplotlib the run writes its report as before.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from raytrain_eks.deploy.results import fetch_run
from raytrain_eks.k8s import job as shipping
from raytrain_eks.report import plots
from raytrain_eks.train.launch import report_line

METRICS = [{"step": s, "loss": 3.0 - s / 10, "lr": 1e-4, "tokens_per_s": 900.0} for s in (1, 2, 3)]


def _run_folder(root: Path) -> Path:
    run = root / "run-20261207-120000"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in METRICS))
    return run


def test_the_runtime_env_ships_the_package_then_the_unpacked_packages_and_no_pip():
    modules = ["/p/peft", "/p/peft-0.21.2.dist-info"]
    env = shipping.runtime_env("/c", [], modules=modules)
    assert env == {"py_modules": ["/c/raytrain_eks", *modules]}
    argv = shipping.ray_job_submit_argv("/c", pip=[], modules=modules)
    assert json.loads(argv[argv.index("--runtime-env-json") + 1]) == env
    # pip stays the fallback: what it installs, with the package still first.
    assert shipping.runtime_env("/c", ["rich>=15"])["pip"] == ["rich>=15"]
    assert "matplotlib" not in {shipping.requirement_name(r).lower() for r in shipping.job_requirements()}


def test_without_matplotlib_the_run_writes_no_report_and_says_where_it_is_drawn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as on an image without it: find_spec and import fail
    assert plots.can_draw() is False
    run = _run_folder(tmp_path)
    line = report_line(run)
    assert line.startswith("report: not written here (this Python has no matplotlib, which draws its plots)")
    assert f"`raytrain-eks results {run.name}` writes it from the run's metrics" in line
    assert not (run / "report.html").exists() and not (run / "plots").exists()


def test_results_draws_the_report_of_a_run_that_wrote_none(tmp_path: Path):
    storage = tmp_path / "storage"
    run = _run_folder(storage)
    (run / "run.json").write_text(json.dumps({"state": "finished", "steps": 3}) + "\n")
    fetched = fetch_run(str(storage), run.name, into=tmp_path / "here")
    assert fetched.rendered and fetched.report == tmp_path / "here" / "report.html"
    assert {p.name for p in (tmp_path / "here" / "plots").iterdir()} >= {"loss.png", "lr.png", "tokens_per_s.png"}
    assert "data:image/png;base64," in fetched.report.read_text()


def test_with_matplotlib_the_run_writes_its_report(tmp_path: Path):
    assert plots.can_draw() is True
    run = _run_folder(tmp_path)
    assert report_line(run) == f"report: {run / 'report.html'}"
    assert (run / "plots" / "loss.png").is_file()


def test_a_configmap_over_kubernetes_limit_is_refused_naming_what_fills_it(monkeypatch):
    from raytrain_eks.config import load_config
    from raytrain_eks.errors import UserError
    from raytrain_eks.k8s.wheelhouse import Unpacked

    cfg = load_config(environ={}, path=None)
    monkeypatch.setattr(shipping, "CONFIG_MAP_MAX_BYTES", 2_000)
    small, items = shipping.code_config_map(cfg, {"raytrain_eks/small.py": "y = 1\n"})
    assert small["metadata"]["name"] == f"{cfg.ray.cluster_name}-code"
    assert items == [{"key": shipping.ARCHIVE_KEY, "path": shipping.ARCHIVE_KEY}]
    noise = "".join(f"k{i} = '{hashlib.sha256(str(i).encode()).hexdigest()}'\n" for i in range(200))  # no gzip gain
    big = {"raytrain_eks/big.py": noise, "raytrain_eks/small.py": "y = 1\n"}
    with pytest.raises(
        UserError, match=r"-code \S+ bytes; Kubernetes accepts at most 2,000\. Largest files: raytrain_eks/big"
    ) as err:
        shipping.code_config_map(cfg, big)
    assert "--mode raycluster" in err.value.hint
    packed = Unpacked(
        files={"pkg/data.bin": b"".join(hashlib.sha256(i.to_bytes(2, "big")).digest() for i in range(200))},
        top_level=("pkg",),
        wheels=("pkg-1-py3-none-any.whl",),
        requirements=("pkg",),
        digest="d",
    )
    with pytest.raises(UserError, match=r"-packages \S+ bytes; Kubernetes accepts at most 2,000") as err:
        shipping.packages_config_map(cfg, packed)
    assert "pkg-1-py3-none-any.whl unpacked" in str(err.value) and "--mode raycluster" in err.value.hint
