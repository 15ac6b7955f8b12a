"""The programs each command runs, declared step by step, and the check that all of them are installed before a
command creates, changes or asks anything.

Each step says what it runs (:data:`STEPS`: those every target shares, :data:`raytrain_eks.k8s.programs.STEPS`, and
the EKS target's, which run eksctl); a command is the steps it takes on its target, which the target decides
(``ClusterTarget.command_steps``). On the EKS target that is :func:`command_steps`: ``down`` the steps that delete
what the state file records, ``submit`` the node-group step only when it scales the GPU group.
:func:`require_programs` checks the programs of all of them and names every missing one in one message (exit 2),
each with how to install it.

Every call to the Kubernetes API, helm's and the Kubernetes client's alike, runs the credential program the
kubeconfig names. eksctl writes ``aws eks get-token`` (the AWS CLI) or ``aws-iam-authenticator token``, whichever of
the two it finds on PATH (eksctl v0.230.0, ``pkg/utils/kubeconfig/kubeconfig.go``: ``lookupAuthenticator``,
``AppendAuthenticator``). The program is read from this folder's kubeconfig when it exists (``users[].user.exec
.command``); ``up`` writes the kubeconfig anew before its first call to the cluster, so it needs either of the two.
Example::

    require_programs(d, "submit", steps_of=target_for(d.cfg).command_steps)
    # MissingToolsError naming `aws` when the kubeconfig runs it and it is missing
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from raytrain_eks.k8s import programs as shared
from raytrain_eks.k8s.programs import KUBERNETES, Step
from raytrain_eks.k8s.runner import require_tools
from raytrain_eks.k8s.state import Deployment

EKSCTL = "eksctl"
# What eksctl may name in a kubeconfig; the first is the one named when neither is installed.
CREDENTIAL_PROGRAMS = ("aws", "aws-iam-authenticator")

STEPS: dict[str, Step] = {
    "cluster": Step("the EKS cluster and this folder's kubeconfig (eksctl get/create/delete cluster)", (EKSCTL,)),
    "node-groups": Step("the node groups (eksctl get/create/delete/scale nodegroup)", (EKSCTL,)),
    "iam-service-account": Step(
        "the Ray pods' service account and its IAM role (eksctl create/update iamserviceaccount)", (EKSCTL, KUBERNETES)
    ),
    "iam-service-account-delete": Step(
        "the Ray pods' service account and its IAM role (eksctl delete iamserviceaccount)", (EKSCTL,)
    ),
    **shared.STEPS,
}
# The step that (re)writes this folder's kubeconfig, with eksctl: a target whose up takes it owns the kubeconfig.
WRITES_KUBECONFIG = "cluster"

# The steps of each command on the EKS target, in the order it takes them.
COMMANDS: dict[str, tuple[str, ...]] = {
    "up": ("cluster", "iam-service-account", "node-groups", "kubernetes", "helm-releases"),
    "status": ("cluster", "node-groups", "kubernetes"),
    "submit": ("kubernetes",),  # and node-groups when it scales the GPU group (command_steps)
    "compare-fabric": ("kubernetes",),  # the RayCluster replaced, then submit twice
    "logs": ("kubernetes",),
    "down": ("cluster",),  # it asks eksctl whether the cluster exists; then DELETE_STEPS of what is recorded
}
# What down takes to delete each kind of item the state file records on the EKS target.
DELETE_STEPS: dict[str, tuple[str, ...]] = {
    "bucket": (),
    **shared.DELETE_STEPS,
    "nodegroup": ("node-groups",),
    "cluster": ("cluster",),
    "iamserviceaccount": ("iam-service-account-delete",),
    "oidc-provider": (),  # IAM, through boto3
}


class StepsOf(Protocol):
    """A target's ``command_steps``: the steps a command takes from a folder now."""

    def __call__(self, d: Deployment, command: str, *, mode: str = ...) -> tuple[str, ...]: ...


def command_steps(d: Deployment, command: str, *, mode: str = "raycluster") -> tuple[str, ...]:
    """The steps ``command`` takes on the EKS target from this folder now (``EksTarget.command_steps``). ``mode``:
    submit's (a RayJob scales the GPU group to 0).

    Nothing for ``down`` when nothing is recorded, nor for ``logs`` when no job is, since they then run nothing.
    """
    s = d.state
    steps = COMMANDS[command]
    if command == "down":
        if not s.created:
            return ()
        steps = steps + tuple(step for item in s.created for step in DELETE_STEPS.get(item["type"], ()))
    elif command in ("submit", "compare-fabric"):
        if mode == "rayjob" or s.get("gpu_scaled_to") == 0:
            steps = (*steps, "node-groups")
    elif command == "logs" and not (s.get("job") or {}).get("id"):
        return ()
    return tuple(dict.fromkeys(steps))


