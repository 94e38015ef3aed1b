"""The checkpoint options of a run: where and when it saves, what and how it loads.

Field names are Megatron's flag names (``--no-save-optim`` -> ``no_save_optim``), so a config
can stand in for those flags wherever checkpointing reads them
(:func:`megatron.checkpoint.load.checkpoint_args`). ``megatron/training/configs.py`` builds
it from the validated flags; the training loop replaces fields of a copy
(``dataclasses.replace``) to load another folder or save in another format, and leaves the
flags as they were parsed.
"""

from dataclasses import dataclass
from typing import Optional

from megatron.core.config import ConfigError

CHECKPOINT_FORMATS = ("torch", "torch_dist", "fsdp_dtensor", "torch_dcp")
CONVERT_FORMATS = ("torch", "torch_dist")   # --ckpt-convert-format: Megatron's choices


def torch_format_expert_tp_error(tp_size: int, expert_tp_size: int, what: str,
                                 remedy: str = "use --ckpt-format torch_dist") -> str:
    """The one-line refusal of the torch format for experts split over ``expert_tp_size``
    ranks under ``tp_size``: Megatron's torch format names each rank's folder
    ``mp_rank_{tp:02d}[_{pp:03d}]_{ep:03d}`` by the tensor and expert ranks alone, so with expert
    TP != TP the ranks of one folder would hold different expert pieces (two would write the
    same file) or no folder would hold some. ``what`` says which checkpoint, e.g.
    ``"--ckpt-format torch cannot save"``; ``remedy`` what to do instead."""
    return (f"{what} --expert-tensor-parallel-size {expert_tp_size} with "
            f"--tensor-model-parallel-size {tp_size}: its rank folders are named by tensor and "
            f"expert rank only, so expert pieces split otherwise than by TP have no file of "
            f"their own; {remedy}")


@dataclass
class CheckpointConfig:
    """Megatron's checkpointing flags (``None`` where Megatron's default is ``None``)."""

    save: Optional[str] = None                   # --save: folder to write checkpoints to
    save_interval: Optional[int] = None          # --save-interval (None: at the end only)
    no_save_optim: Optional[bool] = None         # --no-save-optim
    no_save_rng: Optional[bool] = None           # --no-save-rng
    load: Optional[str] = None                   # --load: folder to resume from
    no_load_optim: Optional[bool] = None         # --no-load-optim
    no_load_rng: Optional[bool] = None           # --no-load-rng
    finetune: bool = False                       # --finetune: weights only, iteration 0
    pretrained_checkpoint: Optional[str] = None  # --pretrained-checkpoint
    ckpt_step: Optional[int] = None              # --ckpt-step: load this iteration
    exit_on_missing_checkpoint: bool = False     # --exit-on-missing-checkpoint
    ckpt_format: str = "torch_dist"              # --ckpt-format, one of CHECKPOINT_FORMATS
    async_save: bool = False                     # --async-save
    ckpt_convert_format: Optional[str] = None    # --ckpt-convert-format
    ckpt_convert_save: Optional[str] = None      # --ckpt-convert-save
    dist_ckpt_strictness: str = "assume_ok_unexpected"  # --dist-ckpt-strictness
    non_persistent_save_interval: Optional[int] = None    # --non-persistent-save-interval
    non_persistent_ckpt_type: Optional[str] = None        # --non-persistent-ckpt-type
    non_persistent_global_ckpt_dir: Optional[str] = None  # --non-persistent-global-ckpt-dir
    non_persistent_local_ckpt_dir: Optional[str] = None   # --non-persistent-local-ckpt-dir
    replication: bool = False                    # --replication
    replication_jump: Optional[int] = None       # --replication-jump
    replication_factor: int = 2                  # --replication-factor
    verify_integrity: bool = False               # --verify-integrity: integrity.json per save
    override_ckpt_iteration: Optional[int] = None  # --override-ckpt-iteration
    load_main_params_from_ckpt: bool = False     # --load-main-params-from-ckpt

    def __post_init__(self):
        for flag, value, allowed in (
                ("--ckpt-format", self.ckpt_format, CHECKPOINT_FORMATS),
                ("--ckpt-convert-format", self.ckpt_convert_format, CONVERT_FORMATS)):
            if value is not None and value not in allowed:
                raise ConfigError(f"{flag} must be one of {', '.join(allowed)}, got {value!r}")
        if self.load_main_params_from_ckpt and not (self.no_load_optim or self.finetune):
            raise ConfigError("--load-main-params-from-ckpt takes the fp32 main parameters from "
                              "the checkpoint's weights when its optimizer state is not loaded: "
                              "add --no-load-optim (or --finetune)")
        if self.override_ckpt_iteration is not None and self.override_ckpt_iteration < 0:
            raise ConfigError(f"--override-ckpt-iteration must be >= 0, got "
                              f"{self.override_ckpt_iteration}")
        if (self.ckpt_convert_format is None) != (self.ckpt_convert_save is None):
            raise ConfigError("--ckpt-convert-format and --ckpt-convert-save go together (the "
                              "format to convert --load to, and the folder to write it in)")

    def check_expert_tensor_parallel(self, tp_size: int, expert_tp_size: Optional[int]) -> None:
        """Refuse writing the torch format (``--save`` with ``--ckpt-format torch``, or
        ``--ckpt-convert-format torch``) for a MoE model whose experts are split over
        ``expert_tp_size`` != ``tp_size`` ranks (None: TP's); see
        :func:`torch_format_expert_tp_error`."""
        if expert_tp_size is None or expert_tp_size == tp_size:
            return
        for flag, value, writes in (("--ckpt-format", self.ckpt_format, bool(self.save)),
                                    ("--ckpt-convert-format", self.ckpt_convert_format, True)):
            if writes and value == "torch":
                raise ConfigError(torch_format_expert_tp_error(
                    tp_size, expert_tp_size, f"{flag} torch cannot save"))
