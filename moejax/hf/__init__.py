"""Hugging Face interop: transformers configs, state dicts and safetensors checkpoints -> moejax, and back.

The one-call path: `cfg, params = moejax.hf.load_layer("path/to/model", 3)` reads a checkpoint directory as
`save_pretrained` writes it (config.json + safetensors shards) and returns the MoE block of layer 3; no key
prefix to know. `load_layers` does every MoE layer (`{layer index: (cfg, params)}`), reading each shard once;
`save_layer` writes a block back (a transaction: `moejax.hf.transaction`).
Quantized checkpoints (config.json's `quantization_config` or ModelOpt's `hf_quant_config.json`) load with their
routed experts still quantized (`moejax.quantized`, docs/FORMATS.md) and save back in their own on-disk form.

Below it, the prefix-level API:

* `config_from_hf(hf_config, layer_idx=None)`: the `MoEConfig` of a transformers config (object or dict, also a
  multimodal one with a nested `text_config`), every spelling of its fields read.
* `is_moe_layer(hf_config, layer_idx)`, `moe_layer_indices(hf_config)`: which decoder layers hold an MoE block.
* `params_from_hf(state_dict, cfg)`: the tensors of one block (keys relative to the block) -> `MoEParams`, from
  the fused in-memory tensors of transformers 5 or the per-expert checkpoint keys; `params_to_hf` is its inverse.
* `load_safetensors(files, cfg, prefix)`: one block from a (sharded) safetensors checkpoint, given its prefix.

PEFT LoRA adapters: `load_adapter(adapter_dir, cfg, layer_idx)` -> `moejax.lora.LoRAParams` of one block (peft 0.21,
transformers 5 module names; docs/LORA.md), `save_adapter` writes one back (merged into an existing adapter).

Everything about a family (model types, config mapping, MoE layers, block prefixes per checkpoint class, key
names) is one record in `moejax.hf.families.FAMILY_RECORDS`; every key name and spelling is in `moejax.hf.keys`.
"""

from moejax.hf.adapter_load import load_adapter
from moejax.hf.adapter_save import save_adapter
from moejax.hf.checkpoint import load_layer, load_layers, load_safetensors
from moejax.hf.checkpoint_save import layer_tensors, save_layer
from moejax.hf.convert import params_from_hf, params_to_hf
from moejax.hf.families import (
    BY_MODEL_TYPE,
    FAMILY_RECORDS,
    Block,
    Family,
    config_from_hf,
    is_moe_layer,
    moe_layer_indices,
)

# HF model_type -> moejax family (docs/FAMILIES.md).
MODEL_TYPES: dict[str, str] = {model_type: family.name for model_type, family in BY_MODEL_TYPE.items()}

__all__ = [
    "FAMILY_RECORDS",
    "MODEL_TYPES",
    "Block",
    "Family",
    "config_from_hf",
    "is_moe_layer",
    "layer_tensors",
    "load_adapter",
    "load_layer",
    "load_layers",
    "load_safetensors",
    "moe_layer_indices",
    "params_from_hf",
    "params_to_hf",
    "save_adapter",
    "save_layer",
]
