"""RULER's synthetic tasks, generated as its reference implementation generates them.

RULER (Hsieh et al., 2024, "RULER: What's the Real Context Size of Your Long-Context Language
Models?"; NVIDIA/RULER, Apache-2.0) is the suite methods that approximate the KV cache are compared
on. Its synthetic tasks are built from templates, a haystack and random keys and values; this module
builds the same prompts (the prompt templates, answer prefixes and generation lengths below are
RULER's, ``scripts/data/synthetic/constants.py`` and ``scripts/synthetic.yaml``) and scores them with
RULER's ``string_match_all``. The code is written from the description of the reference, not taken
from it. Where this module departs from it (docs/ruler/README.md lists every deviation):

* the **essay haystack** is the project's own evaluation text (:func:`ridgefill_cpp.quality.evaluate.
  default_texts`: Python's reference documentation, PSF-2.0) or the caller's ``--text``, not Paul
  Graham's essays (not redistributable, and nothing is downloaded);
* sentences are split by :func:`split_sentences` (a rule: end punctuation, space, capital), not by
  NLTK's punkt model (a download);
* a key of kind ``words`` is an adjective-noun pair drawn uniformly from wonderwords' lists
  (RULER materialises every pair; the distribution is the same);
* variable tracking's one-shot example and common-words' few-shot example are generated per sample
  from its seed; with a chat template the few-shot example of ``cwe`` is an earlier user/assistant
  turn (RULER pastes a second templated turn into the prompt, which is the same thing for its
  string templates);
* the QA tasks (SQuAD, HotpotQA: downloads) are left out.

Every sample is a pure function of (task, seed, size): :func:`generate` makes it, and the runner
(:mod:`.ruler`) picks the largest size whose prompt and generation fit the requested length.
"""

from __future__ import annotations

import heapq
import math
import random
import re
import string
import uuid
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Callable, Sequence

# RULER's prompt templates ({context}, {query}, ...), answer prefixes and tokens to generate
NIAH = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
        "{type_needle_v} for {query} mentioned in the provided text?",
        " The special magic {type_needle_v} for {query} mentioned in the provided text are", 128)
VARIABLE_TRACKING = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
                     "{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.",
                     " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
                     "are assigned the value {query}, they are: ", 30)
COMMON_WORDS = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
                "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?",
                " Answer: The top 10 words that appear most often in the list are:", 120)
FREQ_WORDS = ("Read the following coded text and track the frequency of each coded word. Find the three most "
              "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
              "the dots '....'. What are the three most frequently appeared words in the above coded text?",
              " Answer: According to the coded text above, the three most frequently appeared words are:", 50)
KINDS = {"niah": NIAH, "variable_tracking": VARIABLE_TRACKING, "common_words_extraction": COMMON_WORDS,
         "freq_words_extraction": FREQ_WORDS}

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
DEPTHS = [round(100 * i / 39) for i in range(40)]  # RULER's 40 insertion depths, percent (0, 3, 5, ..., 100)


@dataclass(frozen=True)
class Task:
    name: str
    kind: str            # a key of KINDS
    args: tuple          # (name, value) pairs of the task's configuration (RULER's synthetic.yaml)

    @property
    def config(self) -> dict:
        return dict(self.args)

    @property
    def max_new_tokens(self) -> int:
        return KINDS[self.kind][2]


def _niah(name: str, haystack: str, k: str, v: str, nk: int = 1, nv: int = 1, nq: int = 1) -> Task:
    return Task(name, "niah", (("type_haystack", haystack), ("type_needle_k", k), ("type_needle_v", v),
                               ("num_needle_k", nk), ("num_needle_v", nv), ("num_needle_q", nq)))


