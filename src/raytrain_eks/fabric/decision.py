"""Whether a job's NCCL lines meet ``fabric.require``: one rule for the in-job gate and for ``submit``'s verdict.

A job on one node sends nothing between nodes, so ``single-node`` meets any requirement there. A job on several
nodes meets ``efa`` or ``ib`` only on ``proven`` evidence (connection lines); evidence that is only ``selected``
makes the in-job gate look again after the next step, and fails the last look (the gate's second one, or the
verdict after the job has ended). Example::

    gate_decision(analyze(lines), "efa", job_nodes=2, last_look=True)["met"]  # False unless connection lines prove it

A shortfall in how EFA is used (the report's ``usage`` findings: fewer EFA devices found or used than the instance
type offers, GPUDirect RDMA off where it supports it) is a warning in the note, and stops the job only with
``require_full_efa``.
"""

from __future__ import annotations

from raytrain_eks.fabric.nccl_report import TransportReport


def gate_decision(
    report: TransportReport, require: str, *, job_nodes: int, last_look: bool, require_full_efa: bool = False
) -> dict[str, object]:
    """What to do with one look at a job's NCCL lines: ``continue``, ``look-again`` or ``stop``.

    Returns ``require``, ``verdict``, ``basis``, ``job_nodes``, ``met`` (True, False, or None while looking again),
    ``action``, ``note`` (why, in one sentence) and ``report`` (the rendered report followed by the note).
    ``require`` ``any`` accepts every transport NCCL's lines show, and nothing when they show none. Also
    ``usage_full`` (True, False, or None when it cannot tell) and ``usage_findings`` (``kind: message`` each).
    """
    result = {"require": require, "verdict": report.verdict, "basis": report.basis, "job_nodes": job_nodes}
    if report.verdict == "inconclusive":
        met, action, note = False, "stop", "NCCL's lines do not show which network it selected or used"
    elif require == "any":
        met, action = True, "continue"
        note = f"fabric.require is 'any': the {report.verdict!r} transport ({report.basis}) is accepted"
    elif job_nodes <= 1 and report.verdict == "single-node":
        met, action = True, "continue"
        note = "the job runs on one node: no inter-node link existed, so any fabric requirement is met"
    elif report.verdict == "single-node":
        met, action = False, "stop"
        note = f"the job spans {job_nodes} nodes, but NCCL's lines show no link between them"
    elif not report.meets(require):
        met, action = False, "stop"
        note = f"the transport is {report.verdict!r} ({report.basis}), not {require!r}"
    elif report.basis == "proven":
        met, action, note = True, "continue", f"connection lines prove the {report.verdict!r} transport"
    elif last_look:
        met, action = False, "stop"
        note = (
            f"NCCL's lines still do not prove that {require!r} carries the inter-node links of this {job_nodes}-node "
            "job: they show the network NCCL selected, but no connection line"
        )
    else:
        met, action = None, "look-again"
        note = "no connection line proves the transport yet: looking again after the next step"
    findings = [f"{f.kind}: {f.message}" for f in report.usage.findings]
    if findings and met is not False:
        kinds = ", ".join(f.kind for f in report.usage.findings)
        if require_full_efa:
            met, action = False, "stop"
            note = f"{note}; but EFA is used short of what the instance type offers ({kinds}), and "
            note += "fabric.require_full_efa is set"
        else:
            note = f"{note}; warning: EFA is used short of what the instance type offers ({kinds})"
    usage = {"usage_full": report.usage.full, "usage_findings": findings}
    text = report.render(require)
    decided = {"met": met, "action": action, "note": note, **usage}
    return {**result, **decided, "report": f"{text}\n\nTransport gate: {note}"}
