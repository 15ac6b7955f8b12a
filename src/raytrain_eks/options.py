"""Command-line options shared by every command, declared once."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from raytrain_eks import presets
from raytrain_eks.config import DEFAULT_CONFIG_FILE

ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", "-c", help=f"YAML configuration (default: ./{DEFAULT_CONFIG_FILE} if present)."),
]
# Commands that train or probe: the default depends on where they run (see presets.choose).
PresetOpt = Annotated[
    str | None,
    typer.Option(
        help=f"Starting point under the file: {', '.join(presets.PRESETS)} (default: local-tiny locally, "
        "reference with --address)."
    ),
]
# Commands about the cluster: the reference deployment unless told otherwise.
ClusterPresetOpt = Annotated[str, typer.Option(help=f"Starting point under the file: {', '.join(presets.PRESETS)}.")]
# Commands that ask before they create or delete: -y, or ASSUME_YES=1 as in the reference's env.sh.
YesOpt = Annotated[
    bool, typer.Option("--yes", "-y", envvar="ASSUME_YES", help="Do not ask for confirmation (also ASSUME_YES=1).")
]

StateDirOpt = Annotated[
    Path, typer.Option("--state-dir", help="Where this deployment's state, kubeconfig and generated files live.")
]
# Commands that run Ray jobs: train here, or on a Ray cluster that is already running.
AddressOpt = Annotated[
    str | None, typer.Option(help="Join a running Ray cluster ('auto' or HOST:PORT) instead of starting one here.")
]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Show Ray's and the workers' logs.")]
# Commands whose result can be read by programs: stdout then holds only JSON, progress goes to stderr.
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON (stdout holds only the JSON).")]
# Any setting by its dotted name, over the file, the environment and the other flags.
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        metavar="SECTION.FIELD=VALUE",
        help="Any setting by its dotted name, value as in the YAML file (repeatable; last of all layers), "
        "e.g. --set training.steps=20 --set cluster.gpu_node_count=4.",
    ),
]
