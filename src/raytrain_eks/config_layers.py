"""The layers of the settings: the environment variables read, how the file, environment and flags are laid on one
another while each setting's source is remembered, and how a refused setting is described (its place, the value
given there, where it came from). :mod:`raytrain_eks.config` builds and validates the settings with these.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal, Protocol

import yaml
from pydantic import BaseModel, BeforeValidator

from raytrain_eks.errors import ConfigError

if TYPE_CHECKING:
    from pydantic_core import ErrorDetails

# Environment variables of the reference's scripts/env.sh and the setting each one overrides.
ENV_VARS: dict[str, tuple[str, str]] = {
    "CLUSTER_NAME": ("cluster", "name"),
    "REGION": ("cluster", "region"),
    "K8S_VERSION": ("cluster", "k8s_version"),
    "SYSTEM_NODE_TYPE": ("cluster", "system_node_type"),
    "SYSTEM_NODE_COUNT": ("cluster", "system_node_count"),
    "GPU_NODE_TYPE": ("cluster", "gpu_node_type"),
    "GPU_NODE_COUNT": ("cluster", "gpu_node_count"),
    "GPUS_PER_NODE": ("cluster", "gpus_per_node"),
    "GPU_NODEGROUP_NAME": ("cluster", "gpu_nodegroup_name"),
    "GPU_AZ": ("cluster", "gpu_az"),
    "CAPACITY_RESERVATION_ID": ("cluster", "capacity_reservation_id"),
    "CHECKPOINT_BUCKET": ("cluster", "checkpoint_bucket"),
    "NODE_AMI_FAMILY": ("cluster", "ami_family"),
    "DLC_IMAGE": ("ray", "image"),
    "KUBERAY_VERSION": ("addons", "kuberay_version"),
    "RAY_VERSION": ("ray", "version"),
    "NVIDIA_DEVICE_PLUGIN_VERSION": ("addons", "nvidia_device_plugin_version"),
    "EFA_DEVICE_PLUGIN_VERSION": ("addons", "efa_device_plugin_version"),
    "NAMESPACE": ("ray", "namespace"),
    "RAY_CLUSTER_NAME": ("ray", "cluster_name"),
    "MODEL_ID": ("training", "model_id"),
    "STEPS": ("training", "steps"),
    "SEQ_LEN": ("training", "seq_len"),
    "BATCH_SIZE": ("training", "batch_size"),
    "LEARNING_RATE": ("training", "learning_rate"),
    "NUM_WORKERS": ("training", "num_workers"),
    "CHECKPOINT_EVERY": ("training", "checkpoint_every"),
    "KEEP_CHECKPOINTS": ("training", "keep_checkpoints"),
    "STORAGE_PATH": ("training", "storage_path"),
    "STORAGE_SHARED": ("training", "storage_shared"),
    "BENCH_STEPS": ("fabric", "compare_steps"),
    "BENCH_WARMUP_STEPS": ("fabric", "compare_warmup_steps"),
}

# Variables of the reference's env.sh that are not settings but a command's option: each one is read by the option
# itself (``ASSUME_YES=1`` answers yes to the confirmation of up, down and compare-fabric, as ``-y`` does). The
# reference's AWS_REGION and AWS_DEFAULT_REGION are REGION again, for the AWS tools; boto3 reads them itself.
COMMAND_ENV_VARS: dict[str, str] = {"ASSUME_YES": "--yes (-y) of up, down and compare-fabric"}


def read_yaml(path: Path, sections: Iterable[str]) -> dict[str, object]:
    """The YAML file's mapping of ``sections`` (a :class:`ConfigError` naming the file when it is not one)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError([f"cannot read the file: {exc.strerror}"], source=str(path)) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError([f"not valid YAML{where}: {getattr(exc, 'problem', exc)}"], source=str(path)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            [f"the top level must be a mapping of sections ({', '.join(sections)}), got {type(data).__name__}"],
            source=str(path),
        )
    return data


