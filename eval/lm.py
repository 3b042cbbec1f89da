"""lm-eval adapter: a run's evaluation model served to lm-evaluation-harness.

`commbench eval RUN_DIR` builds it with `CommbenchLM.from_run(RUN_DIR)`; tests build it
from a model in memory with `CommbenchLM(model, tokenizer)`.

Every scoring request reduces to "score tokens[first:] of a token list": the scored
tokens are cut into chunks of at most `seq_len`, and each chunk is fed with as much
left context as the window holds (so a context longer than the window is truncated from
the left, and a continuation longer than the window is still scored token by token).
Chunks of all requests are sorted by length and batched with right padding, which a
causal model cannot see. `loglikelihood_rolling` scores a text after the end-of-text
token, as lm-eval's perplexity tasks expect. `generate_until` decodes greedily.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from tqdm import tqdm

from bench.data.tokenizers import get_tokenizer
from bench.model import CausalLM, build_model, config_from_dict
from bench.run.checkpoint import load_payload
from bench.run.records import RunDir

logger = logging.getLogger(__name__)

CHECKPOINT = RunDir.FINAL_CHECKPOINT
"""The evaluation model inside a run directory (written by bench/run/checkpoint.py)."""

# (input ids, target ids, number of trailing targets that are scored)
Window = tuple[list[int], list[int], int]


def checkpoint_path(run_dir: str | Path) -> Path:
    """The run's evaluation checkpoint; ValueError if the directory or the file is missing."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run directory {str(run_dir)!r} does not exist")
    path = RunDir(run_dir).final_checkpoint
    if not path.is_file():
        raise ValueError(
            f"run directory {str(run_dir)!r} has no evaluation model {CHECKPOINT}: the run "
            "has not finished, or it ran with checkpoint.final=false"
        )
    return path


def load_checkpoint(path: str | Path, device: str = "cpu") -> tuple[CausalLM, object, dict]:
    """(model in eval mode on `device`, its tokenizer, the checkpoint's other fields)."""
    try:
        payload = load_payload(path, map_location="cpu")  # tensors and plain data only
    except pickle.UnpicklingError:
        raise ValueError(f"checkpoint {str(path)!r} holds objects other than tensors and "
                         "plain data (not loaded: loading them could run code); it was not "
                         "written by commbench") from None
    except Exception as err:
        raise ValueError(f"cannot read checkpoint {str(path)!r}: {err}") from err
    if not isinstance(payload, dict):
        raise ValueError(f"checkpoint {str(path)!r} is not a commbench evaluation model")
    missing = [k for k in ("model", "gpt_config", "tokenizer") if k not in payload]
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} lacks {missing}")
    # A state dict saved from a torch.compile'd model prefixes every key.
    state = {k.removeprefix("_orig_mod."): v for k, v in payload["model"].items()}
    model = _meta_model(path, payload["gpt_config"], state)  # the values replace the init
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gave the tied head its own tensor
    model.load_state_dict(state)
    info = {k: v for k, v in payload.items() if k != "model"}
    return model.to(device).eval(), get_tokenizer(payload["tokenizer"]), info


