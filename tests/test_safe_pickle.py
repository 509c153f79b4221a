"""The allow-list reader of torch.save zips (MODEL.md §2.5 rule 7): real files round-trip, hostile
pickles are refused before anything in them runs."""

from __future__ import annotations

import collections
import os
import pickle
import subprocess
import zipfile

import pytest
import torch

from services.common.safe_pickle import UnsafePickleError, load_torch_state_dict


def _write_zip(path, payload: bytes, extra: dict[str, bytes] | None = None):
    """A torch.save-shaped zip around an arbitrary pickle."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", payload)
        zf.writestr("archive/byteorder", b"little")
        zf.writestr("archive/version", b"3\n")
        for name, data in (extra or {}).items():
            zf.writestr(f"archive/{name}", data)
    return path


class _Reduce:
    """Pickles as `func(*args)`, the classic code-execution gadget."""

    def __init__(self, func, args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


# --------------------------------------------------------------------------------------------
# real files
# --------------------------------------------------------------------------------------------

def _sample_state_dict():
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(4, 6, generator=gen)
    sd = collections.OrderedDict()
    sd["f32"] = base
    sd["bf16"] = torch.randn(3, 5, generator=gen).to(torch.bfloat16)
    sd["f16"] = torch.randn(2, 1, 7, generator=gen).to(torch.float16)
    sd["view_offset"] = base[1:3]               # shares base's storage, non-zero offset
    sd["transposed"] = base.t()                 # non-contiguous strides
    sd["param"] = torch.nn.Parameter(torch.randn(5, generator=gen))
    sd["scalar"] = torch.tensor(3.5)
    sd["empty"] = torch.zeros(0, 4)
    sd["int64"] = torch.arange(7)
    sd._metadata = collections.OrderedDict({"": {"version": 1}})   # what Module.state_dict() adds
    return sd


def test_real_torch_save_round_trips(tmp_path):
    sd = _sample_state_dict()
    path = tmp_path / "codec.pth"
    torch.save(sd, path)
    loaded = load_torch_state_dict(path)
    assert isinstance(loaded, collections.OrderedDict)
    assert list(loaded) == list(sd)
    for name, tensor in sd.items():
        got = loaded[name]
        assert type(got) is torch.Tensor, name
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(got, tensor.detach()), name
    assert loaded["transposed"].stride() == sd["transposed"].stride()


@pytest.mark.filterwarnings("ignore:.*weight_norm.*:FutureWarning")
def test_module_state_dict_round_trips(tmp_path):
    """A real module's state dict (weight-norm parametrizations, old-style g/v, buffers)."""
    module = torch.nn.Sequential(
        torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(3, 4, 7)),
        torch.nn.utils.weight_norm(torch.nn.Conv1d(4, 2, 1)),
        torch.nn.LayerNorm(2),
    )
    path = tmp_path / "m.pth"
    torch.save(module.state_dict(), path)
    loaded = load_torch_state_dict(path)
    reference = torch.load(path, weights_only=True)
    assert list(loaded) == list(reference)
    assert "0.parametrizations.weight.original0" in loaded and "1.weight_g" in loaded
    for name in reference:
        assert torch.equal(loaded[name], reference[name]), name


