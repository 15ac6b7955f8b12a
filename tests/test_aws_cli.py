"""The credential command of the kubeconfig eksctl writes, run for real: the AWS CLI's ``aws eks get-token``.

eksctl v0.230.0 writes a kubeconfig whose user runs ``aws eks get-token`` (pkg/utils/kubeconfig/kubeconfig.go,
vendored in fixtures/eksctl/); the Kubernetes client runs it, through the tool's own :class:`KubernetesApi`, each
time it loads the kubeconfig. ``get-token`` presigns an STS GetCallerIdentity request locally, so dummy credentials
and no network give a real token. The AWS CLI is a test dependency (pyproject.toml), installed next to this Python.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import sys
import urllib.parse
from pathlib import Path

import pytest
import yaml
from eksctl_source import ROOT

from raytrain_eks.k8s.cluster import KubernetesApi

KUBECONFIG_GO = ROOT / "pkg" / "utils" / "kubeconfig" / "kubeconfig.go"
CLUSTER, REGION = "ray-train-eks", "us-east-1"


def get_token_args(cluster: str, region: str) -> list[str]:
    """The arguments AppendAuthenticator gives ``aws`` (its AWSEKSAuthenticator case), read from the vendored
    source: ``args = []string{"eks", "get-token", ...}`` with the cluster's ID, then ``--region`` and the region."""
    source = KUBECONFIG_GO.read_text()
    case = source[source.index("case AWSEKSAuthenticator:") :]
    match = re.search(r"args = \[\]string\{([^}]*)\}", case)
    assert match, "AppendAuthenticator's aws arguments are not where they were"
    args = [cluster if a.strip() == "cluster.ID()" else a.strip().strip('"') for a in match.group(1).split(",")]
    assert 'args = append(args, "--region", meta.Region)' in case
    return [*args, "--region", region]


def eksctl_kubeconfig(cluster: str, region: str) -> dict:
    """The kubeconfig as eksctl writes it for ``aws`` (kubeconfig.go: NewBuilder and Build name the cluster
    ``NAME.REGION.eksctl.io`` and the context and user ``USER@NAME.REGION.eksctl.io``; AppendAuthenticator adds
    the exec section: API version client.authentication.k8s.io/v1beta1 for any AWS CLI v1 from 1.23.9, the env
    AWS_STS_REGIONAL_ENDPOINTS=regional, provideClusterInfo false). The endpoint and CA are placeholders: nothing
    here contacts the cluster."""
    name = f"{cluster}.{region}.eksctl.io"
    user = f"raytrain-eks@{name}"
    ca = base64.b64encode(b"-----BEGIN CERTIFICATE-----\nplaceholder\n-----END CERTIFICATE-----\n").decode()
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": name,
                "cluster": {
                    "server": "https://EXAMPLE.gr7.us-east-1.eks.amazonaws.com",
                    "certificate-authority-data": ca,
                },
            }
        ],
        "contexts": [{"name": user, "context": {"cluster": name, "user": user}}],
        "current-context": user,
        "users": [
            {
                "name": user,
                "user": {
                    "exec": {
                        "apiVersion": "client.authentication.k8s.io/v1beta1",
                        "command": "aws",
                        "args": get_token_args(cluster, region),
                        "env": [{"name": "AWS_STS_REGIONAL_ENDPOINTS", "value": "regional"}],
                        "provideClusterInfo": False,
                    }
                },
            }
        ],
    }


def test_the_vendored_writer_names_aws_eks_get_token():
    source = KUBECONFIG_GO.read_text()
    assert (
        'AWSEKSAuthenticator = "aws"' in source and 'betaAPIVersion  = "client.authentication.k8s.io/v1beta1"' in source
    )
    assert get_token_args("c", "r") == ["eks", "get-token", "--output", "json", "--cluster-name", "c", "--region", "r"]


def test_the_kubernetes_client_gets_a_token_from_aws_eks_get_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    bin_dir = str(Path(sys.executable).parent)
    if shutil.which("aws", path=bin_dir) is None:
        pytest.fail(f"the AWS CLI is not installed in {bin_dir}: install the test extras (`pip install -e '.[test]'`)")
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PATH", os.pathsep.join([bin_dir, os.environ.get("PATH", "")]))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAIOSFODNN7EXAMPLE")  # AWS's documented example key: not an account
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(eksctl_kubeconfig(CLUSTER, REGION)))

    api = KubernetesApi(path)
    configuration = api._api().configuration  # loading runs the exec plugin; no request is made
    header = configuration.get_api_key_with_prefix("BearerToken")
    assert header and header.startswith("Bearer k8s-aws-v1."), f"no token from `aws eks get-token`: {header!r}"
    token = header.removeprefix("Bearer k8s-aws-v1.")
    url = urllib.parse.urlsplit(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode())
    query = urllib.parse.parse_qs(url.query)
    # A presigned STS GetCallerIdentity, for these credentials, in the kubeconfig's region, bound to the cluster.
    assert url.netloc == f"sts.{REGION}.amazonaws.com" and query["Action"] == ["GetCallerIdentity"]
    assert (
        query["X-Amz-Credential"][0].startswith("AKIAIOSFODNN7EXAMPLE/")
        and f"/{REGION}/sts/" in query["X-Amz-Credential"][0]
    )
    assert "x-k8s-aws-id" in query["X-Amz-SignedHeaders"][0].split(";")