# RULER's thirteen tasks less the two QA tasks, with its configuration
TASKS: dict[str, Task] = {t.name: t for t in (
    _niah("niah_single_1", "noise", "words", "numbers"),
    _niah("niah_single_2", "essay", "words", "numbers"),
    _niah("niah_single_3", "essay", "words", "uuids"),
    _niah("niah_multikey_1", "essay", "words", "numbers", nk=4),
    _niah("niah_multikey_2", "needle", "words", "numbers"),
    _niah("niah_multikey_3", "needle", "uuids", "uuids"),
    _niah("niah_multivalue", "essay", "words", "numbers", nv=4),
    _niah("niah_multiquery", "essay", "words", "numbers", nq=4),
    Task("vt", "variable_tracking", (("type_haystack", "noise"), ("num_chains", 1), ("num_hops", 4))),
    Task("cwe", "common_words_extraction", (("freq_cw", 30), ("freq_ucw", 3), ("num_cw", 10), ("num_fewshot", 1))),
    Task("fwe", "freq_words_extraction", (("alpha", 2.0), ("coded_wordlen", 6))),
)}


@dataclass
class Sample:
    """One prompt of a task: the chat turns before it (few-shot), the user's text, the answer prefix
    the assistant's answer starts with, and the strings a right answer contains."""
    task: str
    seed: int
    size: int                           # haystack units (sentences, words) the generator was asked for
    user: str
    answer_prefix: str
    answers: list[str]
    shots: list[tuple[str, str]] = field(default_factory=list)   # (user, assistant) turns before it


# ------------------------------------------------------------------------------------------------
# word lists and text


@lru_cache(maxsize=None)
def word_list(name: str) -> tuple[str, ...]:
    """A word list of the wonderwords package (MIT): ``nounlist``, ``adjectivelist``, ``verblist``."""
    text = resources.files("wonderwords").joinpath("assets", f"{name}.txt").read_text(encoding="utf-8")
    return tuple(w.strip() for w in text.splitlines() if w.strip())


@lru_cache(maxsize=None)
def _pair_words() -> tuple[tuple[str, ...], tuple[str, ...]]:
    return tuple(sorted(set(word_list("adjectivelist")))), tuple(sorted(set(word_list("nounlist"))))


@lru_cache(maxsize=None)
def common_words() -> tuple[str, ...]:
    """The words of ``cwe``: wonderwords' nouns, adjectives and verbs, each once, sorted."""
    return tuple(sorted(set(word_list("nounlist") + word_list("adjectivelist") + word_list("verblist"))))


_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")


def split_sentences(text: str) -> list[str]:
    """Sentences of whitespace-normalised ``text``: a break after ``.``, ``!`` or ``?`` (and any
    closing quote or bracket) followed by a space and a capital or digit. Stands in for NLTK's punkt."""
    out, at = [], 0
    for m in _SENTENCE_END.finditer(text):
        out.append(text[at:m.start()].strip() + text[m.start():m.end()].strip())
        at = m.end()
    out.append(text[at:].strip())
    return [s for s in out if s]


def haystack_words(text: str) -> list[str]:
    """The essay haystack as RULER holds it: the text's words, every run of whitespace one space."""
    return re.sub(r"\s+", " ", text).strip().split(" ")


def random_value(rng: random.Random, kind: str) -> str:
    """A needle key or value of ``kind``: a 7-digit number, an adjective-noun pair, or a UUID."""
    if kind == "numbers":
        return str(rng.randint(10 ** 6, 10 ** 7 - 1))
    if kind == "words":
        adjs, nouns = _pair_words()
        i = rng.randrange(len(adjs) * len(nouns))
        return f"{adjs[i // len(nouns)]}-{nouns[i % len(nouns)]}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown key/value kind {kind!r}")


def zeta(s: float) -> float:
    """The Riemann zeta function for s > 1 (Euler-Maclaurin, 1e-12): fwe's word counts."""
    if not s > 1:
        raise ValueError(f"zeta({s}) diverges: the exponent must be > 1")
    n = 64
    head = math.fsum(k ** -s for k in range(1, n))
    return head + n ** (1 - s) / (s - 1) + 0.5 * n ** -s + s * n ** (-s - 1) / 12 - s * (s + 1) * (s + 2) * n ** (-s - 3) / 720


# ------------------------------------------------------------------------------------------------
# the generators: (task configuration, rng, size, essay words) -> user text, answer prefix, answers


