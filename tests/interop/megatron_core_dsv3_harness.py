"""Megatron-Core's side of the DeepSeek-V3-style interoperability tests: run, like
``megatron_core_harness.py``, in the virtual environment with the ``megatron-core`` release from
PyPI, under ``torchrun`` (one process), on the CPU with gloo.

    torchrun --nproc_per_node 1 megatron_core_dsv3_harness.py save ARCH_JSON INPUTS SAVE_ROOT OUT
    torchrun --nproc_per_node 1 megatron_core_dsv3_harness.py load ARCH_JSON INPUTS CKPT_DIR OUT

The model (ARCH_JSON, written by the test): a GPT with RMSNorm, SwiGLU, rope, untied output,
no biases; a dense first layer and MoE layers after it (``moe_layer_freq``) with DeepSeek-V3's
router (sigmoid scores plus a per-expert bias that training moves, group-limited top-k, scaled
probabilities), a shared expert, and one multi-token prediction layer (Megatron-Core's MTP block
spec); optionally multi-latent attention (``"mla": true``). Local layer spec throughout.

``save``: initialise it, train ``ARCH["train_steps"]`` SGD steps on the tokens of INPUTS (a
dict with ``tokens``, ``position_ids``, ``labels``), updating the expert biases after each as
Megatron-Core's gradient finalisation does, then save torch_dist into
SAVE_ROOT/iter_<steps> with a tracker file, and write to OUT what it computes on INPUTS
afterwards. ``load``: build the model, load CKPT_DIR, write the same to OUT. What it writes:
``logits`` [b, s, V] (main head, eval mode), ``mtp_loss`` [depths] (the per-depth losses Megatron
logs, from a training-mode forward), ``expert_bias`` {router module name: tensor}, ``sharded``
(the keys and global shapes of the model's own ``sharded_state_dict``).

Megatron-Core 0.16.1 on a machine without TransformerEngine needs two names defined
(:func:`_no_transformer_engine_names`), and its MLA a core attention that accepts MLA's
channel counts (:class:`StandInCoreAttention`); in ``load`` mode its MLA layers take the
TransformerEngine spec's norm names (``TE_MLA_NORM_NAMES``).
"""

import argparse
import contextlib
import json
import os
import pathlib
import sys

import torch
import torch.distributed as dist


def _config(arch: dict):
    from megatron.core.transformer.transformer_config import (MLATransformerConfig,
                                                              TransformerConfig)

    kwargs = dict(
        num_layers=arch["num_layers"], hidden_size=arch["hidden_size"],
        num_attention_heads=arch["num_attention_heads"],
        ffn_hidden_size=arch["ffn_hidden_size"], kv_channels=arch["kv_channels"],
        tensor_model_parallel_size=1, use_cpu_initialization=True, init_method_std=0.02,
        hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=1e-5,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, bias_activation_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False,
        num_moe_experts=arch["num_experts"], moe_ffn_hidden_size=arch["moe_ffn_hidden_size"],
        moe_layer_freq=arch["moe_layer_freq"], moe_router_topk=arch["topk"],
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=arch["bias_update_rate"],
        moe_router_num_groups=arch["num_groups"], moe_router_group_topk=arch["group_topk"],
        moe_router_topk_scaling_factor=arch["topk_scaling_factor"],
        moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-3,
        moe_shared_expert_intermediate_size=arch["shared_expert_size"],
        moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
        mtp_num_layers=1, mtp_loss_scaling_factor=arch["mtp_loss_scaling_factor"])
    if not arch.get("mla"):
        return TransformerConfig(**kwargs)
    return MLATransformerConfig(
        **kwargs, multi_latent_attention=True, q_lora_rank=arch["q_lora_rank"],
        kv_lora_rank=arch["kv_lora_rank"], qk_head_dim=arch["qk_head_dim"],
        qk_pos_emb_head_dim=arch["qk_pos_emb_head_dim"], v_head_dim=arch["v_head_dim"],
        qk_layernorm=True, rope_type="rope", rotary_base=10000)


