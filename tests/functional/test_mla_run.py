"""Multi-latent attention end to end: a TP=2 run with sequence parallelism and DeepSeek's
flags trains (its losses equal a one-process run's), saves ``torch_dist`` under Megatron-Core's
MLA keys, and resumes from it bit for bit; ``--use-checkpoint-args`` takes the MLA sizes."""

import os

import pytest
import torch

from megatron.checkpoint.dist import DistCheckpointReader
from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.functional.test_convert_dist import _iter_dir
from tests.multiprocess import run_on_ranks

MLA = ["--multi-latent-attention", "--q-lora-rank", "12", "--kv-lora-rank", "16",
       "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6",
       "--qk-layernorm", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
       "--position-embedding-type", "rope", "--rotary-scaling-factor", "2",
       "--yarn-original-max-position-embeddings", "8", "--mscale", "1.0",
       "--mscale-all-dim", "1.0", "--untie-embeddings-and-output-weights"]


def _run(corpus, tp, iters, extra=()):
    flags = gpt_flags(corpus, iters, tp=tp, dropout=0.0, extra=MLA + list(extra))
    return run_on_ranks(run_pretrain, tp, flags)[-1]


@pytest.mark.slow
def test_mla_tp2_sp_trains_saves_torch_dist_and_resumes(tmp_path):
    corpus = write_counting_corpus(str(tmp_path / "count_document"))
    one = _run(corpus, 1, 4)
    save = str(tmp_path / "ckpt")
    dist_flags = ["--sequence-parallel", "--ckpt-format", "torch_dist", "--save", save,
                  "--save-interval", "2"]
    two = _run(corpus, 2, 4, dist_flags)
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]),
                               rtol=1e-5, atol=1e-5)
    reader = DistCheckpointReader(_iter_dir(save))
    attn = "decoder.layers.self_attention."
    assert reader.shape(attn + "linear_q_up_proj.weight") == (2, 4 * 12, 12)
    assert reader.shape(attn + "linear_kv_up_proj.layer_norm_weight") == (2, 16)
    assert reader.shape(attn + "linear_kv_down_proj.weight") == (2, 16 + 4, 32)
    assert "decoder.layers.input_layernorm.weight" in reader
    assert not any("linear_qkv" in k for k in reader.tensor_keys())
    # resume from iteration 4's checkpoint? the run saved at 2 and 4: restart from 2
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")
    resumed = _run(corpus, 2, 4, dist_flags[:-4] + ["--load", save])
    assert resumed["losses"][-2:] == two["losses"][-2:]

    from megatron.checkpoint.load import load_args_from_checkpoint
    from megatron.training.arguments import parse_args
    args = load_args_from_checkpoint(parse_args(argv=["--load", save, "--use-checkpoint-args"]))
    assert (args.q_lora_rank, args.kv_lora_rank, args.qk_head_dim, args.qk_pos_emb_head_dim,
            args.v_head_dim) == (12, 16, 8, 4, 6)


@pytest.mark.slow
def test_fused_down_projection_run_saves_unfused_keys_and_an_unfused_run_resumes(tmp_path):
    """--mla-down-proj-fusion at TP 2 with SP and the distributed optimizer trains the losses
    of the unfused run (same seed: same weights), writes Megatron-Core's unfused down-projection
    keys (weights and Adam moments), and an unfused run resumed from its iteration-2 checkpoint
    repeats its last losses; the reverse resume (fused from an unfused file) too."""
    corpus = write_counting_corpus(str(tmp_path / "count_document"))
    fuse = ["--mla-down-proj-fusion"]
    common = ["--sequence-parallel", "--ckpt-format", "torch_dist", "--save-interval", "2",
              "--use-distributed-optimizer"]
    runs = {}
    for name, extra in (("fused", fuse), ("unfused", [])):
        save = str(tmp_path / name)
        runs[name] = (save, _run(corpus, 2, 4, common + ["--save", save] + extra))
    fused_losses = torch.tensor(runs["fused"][1]["losses"])
    torch.testing.assert_close(fused_losses, torch.tensor(runs["unfused"][1]["losses"]),
                               rtol=1e-6, atol=1e-6)
    reader = DistCheckpointReader(_iter_dir(runs["fused"][0]))
    attn = "decoder.layers.self_attention."
    assert reader.shape(attn + "linear_q_down_proj.weight") == (2, 12, 32)
    assert reader.shape(attn + "linear_kv_down_proj.weight") == (2, 16 + 4, 32)
    assert not any("linear_qkv_down_proj" in k for k in reader.tensor_keys())
    assert any(k.endswith("exp_avg." + attn + "linear_q_down_proj.weight")
               for k in reader.tensor_keys())
    for saved, resume_extra, straight in (("fused", [], "fused"), ("unfused", fuse, "unfused")):
        save = runs[saved][0]
        with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("2")
        resumed = _run(corpus, 2, 4, common[:-3] + common[-1:] + ["--load", save]
                       + resume_extra)
        torch.testing.assert_close(torch.tensor(resumed["losses"][-2:]),
                                   torch.tensor(runs[straight][1]["losses"][-2:]),
                                   rtol=1e-6, atol=1e-6)