def _insert_into_essay(essay: Sequence[str], n_words: int, inserts: Sequence[str], rng: random.Random) -> str:
    """The first ``n_words`` words of the essay (repeated when shorter), split into sentences, with
    each insert placed at a depth drawn from :data:`DEPTHS` without replacement (sorted: the i-th
    insert at the i-th depth), sentences joined by a space."""
    words = list(essay) * (n_words // len(essay) + 1) if n_words > len(essay) else list(essay)
    sents = split_sentences(" ".join(words[:n_words]))
    cuts = [0] + sorted(int(len(sents) * d / 100) for d in rng.sample(DEPTHS, len(inserts))) + [len(sents)]
    parts = []
    for i in range(1, len(cuts)):
        parts.append(" ".join(sents[cuts[i - 1]:cuts[i]]))
        if i - 1 < len(inserts):
            parts.append(inserts[i - 1])
    return " ".join(parts)


def _niah(cfg: dict, rng: random.Random, size: int, essay: Sequence[str]) -> tuple[str, str, list[str]]:
    kind_k, kind_v = cfg["type_needle_k"], cfg["type_needle_v"]
    n_q = cfg["num_needle_q"]
    n_k, n_v = max(cfg["num_needle_k"], n_q), cfg["num_needle_v"]
    keys, values, needles = [], [], []
    for _ in range(n_k):
        keys.append(random_value(rng, kind_k))
        values.append([random_value(rng, kind_v) for _ in range(n_v)])
        needles += [NEEDLE.format(type_needle_v=kind_v, key=keys[-1], value=v) for v in values[-1]]
    rng.shuffle(needles)
    haystack = cfg["type_haystack"]
    if haystack == "essay":
        context = _insert_into_essay(essay, size, needles, rng)
    else:
        if haystack == "noise":
            lines = [NOISE] * size
        elif haystack == "needle":
            lines = [NEEDLE.format(type_needle_v=kind_v, key=random_value(rng, kind_k), value=random_value(rng, kind_v))
                     for _ in range(size)]
        else:
            raise ValueError(f"unknown haystack {haystack!r}")
        for at, needle in zip(sorted(rng.sample(range(size), len(needles)), reverse=True), needles):
            lines.insert(at, needle)
        context = "\n".join(lines)
    asked = rng.sample(range(n_k), n_q)
    queries = [keys[i] for i in asked]
    answers = [v for i in asked for v in values[i]]
    query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
    template, prefix, _ = NIAH
    type_v = kind_v
    if n_q * n_v == 1:  # one answer: RULER words the question in the singular
        template, prefix = (_singular(t) for t in (template, prefix))
        type_v = kind_v[:-1]
    return (template.format(type_needle_v=type_v, context=context, query=query),
            prefix.format(type_needle_v=type_v, query=query), answers)


def _singular(text: str) -> str:
    for plural, single in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        text = text.replace(plural, single)
    return text


def _chain(rng: random.Random, n_hops: int, letters: int, value: str) -> tuple[list[str], list[str]]:
    """One chain of variable assignments: its variables (distinct) and its statements."""
    names: list[str] = []
    while len(names) < n_hops + 1:
        v = "".join(rng.choices(string.ascii_uppercase, k=letters))
        names += [v] if v not in names else []
    return names, [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(n_hops)]


def _vt_text(cfg: dict, rng: random.Random, size: int, icl: bool) -> tuple[str, str, list[str]]:
    n_chains, n_hops = cfg["num_chains"], cfg["num_hops"]
    letters, hops = (3, min(10, n_hops)) if icl else (5, n_hops)
    chains, seen = [], set()
    for c in range(n_chains):
        while True:
            value = "12345" if icl else str(rng.randint(10000, 99998))
            names, statements = _chain(rng, hops, letters, value)
            if not seen & set(names):
                break
        seen |= set(names)
        chains.append((names, statements))
    lines = [NOISE] * size
    for _, statements in chains:
        for j, at in enumerate(sorted(rng.sample(range(len(lines)), len(statements)))):
            lines.insert(at + j, statements[j])
    context = "\n".join(lines).replace(". \n", ".\n")
    template, prefix, _ = VARIABLE_TRACKING
    value = chains[0][1][0].split("=")[-1].strip()
    fmt = dict(context=context, query=value, num_v=hops + 1)
    return template.format(**fmt), prefix.format(**fmt), chains[0][0]


ICL_TOKENS = 500  # variable tracking's one-shot example: RULER sizes it to 500 tokens


def vt_example(task: Task | str, seed: int, size: int) -> str:
    """Variable tracking's one-shot example of sample ``seed``: the task with ``size`` noise
    sentences, value 12345, three-letter variables, its answer prefix and the answer."""
    task = TASKS[task] if isinstance(task, str) else task
    text, prefix, answer = _vt_text(task.config, random.Random(f"{seed}:example"), size, icl=True)
    return text + prefix + " " + " ".join(answer)


def _vt(task: Task, rng: random.Random, size: int, icl_size: int, seed: int) -> tuple[str, str, list[str]]:
    if task.config.get("type_haystack", "noise") != "noise":
        raise ValueError("variable tracking: only the noise haystack (RULER's configuration)")
    text, prefix, answer = _vt_text(task.config, rng, size, icl=False)
    if icl_size:
        text = vt_example(task, seed, icl_size) + "\n\n" + text
    return text, prefix, answer


def _cwe_list(rng: random.Random, n_words: int, common: int, uncommon: int, n_common: int) -> tuple[str, list[str]]:
    pool = common_words()
    if n_words > len(pool):
        raise ValueError(f"cwe: {n_words} distinct words asked for, the word list has {len(pool)}")
    chosen = rng.sample(pool, n_words)
    listing = chosen[:n_common] * common + chosen[n_common:] * uncommon
    rng.shuffle(listing)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listing)), chosen[:n_common]