class StandInCoreAttention(torch.nn.Module):
    """Causal softmax attention for multi-latent attention's local spec. megatron-core 0.16.1
    cannot build that spec: its ``MLASelfAttention`` passes ``k_channels`` and ``v_channels``
    to the core attention, which only TransformerEngine's accepts (the local one fails with
    ``TypeError: DotProductAttention.__init__() got an unexpected keyword argument
    'k_channels'``). This stands in for it: query and key ``[s, b, n, dq]``, value
    ``[s, b, n, dv]`` -> ``[s, b, n dv]``, scaled by the ``softmax_scale`` MLA hands it, in
    plain torch; it holds no parameters, so the model's state is Megatron-Core's own."""

    def __init__(self, softmax_scale: float, **_):
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask=None, **_):
        s = query.size(0)
        scores = torch.einsum("sbnd,tbnd->bnst", query, key) * self.softmax_scale
        future = torch.ones(s, s, dtype=torch.bool, device=query.device).triu(1)
        probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        out = torch.einsum("bnst,tbnd->sbnd", probs, value)                  # [s, b, n, dv]
        return out.reshape(s, out.size(1), -1)


# The names Megatron-Core's TransformerEngine MLA spec gives the norms its local spec keeps
# as modules (its fused LayerNorm-linear modules hold them), the names this project writes.
TE_MLA_NORM_NAMES = {"self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
                     "self_attention.kv_layernorm.":
                         "self_attention.linear_kv_up_proj.layer_norm_",
                     "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def _model(arch: dict, te_names: bool = False):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec,
                                                          get_gpt_mtp_block_spec)

    config = _config(arch)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                       normalization="RMSNorm")
    if arch.get("mla"):
        for spec in block.layer_specs:
            spec.submodules.self_attention.submodules.core_attention = StandInCoreAttention
            if te_names:
                spec.submodules.sharded_state_dict_keys_map = dict(TE_MLA_NORM_NAMES)
    mtp = get_gpt_mtp_block_spec(config, block, use_transformer_engine=False)
    return GPTModel(config, block, vocab_size=arch["padded_vocab_size"],
                    max_sequence_length=arch["seq_length"], position_embedding_type="rope",
                    share_embeddings_and_output_weights=False, parallel_output=True,
                    mtp_block_spec=mtp)


def _routers(model):
    return [(name, module) for name, module in model.named_modules()
            if getattr(module, "expert_bias", None) is not None]


def _train(model, ref: dict, steps: int, lr: float) -> None:
    """Plain SGD on the mean token loss (the MTP and auxiliary losses reach the gradients
    through their autoscalers), then the expert-bias update of each global batch."""
    from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias

    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(ref["tokens"], ref["position_ids"], None, labels=ref["labels"])
        loss.float().mean().backward()
        optimizer.step()
        _update_router_expert_bias([model], model.config)
        for _, router in _routers(model):
            router.local_tokens_per_expert.zero_()


def _outputs(model, ref: dict) -> dict:
    """Main-head logits (eval), per-depth MTP losses (a training-mode forward without a step)
    and the routers' expert biases."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    heads = []  # copies: the cross entropy that follows turns the logits into softmax in place
    hook = model.output_layer.register_forward_hook(lambda m, i, o: heads.append(o[0].clone()))
    model.eval()
    with torch.no_grad():
        model(ref["tokens"], ref["position_ids"], None, labels=ref["labels"])
        logits = heads[-1].transpose(0, 1).float()  # the main head runs after the MTP heads
        MTPLossLoggingHelper.tracker.pop("values", None)  # what training logged before
        model.train()
        model(ref["tokens"], ref["position_ids"], None, labels=ref["labels"])
    hook.remove()
    mtp_loss = MTPLossLoggingHelper.tracker["values"].clone()
    biases = {name: router.expert_bias.detach().clone() for name, router in _routers(model)}
    return {"logits": logits, "mtp_loss": mtp_loss, "expert_bias": biases,
            "sharded": _sharded_keys(model)}


def _sharded_keys(model) -> dict:
    """The model's own ``sharded_state_dict``: ``{tensor key: global shape}`` and, under
    ``"objects"``, the byte entries' keys as the file stores them."""
    from megatron.core.dist_checkpointing.mapping import (ShardedObject, ShardedTensor,
                                                          apply_factories)
    from megatron.core.dist_checkpointing.utils import extract_sharded_base

    found, objects = {}, set()
    state = model.sharded_state_dict()
    apply_factories(state)  # SwiGLU's fc1: the gate and value halves of one global tensor
    sharded, _ = extract_sharded_base(state)
    for item in _leaves(sharded):
        if isinstance(item, ShardedTensor):
            found[item.key] = tuple(item.global_shape)
        elif isinstance(item, ShardedObject):
            objects.add(item.unique_key)
    found["objects"] = sorted(objects)
    return found


