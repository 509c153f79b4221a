"""Kernel settings the benches compare inside one process (issue #7).

    with applied("session20"): ...     build or capture the engine's steps under that setting

Separate processes on one lent machine differ by up to ~0.3 ms per backbone step and ±0.1 ms per
tower step (docs/perf.md), more than a launch config changes. Each setting names module
attributes that the kernels read at every call (so graphs captured under a setting keep it):

    tuned           as the modules have them (decode_gemm.TUNED of session 21, the split
                    reduce in its own launch)
    last-reduces    decode_gemm.LAST_REDUCES: the split reduce in the GEMM launch
    session20       session 20's decode_gemm.TUNED (the tower's down projection only)
    norm-separate   decode_gemm.NORM_IN_REDUCE off: the post-attention norm in its own launch
                    after the out-projection's split reduce (before session 22)
    tma             decode_gemm.TMA: bf16 weights through TMA box loads (DRAMA_DECODE_GEMM_TMA=1)
    preload         weights and state read before the PDL wait (DRAMA_PDL_PRELOAD, on by default,
                    see kernels/__init__.PDL_PRELOAD)
    early           preload without the down launch's weights and the combine's inputs (the
                    set of session 28 run 2)
    no-preload      none of them (whatever DRAMA_PDL_PRELOAD says)
    preload-router, -route, -state, -conv, -reduce, -down, -combine: one of them each
    no-preload-router, ... -combine: that one off, the others as DRAMA_PDL_PRELOAD says
    race-first      the tower's draws answer from the race when its winner is inside the cut
                    (tower kernels.RACE_FIRST, DRAMA_DRAW_RACE_FIRST, on by default)
    no-race-first   every draw bisects for its cut (before session 29)
"""

from __future__ import annotations

import contextlib

import torch

from services.backbone.kernels import decode_gemm, decode_graph, gdn, moe_decode
from services.tower import kernels as tower_kernels

SESSION20_TUNED = {(2048, 12288, torch.bfloat16): dict(BN=64, BK=128, SPLIT=4)}
# what DRAMA_PDL_PRELOAD turns on, by the setting that turns on one of them alone
PRELOADS = {"router": (moe_decode, "ROUTER_PRELOAD"), "route": (moe_decode, "ROUTE_PRELOAD"),
            "state": (gdn, "STATE_PRELOAD"), "conv": (gdn, "CONV_PRELOAD"), "reduce": (decode_gemm, "REDUCE_PRELOAD"),
            "down": (moe_decode, "DOWN_PRELOAD"), "combine": (decode_graph, "COMBINE_PRELOAD")}
SETTINGS = {"tuned": {},
            "last-reduces": {(decode_gemm, "LAST_REDUCES"): True},
            "session20": {(decode_gemm, "TUNED"): SESSION20_TUNED},
            "norm-separate": {(decode_gemm, "NORM_IN_REDUCE"): False},
            "tma": {(decode_gemm, "TMA"): True},
            "preload": {key: True for key in PRELOADS.values()},
            "no-preload": {key: False for key in PRELOADS.values()},
            "early": {key: name not in ("down", "combine") for name, key in PRELOADS.items()},
            **{f"preload-{name}": {key: True} for name, key in PRELOADS.items()},
            **{f"no-preload-{name}": {key: False} for name, key in PRELOADS.items()},
            "race-first": {(tower_kernels, "RACE_FIRST"): True},
            "no-race-first": {(tower_kernels, "RACE_FIRST"): False}}


@contextlib.contextmanager
def applied(name: str | None):
    """The attributes `name` sets (None: nothing), as they were again after."""
    changes = SETTINGS[name] if name is not None else {}
    saved = {key: getattr(*key) for key in changes}
    try:
        for (module, attr), value in changes.items():
            setattr(module, attr, value)
        yield
    finally:
        for (module, attr), value in saved.items():
            setattr(module, attr, value)
