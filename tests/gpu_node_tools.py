"""What a GPU node's tools print in a pod on it, for the GPU node checks (``raytrain_eks.health.node``): the deploy
tests' FakeRay answers ``nvidia-smi``, ``dmesg`` and ``dcgmi`` through :class:`GpuNodeTools`."""

from __future__ import annotations

from typing import Any

from raytrain_eks.k8s.cluster import ExecResult

# What util-linux's dmesg prints where the kernel refuses the read (a container without CAP_SYSLOG while
# kernel.dmesg_restrict is 1): sys-utils/dmesg.c, `err(EXIT_FAILURE, _("read kernel buffer failed"))`, which
# appends strerror(EPERM) and exits 1.
DMESG_REFUSED = ExecResult(1, "", "dmesg: read kernel buffer failed: Operation not permitted\n")
# What kubectl exec reports for a program the image lacks: the runtime's "executable file not found in $PATH"
# with exit status 127, the status the deploy steps read as "not installed" (check_efa_provider).
NOT_IN_IMAGE = ExecResult(127, "", 'exec: "dcgmi": executable file not found in $PATH\n')
# A node whose driver runs the default image's CUDA 13 (580 or later: raytrain_eks.k8s.cuda): four GPUs on the bus
# ids a g6.12xlarge's L4s have, recorded on a g6e.12xlarge (four L40S) with driver 580.126.09. The checks count the
# GPUs and read ECC and the driver; they do not compare the model's name with the instance type.
HEALTHY = "nvidia_smi_4xl40s_580.txt"


class GpuNodeTools:
    """What the GPU node checks (``raytrain_eks.health.node``) read in a worker pod, from the public recordings of
    ``fixtures/recorded/`` (SOURCES.md): by default a healthy node of four GPUs with a 580 driver (row remapper
    clean), a kernel log the pod may not read and no ``dcgmi`` in the image. :meth:`break_pod` makes one pod's node
    answer as the failing recordings do: a GPU with uncorrectable ECC errors, the Xids of that double-bit error,
    DCGM's failed test. ``fi_info`` is FakeRay's (its ``efa``)."""

    def __init__(self, recorded: Any) -> None:
        self.recorded = recorded
        self.broken: set[str] = set()
        self.dcgmi: bool = False  # the image has dcgmi (its healthy answer: dcgmi_diag_pass.txt)
        self.old_driver: bool = False  # the nodes run driver 535 (nvidia_smi_4xl4.txt): too old for a CUDA 13 image

    def break_pod(self, pod: str) -> None:
        self.broken.add(pod)

    def _read(self, name: str) -> str:
        return str((self.recorded / name).read_text())

    def answer(self, pod: str, argv: list[str]) -> ExecResult | None:
        bad = pod in self.broken
        if argv == ["nvidia-smi"]:
            healthy = "nvidia_smi_4xl4.txt" if self.old_driver else HEALTHY
            return ExecResult(0, self._read("nvidia_smi_ecc_uncorrected.txt" if bad else healthy))
        if argv[:1] == ["nvidia-smi"] and argv[1].startswith("--query-remapped-rows="):
            return ExecResult(0, self._read("nvidia_smi_remapped_rows.txt"))
        if argv == ["dmesg"]:
            return ExecResult(0, self._read("kernel_xid_dbe.txt")) if bad else DMESG_REFUSED
        if argv[:2] == ["dcgmi", "diag"]:
            if bad:  # the recording does not show dcgmi's exit status; the check reads only the table
                return ExecResult(0, self._read("dcgmi_diag_pcie_fail.txt"))
            return ExecResult(0, self._read("dcgmi_diag_pass.txt")) if self.dcgmi else NOT_IN_IMAGE
        return None