def _meta_model(path, model_config, state: dict) -> CausalLM:
    """The checkpoint's model, built on the meta device, once its weights' names and
    shapes are the saved ones: a config that does not describe them (a crafted or damaged
    file) fails here, before a model of its size is allocated."""
    try:
        with torch.device("meta"):
            model = build_model(config_from_dict(model_config))
    except (TypeError, ValueError) as err:
        raise ValueError(f"checkpoint {str(path)!r}: gpt_config {model_config!r} does not "
                         f"describe a model ({err})") from None
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    saved = {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
    if saved != expected or len(saved) != len(state):
        raise ValueError(f"checkpoint {str(path)!r}: its weights do not match its gpt_config "
                         f"{model_config!r} (names or shapes differ)")
    return model


def score_windows(tokens: list[int], first: int, max_len: int) -> Iterator[Window]:
    """Windows that score tokens[first:], each token seeing at most `max_len` tokens before
    it. Chunk [a, b) is fed tokens[s : b-1] with s as small as the window allows."""
    assert first >= 1, "the first scored token needs at least one token of context"
    a = first
    while a < len(tokens):
        b = min(a + max_len, len(tokens))
        s = max(0, b - 1 - max_len)
        yield tokens[s : b - 1], tokens[s + 1 : b], b - a
        a = b


class CommbenchLM(TemplateLM):
    """A commbench model (GPT-2 or Llama) and tokenizer as an lm-eval model (causal, fp32,
    greedy)."""

    def __init__(
        self,
        model: CausalLM,
        tokenizer,
        batch_size: int = 16,
        device: str = "cpu",
        max_gen_toks: int = 256,
        info: dict | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"eval.batch_size must be >= 1, got {batch_size}")
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self._device = torch.device(device)
        self.max_gen_toks = max_gen_toks
        self.info = info or {}

    @classmethod
    def from_run(cls, run_dir: str | Path, batch_size: int = 16, device: str = "cpu"):
        model, tokenizer, info = load_checkpoint(checkpoint_path(run_dir), device)
        return cls(model, tokenizer, batch_size=batch_size, device=device, info=info)

    # ------------------------------------------------------------------ lm-eval hooks
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eot_token

    @property
    def max_length(self) -> int:
        return self.model.cfg.seq_len

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs):
        return self.tokenizer.encode(string)

    def get_model_info(self) -> dict:
        return {
            "commbench_step": self.info.get("step"),
            "commbench_tokenizer": self.tokenizer.name,
            "commbench_num_params": self.model.num_params(),
        }

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        windows, owners = [], []
        for k, (_, context_enc, continuation_enc) in enumerate(requests):
            for window in score_windows(
                context_enc + continuation_enc, len(context_enc), self.max_length
            ):
                windows.append(window)
                owners.append(k)
        totals = [[0.0, True] for _ in requests]
        for k, (logprob, greedy) in zip(owners, self._score(windows, disable_tqdm), strict=True):
            totals[k][0] += logprob
            totals[k][1] &= greedy
        results = [(logprob, greedy) for logprob, greedy in totals]
        for (key, _, _), result in zip(requests, results, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        encoded = [
            [self.prefix_token_id, *self.tok_encode(text)] for (text,) in (r.args for r in requests)
        ]
        windows, owners = [], []
        for k, tokens in enumerate(encoded):
            for window in score_windows(tokens, 1, self.max_length):
                windows.append(window)
                owners.append(k)
        totals = [0.0] * len(requests)
        for k, (logprob, _) in zip(owners, self._score(windows, disable_tqdm), strict=True):
            totals[k] += logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        jobs = []
        for context, gen_kwargs in (r.args for r in requests):
            gen_kwargs = dict(gen_kwargs or {})
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else [u for u in until if u]
            if gen_kwargs.get("do_sample"):
                logger.warning("CommbenchLM decodes greedily; ignoring do_sample=True")
            max_new = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
            prompt = self.tok_encode(context) or [self.prefix_token_id]
            jobs.append((prompt, until, max_new))
        order = sorted(range(len(jobs)), key=lambda i: -len(jobs[i][0]))
        outputs: list[str] = [""] * len(jobs)
        batches = range(0, len(order), self.batch_size)
        for start in tqdm(batches, desc="generate_until", disable=disable_tqdm):
            batch = order[start : start + self.batch_size]
            texts = self._greedy([jobs[i] for i in batch])
            for i, text in zip(batch, texts, strict=True):
                outputs[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return outputs

    # ------------------------------------------------------------------ computation
    @torch.inference_mode()
    def _score(self, windows: list[Window], disable_tqdm: bool) -> list[tuple[float, bool]]:
        """(sum of log-probabilities of the scored targets, all of them greedy) per window."""
        order = sorted(range(len(windows)), key=lambda i: -len(windows[i][0]))
        scores: list[tuple[float, bool]] = [(0.0, True)] * len(windows)
        batches = range(0, len(order), self.batch_size)
        for start in tqdm(batches, desc="scoring", disable=disable_tqdm):
            batch = order[start : start + self.batch_size]
            logits_BTV = self._forward([windows[i][0] for i in batch])
            for row, i in enumerate(batch):
                inputs, targets, num_scored = windows[i]
                end = len(inputs)
                logprobs_TV = F.log_softmax(logits_BTV[row, end - num_scored : end].float(), -1)
                targets_T = torch.tensor(targets[-num_scored:], device=self._device)
                logprob = logprobs_TV.gather(-1, targets_T[:, None]).sum().item()
                greedy = bool((logprobs_TV.argmax(-1) == targets_T).all())
                scores[i] = (logprob, greedy)
        return scores

    def _forward(self, rows: list[list[int]]) -> torch.Tensor:
        """Logits for right-padded rows (padding comes after every real token, so a causal
        model's logits at real positions do not depend on it)."""
        idx_BT = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
        for r, ids in enumerate(rows):
            idx_BT[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        logits_BTV, _ = self.model(idx_BT.to(self._device))
        return logits_BTV

    @torch.inference_mode()
    def _greedy(self, jobs: list[tuple[list[int], list[str], int]]) -> list[str]:
        """Greedy continuations of a batch of prompts; each stops at end-of-text, at its
        max_gen_toks, or once its text contains a stop string (cut before it)."""
        generated: list[list[int]] = [[] for _ in jobs]
        active = [r for r, (_, _, max_new) in enumerate(jobs) if max_new > 0]
        while active:
            rows = [(jobs[r][0] + generated[r])[-self.max_length :] for r in active]
            logits_BTV = self._forward(rows)
            last_B = torch.tensor([len(row) - 1 for row in rows], device=self._device)
            next_B = logits_BTV[torch.arange(len(rows), device=self._device), last_B].argmax(-1)
            still = []
            for r, token in zip(active, next_B.tolist(), strict=True):
                _, until, max_new = jobs[r]
                if token == self.eot_token_id:
                    continue
                generated[r].append(token)
                text = self.tokenizer.decode(generated[r])
                if len(generated[r]) < max_new and not any(u in text for u in until):
                    still.append(r)
            active = still
        texts = []
        for (_, until, _), tokens in zip(jobs, generated, strict=True):
            text = self.tokenizer.decode(tokens)
            cut = min([text.index(u) for u in until if u in text], default=len(text))
            texts.append(text[:cut])
        return texts
