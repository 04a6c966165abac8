"""The training loop of scripts/train.py: deep supervision, EMA, checkpoints.

- **Losses** (:mod:`train_losses`): the segmentation loss, the image loss, the SSIM
  term and distillation's BCE.
- **Outside the image** (``--outside``): a crop larger than its image (a 200 px steel strip in
  a 256 px crop) shows, past the image's edge, ``border``: the edge pixels drawn out into
  stripes, with the loss taken there too (scratchnet-2.0's recipe); ``serve``: what the
  serving model's input holds there (edge padding to a multiple of 16, then zeros after
  normalisation, as its convolutions pad), with the loss on the image's own pixels only.
- **Deep supervision** (``--aux W``): 1x1 heads on ``dec2`` and ``dec1`` (upsampled to the
  crop), their loss weighted ``W`` and ``W/2``; training only, never exported.
- An EMA of the weights is what is evaluated and exported.
- **Checkpoints** (:mod:`train_checkpoint`): :meth:`Trainer.state` is model, EMA, auxiliary
  heads, optimiser, step, training seconds, RNG states and the log, so one schedule (cosine
  over ``--minutes`` of training time) spans several processes (``--stop-minutes`` each).
"""

from __future__ import annotations

import copy
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from torch import nn
from train_data import Augment, Batch, GpuImages
from train_losses import image_loss, seg_loss, ssim_loss, weighted_bce

from scratchd.model.net import NetConfig, block_plan
from scratchd.model.torchnet import DSBlock, TorchScratchNet

CROPS = (224, 256, 288)
AUX_STAGES = ("dec2", "dec1")
MEMORY_FORMATS = {"channels_last": torch.channels_last, "contiguous": torch.contiguous_format}
PRECISIONS = ("bf16", "tf32")  # bf16 autocast, or fp32 storage with TF32 convs/matmuls (CUDA)


@dataclass
class Recipe:
    loss: str = "bce+lovasz"
    aux: float = 0.4
    image_loss: float = 0.2
    top_k: int = 16
    min_area: int = 16
    batch: int = 64
    lr: float = 4e-3
    wd: float = 1e-4
    warmup: int = 300
    ema: float = 0.999
    minutes: float = 14.0  # the whole schedule, in training seconds / 60 (0: by --steps)
    steps: int = 1_000_000
    free_weight: float = 0.5
    upscale_below: int = 0  # images with a longer side at most this run at twice their size
    outside: str = "border"  # what a crop shows past its image's edge: border | serve
    distill: float = 0.0  # weight of the main head's BCE against the teacher's map
    ssim: float = 0.0  # weight of the main head's 1 - SSIM against the mask (train_losses)
    teacher: str = ""  # sha256 of the teacher maps' file (train_teacher.py), if distilling
    augment: Augment = field(default_factory=Augment)


OUTSIDE = ("border", "serve")


