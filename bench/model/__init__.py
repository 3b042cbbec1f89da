"""The models commbench trains: GPT-2 and Llama decoders behind one interface.

    commbench run configs/ddp-tiny.yaml --set model.arch=llama
    pytest tests/test_model.py

- bench/model/common.py: `CausalLM` (`as_layers()` = [embedding, blocks..., head] whose
  sequential application is `forward`; init as a function of (seed, parameter name);
  `materialize` of a meta-device part), `TransformerBlock`, `Embedding`, `Head`,
  `RMSNorm`, `lm_loss`, `autocast_context`.
- bench/model/gpt.py: `GPT`, `GPTConfig` (`model.arch: gpt2`).
- bench/model/llama.py: `Llama`, `LlamaConfig` (`model.arch: llama`).
- bench/model/presets.py: `PRESETS` (gpt2), `LLAMA_PRESETS`, `model_config`,
  `gpt_config`, `config_of`.

`build_model(config)` builds the architecture a config names; under
`with torch.device("meta"):` it allocates nothing (a pipeline stage or an FSDP shard then
materialises its own part). `config_from_dict` reads the `gpt_config` a checkpoint holds.
"""

from __future__ import annotations

from bench.model.common import (
    PRECISIONS,
    CausalLM,
    DecoderConfig,
    Embedding,
    Head,
    RMSNorm,
    TransformerBlock,
    autocast_context,
    hidden_matrices,
    lm_loss,
)
from bench.model.gpt import GPT, MLP, Block, CausalSelfAttention, GPTConfig
from bench.model.llama import Llama, LlamaBlock, LlamaConfig
from bench.model.presets import (
    ARCH_PRESETS,
    ARCHS,
    LLAMA_PRESETS,
    PRESETS,
    VOCAB_MULTIPLE,
    ModelShape,
    config_of,
    gpt_config,
    model_config,
)

MODELS: dict[str, tuple[type[DecoderConfig], type[CausalLM]]] = {
    "gpt2": (GPTConfig, GPT),
    "llama": (LlamaConfig, Llama),
}


def build_model(config: DecoderConfig) -> CausalLM:
    """The model `config` describes (its `arch` picks the class)."""
    return MODELS[config.arch][1](config)


def config_from_dict(data: dict) -> DecoderConfig:
    """A model config from its `dataclasses.asdict` (checkpoints written before Llama
    existed have no `arch`: GPT-2)."""
    arch = data.get("arch", "gpt2")
    if arch not in MODELS:
        raise ValueError(f"model arch {arch!r} is not one of {list(MODELS)}")
    return MODELS[arch][0](**{**data, "arch": arch})


__all__ = [
    "ARCHS", "ARCH_PRESETS", "GPT", "LLAMA_PRESETS", "MLP", "MODELS", "PRECISIONS", "PRESETS",
    "VOCAB_MULTIPLE", "Block", "CausalLM", "CausalSelfAttention", "DecoderConfig",
    "Embedding", "GPTConfig", "Head", "Llama", "LlamaBlock", "LlamaConfig", "ModelShape",
    "RMSNorm", "TransformerBlock", "autocast_context", "build_model", "config_from_dict",
    "config_of", "gpt_config", "hidden_matrices", "lm_loss", "model_config",
]
