"""Training configuration: presets, TOML files and ``--set key=value`` overrides."""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from opengem.data.synthetic import SYNTHETIC_PRESETS
from opengem.models.gem import GEMConfig
from opengem.models.presets import GEM_PRESETS
from opengem.models.sequence_ctr import SequenceCTRConfig
from opengem.nn.low_precision_recipe import NAMED_RECIPES
from opengem.train.guards import check_spike_factor
from opengem.validation import (
    check_run_name,
    require_at_least,
    require_finite,
    require_fraction,
    require_positive,
    require_seed,
)

ARCHITECTURES = ("sequence_ctr", "gem")
LOW_PRECISION_MLPS = ("none", "auto", *(name for name in NAMED_RECIPES if name != "bf16"))
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")  # torch.compile modes of the dense blocks
AUTO_BOOL = bool | None  # a setting that is true, false or auto (None: the run decides; spelled "auto" in --set)
SHADOW_ADAMW_MOMENTS = ("fp32", "bf16")  # the shadow AdamW's moments (TrainConfig.shadow_adamw_moments)
PRECISIONS = ("fp32", "bf16")  # bf16: dense compute under torch.autocast; parameters and optimizer stay fp32
def refuse_two_recompute_policies(activation_checkpointing: bool, activation_memory_budget: float) -> None:
    """Whole-block checkpointing leaves the compiler nothing to choose: one recompute policy at a time."""
    if activation_checkpointing and activation_memory_budget != 1:
        raise ValueError(f"activation_checkpointing recomputes whole blocks; activation_memory_budget="
                         f"{activation_memory_budget} chooses what to recompute inside them: set one of the two")


