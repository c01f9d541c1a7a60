"""Group-relative advantages (GRPO, Dr. GRPO)."""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, method: str = "grpo", eps: float = 1e-6) -> torch.Tensor:
    """rewards [num_prompts * group_size] (the samples of one prompt adjacent) -> advantages of
    the same shape. grpo: (R - mean) / (std + eps), std with Bessel's correction (a group of
    one has std 0); dr_grpo: R - mean. A group whose rewards are all equal gets 0."""
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries, "
                         f"got shape {list(rewards.shape)}")
    r = rewards.double().view(-1, group_size)
    centred = r - r.mean(1, keepdim=True)
    if method == "dr_grpo":
        out = centred
    elif method == "grpo":
        std = r.std(1, keepdim=True) if group_size > 1 else torch.zeros_like(centred[:, :1])
        out = centred / (std + eps)
    else:
        raise ValueError(f"unknown advantage method {method!r}; known: grpo, dr_grpo")
    return out.view(-1).to(rewards.dtype if rewards.is_floating_point() else torch.float32)