def _cwe(cfg: dict, rng: random.Random, size: int, long: bool) -> tuple[str, str, list[str], list[tuple[str, str]]]:
    """``long``: the reference's setting for lengths >= 4096 (30 and 3 repeats, a 40-word example
    with 10 and 3); below it 6 and 1 repeats and a 20-word example with 3 and 1."""
    n_cw = cfg["num_cw"]
    if long:
        ex_words, ex_rep, rep = 40, (10, 3), (cfg["freq_cw"], cfg["freq_ucw"])
    else:
        ex_words, ex_rep, rep = 20, (3, 1), (6, 1)
    template, prefix, _ = COMMON_WORDS
    shots = []
    for _ in range(cfg["num_fewshot"]):
        ctx, ans = _cwe_list(rng, ex_words, *ex_rep, n_cw)
        shots.append((template.format(context=ctx), prefix + " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ans))))
    ctx, answer = _cwe_list(rng, size, *rep, n_cw)
    return template.format(context=ctx), prefix, answer, shots


def fwe_vocab_size(length: int) -> int:
    """fwe's vocabulary: the reference draws (length - tokens to generate) // 50 coded words."""
    return max(8, (length - FREQ_WORDS[2]) // 50)


def _fwe(cfg: dict, rng: random.Random, size: int, vocab_size: int) -> tuple[str, str, list[str]]:
    """``size`` words of coded text: ``vocab_size`` random lowercase words of ``coded_wordlen``
    letters in random order, the k-th repeated int(size * k^-alpha / zeta(alpha)) times, the first
    replaced by the noise word '...'; the answer is the next three."""
    alpha, wordlen = cfg["alpha"], cfg["coded_wordlen"]
    vocab: set[str] = set()
    while len(vocab) < vocab_size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=wordlen)))
    words = sorted(vocab)
    rng.shuffle(words)
    words[0] = "..."
    z = zeta(alpha)
    text = [w for k, w in enumerate(words, 1) for _ in range(int(size * k ** -alpha / z))]
    rng.shuffle(text)
    template, prefix, _ = FREQ_WORDS
    return template.format(context=" ".join(text)), prefix, words[1:4]