@dataclass(frozen=True)
class TrainConfig:
    preset: str = "gem-tiny"
    name: str = ""  # run folder under out_dir; defaults to the preset name
    out_dir: str = "runs"
    data_preset: str = "gem-tiny"  # synthetic data preset (opengem.data.synthetic.SYNTHETIC_PRESETS)
    data_dir: str = ""  # Parquet folder written by `opengem data synth`; empty = stream synthetic data
    # Parquet folder of held-out samples (`opengem data synth --holdout`, or any files in data_preset's layout); empty
    # = the synthetic held-out range of the training data's world (data_dir's recorded generator seed, else seed)
    eval_dir: str = ""
    seed: int = 0
    steps: int = 300
    batch_size: int = 256
    lr: float = 2e-3
    weight_decay: float = 0.01
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1  # cosine decay of the dense learning rate down to this fraction
    embedding_lr: float = 0.05
    eval_every: int = 100
    eval_samples: int = 20000
    log_every: int = 10
    checkpoint_every: int = 200
    keep_checkpoints: int = 3
    max_bad_steps: int = 5  # consecutive non-finite losses before training stops
    # a loss above this multiple of its running mean is reported as a spike (only reported: the step still counts);
    # inf: never report one
    spike_factor: float = 3.0
    baseline: bool = True  # also train the history-free baseline on the same batches
    device: str = "auto"  # "auto" (cuda when torch sees one, else cpu), "cpu" or "cuda[:N]"
    num_workers: int = 0
    architecture: str = "sequence_ctr"  # "sequence_ctr" (section `model`) or "gem" (section `gem`)
    precision: str = "fp32"  # one of PRECISIONS
    compile: bool = False  # torch.compile the dense blocks (opengem.train.compile); worth it on GPUs
    compile_mode: str = "default"  # one of COMPILE_MODES; max-autotune times Inductor's kernel choices
    # Inductor's C++ wrapper for the compiled blocks (opengem.train.compile): kernels launched from C++, not generated
    # Python lines; needs compile=true (bench train: --compile) and a C++ compiler (plus the CUDA toolkit on GPUs)
    compile_cpp_wrapper: bool = False
    activation_checkpointing: bool = False  # recompute each block's activations in the backward (memory)
    # the compiled blocks keep this share of the activations the compiler saves by default and recompute the rest,
    # cheapest (element-wise) first (opengem.train.compile; PyTorch's activation memory budget): between 1 (off) and
    # activation_checkpointing's whole-block recompute; needs compile=true
    activation_memory_budget: float = 1.0
    # bf16 copies of the plain Linear layers' weights, cast once a step (opengem.nn.weight_shadows) instead of at each
    # use under autocast: the same numbers, fewer small kernels; precision="bf16", one process. None ("auto", the
    # default): on where both measured faster (docs/performance.md), precision="bf16" in the single-process trainer on
    # a GPU; off elsewhere (see shadow_settings)
    weight_shadows: bool | None = None
    # with weight_shadows: the shadowed layers' weight and bias gradients in fp32 straight from the GEMM and the sum
    # (no bf16 rounding of them, no cast kernel after each); no longer bit for bit autocast's
    fp32_weight_grads: bool = False
    # with weight_shadows: the shadowed weights' bf16 gradients stay on the shadows and AdamW reads them there and
    # writes the next shadows as it updates (opengem.train.shadow_adamw): per parameter 28 B moved a step instead of 40
    # (no gradient cast, no refresh); AdamW's arithmetic on autocast's gradients. None ("auto", the default): on
    # wherever weight_shadows is, unless fp32_weight_grads
    shadow_adamw: bool | None = None
    # with shadow_adamw: the dtype of the moments it keeps for the shadowed weights, "fp32" or "bf16" (4 B a parameter
    # less kept, 8 B less moved a step; stored rounded stochastically, so they stay unbiased: opengem.ops.adamw)
    shadow_adamw_moments: str = "fp32"
    # one of LOW_PRECISION_MLPS: the large Linear layers in that FP8 / MX recipe (opengem.nn.low_precision's
    # default filter: not the heads, the last layer or layers under 512 features), "none" keeps them BF16,
    # "auto" gives each the fastest recipe whose output error on one training batch is <= numerics_bound
    # (opengem.nn.numerics.select_precision; timed per layer on a GPU, a fixed speed order on CPU)
    low_precision_mlp: str = "none"
    low_precision_min_features: int = 512  # smaller Linear layers stay BF16 (their GEMMs gain nothing from FP8)
    # every N steps (0: never) each low-precision layer's output (FP8 linears; FP8 attention layers' residual
    # updates) against a BF16 shadow on the same input
    # (opengem.nn.numerics.NumericsMonitor, one extra eager forward): "numerics/<layer>/rel_error" in
    # metrics.jsonl, a warning past numerics_bound and, with numerics_fallback, that layer in BF16 from then on;
    # numerics_bound is also low_precision_mlp="auto"'s selection bound. inf: never warn or fall back (the errors are
    # still logged), and "auto" takes each layer's fastest recipe whatever its error
    numerics_every: int = 0
    numerics_bound: float = 0.1
    numerics_fallback: bool = False
    model: SequenceCTRConfig = field(default_factory=SequenceCTRConfig)
    gem: GEMConfig = field(default_factory=lambda: GEM_PRESETS["gem-tiny"].model)

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:  # else only found when the trainer builds the model
            raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {self.architecture!r}")
        if self.data_preset not in SYNTHETIC_PRESETS:  # a Parquet data_dir is read in this preset's layout too
            raise ValueError(f"data_preset must be one of {sorted(SYNTHETIC_PRESETS)}, got {self.data_preset!r}")
        _check_device(self.device)
        check_run_name(self.name)
        require_at_least(self, ("steps", "batch_size", "eval_every", "eval_samples", "log_every", "checkpoint_every",
                                "keep_checkpoints", "max_bad_steps", "low_precision_min_features"), 1)
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode must be one of {COMPILE_MODES}, got {self.compile_mode!r}")
        if self.low_precision_mlp not in LOW_PRECISION_MLPS:
            raise ValueError(f"low_precision_mlp must be one of {LOW_PRECISION_MLPS}, got {self.low_precision_mlp!r}")
        require_at_least(self, ("warmup_steps", "num_workers", "numerics_every"), 0)
        require_positive(self, ("lr", "embedding_lr", "numerics_bound"))
        require_at_least(self, ("weight_decay",), 0)
        require_finite(self, ("lr", "embedding_lr", "weight_decay"))
        require_seed(self)  # the synthetic data seeds numpy's default_rng
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1] (a fraction of lr), got {self.min_lr_ratio}")
        check_spike_factor(self.spike_factor)
        if self.weight_shadows and self.precision != "bf16":
            raise ValueError(f"weight_shadows holds bf16 copies for precision=bf16, got precision={self.precision!r}")
        require_fraction(self, ("activation_memory_budget",))
        for setting, in_use in (("compile_cpp_wrapper=true", self.compile_cpp_wrapper),
                                ("activation_memory_budget", self.activation_memory_budget != 1)):
            if in_use and not self.compile:
                raise ValueError(f"{setting} is a setting of the compiled blocks: set compile=true as well "
                                 "(bench train: --compile)")
        refuse_two_recompute_policies(self.activation_checkpointing, self.activation_memory_budget)
        if self.shadow_adamw_moments not in SHADOW_ADAMW_MOMENTS:
            raise ValueError(f"shadow_adamw_moments must be one of {SHADOW_ADAMW_MOMENTS}, got "
                             f"{self.shadow_adamw_moments!r}")
        bf16_moments = self.shadow_adamw_moments != "fp32"
        if bf16_moments and (self.shadow_adamw is False or self.fp32_weight_grads):
            raise ValueError(f"shadow_adamw_moments={self.shadow_adamw_moments} is the shadow AdamW's state: it needs "
                             f"shadow_adamw true or auto and fp32_weight_grads false, got shadow_adamw="
                             f"{_setting_text(self.shadow_adamw)}, fp32_weight_grads={self.fp32_weight_grads}")
        for setting, in_use in (("fp32_weight_grads", self.fp32_weight_grads), ("shadow_adamw", self.shadow_adamw),
                                ("shadow_adamw_moments", bf16_moments)):
            if in_use and (self.weight_shadows is False or self.precision != "bf16"):
                raise ValueError(f"{setting} computes the weight-shadowed layers' gradients: it needs precision=bf16 "
                                 f"and weight_shadows true or auto, got precision={self.precision!r}, "
                                 f"weight_shadows={_setting_text(self.weight_shadows)}")
        if self.fp32_weight_grads and self.shadow_adamw:
            raise ValueError("fp32_weight_grads gives the fp32 weights fp32 gradients and shadow_adamw reads bf16 ones "
                             "from the shadows: choose one")
        low_precision_attention = self.architecture == "gem" and self.gem.attention_precision != "bf16"
        if self.numerics_every and self.low_precision_mlp == "none" and not low_precision_attention:
            raise ValueError("numerics_every monitors the low-precision layers: set low_precision_mlp or "
                             "gem.attention_precision too")

    @property
    def run_name(self) -> str:
        return self.name or self.preset