def _leaves(tree):
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _leaves(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _leaves(value)
    else:
        yield tree


def _args_namespace(arch: dict) -> argparse.Namespace:
    """The model flags a Megatron-LM run stores in its checkpoint's ``args``."""
    return argparse.Namespace(
        num_layers=arch["num_layers"], hidden_size=arch["hidden_size"],
        num_attention_heads=arch["num_attention_heads"], ffn_hidden_size=arch["ffn_hidden_size"],
        kv_channels=arch["kv_channels"], seq_length=arch["seq_length"],
        max_position_embeddings=arch["seq_length"], padded_vocab_size=arch["padded_vocab_size"],
        vocab_size=arch["vocab_size"], tokenizer_type="NullTokenizer",
        position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
        add_bias_linear=False, untie_embeddings_and_output_weights=True,
        num_experts=arch["num_experts"], moe_layer_freq=arch["moe_layer_freq"],
        mtp_num_layers=1, multi_latent_attention=bool(arch.get("mla")),
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, norm_epsilon=1e-5,
        ckpt_format="torch_dist")


def _save(model, arch: dict, save_root: str, iteration: int) -> None:
    from megatron.core import dist_checkpointing

    iter_dir = os.path.join(save_root, f"iter_{iteration:07d}")
    os.makedirs(iter_dir, exist_ok=True)
    dist_checkpointing.save({"model": model.sharded_state_dict(), "args": _args_namespace(arch),
                             "iteration": iteration, "checkpoint_version": 3.0}, iter_dir)
    with open(os.path.join(save_root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))


def _load(model, ckpt: str) -> None:
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, pathlib.Path(ckpt))
    missing, unexpected = model.load_state_dict(state["model"], strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise SystemExit(f"{ckpt}: missing {missing}, unexpected {unexpected}")


def _no_transformer_engine_names() -> None:
    """megatron-core 0.16.1's router GEMM tests ``te_general_gemm is not None``, but when
    TransformerEngine is missing its ``moe_utils`` never defines that name (the import that
    would fails first), so the router raises ``NameError: name 'te_general_gemm' is not
    defined`` on the CPU. Defining it as None selects the router's own torch GEMM path."""
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    # Likewise its multi-latent attention believes TransformerEngine present (the import of
    # Megatron-Core's TransformerEngine extension succeeds, its classes stubbed by a
    # MagicMock), and ``isinstance(self.linear_proj, TELinear)`` raises "isinstance() arg 2
    # must be a type, a tuple of types, or a union".
    if not isinstance(multi_latent_attention.TELinear, type):
        multi_latent_attention.HAVE_TE = False


def main() -> None:
    mode, arch_file, inputs, ckpt, out = sys.argv[1:6]
    dist.init_process_group("gloo")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron_core_harness import _host_only  # beside this file

    _host_only()
    _no_transformer_engine_names()
    parallel_state.initialize_model_parallel(1, 1)
    # dropout 0: no random numbers are drawn in the forward, so no CUDA RNG is needed
    mcore_random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    with open(arch_file) as f:
        arch = json.load(f)
    torch.manual_seed(arch["seed"])
    # Loading an MLA file written here: the local spec under the TransformerEngine spec's
    # norm names (the local spec itself cannot read them, see TE_MLA_NORM_NAMES).
    model = _model(arch, te_names=mode == "load")
    ref = torch.load(inputs, weights_only=True)
    if mode == "save":
        _train(model, ref, arch["train_steps"], arch["lr"])
        _save(model, arch, ckpt, arch["train_steps"])
    else:
        _load(model, ckpt)
    torch.save(_outputs(model, ref), out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
