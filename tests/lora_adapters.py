"""Random LoRA adapters in PEFT's format for a saved base model, made by `peft` itself
(the reference the LoRA tests compare with), and the PEFT model that serves one."""

from __future__ import annotations

import torch


def save_random_adapter(
    model_dir,
    path,
    *,
    rank: int,
    alpha: float,
    targets: list[str],
    seed: int,
    rslora: bool = False,
    b_scale: float = 4.0,
):
    """A PEFT adapter of random A and B (B scaled by `b_scale`, so that the delta moves the
    logits) on `model_dir`'s model, saved to `path`; returns `path`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, use_rslora=rslora, lora_dropout=0.0
    )
    torch.manual_seed(seed)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(b_scale)
    model.save_pretrained(str(path))
    return path


def peft_reference(model_dir, adapter_path):
    """transformers' model on `model_dir` with PEFT's adapter at `adapter_path` (fp32,
    eval, no EOS: it generates every step)."""
    from peft import PeftModel
    from runner_steps import reference_model

    return PeftModel.from_pretrained(reference_model(model_dir), str(adapter_path)).eval()
