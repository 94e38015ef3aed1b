"""DeepSeek-V3 folders with a multi-token prediction depth (``num_nextn_predict_layers`` 1, its
weights as ``model.layers.{num_hidden_layers}.*`` as DeepSeek releases them) through the
converter: the import keeps the main model's transformers logits and gives the MTP loss a
hand-written DeepSeek MTP forward (transformers' own decoder layer on the depth's weights)
computes; export, directly or through TP=2 Megatron checkpoints in both formats, gives every
tensor back bit for bit."""

import json
import os

import pytest
import torch

from megatron.convert.hf import load_hf, save_hf
from megatron.convert.schema import ConversionError
from tests.unit.test_convert_hf_deepseek_v3 import (CONFIG, SEQ, VOCAB, _safetensors,
                                                    _state_dict, hf_folder, our_model)

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402

LAYERS = CONFIG["num_hidden_layers"]
P = f"model.layers.{LAYERS}."


def mtp_folder(tmp_path, name="hf"):
    """``hf_folder`` plus one MTP depth: a random MoE decoder layer, norms and projection
    under DeepSeek's names, and the copies of the embedding and the output layer."""
    from safetensors.torch import save_file

    folder, theirs = hf_folder(tmp_path, name)
    tensors = _safetensors(folder)
    torch.manual_seed(5)
    donor = DeepseekV3ForCausalLM(DeepseekV3Config(**dict(
        CONFIG, q_lora_rank=12, num_hidden_layers=LAYERS + 1))).eval()
    donor.save_pretrained(str(tmp_path / f"{name}_donor"))
    for key, value in _safetensors(str(tmp_path / f"{name}_donor")).items():
        if key.startswith(P):
            noise = (torch.rand_like(value) + 0.5 if "norm" in key
                     else torch.randn_like(value) * 0.3)
            tensors[key] = noise.to(value.dtype) if value.is_floating_point() else value
    h = CONFIG["hidden_size"]
    for key in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
        tensors[P + key] = torch.rand(h) + 0.5
    tensors[P + "eh_proj.weight"] = torch.randn(h, 2 * h) * 0.2
    tensors[P + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[P + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["num_nextn_predict_layers"] = 1
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder, theirs


def _our_state_dict(pieces):
    sd = _state_dict([p for p in pieces if p.kind != "mtp"])
    for piece in pieces:
        if piece.kind == "mtp":
            sd.update({f"mtp.layers.{piece.index}.{name}": tensor
                       for name, tensor in piece.tensors.items()})
    return sd


def _reference_mtp_loss(folder, theirs, tensors, ids, labels):
    """DeepSeek's MTP depth 0 by hand, in float32 (transformers' grouped expert matmul has no
    float64): the main model's final hidden state and the
    embedding of the tokens one place ahead, each normed, concatenated (embedding first),
    projected, one decoder layer, the shared head's norm, the output layer; cross entropy
    against the labels one place ahead, the last place left out."""
    model = theirs
    config = model.config
    # The depth's decoder layer, loaded by transformers itself as one more layer.
    longer = DeepseekV3ForCausalLM.from_pretrained(folder, num_hidden_layers=LAYERS + 1,
                                                   attn_implementation="eager")
    layer = longer.model.layers[LAYERS].eval()

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * w

    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state                         # [b, s, h]
        shifted = torch.roll(ids, -1, dims=1)
        embedded = model.model.embed_tokens(shifted)
        both = torch.cat([rms(embedded, tensors[P + "enorm.weight"]),
                          rms(hidden, tensors[P + "hnorm.weight"])], dim=-1)
        x = both @ tensors[P + "eh_proj.weight"].t()
        positions = torch.arange(SEQ).expand(ids.size(0), SEQ)
        rotary = model.model.rotary_emb(x, positions)
        mask = torch.full((SEQ, SEQ), float("-inf"), dtype=torch.float32).triu(1)[None, None]
        out = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=rotary)
        out = out[0] if isinstance(out, tuple) else out
        logits = model.lm_head(rms(out, tensors[P + "shared_head.norm.weight"]))
        target = torch.roll(labels, -1, dims=1)
        losses = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB),
                                                   target[:, :-1].reshape(-1))
    return float(losses)


def _our_mtp_loss(pieces, ids, labels):
    ours = our_model(pieces[0].meta, mtp_num_layers=1)
    missing, unexpected = ours.load_state_dict(_our_state_dict(pieces), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), missing
    ours.train()
    ours(ids, torch.arange(SEQ).expand(ids.size(0), SEQ), None, labels=labels)
    return float(ours.mtp_tracker.values[0]), ours


def test_imported_mtp_depth_gives_deepseeks_mtp_loss_and_transformers_logits(tmp_path):
    """Tolerance: two fp32 forwards whose reductions differ in order (1e-5 relative)."""
    folder, theirs = mtp_folder(tmp_path)
    pieces = list(load_hf(folder))
    assert pieces[0].meta.mtp_num_layers == 1
    assert [p.kind for p in pieces][-1] == "mtp"
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    got, ours = _our_mtp_loss(pieces, ids, labels)
    with torch.no_grad():
        ours.eval()
        logits = ours(ids, torch.arange(SEQ).expand(2, SEQ), None)
        want_logits = theirs(ids).logits
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    want = _reference_mtp_loss(folder, theirs, _safetensors(folder), ids, labels)
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)


@pytest.mark.parametrize("fmt, pp", [(None, None), ("torch", 3), ("torch_dist", 3),
                                     ("torch_dist", 1)])
def test_mtp_folder_comes_back_bit_for_bit_with_the_same_mtp_loss(tmp_path, fmt, pp):
    from tools.checkpoint.convert import main

    folder, _ = mtp_folder(tmp_path)
    back = str(tmp_path / "back")
    if fmt is None:
        save_hf(load_hf(folder), back, allow_no_tokenizer=True)
    else:
        tp2 = str(tmp_path / "tp2")
        common = ["--model-type", "GPT"]
        assert main(common + ["--loader", "hf", "--load-dir", folder, "--save-dir", tp2,
                              "--target-tensor-parallel-size", "2", "--target-ckpt-format",
                              fmt, "--target-pipeline-parallel-size", str(pp)]) == 0
        assert main(common + ["--saver", "hf", "--load-dir", tp2, "--save-dir", back,
                              "--allow-no-tokenizer", "--true-vocab-size", str(VOCAB)]) == 0
    want, got = _safetensors(folder), _safetensors(back)
    assert P + "eh_proj.weight" in got and P + "shared_head.head.weight" in got
    assert sorted(got) == sorted(want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    with open(os.path.join(back, "config.json")) as f:
        assert json.load(f)["num_nextn_predict_layers"] == 1
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    before = _our_mtp_loss(list(load_hf(folder)), ids, labels)[0]
    after = _our_mtp_loss(list(load_hf(back)), ids, labels)[0]
    assert before == after


def test_an_mtp_head_copy_that_differs_from_the_output_layer_is_refused_by_key(tmp_path):
    from safetensors.torch import save_file

    folder, _ = mtp_folder(tmp_path)
    tensors = _safetensors(folder)
    tensors[P + "shared_head.head.weight"] += 1.0
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConversionError, match="shared_head.head.weight differs"):
        list(load_hf(folder))