def shadow_settings(config: TrainConfig, single_process_gpu: bool) -> tuple[bool, bool]:
    """``(weight_shadows, shadow_adamw)`` as a run applies them. An explicit true or false is kept; auto (None) turns
    the shadows on for precision="bf16" when ``single_process_gpu`` (the single-process trainer, parameters on a GPU:
    where they measured faster), and the shadow AdamW on wherever the shadows are, unless fp32_weight_grads. A setting
    that needs the shadows where auto leaves them off is a ``ValueError`` naming it."""
    weight_shadows = config.weight_shadows
    if weight_shadows is None:
        weight_shadows = config.precision == "bf16" and single_process_gpu
    shadow_adamw = config.shadow_adamw
    if shadow_adamw is None:
        shadow_adamw = weight_shadows and not config.fp32_weight_grads
    needs_shadows = [name for name, on in (("fp32_weight_grads", config.fp32_weight_grads),
                                           ("shadow_adamw", shadow_adamw)) if on]
    if needs_shadows and not weight_shadows:
        raise ValueError(f"{' and '.join(needs_shadows)}=true computes the weight-shadowed layers' gradients, and "
                         "weight_shadows=auto leaves the shadows off here (on for the single-process trainer on a "
                         "GPU): set weight_shadows=true or drop it")
    if config.shadow_adamw_moments != "fp32" and not shadow_adamw:
        raise ValueError(f"shadow_adamw_moments={config.shadow_adamw_moments} is the shadow AdamW's state, and auto "
                         "leaves the shadows and the shadow AdamW off here (on for the single-process trainer on a "
                         "GPU): set weight_shadows=true shadow_adamw=true or drop it")
    return weight_shadows, shadow_adamw


