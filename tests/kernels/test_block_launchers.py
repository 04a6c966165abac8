"""The DS-block launchers' kernel arguments, without a GPU: ``ds_block_cuda``, ``ds_tiled_cuda``,
``ds_halo_cuda`` and ``ds_split_cuda`` run against a stand-in for ``kernels/_cuda`` (arrays
that only carry a shape and dtype, launches recorded), and each launch must pass its kernel's
parameters in the order the ``.cu`` signature declares them. The gpu-marked tests check what
the kernels compute; these check, in CI, what the launchers hand them."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from scratchd.kernels import _cuda as cu
from scratchd.kernels.ds_block import ds_block_cuda
from scratchd.kernels.ds_halo import ds_halo_cuda
from scratchd.kernels.ds_split import ds_split_cuda, ds_tiled_cuda


@dataclass(eq=False)
class Arr:
    """A device array as the launchers see it: a name, a shape and a dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: Any = np.float16  # a numpy dtype or scalar type

    def __post_init__(self) -> None:
        self.dtype = np.dtype(self.dtype)
        self.ndim = len(self.shape)
        self.size = int(np.prod(self.shape))
        self.flags = SimpleNamespace(c_contiguous=True)
        self.device = SimpleNamespace(id=0)

    def __getitem__(self, part: slice) -> Arr:  # a flat array's front (the split's scratch)
        return Arr(f"{self.name}[:{part.stop}]", (part.stop,), self.dtype)


@dataclass
class Func:
    name: str


@dataclass
class Recorded:
    launches: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)


@pytest.fixture
def device(monkeypatch: pytest.MonkeyPatch) -> Recorded:
    rec = Recorded()
    fake = SimpleNamespace(
        ndarray=Arr,
        empty=lambda shape, dtype: Arr("new", shape, dtype),
        cuda=SimpleNamespace(runtime=SimpleNamespace(getDevice=lambda: 0)),
    )
    monkeypatch.setattr(cu, "cupy", lambda: fake)
    monkeypatch.setattr(cu, "kernel", lambda file, name, others=(): Func(name))
    monkeypatch.setattr(cu, "sm_count", lambda: 132)
    monkeypatch.setattr(cu, "opt_in_smem", lambda func, smem: None)
    monkeypatch.setattr(cu, "persistent_grid", lambda func, threads, smem, tiles: 264)

    def launch(func: Func, grid: Any, block: Any, args: tuple[Any, ...], smem: int = 0) -> None:
        rec.launches.append((func.name, args))

    def launch_pw(
        func: Func, cin: int, cout: int, pixels: int, args: tuple[Any, ...], *_: Any
    ) -> None:
        rec.launches.append((func.name, args))

    monkeypatch.setattr(cu, "launch", launch)
    monkeypatch.setattr(cu, "launch_pw", launch_pw)
    return rec


def same(got: tuple[Any, ...], want: tuple[Any, ...]) -> None:
    """Arrays by identity, sizes by value and as int32 (what the kernels take)."""
    assert len(got) == len(want), (got, want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if isinstance(w, Arr):
            assert g is w, f"argument {i}: {getattr(g, 'name', g)} instead of {w.name}"
        else:
            assert isinstance(g, np.int32) and g == w, f"argument {i}: {g!r} instead of {w}"


def block(cin: int, cout: int, *, transposed: bool) -> dict[str, Arr]:
    return {
        "dw_w": Arr("dw_w", (3, 3, cin)),
        "dw_b": Arr("dw_b", (cin,), np.float32),
        "pw": Arr("pw", (cout, cin) if transposed else (cin, cout)),
        "pw_b": Arr("pw_b", (cout,), np.float32),
    }


@pytest.mark.parametrize("launcher", [ds_block_cuda, ds_tiled_cuda, ds_halo_cuda])
def test_one_launch_blocks_pass_x_skip_weights_head_out_then_sizes(
    device: Recorded, launcher: Any
) -> None:
    """(x, skip, dw_w, dw_b, pw, pw_b, head_w, head_b, out, N, H, W[, Ho, Wo]); without a skip
    x stands in for it, without the head pw_b for head_w and head_b (never read)."""
    transposed = launcher is not ds_block_cuda
    x, skip = Arr("x", (2, 10, 12, 96)), Arr("skip", (2, 20, 24, 48))
    w = block(144, 48, transposed=transposed)
    out = Arr("out", (2, 20, 24, 48))
    launcher(x, w["dw_w"], w["dw_b"], w["pw"], w["pw_b"], skip=skip, out=out)
    sizes = (2, 20, 24) if launcher is ds_halo_cuda else (2, 20, 24, 20, 24)
    ((name, args),) = device.launches
    same(
        args, (x, skip, w["dw_w"], w["dw_b"], w["pw"], w["pw_b"], w["pw_b"], w["pw_b"], out, *sizes)
    )

    device.launches.clear()
    x = Arr("x", (1, 16, 16, 48))
    w = block(48, 48, transposed=transposed)
    hw, hb = Arr("hw", (48, 1), np.float32), Arr("hb", (1,), np.float32)
    logits = Arr("logits", (1, 16, 16, 1), np.float32)
    launcher(
        x, w["dw_w"], w["dw_b"], w["pw"], w["pw_b"], residual=True, head_w=hw, head_b=hb, out=logits
    )
    sizes = (1, 16, 16) if launcher is ds_halo_cuda else (1, 16, 16, 16, 16)
    ((name, args),) = device.launches
    same(args, (x, x, w["dw_w"], w["dw_b"], w["pw"], w["pw_b"], hw, hb, logits, *sizes))
    assert name.endswith("true, true>") or name.endswith("true, true, 2>")  # residual, head


def test_a_split_block_passes_the_depthwise_then_the_gemm_arguments(device: Recorded) -> None:
    """dw_stage(x, skip, dw_w, dw_b, scratch, N, H, W, Ho, Wo), then pw_gemm(scratch, pw_wt,
    pw_b, res, out, M): the residual is x when asked for, else the scratch (never read)."""
    x = Arr("x", (2, 9, 7, 48))
    w = block(48, 48, transposed=True)
    scratch = Arr("scratch", (2 * 9 * 7 * 48 + 5,))
    out = Arr("out", (2, 9, 7, 48))
    ds_split_cuda(
        x, w["dw_w"], w["dw_b"], w["pw"], w["pw_b"], residual=True, scratch=scratch, out=out
    )
    (dw_name, dw_args), (gemm_name, gemm_args) = device.launches
    assert dw_name.startswith("dw_stage<") and gemm_name.startswith("pw_gemm<")
    mid = dw_args[4]
    assert mid.name == f"scratch[:{2 * 9 * 7 * 48}]"  # the scratch's front, M x Cin halves
    same(dw_args[:4] + dw_args[5:], (x, x, w["dw_w"], w["dw_b"], 2, 9, 7, 9, 7))
    assert gemm_args[0] is mid and gemm_args[3] is x and gemm_args[4] is out
    same(gemm_args[1:3] + gemm_args[5:], (w["pw"], w["pw_b"], 2 * 9 * 7))