def merge(base: dict[str, object], over: Mapping[str, object]) -> dict[str, object]:
    """Return a new dict: ``over`` laid on ``base``, section by section. Neither input is changed."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(held := out.get(key), dict) and key != "env":
            out[key] = merge(held, value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def put(tree: dict[str, object], section: str, field: str, value: object) -> None:
    node = tree.setdefault(section, {})
    if not isinstance(node, dict):
        raise TypeError(f"{section} holds a value, not a section of settings")
    node[field] = value


def record(sources: dict[tuple[str, ...], str], path: tuple[str, ...], origin: str) -> None:
    """Note that the setting at ``path`` (and everything under it) now comes from ``origin``."""
    for key in [k for k in sources if k[: len(path)] == path]:
        del sources[key]
    sources[path] = origin


def record_file(sources: dict[tuple[str, ...], str], path: tuple[str, ...], value: object, origin: str) -> None:
    """Record ``origin`` for ``path`` and for every setting under it, however deep (``training.lora.rank``)."""
    sources[path] = origin
    if isinstance(value, Mapping):
        for key, inner in value.items():
            record_file(sources, (*path, str(key)), inner, origin)


NOT_GIVEN = object()


def given(tree: object, loc: Sequence[object]) -> tuple[tuple[object, ...], object]:
    """The place ``loc`` names in ``tree`` and the value given there (:data:`NOT_GIVEN` when none was).

    pydantic puts the name of a union's member (``list[str]``, ``literal['all-linear']``) into the location of
    the member's error, and ``[key]`` after a mapping's key it refused; those are no place in the settings and
    are left out (for ``[key]`` the value shown is the key).
    """
    path: list[object] = []
    value: object = tree
    for i, part in enumerate(loc):
        if isinstance(value, dict) and (part in value or str(part) in value):
            value = value[part] if part in value else value[str(part)]
        elif isinstance(value, list) and isinstance(part, int) and 0 <= part < len(value):
            value = value[part]
        elif part == "[key]" and path:
            value = path[-1]  # the key itself is what was refused
            continue
        elif isinstance(part, str) and not isinstance(value, dict):
            continue  # a union member's name
        else:  # not given (a required setting left out): name the place, show no value
            path.extend(loc[i:])
            value = NOT_GIVEN
            break
        path.append(part)
    return tuple(path), value


def source(sources: dict[tuple[str, ...], str], path: tuple[str, ...]) -> str:
    """Where the setting at ``path`` came from: its own record, else the nearest setting above it."""
    for end in range(len(path), 0, -1):
        if path[:end] in sources:
            return sources[path[:end]]
    return ""


def describe(
    err: ErrorDetails, sources: dict[tuple[str, ...], str], tree: dict[str, object], root: type[BaseModel]
) -> tuple[str, str]:
    """An error of the settings model ``root`` as (the setting, its value and source; what is wrong)."""
    place, value = given(tree, err["loc"])
    loc = tuple(str(p) for p in place)
    path = ".".join(loc) if loc else "(top level)"
    msg = str(err["msg"]).removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        parent = root
        for part in loc[:-1]:
            field = parent.model_fields.get(part)
            annotation = field.annotation if field else None
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                parent = annotation
        msg = f"unknown setting; allowed here: {', '.join(parent.model_fields)}"
    src = source(sources, loc)
    if len(loc) == 1:  # a check across fields of one section: name where the fields it mentions came from
        src = ", ".join(sorted({v for k, v in sources.items() if len(k) == 2 and k[0] == loc[0] and k[1] in msg}))
    origin = f" (from {src})" if src else ""
    if len(loc) >= 2 and err["type"] != "extra_forbidden" and value is not NOT_GIVEN:
        return f"{path} = {value!r}{origin}", msg
    return f"{path}{origin}", msg


def format_errors(
    errors: Sequence[ErrorDetails],
    sources: dict[tuple[str, ...], str],
    tree: dict[str, object],
    root: type[BaseModel],
) -> list[str]:
    """One line per setting in error: the members of a union that each refused the value share one line."""
    found: dict[str, list[str]] = {}
    for err in errors:
        if err["type"] == "default_factory_not_called":  # a default that follows another setting, itself refused
            continue
        head, msg = describe(err, sources, tree, root)
        if msg not in found.setdefault(head, []):
            found[head].append(msg)
    return [f"{head}: {'; or '.join(msgs)}" for head, msgs in found.items()]


def lay(
    tree: dict[str, object],
    sources: dict[tuple[str, ...], str],
    root: type[BaseModel],
    file: Path | None,
    environ: Mapping[str, str] | None,
    overrides: Mapping[str, Mapping[str, object]],
    sets: Sequence[str],
) -> dict[str, object]:
    """A new tree: the layers laid on ``tree`` (the settings of ``root``, dumped) in order, each setting's source
    recorded in ``sources``. The YAML ``file``; the env.sh variables of ``environ`` (only :data:`ENV_VARS`; ``None``:
    this process's); the flags' ``overrides`` (``{"training": {"steps": 5}}``, ``None`` not given); the ``--set``
    items last (``"training.steps=5"``: any setting by its dotted name, the value read as YAML). A
    :class:`ConfigError` names the ``--set`` items that cannot be laid."""
    tree = copy.deepcopy(tree)
    environ = os.environ if environ is None else environ
    if file is not None:
        data = read_yaml(file, root.model_fields)
        tree = merge(tree, data)
        for section, values in data.items():
            record_file(sources, (str(section),), values, str(file))
    for name, (section, field) in ENV_VARS.items():
        if name in environ:
            # env.sh exports its optional settings empty (GPU_AZ=""): empty means not set, where not set is allowed.
            model = root.model_fields[section].annotation
            optional = isinstance(model, type) and model.model_fields[field].default is None
            put(tree, section, field, None if optional and environ[name] == "" else environ[name])
            record(sources, (section, field), f"environment variable {name}")
    for section, values in overrides.items():
        for field, value in values.items():
            if value is not None:
                put(tree, section, field, value)
                record(sources, (section, field), f"flag --{field.replace('_', '-')}")
    bad = []
    for item in sets:
        key, sep, raw = item.partition("=")
        parts = tuple(p.strip() for p in key.split("."))
        if not sep or len(parts) < 2 or not all(parts):
            bad.append(f"--set {item!r}: write SECTION.FIELD=VALUE, e.g. --set training.steps=20")
            continue
        node = tree
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                bad.append(f"--set {item!r}: {'.'.join(parts[:-1])} is a value, not a section of settings")
                break
            node = child
        else:
            node[parts[-1]] = set_value(raw)
            record(sources, parts, f"--set {key.strip()}")
    if bad:
        raise ConfigError(bad)
    return tree


def set_value(raw: str) -> object:
    """A ``--set`` value as the YAML file would read it (``20`` a number, ``true`` a bool, ``[a, b]`` a list);
    text that is not YAML stays the text it is."""
    try:
        return yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        return raw


def on_off(value: object) -> object:
    """A switch that has grown a third value (``auto``), read as older files and flags give it: ``true`` is ``on``
    and ``false`` is ``off`` (YAML also reads ``on``, ``off``, ``yes`` and ``no`` unquoted as these booleans)."""
    return ("on" if value else "off") if isinstance(value, bool) else value


# training.compile: true and false (older files, --compile/--no-compile) are on and off.
CompileSetting = Annotated[Literal["auto", "on", "off"], BeforeValidator(on_off)]


class ClusterSettings(Protocol):
    """The settings :func:`cluster_settings_refusal` reads (``config_cluster.ClusterConfig``'s, which imports this
    module)."""

    @property
    def target(self) -> str: ...
    @property
    def existing(self) -> bool: ...
    @property
    def gpu_nodes_on_demand(self) -> bool: ...
    @property
    def efa_per_node(self) -> int | None: ...
    @property
    def kubeconfig(self) -> str | None: ...
    @property
    def context(self) -> str | None: ...
    @property
    def usd_per_hour(self) -> float | None: ...
    @property
    def usd_per_node_hour(self) -> float | None: ...


def cluster_settings_refusal(c: ClusterSettings) -> str | None:
    """Why the cluster settings ``c`` (a ``ClusterConfig``) hold one the chosen target would ignore, or two that
    contradict each other; ``None`` when they fit. A setting is refused rather than left to the user to believe it
    applies."""
    if c.target == "kubernetes" and c.existing:
        return (
            "cluster.existing applies to target eks (an EKS cluster up did not create); with target kubernetes "
            "the cluster is always yours and is never created or deleted: leave existing out (or false)"
        )
    if c.gpu_nodes_on_demand and c.target != "kubernetes":
        return (
            "cluster.gpu_nodes_on_demand applies to target kubernetes (nodes an autoscaler adds); with target eks "
            "up creates the GPU node group itself: leave it out, or set cluster.target to kubernetes"
        )
    if c.gpu_nodes_on_demand and c.efa_per_node is None:
        return (
            "cluster.gpu_nodes_on_demand: set cluster.efa_per_node to the EFA interfaces each GPU node will have "
            "(0 for none): nodes that do not exist yet cannot be read for it"
        )
    given = [name for name in ("kubeconfig", "context") if getattr(c, name)]
    if c.target == "eks" and given:
        settings = " and ".join(f"cluster.{name}" for name in given)
        return (
            f"{settings} {'apply' if len(given) > 1 else 'applies'} to target kubernetes; with target eks "
            "every step reaches the EKS cluster through the kubeconfig up writes into the state folder "
            "(.raytrain-eks/kubeconfig by default): set cluster.target to kubernetes to use your kubeconfig's "
            f"cluster, or leave {settings} empty (and --kubeconfig, --context off the command line)"
        )
    if c.usd_per_hour is not None and c.usd_per_node_hour is not None:
        return (
            "set cluster.usd_per_hour (the whole cluster) or cluster.usd_per_node_hour (each GPU node the run's "
            "workers use), not both: either one prices a run"
        )
    return None
