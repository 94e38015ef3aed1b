"""The distillation term: forward KL(teacher || student) on the teacher's saved top-K support.

For each position, with the teacher's kept log-probabilities ``t_j`` at ids ``v_j`` (entries
with id ``-1``, dropped by the top-p cut, count for nothing) and the student's log-softmax
``s = log_softmax(z)`` over the whole (padded) vocabulary:

    KL = sum_j exp(t_j) (t_j - s[v_j])  +  exp(T) (T - S)

where the last term is a "rest" token holding the mass outside the kept entries on both sides:
``T = log(max(1 - sum_j exp(t_j), eps))``, ``S = log(max(1 - sum_j exp(s[v_j]), eps))``,
``eps = 1e-8``. No temperature. This is Megatron-LM's offline-distillation KL (its "ghost token").
"""

import torch

from megatron.training.distillation.logits_files import DROPPED_ID

REST_EPS = 1e-8


def topk_forward_kl(student_logits: torch.Tensor, teacher_logprobs: torch.Tensor,
                    teacher_ids: torch.Tensor) -> torch.Tensor:
    """Per-position KL ``[...]`` from student logits ``[..., V]`` (full vocabulary) and the
    teacher's ``[..., K]`` log-probabilities and ids; differentiable in the student logits."""
    student = torch.log_softmax(student_logits.float(), dim=-1)              # [..., V]
    kept = teacher_ids != DROPPED_ID                                         # [..., K]
    teacher = teacher_logprobs.float()
    picked = torch.gather(student, -1, teacher_ids.clamp(min=0))             # [..., K]
    teacher_p = torch.where(kept, teacher.exp(), torch.zeros_like(teacher))
    student_p = torch.where(kept, picked.exp(), torch.zeros_like(picked))
    rest_t = torch.log((1.0 - teacher_p.sum(-1)).clamp(min=REST_EPS))        # [...]
    rest_s = torch.log((1.0 - student_p.sum(-1)).clamp(min=REST_EPS))
    diff = torch.where(kept, teacher - picked, torch.zeros_like(teacher))
    return (teacher_p * diff).sum(-1) + rest_t.exp() * (rest_t - rest_s)
