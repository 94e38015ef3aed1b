"""A mixture-of-experts GPT end to end: Megatron-Core's MoE file (``mcore_dist_moe_ep1``)
loaded through ``pretrain_gpt.py --load`` gives its recorded logits; a ``torch_dist`` file
written here for that model has exactly Megatron-Core's keys, shapes and dtypes; a file saved at
TP 2 loads at TP 1.
"""

import os
import shutil

import pytest
import torch

from tests.functional.test_megatron_written import (LOGITS_ATOL, _logits_after_load,
                                                    fixture_dir, megatron_argv, reference)
from tests.multiprocess import run_on_ranks

MOE = "mcore_dist_moe_ep1"


def _argv(load, *extra):
    return megatron_argv(MOE) + ["--load", load, "--device", "cpu", *extra]


def test_load_of_megatrons_moe_file_gives_its_logits():
    logits, iteration, _ = run_on_ranks(_logits_after_load, 1, _argv(fixture_dir(MOE)))[0]
    assert iteration == 10
    torch.testing.assert_close(logits.float(), reference(MOE)["logits"], atol=LOGITS_ATOL,
                               rtol=0)
