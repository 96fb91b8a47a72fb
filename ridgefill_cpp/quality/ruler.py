"""``ridgefill-gguf eval --ruler``: RULER's synthetic tasks, exact prefill and RidgeFill on the same prompts.

Each sample (:mod:`.ruler_tasks`) is sized to the requested length with the model's own tokenizer
(the largest haystack whose prompt plus the task's generation fits, as RULER sizes it), wrapped in
the model's chat template when it has one, and run once per condition in one context: exact
prefill first, then each RidgeFill setting (map files, identity fill). Every condition decodes
greedily up to the task's token budget or an end-of-generation token and is scored with RULER's
``string_match_all``. The comparison is paired: per task, per length and over all tasks, the score
of each condition, its difference from exact with a bootstrap CI over samples, how often its answer
equals exact's word for word, and the TTFT ratio; for the needle and variable-tracking tasks, the
same by the depth of the answer in the prompt. The library never prints; ``progress(done, total,
what)`` reports runs.

A run can span several sittings: with a ``journal`` (``eval --ruler --out DIR`` keeps
``DIR/ruler.samples.jsonl``), each prompt's record is appended as soon as every condition has
answered it, and a later run with the same model, conditions, seed and haystack takes the prompts
it already holds from there instead of running them again (more ``--samples``, more tasks or
lengths extend it; an interrupted run goes on where it stopped). A journal of another run is
refused, never mixed in.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..core.files import sha256_file
from ..core.machine import measured_on
from ..core import settings
from ..core.gguf_model import read_model_info
from ..runtime.prefill import Llama, RidgeFill
from . import metrics, ruler_tasks
from .bench import last_logits, timing_warnings
from .evaluate import open_context, plan_summary, text_sources, timed_prefill

DEPTH_BINS = 5  # answer depth: the prompt in fifths
JOURNAL = "ruler.samples.jsonl"  # eval --ruler's record of finished prompts in its --out folder
DEVIATIONS = (
    "essay haystack: the project's evaluation text (or --text), not Paul Graham's essays",
    "sentences split by a rule (end punctuation, space, capital), not NLTK punkt",
    "words keys: adjective-noun pairs drawn uniformly (RULER lists every pair; same distribution)",
    "variable tracking's one-shot and cwe's few-shot examples generated per sample; cwe's as an earlier chat turn",
    "variable tracking's one-shot example: at most a quarter of the prompt below 2,000 tokens (RULER: 500 tokens), at least 5 noise lines",
    "QA tasks (SQuAD, HotpotQA) left out: they need downloads",
)


@dataclass
class RulerOptions:
    tasks: tuple[str, ...] = tuple(ruler_tasks.TASKS)
    lengths: list[int] = field(default_factory=lambda: list(settings.RULER_LENGTHS))
    samples: int = settings.RULER_SAMPLES   # per task and length
    seed: int = 0
    n_boot: int = 2000
    n_threads: int | None = None
    n_gpu_layers: int = 0  # layers offloaded to a GPU (-1: all), as llama.cpp's -ngl
    n_batch: int = settings.N_BATCH
    swa_full: bool = True

    def check(self) -> None:
        unknown = [t for t in self.tasks if t not in ruler_tasks.TASKS]
        if unknown or not self.tasks:
            raise ValueError(f"RULER tasks {', '.join(unknown) or '(none)'}: choose from {', '.join(ruler_tasks.TASKS)}")
        if len(set(self.tasks)) != len(self.tasks):
            raise ValueError(f"a RULER task is listed twice: {', '.join(self.tasks)}")
        if not (isinstance(self.samples, int) and self.samples >= 1):
            raise ValueError(f"samples {self.samples!r}: an integer >= 1 per task and length")
        longest = max(ruler_tasks.TASKS[t].max_new_tokens for t in self.tasks)
        for n in self.lengths:
            if n <= longest + 64:
                raise ValueError(f"length {n}: RULER prompts need more than the task's generation ({longest} "
                                 f"tokens) plus 64")


def sample_seed(seed: int, task: str, length: int, index: int) -> int:
    """The seed of one sample: stable across runs, machines and task selections."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{task}:{length}:{index}".encode()).digest()[:4], "little")


# ------------------------------------------------------------------------------------------------
# the model's side: tokens, chat template, greedy decoding


