"""What the job adds to AWS's Ray Train DLC, and how, known without pulling the image: the package table raytrain-eks
ships is checked against the image's own build files (tests/fixtures/ray-train-dlc, with their commit); the one
package it lacks (peft) is expected to travel unpacked in py_modules, and matplotlib, which only draws the report's
plots, is never shipped; the plan says so."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

from packaging.specifiers import SpecifierSet

from raytrain_eks.config import load_config
from raytrain_eks.k8s import job

DLC = Path(__file__).parent / "fixtures" / "ray-train-dlc" / "docker" / "ray-train"
DEFAULT_IMAGE = "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1.1"


def _table() -> dict:
    return json.loads(job.IMAGE_PACKAGES_FILE.read_text())


def test_the_shipped_table_is_the_images_build_lock_and_dockerfile():
    lock = tomllib.loads((DLC / "uv.lock").read_text())
    locked = {p["name"]: p["version"] for p in lock["package"] if p["name"] != "dlc-ray-train"}
    dockerfile = (DLC / "Dockerfile.cuda").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", dockerfile, re.M))
    table = _table()
    packages = dict(table["packages"])
    # Ray: the released tags' 2.58.0 (the changelog), where the lock of that commit still pins 2.56.0.
    assert (locked.pop("ray"), packages.pop("ray")) == ("2.56.0", "2.58.0")
    assert packages.pop("flash-attn") == args["FLASH_ATTN_VERSION"] == "2.8.3"
    assert packages.pop("transformer-engine") == args["TRANSFORMER_ENGINE_VERSION"]
    assert packages == locked
    project = tomllib.loads((DLC / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == f"=={table['python']}.*"
    assert table["source"]["commit"] in (DLC.parents[1] / "SOURCE.md").read_text()


def test_on_the_default_image_the_runtime_env_installs_only_what_it_lacks_in_range():
    assert load_config(environ={}, path=None).ray.image == DEFAULT_IMAGE  # the image a first run gets
    left, said = job.planned_installs(DEFAULT_IMAGE)
    assert [job.requirement_name(r) for r in left] == ["peft"], left  # not in the image
    # matplotlib is not in the image either, but the cluster never gets it: it draws the report's plots.
    assert "matplotlib" not in {job.requirement_name(r) for r in job.job_requirements()}
    assert "matplotlib" in job.LOCAL_ONLY and "matplotlib" not in _table()["packages"]
    have = {name.lower(): v for name, v in _table()["packages"].items()}
    for spec in job.job_requirements():
        name = job.requirement_name(spec)
        version = have.get(name.lower())
        usable = version is not None and SpecifierSet(spec[len(name) :]).contains(version)
        assert usable == (spec not in left), (spec, version)
    assert "The image has 9 of the job's 10 packages in range" in said
    assert "transformers 5.13.0" in said and "aws/deep-learning-containers@e0ecedea" in said


def test_the_oldest_releases_checked_are_the_images_own():
    """scripts/check_oldest.sh runs the training tests with exactly the image's releases of these packages."""
    have = _table()["packages"]
    assert {name: have[name] for name in job.OLDEST_CHECKED} == job.OLDEST_CHECKED


def test_an_image_not_known_is_asked_at_submit_not_guessed():
    for image in (
        "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda",  # a floating tag: it moves
        "rayproject/ray:2.58.0-py312-gpu",
        f"{DEFAULT_IMAGE}@sha256:{'0' * 64}",
    ):
        assert job.planned_installs(image) is None and job.known_image_packages(image) is None


def test_peft_is_expected_to_travel_unpacked_and_a_compiled_package_is_not():
    # Judged from the copies installed here (the releases the job pins) and the image's table, without a download.
    (peft,) = job.planned_installs(DEFAULT_IMAGE)[0]
    assert job.expected_not_shipped(DEFAULT_IMAGE, [peft]) is None  # py3-none-any; torch, accelerate... in the DLC
    why = job.expected_not_shipped(DEFAULT_IMAGE, ["matplotlib>=3.11.2,<4"])
    assert why is not None and why.startswith("matplotlib 3.11.2 is compiled (cp3")
    # A pure package with compiled dependencies the image lacks: transformers needs tokenizers and safetensors, which
    # an image this tool does not know is taken not to have.
    why = job.expected_not_shipped("rayproject/ray:2.58.0-py312-gpu", ["transformers>=5.13.0,<6"])
    assert why is not None and why.split()[0] in ("tokenizers", "safetensors") and "is compiled" in why
    many = [f"p{i}>=1" for i in range(job.MAX_SHIPPED + 1)]
    assert (
        job.expected_not_shipped(DEFAULT_IMAGE, many)
        == f"{len(many)} packages, more than the 4 that are tried as unpacked wheels"
    )


def test_plan_says_how_the_jobs_packages_reach_the_image(tmp_path, monkeypatch, capsys):
    from raytrain_eks.cli import main
    from raytrain_eks.eks.plan import build_plan

    plan = build_plan(load_config(environ={}, path=None))
    env = plan.summary["runtime_env"]
    assert (env["installs"], env["ships"], env["local_only"]) == ([], ["peft>=0.21.2,<0.22"], ["matplotlib", "py-spy"])
    (submit,) = [s for s in plan.steps if s.name == "submit"]
    assert "peft>=0.21.2,<0.22 travels unpacked beside the package (py_modules)" in submit.action
    assert "the runtime_env has no pip, and no node copies the image's Python" in submit.action
    assert "`raytrain-eks results` draws the report here" in submit.action
    other = "rayproject/ray:2.58.0-py312-gpu"
    plan = build_plan(load_config(environ={}, path=None, sets=[f"ray.image={other}"]), mode="rayjob")
    assert plan.summary["runtime_env"]["installs"] is None and plan.summary["runtime_env"]["ships"] is None
    (apply,) = [s for s in plan.steps if s.name == "apply-rayjob"]
    assert f"Which of them {other} has is known only once it runs" in apply.action
    assert "pure-Python ones travel unpacked beside the package (py_modules)" in apply.action
    assert "after Ray copies the image's whole virtualenv on every node" in apply.action
    assert "submit first asks the image" in apply.action and "a short-lived pod of the image" in apply.action
    monkeypatch.chdir(tmp_path)
    main(["plan"])
    said = " ".join(capsys.readouterr().out.split())
    assert f"Packages the job adds to {DEFAULT_IMAGE}: The image has 9 of the job's 10 packages in range" in said
    assert "peft>=0.21.2,<0.22 travels unpacked beside the package (py_modules)" in said
