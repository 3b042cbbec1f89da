"""Which downstream scores are at chance level, so that the report says so instead of
showing a number that looks like a result.

    commbench report results/quickstart -o reports/quickstart   # the downstream table

Chance levels, by metric (task names as lm-eval and eval/suites.py name them):
- multiple-choice accuracy (`acc`, `acc_norm`) of a task with k choices: 1/k. The smoke
  suite's `smoke_choice` has 4 choices (eval/suites.py); the paper suite's tasks have
  their own (`CHOICES`). At chance: within the 95% binomial band of 1/k for the items
  scored, ±1.96·sqrt(p(1−p)/N) (N from eval.json's `num_samples`, else `DEFAULT_ITEMS`,
  the smoke suite's 100); below the band: "below chance".
- open-vocabulary accuracy (`smoke_cloze/acc` greedy next word, `smoke_gen/exact_match`,
  lambada's `acc`): chance is ~0 (one word of a vocabulary); at chance: 0.
- byte-level scores: `byte_perplexity` ≥ 256 or `bits_per_byte` ≥ 8, what a uniform
  guess over the 256 byte values scores.
- word-level perplexity (`smoke_cloze/perplexity`, `word_perplexity`, lambada's
  `perplexity`) ≥ `WORD_PERPLEXITY`: a uniform guess among 10,000 words does better.
Anything else (an unknown task's accuracy, F1) has no chance level here and is shown as is.
"""

from __future__ import annotations

import math

CHOICES = {
    "smoke_choice": 4, "boolq": 2, "cb": 3, "copa": 2, "multirc": 2, "rte": 2, "wic": 2,
    "wsc": 2, "race": 4, "mathqa": 5, "piqa": 2, "winogrande": 2, "hellaswag": 4,
    "arc_easy": 4, "arc_challenge": 4,
}
"""Choices per item of the multiple-choice tasks the suites run."""
OPEN_VOCABULARY = {"smoke_cloze/acc", "smoke_gen/exact_match", "lambada_openai/acc",
                   "lambada_standard/acc"}
WORD_PERPLEXITY = 1e4
BYTE_PERPLEXITY, BITS_PER_BYTE = 256.0, 8.0
DEFAULT_ITEMS = 100
Z95 = 1.959964


def chance_level(metric: str) -> float | None:
    """The chance score of "task/metric" (None: no chance level known)."""
    task, _, name = metric.partition("/")
    if metric in OPEN_VOCABULARY:
        return 0.0
    if name in ("acc", "acc_norm") and task in CHOICES:
        return 1.0 / CHOICES[task]
    if name == "byte_perplexity":
        return BYTE_PERPLEXITY
    if name == "bits_per_byte":
        return BITS_PER_BYTE
    if name == "word_perplexity" or (name == "perplexity" and (
            task == "smoke_cloze" or task.startswith("lambada"))):
        return WORD_PERPLEXITY
    return None


def label(metric: str, value: float, items: float | None = None) -> str:
    """"at chance", "below chance" or "" (above chance, or no chance level known) for a
    score of "task/metric"; `items`: the items it was scored on (default DEFAULT_ITEMS)."""
    level = chance_level(metric)
    if level is None or value is None or not math.isfinite(value):
        return ""
    name = metric.partition("/")[2]
    if name in ("acc", "acc_norm", "exact_match"):
        if level == 0.0:
            return "at chance" if value <= 0.0 else ""
        n = items if items and items > 0 else DEFAULT_ITEMS
        band = Z95 * math.sqrt(level * (1 - level) / n)
        if value < level - band:
            return "below chance"
        return "at chance" if value <= level + band else ""
    return "at chance" if value >= level else ""  # perplexities, bits: lower is better


def describe(metric: str) -> str:
    """The chance level of a metric in words (for the cell and the table's note)."""
    level = chance_level(metric)
    name = metric.partition("/")[2]
    if level is None:
        return ""
    if name == "word_perplexity" or name == "perplexity":
        return f"chance: perplexity ≥ {WORD_PERPLEXITY:,.0f}"
    if name in ("byte_perplexity", "bits_per_byte"):
        return f"chance: {level:g} (uniform bytes)"
    return f"chance {level:.3g}"
