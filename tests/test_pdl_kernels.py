"""Programmatic dependent launch (services/backbone/kernels.pdl_args / pdl_prologue), checked
from the source, so it runs without Triton or a GPU: every kernel launched with pdl_args()
declares `PDL` and calls pdl_prologue(PDL) first, or, with a `PRELOAD` parameter, after reads
only: on every path, before it stores anything or returns.

Why it matters: a kernel launched with PDL may start before the kernel before it has finished.
It must wait (griddepcontrol.wait, in pdl_prologue) in every program before it writes, returns,
or reads what that kernel writes: a program that returned early without waiting could let the
kernel finish before its predecessor, and the next kernel, which waits only for it, would read
stale memory. What a PRELOAD kernel reads before its wait is kernels/__init__.PDL_PRELOAD's
contract (never the predecessor's output), which the source cannot show: each such kernel has a
GPU or interpreter test that its bits do not change. Bit equality with PDL on and off is
tests/test_backbone_gpu.py's (CUDA only)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the backbone's kernels, and the tower's (which launch with the backbone's pdl_args)
SOURCES = sorted((ROOT / "services" / "backbone" / "kernels").glob("*.py")) + [ROOT / "services" / "tower" / "kernels.py"]


def _modules():
    return {str(path.relative_to(ROOT)): ast.parse(path.read_text()) for path in SOURCES}


def _kernels(tree) -> dict[str, ast.FunctionDef]:
    return {node.name: node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
            and any("jit" in ast.unparse(d) for d in node.decorator_list)}


def _launched_with_pdl(tree) -> set[str]:
    """Names of kernels called as kernel[grid](..., **pdl_args())."""
    names = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                and any(k.arg is None and "pdl_args" in ast.unparse(k.value) for k in node.keywords)):
            names.add(ast.unparse(node.func.value).rsplit(".", 1)[-1])
    return names


def test_every_pdl_launch_targets_a_kernel_that_waits_first():
    modules = _modules()
    kernels = {name: fn for tree in modules.values() for name, fn in _kernels(tree).items()}
    launched = set().union(*(_launched_with_pdl(tree) for tree in modules.values()))
    assert len(launched) >= 21, sorted(launched)          # the decode steps' kernels, backbone and tower
    for name in sorted(launched):
        fn = kernels[name]
        params = [a.arg for a in fn.args.args]
        assert params[-1] == "PDL", f"{name}: PDL must be its last parameter (default False)"
        body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) \
            else fn.body
        if ast.unparse(body[0]) == "pdl_prologue(PDL)":
            continue
        assert "PRELOAD" in params, f"{name} does not wait first: {ast.unparse(body[0])}"
        waits = [i for i, stmt in enumerate(body) if _waits(stmt)]
        assert waits, f"{name}: not every path reaches pdl_prologue(PDL) at its top level"
        for stmt in body[:waits[0]]:
            assert not _writes_or_returns(stmt), f"{name} writes or returns before it waits: {ast.unparse(stmt)}"


def _waits(stmt) -> bool:
    """Does every path through `stmt` call pdl_prologue(PDL) at its top level, before any store
    or return of that path?"""
    if ast.unparse(stmt) == "pdl_prologue(PDL)":
        return True
    if not isinstance(stmt, ast.If) or not stmt.orelse:
        return False
    return all(_branch_waits(branch) for branch in (stmt.body, stmt.orelse))


def _branch_waits(body) -> bool:
    for stmt in body:
        if _waits(stmt):
            return True
        if _writes_or_returns(stmt):
            return False
    return False


def _writes_or_returns(stmt) -> bool:
    text = ast.unparse(stmt)
    return any(isinstance(n, ast.Return) for n in ast.walk(stmt)) or "tl.store" in text or "tl.atomic" in text


def test_no_kernel_waits_without_being_launched_for_it():
    """A kernel with the PDL parameter that no launch passes pdl_args() to would never wait:
    harmless, but a sign a launch site lost its argument."""
    modules = _modules()
    launched = set().union(*(_launched_with_pdl(tree) for tree in modules.values()))
    declared = {name for tree in modules.values() for name, fn in _kernels(tree).items()
                if fn.args.args and fn.args.args[-1].arg == "PDL"}
    assert declared == launched, (sorted(declared - launched), sorted(launched - declared))