class Prompter:
    """Prompt text -> tokens with ``llm``'s tokenizer, and a sample's prompt text in its chat
    template (``tokenizer.chat_template`` of the GGUF; RULER's base template without one)."""

    def __init__(self, llm: Llama):
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        self.llm = llm
        template = llm.metadata.get("tokenizer.chat_template")
        self.chat: ruler_tasks.ChatTemplate | None = None
        if template:
            text = llm._model.token_get_text
            fmt = Jinja2ChatFormatter(template, eos_token=text(llm.token_eos()) if llm.token_eos() != -1 else "",
                                      bos_token=text(llm.token_bos()) if llm.token_bos() != -1 else "")
            self.chat = lambda messages: fmt(messages=messages).prompt

    @property
    def template(self) -> str:
        return "chat" if self.chat else "base"

    def tokens(self, text: str) -> list[int]:
        # a chat template writes its own BOS text (llama-cpp-python's chat handlers tokenize it so)
        return self.llm.tokenize(text.encode(), add_bos=self.chat is None, special=True)

    def prompt(self, sample: ruler_tasks.Sample) -> str:
        return ruler_tasks.render(sample, self.chat)


def greedy_answer(llm: Llama, first_logits: np.ndarray, max_new: int) -> str:
    """Greedy decoding after the prompt just evaluated: up to ``max_new`` tokens, stopping at an
    end-of-generation token (end of turn included; not part of the text)."""
    import llama_cpp

    out, logits = [], first_logits
    vocab = llm._model.vocab
    while len(out) < max_new:
        tok = int(np.argmax(logits))
        if llama_cpp.llama_vocab_is_eog(vocab, tok):
            break
        out.append(tok)
        if len(out) < max_new:
            llm.eval([tok])
            logits = last_logits(llm)
    return llm.detokenize(out).decode(errors="replace")