def kubeconfig_programs(path: Path) -> list[tuple[str, list[str]]] | None:
    """The credential programs a kubeconfig runs, with their arguments (``users[].user.exec``); ``None`` when the
    file does not exist or cannot be read as a kubeconfig."""
    import yaml

    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    if not isinstance(doc, dict):
        return None
    found: dict[str, list[str]] = {}
    users = doc.get("users")
    for user in users if isinstance(users, list) else []:
        plugin = ((user or {}).get("user") or {}).get("exec") if isinstance(user, dict) else None
        if isinstance(plugin, dict) and isinstance(plugin.get("command"), str) and plugin["command"]:
            args = plugin.get("args")
            found.setdefault(plugin["command"], [str(a) for a in args] if isinstance(args, list) else [])
    return list(found.items())


def credential_needs(d: Deployment, command: str, uses: str, *, steps_of: StepsOf) -> list[tuple[tuple[str, ...], str]]:
    """What every call to the cluster needs for its credentials: the program(s) the kubeconfig names, or, when the
    target's up writes it (``steps_of``: the target's ``command_steps``), before it exists (and for
    ``up``, which writes it anew), either program eksctl may name. ``uses``: the steps, in words."""
    path = Path(d.kubeconfig)
    own = WRITES_KUBECONFIG in steps_of(d, "up")  # this folder's kubeconfig, which eksctl (re)writes at up
    named = None if command == "up" and own else kubeconfig_programs(path)
    if named is None and not own:  # the user's kubeconfig, unreadable: the Kubernetes client says why, first call
        return []
    if named is None:
        return [
            (
                CREDENTIAL_PROGRAMS,
                f"`aws eks get-token`: eksctl writes {path} to run it for the credentials of every call to the "
                f"cluster ({uses})",
            )
        ]
    return [
        (
            (program,),
            f"{path} runs `{shlex.join([program, *args[:2]])}` for the credentials of every call to the "
            f"cluster ({uses})",
        )
        for program, args in named
    ]


def needs(
    d: Deployment, commands: Sequence[str], *, mode: str = "raycluster", steps_of: StepsOf
) -> list[tuple[tuple[str, ...], str]]:
    """Every program ``commands`` will run from this folder now, as ``(alternatives, why)``, taking the steps
    ``steps_of`` gives (the target's ``command_steps``)."""
    steps = list(dict.fromkeys(step for command in commands for step in steps_of(d, command, mode=mode)))
    programs = list(dict.fromkeys(p for step in steps for p in STEPS[step].programs))
    out: list[tuple[tuple[str, ...], str]] = []
    for program in programs:
        uses = "; ".join(STEPS[step].what for step in steps if program in STEPS[step].programs)
        if program == KUBERNETES:
            out += credential_needs(d, "up" if "up" in commands else commands[0], uses, steps_of=steps_of)
        else:
            out.append(((program,), uses))
    return out


def require_programs(d: Deployment, *commands: str, mode: str = "raycluster", steps_of: StepsOf) -> None:
    """Raise :class:`~raytrain_eks.k8s.runner.MissingToolsError` (exit 2) naming every program ``commands`` need
    that is not installed, checked through ``d.require_tool``; do nothing when all are there. ``steps_of``: the
    target's ``command_steps``."""
    require_tools(needs(d, commands, mode=mode, steps_of=steps_of), d.require_tool)


def declared_programs(command: str) -> str:
    """The programs ``command`` may run, in words, for plans and help: ``eksctl, helm and aws (or
    aws-iam-authenticator)``."""
    steps = COMMANDS[command]
    names = sorted(dict.fromkeys(p for step in steps for p in STEPS[step].programs), key=lambda p: p == KUBERNETES)
    words = [
        f"{CREDENTIAL_PROGRAMS[0]} (or {' or '.join(CREDENTIAL_PROGRAMS[1:])}) for the kubeconfig's credentials"
        if p == KUBERNETES
        else p
        for p in names
    ]
    return ", ".join(words[:-1]) + f" and {words[-1]}" if len(words) > 1 else "".join(words)