def _check_device(device: str) -> None:
    """``device`` as the trainer resolves it (opengem.train.trainer.resolve_device): auto, cpu or a CUDA device. A
    well-formed CUDA device passes on a machine without one (the config may be written for another machine); whether
    it exists is the trainer's question."""
    if device in ("auto", "cpu"):
        return
    try:
        parsed = torch.device(device)
    except RuntimeError as error:  # torch's parser: "cuda:x", "cudaa", ""
        raise ValueError(f"device must be auto, cpu or cuda[:N], got {device!r} ({error})") from None
    if parsed.type != "cuda":  # a real torch device ("mps", "meta", "cpu:0") the trainer does not run on
        raise ValueError(f"device must be auto, cpu or cuda[:N], got {device!r}")


def _setting_text(value: bool | None) -> str:
    """A tri-state setting as ``--set`` spells it."""
    return "auto" if value is None else str(value).lower()


_GEM_SMALL = TrainConfig(
    preset="gem-small",
    data_preset="gem-small",
    steps=2000,
    batch_size=2048,
    lr=1e-3,
    embedding_lr=0.02,
    eval_every=500,
    eval_samples=50000,
    num_workers=8,
    architecture="gem",
    precision="bf16",
    compile=True,
    model=SequenceCTRConfig(embedding_dim=64, d_model=256, num_heads=2, num_layers=4, mlp_dims=(1024, 512)),
    gem=GEM_PRESETS["gem-small"].model,
)

PRESETS: dict[str, TrainConfig] = {
    # The CPU demo: short histories, a small model; trains in a few minutes on 2 cores.
    "gem-tiny": TrainConfig(steps=800, eval_every=200),
    # One GPU, the GEM model (~100M dense): long power-law histories; bf16 autocast and compiled blocks (the
    # fastest measured setting on an H200, docs/performance.md); batch 2048 peaks at ~52 GiB.
    "gem-small": _GEM_SMALL,
    # One H100/H200, the GEM model (~1B dense): histories up to 16k tokens (mean ~510), so ~65k history
    # tokens per batch of 128; with bf16 activations that leaves headroom in 80 GB next to the ~22 GB
    # of fp32 tables and the ~18 GB of fp32 weights + AdamW state.
    "gem-large": replace(
        _GEM_SMALL, preset="gem-large", data_preset="gem-large", batch_size=128, lr=5e-4, eval_samples=20000,
        gem=GEM_PRESETS["gem-large"].model,
    ),
}