def generate(task: Task | str, seed: int, size: int, *, essay: Sequence[str] = (), length: int = 4096,
             icl_size: int | None = None) -> Sample:
    """Sample ``seed`` of ``task`` with a haystack of ``size`` units: sentences (noise, needle
    haystacks and variable tracking), words of ``essay`` (the essay haystack), list entries (cwe)
    or coded words (fwe). ``length`` (the prompt length asked for) picks cwe's repeat counts and
    fwe's vocabulary as the reference does; ``icl_size``: the noise sentences of variable tracking's
    one-shot example (None: no example)."""
    task = TASKS[task] if isinstance(task, str) else task
    if size < 1:
        raise ValueError(f"{task.name}: haystack size {size} must be >= 1")
    cfg, rng, shots = task.config, random.Random(seed), []
    if task.kind == "niah":
        if cfg["type_haystack"] == "essay" and not essay:
            raise ValueError(f"{task.name}: the essay haystack needs text")
        user, prefix, answers = _niah(cfg, rng, size, essay)
    elif task.kind == "variable_tracking":
        user, prefix, answers = _vt(task, rng, size, icl_size or 0, seed)
    elif task.kind == "common_words_extraction":
        user, prefix, answers, shots = _cwe(cfg, rng, size, long=length >= 4096)
    elif task.kind == "freq_words_extraction":
        user, prefix, answers = _fwe(cfg, rng, size, fwe_vocab_size(length))
    else:
        raise ValueError(f"unknown task kind {task.kind!r}")
    return Sample(task.name, seed, size, user, prefix, answers, shots)


def min_size(task: Task | str) -> int:
    """The smallest haystack of ``task``: room for every needle, every statement of a chain, and
    the common words of cwe."""
    task = TASKS[task] if isinstance(task, str) else task
    cfg = task.config
    if task.kind == "niah" and cfg["type_haystack"] != "essay":
        return max(cfg["num_needle_k"], cfg["num_needle_q"]) * cfg["num_needle_v"]
    if task.kind == "variable_tracking":
        return cfg["num_hops"] + 1
    if task.kind == "common_words_extraction":
        return cfg["num_cw"] + 1
    return 1


def uses_essay(task: Task | str) -> bool:
    task = TASKS[task] if isinstance(task, str) else task
    return task.kind == "niah" and task.config["type_haystack"] == "essay"


# ------------------------------------------------------------------------------------------------
# prompts and scoring


ChatTemplate = Callable[[list[dict]], str]


def render(sample: Sample, chat: ChatTemplate | None) -> str:
    """The prompt text: with ``chat`` (messages -> the model's chat template with the assistant
    turn opened), the few-shot turns, the user's text, then the answer prefix, as RULER appends it
    after its model template; without, RULER's ``base`` template (the texts one after the other)."""
    if chat is None:
        return "".join(u + a + "\n" for u, a in sample.shots) + sample.user + sample.answer_prefix
    messages = []
    for u, a in sample.shots:
        messages += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    return chat(messages + [{"role": "user", "content": sample.user}]) + sample.answer_prefix


_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(prediction: str) -> str:
    """RULER's clean-up of a prediction: stripped, control characters as newlines."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def string_match_all(prediction: str, answers: Sequence[str]) -> float:
    """RULER's score of one prediction: the share of ``answers`` it contains, ignoring case."""
    if not answers:
        raise ValueError("a sample without answers cannot be scored")
    pred = postprocess(prediction).lower()
    return sum(a.lower() in pred for a in answers) / len(answers)


def fit_size(make: Callable[[int], int], budget: int, start: int, smallest: int = 1) -> int:
    """The largest haystack size (at least ``smallest``) whose token count ``make(size)`` is at
    most ``budget``, by doubling from ``start`` then bisection (the counts grow with the size).
    ValueError when even the smallest is over."""
    if make(smallest) > budget:
        raise ValueError(f"even the smallest haystack needs {make(smallest)} tokens, over the {budget} available")
    lo, hi = smallest, max(smallest + 1, start)
    while make(hi) <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if make(mid) <= budget else (lo, mid)
    return lo