def test_not_a_zip_is_refused(tmp_path):
    path = tmp_path / "legacy.pth"
    torch.save({"a": torch.ones(1)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(ValueError, match="not a zip"):
        load_torch_state_dict(path)


# --------------------------------------------------------------------------------------------
# hostile files: refused, and the marker file the payload would create does not exist
# --------------------------------------------------------------------------------------------

def _hostile_payloads(marker):
    # Protocol 3 keeps Python 3 module names (protocol 2 would spell __builtin__.eval).
    cmd = f"touch {marker}"
    yield "os.system/GLOBAL", pickle.dumps(_Reduce(os.system, (cmd,)), protocol=2), "system"
    yield "os.system/STACK_GLOBAL", pickle.dumps(_Reduce(os.system, (cmd,)), protocol=4), "system"
    yield "builtins.eval", pickle.dumps(
        _Reduce(eval, (f"__import__('os').system({cmd!r})",)), protocol=3), "builtins.eval"
    yield "subprocess.call", pickle.dumps(
        _Reduce(subprocess.call, (["touch", str(marker)],)), protocol=3), "subprocess.call"
    # getattr(__import__('os'), 'system')(cmd), spelled out in opcodes.
    yield "builtins.getattr", (
        b"\x80\x02cbuiltins\ngetattr\n"
        b"cbuiltins\n__import__\nX\x02\x00\x00\x00os\x85R"
        b"X\x06\x00\x00\x00system\x86R"
        + b"X" + len(cmd).to_bytes(4, "little") + cmd.encode() + b"\x85R."), "builtins.getattr"
    # A plausible state dict whose second entry hides the gadget (first entry is fine).
    inner = collections.OrderedDict(ok=1, evil=_Reduce(os.system, (cmd,)))
    yield "gadget inside an OrderedDict", pickle.dumps(inner, protocol=2), "system"
    # The gadget as a tensor's backward hooks argument of an allowed rebuild call.
    yield "gadget in rebuild args", (
        b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n(cos\nsystem\n"
        + b"X" + len(cmd).to_bytes(4, "little") + cmd.encode() + b"\x85Rt."), "os.system"
    # INST opcode: module/name are read from the stream and called with the marked args.
    yield "INST opcode", b"(X" + len(cmd).to_bytes(4, "little") + cmd.encode() + b"ios\nsystem\n.", "INST"
    # EXT1: a global looked up through copyreg's extension registry.
    yield "EXT1 opcode", b"\x80\x02\x82\x01X\x01\x00\x00\x00x\x85R.", "EXT1"


@pytest.mark.parametrize("case", list(range(9)),
                         ids=[name for name, _, _ in _hostile_payloads("m")])
def test_hostile_pickle_is_refused_and_nothing_runs(tmp_path, case):
    marker = tmp_path / "pwned"
    name, payload, expected = list(_hostile_payloads(marker))[case]
    path = _write_zip(tmp_path / "evil.pth", payload)
    with pytest.raises(UnsafePickleError) as info:
        load_torch_state_dict(path)
    message = str(info.value)
    assert expected in message and str(path) in message, message
    assert not marker.exists(), f"{name}: payload ran"


def test_hostile_payload_is_live_under_plain_pickle(tmp_path):
    """Guards the test above: the same bytes do create the marker under a normal unpickler."""
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Reduce(os.system, (f"touch {marker}",)), protocol=2)
    pickle.loads(payload)
    assert marker.exists()


def test_build_on_a_tensor_is_refused(tmp_path):
    """BUILD would call Tensor.__setstate__; only OrderedDict attribute updates are allowed."""
    sd = {"w": torch.ones(2)}
    path = tmp_path / "ok.pth"
    torch.save(sd, path)
    with zipfile.ZipFile(path) as zf:
        records = {n: zf.read(n) for n in zf.namelist()}
    pkl_name = next(n for n in records if n.endswith("data.pkl"))
    payload = records[pkl_name]
    assert payload.endswith(b"s.")   # ... SETITEM STOP; re-open the tensor and BUILD on it
    tampered = payload[:-2] + b"s" + b"h\x00}b."   # BINGET 0 (the dict) -> not a tensor either
    with zipfile.ZipFile(tmp_path / "bad.pth", "w") as zf:
        for name, data in records.items():
            zf.writestr(name, tampered if name == pkl_name else data)
    with pytest.raises(UnsafePickleError, match="BUILD"):
        load_torch_state_dict(tmp_path / "bad.pth")


def test_view_past_its_storage_is_refused(tmp_path):
    """A size that reaches past the storage record must not read foreign memory."""
    payload = (b"\x80\x02ccollections\nOrderedDict\n)R(X\x01\x00\x00\x00w"
               b"ctorch._utils\n_rebuild_tensor_v2\n("
               b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x02tQ"
               b"K\x00K\x64\x85K\x01\x85\x89ccollections\nOrderedDict\n)RtRu.")
    path = _write_zip(tmp_path / "oob.pth", payload, {"data/0": b"\x00" * 8})
    with pytest.raises(UnsafePickleError, match="past its storage"):
        load_torch_state_dict(path)
    # The same file with an in-bounds size loads.
    ok = payload.replace(b"K\x64\x85", b"K\x02\x85")
    path = _write_zip(tmp_path / "ok.pth", ok, {"data/0": b"\x00" * 8})
    assert load_torch_state_dict(path)["w"].tolist() == [0.0, 0.0]