def load_config(
    preset: str | None = None, file: str | Path | None = None, overrides: typing.Sequence[str] = ()
) -> TrainConfig:
    """Preset defaults, then the TOML file, then ``key=value`` overrides (``model.num_layers=4``). The file's values
    must have their settings' types (TOML's are typed); its ``preset`` key chooses the base preset, as ``preset`` does,
    and the two may not disagree."""
    table: dict[str, Any] = {}
    path = Path(file) if file is not None else None
    if path is not None:
        try:
            table = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as error:
            raise ValueError(f"cannot read config file {path}: {error}") from error
    # the preset is the base the other settings land on, not a setting: it is chosen first and never renamed after
    file_preset = table.pop("preset", None)
    if file_preset is not None:
        if type(file_preset) is not str:
            raise ValueError(f"{path}: preset must be a string, got {type(file_preset).__name__} {file_preset!r}")
        if preset is not None and preset != file_preset:
            raise ValueError(f"{path}: preset = {file_preset!r} disagrees with --preset {preset}: choose one")
    base_name = preset if preset is not None else file_preset if file_preset is not None else "gem-tiny"
    if base_name not in PRESETS:
        where = f"{path}: " if base_name == file_preset else ""
        raise ValueError(f"{where}unknown preset {base_name!r}; choose one of {sorted(PRESETS)}")
    config = PRESETS[base_name]
    if path is not None:
        config = _apply(config, _flatten(table), source=str(path), typed=True)
    return apply_overrides(config, overrides)


def apply_overrides(config: TrainConfig, overrides: typing.Sequence[str]) -> TrainConfig:
    """Apply ``key=value`` strings (dotted keys reach into sections, e.g. ``model.num_layers=4``)."""
    pairs: dict[str, Any] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects key=value, got {item!r}")
        pairs[key.strip()] = value.strip()
    if "preset" in pairs:  # setting it would only rename the run: the preset's batch, model and data would stay
        raise ValueError(f"--set preset={pairs['preset']}: the preset is the base the settings start from, not a "
                         "setting; choose it with --preset NAME (or preset = \"NAME\" in the --config file)")
    return _apply(config, pairs, source="--set", typed=False)


def config_from_dict(saved: dict[str, Any]) -> TrainConfig:
    """Rebuild a TrainConfig from ``dataclasses.asdict`` output (as stored in checkpoints); a setting this version
    does not know, or a value of the wrong type, is a ``ValueError`` naming it."""
    sections = {"model": SequenceCTRConfig, "gem": GEMConfig}
    for name, kind in (("", TrainConfig), *sections.items()):
        table = saved.get(name, {}) if name else saved
        if not isinstance(table, dict):
            raise ValueError(f"saved config's {name or 'top level'!r} must be a table, got {type(table).__name__}")
        known = {f.name for f in dataclasses.fields(kind)}
        unknown = sorted(set(table) - known)
        if unknown:
            raise ValueError(f"saved config has settings this version does not know: "
                             f"{', '.join(f'{name}.{key}' if name else key for key in unknown)}")
        hints = typing.get_type_hints(kind)
        for key, value in table.items():
            if not (name == "" and key in sections):
                _check_saved_type(value, hints[key], f"{name}.{key}" if name else key)
    rebuilt = {}
    for name, kind in sections.items():
        if name in saved:  # checkpoints written before the gem section existed lack it
            try:
                rebuilt[name] = kind(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved[name].items()})
            except ValueError as error:  # a __post_init__ check, named with its section: model.num_heads
                raise ValueError(f"saved config's {name}.{error}") from error
    return replace(TrainConfig(**{k: v for k, v in saved.items() if k not in sections}), **rebuilt)


def _check_saved_type(value: Any, hint: Any, key: str) -> None:
    """A saved setting must hold its field's JSON type exactly (asdict wrote it): no string-to-number conversion, which
    would let ``"seed": "x"`` load and fail steps later."""
    if not _fits(value, hint):
        raise ValueError(f"saved config's {key!r} must be {_type_name(hint)}, got {value!r}")


def _fits(value: Any, hint: Any) -> bool:
    """``value`` has ``hint``'s JSON / TOML type: bools are not numbers, numbers not strings, and nothing converts."""
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if hint == AUTO_BOOL:
        return value is None or type(value) is bool
    if origin is tuple:
        return isinstance(value, (list, tuple)) and all(type(item) is int for item in value)
    if hint is float:
        return type(value) in (int, float)
    return type(value) is hint


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return f"one of {typing.get_args(hint)}"
    names = {int: "an int", float: "a number", str: "a string", bool: "true or false", AUTO_BOOL: "true, false or null"}
    return names.get(hint, "a list of ints")