class Trainer:
    """Model, EMA, auxiliary heads and optimiser, steppable and checkpointable."""

    def __init__(
        self, model: TorchScratchNet, recipe: Recipe, device: torch.device, seed: int,
        memory_format: torch.memory_format = torch.channels_last, precision: str = "bf16",
        compiled: bool = False, compile_backend: str | Callable[..., Any] = "inductor",
    ) -> None:  # fmt: skip
        """``memory_format`` is how activations are laid out and ``precision`` what the CUDA
        arithmetic runs in (:data:`PRECISIONS`; the CPU runs fp32 either way); ``compiled``
        runs the network through ``torch.compile`` with ``compile_backend`` (one graph per
        crop size, compiled on its first step). The same function each way, but which
        kernels run, and so a step's time, depends on them (``scripts/bench_train_step.py``
        times them)."""
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        if recipe.outside not in OUTSIDE:
            raise ValueError(f"outside must be one of {OUTSIDE}, got {recipe.outside!r}")
        self.recipe, self.device, self.memory_format = recipe, device, memory_format
        self.precision = precision
        # The network only: inductor's Triton code generation failed on the losses (H200,
        # torch 2.x of the device image: "list indices must be integers ..., not NoneType").
        net = self._eager_net
        # dynamic=False: one static graph per crop size (three), not a shape-generic one.
        self._net = torch.compile(net, backend=compile_backend, dynamic=False) if compiled else net
        torch.manual_seed(seed)
        self.model = model.to(device)
        for p in self.model.parameters():
            if p.ndim == 4:
                p.data = p.data.contiguous(memory_format=memory_format)
        w = model.cfg.widths
        self.aux = nn.ModuleDict({s: nn.Conv2d(w[int(s[-1])], 1, 1) for s in AUX_STAGES}).to(device)
        self.ema = copy.deepcopy(self.model).eval()
        params = [*self.model.named_parameters(), *self.aux.named_parameters()]
        decay = [p for _, p in params if p.ndim > 1]
        other = [p for _, p in params if p.ndim <= 1]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": recipe.wd}, {"params": other, "weight_decay": 0}],
            lr=recipe.lr,
        )
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.rng = np.random.default_rng(seed)
        self.step = 0
        self.seconds = 0.0  # training time over all processes of this schedule
        self.warmup_seconds = 0.0  # each process's first steps (autotuning), not scheduled
        self.log: list[dict[str, float]] = []
        self.evals: list[dict[str, Any]] = []
        self.commands: list[str] = []
        # The checkpoint a fine-tune started from: its sha256, steps, seconds and commands.
        self.parent: dict[str, Any] | None = None
        self.stop_requested = False  # end after the step in progress (run's loop checks it)

    def progress(self) -> float:
        r = self.recipe
        return self.seconds / (60 * r.minutes) if r.minutes > 0 else self.step / r.steps

    def train_step(self, data: GpuImages, probs: torch.Tensor, mean: float, std: float) -> float:
        r = self.recipe
        cosine = 0.5 * (1 + math.cos(math.pi * min(self.progress(), 1.0)))
        lr = r.lr * min(1.0, (self.step + 1) / r.warmup) * cosine
        for g in self.opt.param_groups:
            g["lr"] = lr
        size = CROPS[self.step % len(CROPS)]
        idx = torch.multinomial(probs, r.batch, replacement=True, generator=self.gen)
        x, y, w, t = self._inputs(data.batch(idx, size, r.augment, self.gen), mean, std)
        # Set per step (a process may hold trainers of both kinds, scripts/bench_train_step.py);
        # cuDNN's TF32 is PyTorch's default already, matmuls' is not.
        torch.backends.cuda.matmul.allow_tf32 = self.precision == "tf32"
        loss = self._losses(x, y, w, t)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([*self.model.parameters(), *self.aux.parameters()], 2.0)
        self.opt.step()
        self._update_ema()
        self.step += 1
        return lr

    def _eager_net(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The main head's logits and the deep-supervision heads' of one batch."""
        r, dev = self.recipe, self.device
        amp = dev.type == "cuda" and self.precision == "bf16"
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            stages = self.model.decode(x)
            main = self.model.head(stages["dec0"])
            aux = {s: self.aux[s](stages[s]) for s in AUX_STAGES if r.aux > 0}
        return main, aux

    def _losses(
        self, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor | None,
        teacher: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """The training loss of one batch: main head, its SSIM term (``recipe.ssim`` > 0),
        distillation towards ``teacher``'s map (``recipe.distill`` > 0), deep supervision,
        image loss."""
        r = self.recipe
        size = x.shape[-1]
        main, aux = self._net(x)
        up = F.interpolate(main.float(), size=(size, size), mode="bilinear", align_corners=False)
        loss = seg_loss(up, y, r.loss, w)
        if r.ssim > 0:
            loss = loss + r.ssim * ssim_loss(up, y, w)
        if r.distill > 0:
            if teacher is None:
                raise ValueError("the recipe distils, but the batch has no teacher maps")
            loss = loss + r.distill * weighted_bce(up, teacher, w)
        for s, weight in zip(AUX_STAGES, (r.aux / 2, r.aux), strict=True):
            if s in aux:
                a = F.interpolate(aux[s].float(), size=(size, size), mode="bilinear")
                loss = loss + weight * seg_loss(a, y, r.loss, w)
        if r.image_loss > 0:
            loss = loss + r.image_loss * image_loss(up, y, r.top_k, r.min_area, w)
        return loss

    def _inputs(
        self, b: Batch, mean: float, std: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The network's input, the target, the loss's pixel weights (None: all) under
        the recipe's ``outside`` rule, and the teacher's map (None: none)."""
        x = (b.x - mean) / std
        w = None
        if self.recipe.outside == "serve":
            x, w = x * b.seen, b.scored
        return x.contiguous(memory_format=self.memory_format), b.y, w, b.teacher

    def _update_ema(self) -> None:
        decay = min(self.recipe.ema, (1 + self.step) / (10 + self.step))
        weights: list[torch.Tensor] = []
        targets: list[torch.Tensor] = []
        with torch.no_grad():
            for e, m in zip(
                self.ema.state_dict().values(), self.model.state_dict().values(), strict=True
            ):
                if e.dtype.is_floating_point:
                    weights.append(e)
                    targets.append(m)
                else:  # BatchNorm's batch counters
                    e.copy_(m)
            # One fused launch for the floating tensors instead of one per tensor.
            torch._foreach_lerp_(weights, targets, 1 - decay)

    def profile(
        self, data: GpuImages, probs: torch.Tensor, mean: float, std: float, steps: int,
        path: Path,
    ) -> None:  # fmt: skip
        """Run ``steps`` training steps (after the warm-up shapes) under the PyTorch profiler
        and write its per-op table to ``path``: where a step's time goes. These are real steps
        of the schedule; their time is kept out of its clock, like the warm-up's."""
        from torch.profiler import ProfilerActivity, profile

        t0 = time.perf_counter()
        for _ in range(2 * len(CROPS)):
            self.train_step(data, probs, mean, std)
        self._sync()
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        t1 = time.perf_counter()
        with profile(activities=activities) as prof:
            for _ in range(steps):
                self.train_step(data, probs, mean, std)
            self._sync()
        wall = time.perf_counter() - t1
        sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=60)
        path.write_text(f"{steps} steps, {wall / steps * 1e3:.1f} ms a step (wall)\n{table}")
        self.warmup_seconds += time.perf_counter() - t0

    def run(
        self, data: GpuImages, probs: torch.Tensor, mean: float, std: float, stop_seconds: float
    ) -> None:
        """Train until the schedule ends, this process has trained ``stop_seconds``, or
        ``stop_requested`` is set (``train.py`` sets it on SIGTERM: the step in progress ends,
        then the checkpoint is written as after ``--stop-minutes``).

        The schedule's clock starts once each crop size has run twice in this process: the
        first steps of a shape pay for startup (presumably cuDNN autotuning; several times the
        later rate, docs/scratchnet2/README.md), which must not eat the schedule; that time is
        kept in ``warmup_seconds``."""
        start_seconds, t0 = self.seconds, time.perf_counter()
        warm_until = self.step + 2 * len(CROPS)
        bar = Progress(
            TextColumn("[bold]train"), BarColumn(),
            TextColumn("{task.completed:.0f}/{task.total:.0f}"),
            TextColumn("step {task.fields[step]} loss {task.fields[loss]}"),
            TimeElapsedColumn(), TimeRemainingColumn(), disable=not sys.stdout.isatty(),
        )  # fmt: skip
        total = 60 * self.recipe.minutes if self.recipe.minutes > 0 else float(self.recipe.steps)
        with bar:
            task = bar.add_task("train", total=total, step=self.step, loss="-")
            while (
                self.progress() < 1.0
                and self.seconds - start_seconds < stop_seconds
                and not self.stop_requested
            ):
                lr = self.train_step(data, probs, mean, std)
                if self.step == warm_until:
                    self._sync()
                    self.warmup_seconds += time.perf_counter() - t0
                    t0 = time.perf_counter()
                if self.step % 10 == 0 and self.step > warm_until:
                    self._sync()
                    self.seconds = start_seconds + time.perf_counter() - t0
                if self.step % 200 == 0:
                    loss = float(self._last_loss(data, probs, mean, std))
                    entry = {"step": self.step, "loss": round(loss, 5),
                             "lr": lr, "seconds": round(self.seconds, 1)}  # fmt: skip
                    self.log.append(entry)
                    done = self.seconds if self.recipe.minutes > 0 else self.step
                    bar.update(task, completed=done, step=self.step, loss=f"{entry['loss']:.4f}")
                    if self.step % 2000 == 0:
                        print(json.dumps(entry), flush=True)
        if self.step > warm_until:
            self._sync()
            self.seconds = start_seconds + time.perf_counter() - t0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def _last_loss(
        self, data: GpuImages, probs: torch.Tensor, mean: float, std: float
    ) -> torch.Tensor:
        """The main head's segmentation loss on one fresh batch (EMA model, no aux)."""
        r = self.recipe
        idx = torch.multinomial(probs, r.batch, replacement=True, generator=self.gen)
        x, y, w, _ = self._inputs(data.batch(idx, CROPS[1], r.augment, self.gen), mean, std)
        logits = self.ema(x).float()
        up = F.interpolate(logits, size=y.shape[-2:], mode="bilinear", align_corners=False)
        return seg_loss(up, y, r.loss, w)

    def state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "ema": self.ema.state_dict(),
            "aux": self.aux.state_dict(),
            "opt": self.opt.state_dict(),
            "gen": self.gen.get_state(),
            "step": self.step,
            "seconds": self.seconds,
            "warmup_seconds": self.warmup_seconds,
            "log": self.log,
            "evals": self.evals,
            "commands": self.commands,
            "parent": self.parent,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.ema.load_state_dict(state["ema"])
        self.aux.load_state_dict(state["aux"])
        self.opt.load_state_dict(state["opt"])
        try:
            self.gen.set_state(state["gen"].cpu())
        except RuntimeError:  # saved on another device type (CUDA vs CPU): a fresh stream
            print("note: batch RNG state not restored (other device type)", flush=True)
        self.step, self.seconds = int(state["step"]), float(state["seconds"])
        self.warmup_seconds = float(state.get("warmup_seconds", 0.0))
        self.log, self.evals = list(state["log"]), list(state["evals"])
        self.commands = list(state["commands"])
        self.parent = state.get("parent")

    def init_from(self, state: dict[str, Any], sha256: str, parent_cfg: NetConfig) -> None:
        """Start a new schedule (fresh optimiser, step 0) from a checkpoint's weights: the
        model and its EMA both take the checkpoint's EMA weights (the better of its two, and
        the one it exported), the auxiliary heads its heads. The parent's record (sha256,
        steps, seconds, commands, and its own parent) is kept in :attr:`parent`.

        The model may be the parent grown by residual blocks (:func:`grown_blocks`: say one
        more dilated block at H/16): each new block's last BatchNorm starts at zero scale
        and shift, so the block starts as the identity on its input (non-negative, after a
        ReLU) and the grown net computes exactly what the parent did."""
        new = grown_blocks(parent_cfg, self.model.cfg)
        for net in (self.model, self.ema):
            missing, unexpected = net.load_state_dict(state["ema"], strict=False)
            if unexpected or any(k.split(".")[1] not in new for k in missing):
                raise ValueError(f"weights do not fit: {unexpected or missing}")
            for name in new:
                block = net.blocks[name]
                assert isinstance(block, DSBlock)
                bn = block.pw.bn
                if bn is None:
                    raise ValueError("a fused (inference) net cannot be trained")
                nn.init.zeros_(bn.weight)
                nn.init.zeros_(bn.bias)
        self.aux.load_state_dict(state["aux"])
        self.parent = {
            "sha256": sha256,
            "steps": int(state["step"]),
            "seconds": round(float(state["seconds"]), 1),
            "commands": list(state["commands"]),
            "parent": state.get("parent"),
            "grown_by": sorted(new),
        }


def grown_blocks(parent: NetConfig, child: NetConfig) -> set[str]:
    """The blocks (module names) ``child`` adds to ``parent``: every block of the parent must
    be in the child unchanged and every added block residual (so it can start as the
    identity); ValueError otherwise. Empty for the same architecture."""
    have = {b.name: b for b in block_plan(parent)}
    added = set()
    for b in block_plan(child):
        if b.name in have:
            if have.pop(b.name) != b:
                raise ValueError(f"block {b.name} differs between the two architectures")
        elif b.residual:
            added.add(b.name.replace(".", "_"))
        else:
            raise ValueError(f"block {b.name} is new and not residual: it cannot start as identity")
    if have:
        raise ValueError(f"blocks {sorted(have)} of the parent are not in this architecture")
    return added
