"""The three pinned Helm charts as vendored in fixtures/charts/ (SOURCE.md there says from where), the objects each
renders with the tool's own values, and eksctl's own EFA device-plugin DaemonSet (fixtures/eksctl/).

The rendered objects are ``helm template`` output kept in fixtures/charts/rendered/ (``RELEASE.yaml``, with the
values file it was rendered with beside it, ``RELEASE.values.yaml``); test_charts.py renders them again with real
Helm 3 and Helm 4 and fails when they differ, so what the fakes create is what the charts create. Example::

    chart = vendored("aws-efa-k8s-device-plugin", "v0.5.30")
    [o["kind"] for o in rendered("aws-efa-k8s-device-plugin")]   # ['DaemonSet']
    [c["metadata"]["name"] for c in crds(vendored("kuberay-operator"))][0]   # 'rayclusters.ray.io'
"""

from __future__ import annotations

import functools
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from fake_kube import copied

FIXTURES = Path(__file__).parent / "fixtures"
CHARTS = FIXTURES / "charts"
RENDERED = CHARTS / "rendered"
# eksctl v0.230.0's EFA plugin, applied by pkg/addons/device_plugin.go for any efaEnabled node group.
EKSCTL_EFA_ASSET = FIXTURES / "eksctl" / "pkg" / "addons" / "assets" / "efa-device-plugin.yaml"
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's safe loader when PyYAML has it: the same data


@dataclass(frozen=True)
class Chart:
    """A vendored chart: its name and version (its Chart.yaml's), the repository that publishes it
    (docs/reference/infra-facts.md §1), and where it is here: a chart folder, or a ``.tgz`` laid out as a chart
    repository serves one."""

    name: str
    version: str
    repo_url: str
    path: Path

    def file(self, name: str) -> bytes | None:
        """A file of the chart by its path inside the chart (``Chart.yaml``, ``crds/x.yaml``), or ``None``."""
        return self.files().get(name)

    def files(self) -> dict[str, bytes]:
        return _files(self.path)


VENDORED = (
    Chart(
        "nvidia-device-plugin",
        "0.20.0",
        "https://nvidia.github.io/k8s-device-plugin",
        CHARTS / "nvidia-device-plugin",
    ),
    Chart(
        "aws-efa-k8s-device-plugin",
        "v0.5.30",
        "https://aws.github.io/eks-charts",
        CHARTS / "aws-efa-k8s-device-plugin",
    ),
    Chart(
        "kuberay-operator",
        "1.7.0",
        "https://ray-project.github.io/kuberay-helm/",
        CHARTS / "kuberay-operator-1.7.0.tgz",
    ),
)


def vendored(name: str, version: str | None = None) -> Chart | None:
    """The vendored chart of that name (and version, when given), or ``None``."""
    return next((c for c in VENDORED if c.name == name and version in (None, c.version)), None)


@functools.cache
def _files(path: Path) -> dict[str, bytes]:
    if path.is_dir():
        return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}
    out = {}
    with tarfile.open(path, "r:gz") as tar:
        for member in tar.getmembers():
            if member.isfile():
                data = tar.extractfile(member)
                assert data is not None
                out[member.name.split("/", 1)[1]] = data.read()
    return out


def rendered_path(release: str) -> Path:
    return RENDERED / f"{release}.yaml"


def values_path(release: str) -> Path:
    return RENDERED / f"{release}.values.yaml"


@functools.cache
def _rendered(release: str) -> tuple[dict[str, Any], ...]:
    return tuple(d for d in yaml.load_all(rendered_path(release).read_text(), Loader=_LOADER) if d)


def rendered(release: str) -> list[dict[str, Any]]:
    """The objects the chart of ``release`` renders with the tool's values (copies: callers may change them)."""
    return copied(list(_rendered(release)))


@functools.cache
def _crds(chart: Chart) -> tuple[dict[str, Any], ...]:
    # Whole, schemas included (the kept-KubeRay check reads them): libyaml parses KubeRay's 3 MB of CRDs in well
    # under a second, once per session.
    return tuple(
        yaml.load(data.decode(), Loader=_LOADER)
        for name, data in sorted(chart.files().items())
        if name.startswith("crds/") and name.endswith((".yaml", ".yml"))
    )


def crds(chart: Chart) -> list[dict[str, Any]]:
    """The chart's ``crds/`` CustomResourceDefinitions as they are: Helm creates them, unchanged and before the
    templates, when it installs a release (helm/helm pkg/action/install.go, installCRDs; v3.17.3, v4.1.4)."""
    return copied(list(_crds(chart)))


@functools.cache
def _eksctl_efa() -> dict[str, Any]:
    (doc,) = [d for d in yaml.load_all(EKSCTL_EFA_ASSET.read_text(), Loader=_LOADER) if d]
    return doc


def eksctl_efa_daemon_set() -> dict[str, Any]:
    """eksctl's EFA device-plugin DaemonSet as it applies it (its image's %s placeholders are filled with the
    region's ECR by eksctl; the fakes look only at the image's name)."""
    return copied(_eksctl_efa())