def _flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _apply(config: Any, pairs: dict[str, Any], source: str, typed: bool, prefix: str = "") -> Any:
    """``pairs`` (dotted keys below ``prefix``, which errors name in full: ``model.num_heads``) onto ``config``;
    ``typed``: the values come typed (TOML) and must have their settings' types, else they are ``--set`` text."""
    nested: dict[str, dict[str, Any]] = {}
    changes: dict[str, Any] = {}
    fields = {f.name: f for f in dataclasses.fields(config)}
    hints = typing.get_type_hints(type(config))
    for key, value in pairs.items():
        head, _, rest = key.partition(".")
        if head not in fields:
            raise ValueError(f"{source}: unknown setting {prefix + key!r}; known: {sorted(fields)}")
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            convert = _check_typed if typed else _parse_text
            changes[head] = convert(value, hints[head], f"{source}: {prefix + key}")
    for head, sub in nested.items():
        changes[head] = _apply(getattr(config, head), sub, source, typed, f"{prefix}{head}.")
    try:
        return replace(config, **changes)
    except ValueError as error:  # a __post_init__ check: say where the value came from and, in a section, which one
        # (the model configs' messages start with the field's name: "num_heads=3 must ..." -> "model.num_heads=3 ...")
        raise ValueError(f"{source}: {prefix}{error}") from error


def _check_typed(value: Any, hint: Any, where: str) -> Any:
    """A TOML value: it has its type already, so a wrong one is an error (``steps = true`` is not 1)."""
    if dataclasses.is_dataclass(hint):
        raise ValueError(f"{where} is a section; set its fields with dotted keys")
    if hint == AUTO_BOOL and value == "auto":  # TOML has no null: auto is spelled as --set spells it
        return None
    if not _fits(value, hint):
        expected = 'true, false or "auto"' if hint == AUTO_BOOL else _type_name(hint)
        raise ValueError(f"{where} must be {expected}, got {type(value).__name__} {value!r}")
    if typing.get_origin(hint) is tuple:
        return tuple(value)
    return float(value) if hint is float else value


def _parse_text(value: str, hint: Any, where: str) -> Any:
    """A ``--set`` value: text, parsed as the setting's type."""
    if dataclasses.is_dataclass(hint):
        raise ValueError(f"{where} is a section; set its fields with dotted keys")
    origin = typing.get_origin(hint)
    try:
        if hint == AUTO_BOOL and value.lower() == "auto":
            return None
        if hint in (bool, AUTO_BOOL):
            lowered = value.lower()
            if lowered not in ("true", "false", "1", "0"):
                choices = "true, false or auto" if hint == AUTO_BOOL else "true or false"
                raise ValueError(f"expected {choices}, got {value!r}")
            return lowered in ("true", "1")
        if origin is typing.Literal:
            if value not in typing.get_args(hint):
                raise ValueError(f"expected one of {typing.get_args(hint)}, got {value!r}")
            return value
        if hint in (int, float, str):
            return hint(value)
        if origin is tuple:
            return _int_tuple(value)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from error
    raise ValueError(f"{where}: unsupported setting type {hint}")


def _int_tuple(text: str) -> tuple[int, ...]:
    """``8,4``, ``(8, 4)`` or ``[8, 4]``; ``()`` is empty and ``(8,)`` Python's one-tuple. An entry that is empty
    (``8,,4``) or not an integer (``1.5``) is an error, not dropped or truncated."""
    inner = text[1:-1] if text[:1] + text[-1:] in ("()", "[]") else text
    parts = [part.strip() for part in inner.split(",")]
    if parts == [""]:
        return ()
    if len(parts) > 1 and parts[-1] == "":
        parts.pop()
    try:
        return tuple(int(part) for part in parts)
    except ValueError:
        raise ValueError(f"expected integers separated by commas, got {text!r}") from None