def sized_sample(prompter: Prompter, task: str, seed: int, length: int, essay: Sequence[str],
                 start: int) -> tuple[ruler_tasks.Sample, list[int]]:
    """Sample ``seed`` of ``task`` with the largest haystack whose prompt plus the task's generation
    fits ``length`` tokens, and its prompt tokens."""
    spec = ruler_tasks.TASKS[task]
    budget = length - spec.max_new_tokens
    icl = None
    if spec.kind == "variable_tracking":  # the one-shot example: 500 tokens, or a quarter of a short prompt
        smallest = ruler_tasks.min_size(spec)
        try:
            icl = ruler_tasks.fit_size(lambda s: len(prompter.tokens(ruler_tasks.vt_example(spec, seed, s))),
                                       min(ruler_tasks.ICL_TOKENS, budget // 4), 5, smallest)
        except ValueError:
            icl = smallest  # the smallest example; whether the prompt still fits is decided below

    def make(size: int) -> ruler_tasks.Sample:
        return ruler_tasks.generate(spec, seed, size, essay=essay, length=length, icl_size=icl)

    try:
        size = ruler_tasks.fit_size(lambda s: len(prompter.tokens(prompter.prompt(make(s)))), budget, start,
                                     ruler_tasks.min_size(spec))
    except ValueError as e:
        raise ValueError(f"{task} at {length} tokens: {e}") from None
    sample = make(size)
    return sample, prompter.tokens(prompter.prompt(sample))


def answer_depth(prompter: Prompter, text: str, n_tokens: int, sample: ruler_tasks.Sample) -> float | None:
    """Where the first answer sits in the prompt, as a share of its tokens (needle and variable
    tracking tasks; None for the word-frequency tasks, whose answers are everywhere)."""
    if ruler_tasks.TASKS[sample.task].kind not in ("niah", "variable_tracking"):
        return None
    at = text.find(sample.answers[0])
    return None if at < 0 else len(prompter.tokens(text[:at])) / n_tokens


# ------------------------------------------------------------------------------------------------
# the journal: finished prompts, kept across sittings


def run_key(model: os.PathLike | str, conditions: dict[str, RidgeFill | None], options: RulerOptions,
            essay_text: str) -> dict:
    """What makes two runs' prompts and answers the same: the model (fingerprint), each condition
    (its settings and the map file's content), the seed, the batch, the KV cache kind and the
    haystack. Not the tasks, lengths, sample count, threads or GPU layers, which a later sitting may change."""
    from ..maps.fingerprint import model_fingerprint

    conds = {}
    for name, rf in conditions.items():
        rec = _condition_record(rf)
        rec["maps"] = None if rf is None or rf.maps is None else "sha256:" + sha256_file(rf.maps)
        conds[name] = rec
    return {"model": model_fingerprint(model), "conditions": conds, "seed": options.seed,
            "n_batch": options.n_batch, "swa_full": options.swa_full,
            "haystack": "sha256:" + hashlib.sha256(essay_text.encode()).hexdigest()}


def _key_difference(old: dict, new: dict) -> str:
    what = {"model": "the model", "conditions": "the conditions (names, map files or settings)", "seed": "the seed",
            "n_batch": "the batch size", "swa_full": "the KV cache kind (--swa-full)", "haystack": "the haystack text"}
    return ", ".join(v for k, v in what.items() if old.get(k) != new.get(k)) or "its format"


class Journal:
    """``ruler.samples.jsonl``: a first line ``{"run": KEY}``, then one finished prompt's record per
    line, appended and synced as each prompt finishes. An unfinished last line (a run killed while
    writing it) is dropped; any other damage is an error, and the file is never rewritten."""

    def __init__(self, path: os.PathLike | str, key: dict):
        self.path = Path(path)
        self.key = key
        self.done: dict[tuple[str, int, int], dict] = {}
        if self.path.exists():
            self._read(key)

    def _read(self, key: dict) -> None:
        raw = self.path.read_bytes()
        end = raw.rfind(b"\n") + 1
        lines = raw[:end].decode("utf-8", errors="replace").splitlines()
        try:
            head = json.loads(lines[0]) if lines else None
            old = head["run"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{self.path} is not a RULER journal of eval --ruler (its first line is not a run "
                             "record): give another --out") from None
        if old != key:
            raise ValueError(f"{self.path} holds a RULER run with other settings ({_key_difference(old, key)} "
                             "differ): give another --out, or remove the file to start over") from None
        for n, line in enumerate(lines[1:], 2):
            try:
                rec = json.loads(line)
                self.done[(rec["task"], rec["length"], rec["index"])] = rec
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{self.path}, line {n}: not a prompt record (the file was edited or damaged); "
                                 "remove the file to start over") from None
        if end < len(raw):  # a record cut off by a killed run: drop it, it is run again
            with open(self.path, "r+b") as f:
                f.truncate(end)

    def add(self, rec: dict) -> None:
        """Append one finished prompt (the file, and its folder, are made with the first one: a run
        that fails before any prompt finishes leaves nothing behind)."""
        try:
            if not self.path.exists():
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with open(self.path, "x", encoding="utf-8") as f:
                    f.write(json.dumps({"run": self.key}) + "\n")
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise ValueError(f"cannot write {self.path}: {e.strerror or e}") from None
        self.done[(rec["task"], rec["length"], rec["index"])] = rec


# ------------------------------------------------------------------------------------------------
# the run


@dataclass
class RulerResult:
    model: str
    conditions: dict            # name -> {"kind", "maps", "split", "settings"}
    options: dict
    template: str               # "chat" or "base"
    sources: list[str]
    deviations: list[str]
    samples: list = field(default_factory=list)   # one record per prompt (see run_ruler)
    summary: dict = field(default_factory=dict)   # length -> task | "average" -> condition -> statistics
    by_depth: dict = field(default_factory=dict)  # length -> depth bin -> condition -> statistics
    ttft: dict = field(default_factory=dict)      # length -> condition -> exact median / condition median
    # length -> the TTFT ratios above their ceiling (bench.timing_warnings: noise)
    timing_warnings: dict = field(default_factory=dict)
    worst: dict = field(default_factory=dict)     # length -> condition -> the (task, depth) cell it loses most in
    elapsed_s: float | None = None                # this sitting's wall time
    reused: int = 0                               # prompts taken from the journal of earlier sittings
    measured: dict = field(default_factory=dict)  # core.machine.measured_on: date, CPU, threads, versions

    def as_dict(self) -> dict:
        return asdict(self)


def run_ruler(model: os.PathLike | str, conditions: dict[str, RidgeFill | None], options: RulerOptions,
              essay_text: str, essay_source: str | None = None,
              progress: Callable[[int, int, str], None] | None = None,
              journal: os.PathLike | str | None = None, compared: dict[str, str] | None = None) -> RulerResult:
    """Run every task of ``options`` at every length on ``options.samples`` prompts, each with every
    condition (name -> RidgeFill; None: exact prefill, which must come first). With ``journal`` (a
    path), prompts it already holds for the same run are taken from it, and each new one is
    appended to it as it finishes (see :class:`Journal`). ``compared`` (name -> another condition's
    name): a condition also gets its paired difference from that one (e.g. another map file for the
    same split against the main one)."""
    options.check()
    names = list(conditions)
    if not names or conditions[names[0]] is not None:
        raise ValueError("the first condition must be exact prefill (None)")
    compared = dict(compared or {})
    for name, base in compared.items():
        if name not in conditions or base not in conditions or name == base:
            raise ValueError(f"compared conditions must be two different conditions of the run: {name!r}, {base!r}")
    essay = ruler_tasks.haystack_words(essay_text) if essay_text.strip() else []
    if not essay and any(ruler_tasks.uses_essay(t) for t in options.tasks):
        raise ValueError("the essay haystack has no text: give --text with some words in it")
    info = read_model_info(model)
    if max(options.lengths) > info.context_length:
        raise ValueError(f"a {max(options.lengths)}-token RULER prompt (with its answer) is longer than the model's "
                         f"context ({info.context_length})")
    t0 = time.perf_counter()
    jr = Journal(journal, run_key(model, conditions, options, essay_text)) if journal is not None else None
    wanted = [(task, length, i) for length in options.lengths for task in options.tasks for i in range(options.samples)]
    reused = sum(1 for k in wanted if jr and k in jr.done)
    first_rf = next((rf for rf in conditions.values() if rf is not None), None)
    llm = open_context(model, max(options.lengths), options.n_batch, options.n_threads, first_rf, options.swa_full,
                       options.n_gpu_layers)
    prompter = Prompter(llm)
    total = (len(wanted) - reused) * len(names)
    done = 0
    records = []
    try:
        for length in options.lengths:
            for task in options.tasks:
                start = 64
                for i in range(options.samples):
                    if jr and (task, length, i) in jr.done:
                        rec = jr.done[(task, length, i)]
                        start = rec["size"]
                        records.append(rec)
                        continue
                    seed = sample_seed(options.seed, task, length, i)
                    sample, tokens = sized_sample(prompter, task, seed, length, essay, start)
                    start = sample.size
                    text = prompter.prompt(sample)
                    rec = {"task": task, "length": length, "index": i, "seed": seed, "size": sample.size,
                           "n_prompt": len(tokens), "depth": answer_depth(prompter, text, len(tokens), sample),
                           "answers": sample.answers, "outputs": {}}
                    for name in names:
                        logits, secs = timed_prefill(llm, conditions[name], tokens, 1)
                        plan = plan_summary(llm, conditions[name].split if conditions[name] else 0)
                        pred = greedy_answer(llm, logits[-1], ruler_tasks.TASKS[task].max_new_tokens)
                        rec["outputs"][name] = {"text": pred, "score": ruler_tasks.string_match_all(pred, sample.answers),
                                                "prefill_s": secs, "plan": plan}
                        done += 1
                        if progress:
                            progress(done, total, f"{task} at {length} ({name})")
                    if jr:
                        jr.add(rec)
                    records.append(rec)
    finally:
        llm.close()
    res = RulerResult(
        model=str(model), options={**asdict(options), "tasks": list(options.tasks)}, template=prompter.template,
        conditions={n: {**_condition_record(rf), "compared_with": compared.get(n)} for n, rf in conditions.items()},
        sources=[essay_source or text_sources({"documentation": [("", "")]})[0],
                 "wonderwords word lists (MIT): needle keys, cwe's words"],
        deviations=list(DEVIATIONS), samples=records, reused=reused,
        measured=measured_on(options.n_threads, options.n_gpu_layers))
    summarise(res, options.n_boot, options.seed)
    res.elapsed_s = time.perf_counter() - t0
    return res


def _condition_record(rf: RidgeFill | None) -> dict:
    if rf is None:
        return {"kind": "exact", "maps": None, "split": None, "settings": None}
    return {"kind": "ridge" if rf.maps is not None else "identity", "maps": None if rf.maps is None else str(rf.maps),
            "split": rf.split, "settings": json.loads(json.dumps(
                {f.name: getattr(rf, f.name) for f in dataclasses.fields(rf) if f.init and f.name != "maps"}, default=str))}


# ------------------------------------------------------------------------------------------------
# the paired summary


def _ci(v: np.ndarray, n_boot: int, seed: int) -> dict:
    return metrics.bootstrap_ci(v, n_boot=n_boot, seed=seed)._asdict()


def _stats(scores: np.ndarray, exact: np.ndarray, same: np.ndarray, n_boot: int, seed: int) -> dict:
    return {"score": _ci(100 * scores, n_boot, seed), "delta": _ci(100 * (scores - exact), n_boot, seed),
            "same_answer": float(same.mean()), "n": int(scores.size)}


def _paired(recs: list[dict], names: list[str], n_boot: int, seed: int, compared: dict[str, str] | None = None) -> dict:
    """Each condition's score and its paired difference from exact (the first); a condition of
    ``compared`` also its paired difference from the condition it is compared with (``vs``)."""
    scores = {n: np.array([r["outputs"][n]["score"] for r in recs]) for n in names}
    exact_text = [ruler_tasks.postprocess(r["outputs"][names[0]]["text"]) for r in recs]
    out = {}
    for name in names:
        same = np.array([ruler_tasks.postprocess(r["outputs"][name]["text"]) == e for r, e in zip(recs, exact_text)])
        out[name] = _stats(scores[name], scores[names[0]], same, n_boot, seed)
        base = (compared or {}).get(name)
        if base:
            out[name]["vs"] = _ci(100 * (scores[name] - scores[base]), n_boot, seed)
    return out


def depth_bin(depth: float) -> str:
    k = min(int(depth * DEPTH_BINS), DEPTH_BINS - 1)
    return f"{k / DEPTH_BINS:.1f}-{(k + 1) / DEPTH_BINS:.1f}"


def compared_conditions(res: RulerResult) -> dict[str, str]:
    """The conditions compared with another (name -> that one's name; see :func:`run_ruler`)."""
    return {n: c["compared_with"] for n, c in res.conditions.items() if c.get("compared_with")}


def summarise(res: RulerResult, n_boot: int = 2000, seed: int = 0) -> None:
    """Fill ``res.summary``, ``by_depth``, ``ttft`` and ``worst`` from ``res.samples``."""
    names = list(res.conditions)
    compared = compared_conditions(res)
    for length in sorted({r["length"] for r in res.samples}):
        recs = [r for r in res.samples if r["length"] == length]
        tasks = list(dict.fromkeys(r["task"] for r in recs))
        key = str(length)
        res.summary[key] = {t: _paired([r for r in recs if r["task"] == t], names, n_boot, seed, compared) for t in tasks}
        res.summary[key]["average"] = _paired(recs, names, n_boot, seed, compared)
        placed = [r for r in recs if r["depth"] is not None]
        bins = sorted({depth_bin(r["depth"]) for r in placed})
        res.by_depth[key] = {b: _paired([r for r in placed if depth_bin(r["depth"]) == b], names, n_boot, seed)
                             for b in bins}
        exact_t = statistics.median(r["outputs"][names[0]]["prefill_s"] for r in recs)
        res.ttft[key] = {n: exact_t / statistics.median(r["outputs"][n]["prefill_s"] for r in recs) for n in names}
        # each prompt timed once per condition, prompts of several tasks: only the ceiling rule applies;
        # the ceiling is the mean over the prompts, as the report shows it (none where a plan lacks one)
        ceilings = {n: [r["outputs"][n].get("plan", {}).get("ceiling") for r in recs] for n in names[1:]}
        res.timing_warnings[key] = timing_warnings(
            {n: [r["outputs"][n]["prefill_s"] for r in recs] for n in names},
            {n: None if None in cs else sum(cs) / len(cs) for n, cs in ceilings.items()},
            base=names[0], n_prompt=length, repeats=False, more=None)
        # cells: (task, depth bin) for the needle and vt tasks, (task, "all") for cwe and fwe, which have
        # no depth; the largest mean loss wins, the cell with more samples on a tie
        groups: dict = {}
        for r in recs:
            groups.setdefault((r["task"], depth_bin(r["depth"]) if r["depth"] is not None else "all"), []).append(r)
        res.worst[key] = {}
        for n in names[1:]:
            cells = [(float(np.mean([r["outputs"][n]["score"] - r["outputs"][names[0]]["score"] for r in sel])),
                     -len(sel), t, b) for (t, b), sel in groups.items()]
            d, k, t, b = min(cells)
            res.worst[key][n] = {"task": t, "depth": b, "delta": 100 * d, "n": -k}
