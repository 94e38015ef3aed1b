"""The data flags of a run as one typed config: which files, how they split, how they load.

Field names are Megatron's flag names (``--data-cache-path`` -> ``data_cache_path``).
``megatron/training/configs.py`` builds it from the validated flags; the dataset providers of
the entry points turn it into their dataset's config
(:class:`~megatron.data.gpt_dataset.GPTDatasetConfig`,
:class:`~megatron.data.bert_dataset.BertDatasetConfig`), which check the values they use, and
the training loop hands the loader fields to
:func:`~megatron.data.samplers.build_pretraining_data_loader`, which checks those.
"""

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class FIMFlags:
    """The fill-in-the-middle flags (token fields are token texts;
    :func:`megatron.data.fim_dataset.resolve_fim_config` looks up their ids)."""

    fim_data: bool = False                       # --fim-data: GPT samples get FIM permutations
    fim_rate: float = 0.5                        # --fim-rate: chance a segment is permuted
    fim_spm_rate: float = 0.5                    # --fim-spm-rate: chance of SPM over PSM
    fim_split_sample: Optional[str] = None       # --fim-split-sample: fragment separator token
    fim_fragment_rate: Optional[float] = None    # --fim-fragment-rate: chance per fragment
    fim_no_prefix: Optional[str] = None          # --fim-no-prefix: text that skips FIM
    fim_prefix_token: str = "<fim_prefix>"       # --fim-prefix-token
    fim_middle_token: str = "<fim_middle>"       # --fim-middle-token
    fim_suffix_token: str = "<fim_suffix>"       # --fim-suffix-token
    fim_pad_token: str = "<fim_pad>"             # --fim-pad-token
    fim_eod_token: str = "<|endoftext|>"         # --fim-eod-token


@dataclass
class DataConfig:
    """Where the samples come from and how each data-parallel rank reads them."""

    seq_length: int                              # --seq-length
    micro_batch_size: int                        # --micro-batch-size: samples per loader batch
    seed: int = 1234                             # --seed: shuffles, masks, loader workers
    data_path: Optional[List[str]] = None        # --data-path: prefixes, optionally weighted
    train_data_path: Optional[List[str]] = None  # --train-data-path
    valid_data_path: Optional[List[str]] = None  # --valid-data-path
    test_data_path: Optional[List[str]] = None   # --test-data-path
    split: str = "969, 30, 1"                    # --split
    data_cache_path: Optional[str] = None        # --data-cache-path
    mock_data: bool = False                      # --mock-data
    reset_position_ids: bool = False             # --reset-position-ids
    reset_attention_mask: bool = False           # --reset-attention-mask
    eod_mask_loss: bool = False                  # --eod-mask-loss
    mask_prob: float = 0.15                      # --mask-prob (BERT)
    short_seq_prob: float = 0.1                  # --short-seq-prob (BERT)
    dataloader_type: str = "single"              # --dataloader-type single | cyclic | external
    num_workers: int = 2                         # --num-workers
    mmap_bin_files: bool = True                  # False with --no-mmap-bin-files
    object_storage_cache_path: Optional[str] = None  # --object-storage-cache-path (msc:// data)
    enable_msc: bool = False                     # --enable-msc: msc:// data prefixes allowed
    mid_level_dataset_surplus: float = 0.005     # --mid-level-dataset-surplus: blend headroom
    per_dataset_sequences_path: Optional[str] = None  # --per-dataset-sequences-path (GPT)
    dataloader_inter_document_masking: bool = False  # GPT samples carry document boundaries
    fim: FIMFlags = field(default_factory=FIMFlags)  # --fim-data and its flags (GPT only)
    multiple_validation_sets: bool = False       # --multiple-validation-sets: one set a prefix
