"""``eval --ruler``: RULER's task generators against hand-worked examples of its reference
(NVIDIA/RULER scripts/data/synthetic), its scoring, and a small end-to-end run on a tiny model."""

from __future__ import annotations

import json
import math
import random
import re
import shutil
from collections import Counter

import pytest

from ridgefill_cpp.fitting import corpus
from ridgefill_cpp.fitting.fit import FitOptions, fit_ridge_maps
from ridgefill_cpp.maps.mapfile import write_map_file
from ridgefill_cpp.quality import ruler, ruler_tasks as rt

ESSAY = rt.haystack_words(" ".join(f"Sentence number {i} is here." for i in range(40)))
NEEDLE_RE = re.compile(r"One of the special magic (numbers|uuids) for (.+?) is: (\S+)\.")
ENTRY_RE = r"(\d+)\. (.+?)(?= \d+\. |$)"  # "1. word 2. ad hoc ..." (a few list words have a space)
UUID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


def _context(sample: rt.Sample) -> str:
    """The haystack between the instruction's first line and the question."""
    return sample.user.split("\n", 1)[1].rsplit("\n", 1)[0]


def test_the_single_needle_prompt_is_the_reference_template_in_the_singular():
    s = rt.generate("niah_single_1", 7, 3)
    (kind, key, value), = NEEDLE_RE.findall(s.user)
    assert kind == "numbers" and re.fullmatch(r"[^-]+(-[^-]+)+", key)
    assert re.fullmatch(r"[1-9]\d{6}", value) and s.answers == [value]
    lines = _context(s).split("\n")
    assert len(lines) == 4 and lines.count(rt.NOISE) == 3
    assert s.user == ("A special magic number is hidden within the following text. Make sure to memorize it. I will quiz "
                      "you about the number afterwards.\n" + "\n".join(lines) + "\nWhat is the special magic number for "
                      f"{key} mentioned in the provided text?")
    assert s.answer_prefix == f" The special magic number for {key} mentioned in the provided text is"
    assert rt.TASKS["niah_single_1"].max_new_tokens == 128


@pytest.mark.parametrize("task, needles, answers, kind_v", [
    ("niah_single_2", 1, 1, "numbers"), ("niah_single_3", 1, 1, "uuids"), ("niah_multikey_1", 4, 1, "numbers"),
    ("niah_multikey_2", 13, 1, "numbers"), ("niah_multikey_3", 13, 1, "uuids"), ("niah_multivalue", 4, 4, "numbers"),
    ("niah_multiquery", 4, 4, "numbers")])
def test_needle_counts_keys_values_and_questions(task, needles, answers, kind_v):
    s = rt.generate(task, 3, 12, essay=ESSAY)
    found = NEEDLE_RE.findall(s.user)
    assert len(found) == needles and {k for k, _, _ in found} == {kind_v}
    assert len(s.answers) == answers and all(a in {v for _, _, v in found} for a in s.answers)
    asked = re.search(r"for (.+) mentioned in the provided text\?", s.user).group(1)
    if task == "niah_multiquery":  # four keys asked, "a, b, c, and d", each with its own value
        keys = re.fullmatch(r"(.+), (.+), (.+), and (.+)", asked).groups()
        assert [v for k in keys for kk, _, v in [f for f in found if f[1] == k]] == s.answers
        assert "What are all the special magic numbers for" in s.user and s.answer_prefix.endswith(" are")
    elif task == "niah_multivalue":  # one key, four values, all of them the answer
        assert {k for _, k, _ in found} == {asked} and sorted(v for _, _, v in found) == sorted(s.answers)
        assert s.user.startswith("Some special magic numbers are hidden")
    else:
        assert [v for _, k, v in found if k == asked] == s.answers  # exactly one needle of the asked key
        assert s.user.startswith(f"A special magic {kind_v[:-1]} is hidden")
    if task == "niah_multikey_2":  # the needle haystack: every line a needle
        assert all(NEEDLE_RE.fullmatch(line) for line in _context(s).split("\n"))
    if kind_v == "uuids":
        assert all(UUID_RE.match(v) for _, _, v in found)
    if task == "niah_multikey_3":
        assert all(UUID_RE.match(k) for _, k, _ in found)


class _Depths:
    """A stand-in rng whose sample() returns the depths a test asks for."""

    def __init__(self, depths):
        self.depths = depths

    def sample(self, population, k):
        assert list(population) == rt.DEPTHS and k == len(self.depths)
        return list(self.depths)


def test_needles_go_in_at_the_reference_depths_between_sentences():
    essay = rt.haystack_words(" ".join(f"Sentence {i} ends." for i in range(10)))
    assert len(rt.split_sentences(" ".join(essay))) == 10
    # depth 50 of 10 sentences: after the 5th; depths are sorted, the i-th insert at the i-th depth
    text = rt._insert_into_essay(essay, len(essay), ["NEEDLE-A.", "NEEDLE-B."], _Depths([100, 50]))
    assert text == ("Sentence 0 ends. Sentence 1 ends. Sentence 2 ends. Sentence 3 ends. Sentence 4 ends. NEEDLE-A. "
                    "Sentence 5 ends. Sentence 6 ends. Sentence 7 ends. Sentence 8 ends. Sentence 9 ends. NEEDLE-B. ")
    # depth 0: before the first sentence (the reference joins an empty first part: a leading space)
    assert rt._insert_into_essay(essay, 4, ["N."], _Depths([0])) == " N. Sentence 0 ends. Sentence"
    # a haystack longer than the essay repeats it
    assert rt._insert_into_essay(essay, 35, ["N."], _Depths([100])).count("Sentence 0 ends.") == 2
    assert rt.DEPTHS[:4] == [0, 3, 5, 8] and rt.DEPTHS[-1] == 100 and len(rt.DEPTHS) == 40


def test_sentence_split_and_words():
    assert rt.split_sentences('He said "Stop." Then 3 more. e.g. this stays. Why? (Yes.) Done!') == \
        ['He said "Stop."', "Then 3 more. e.g. this stays.", "Why?", "(Yes.)", "Done!"]
    assert rt.haystack_words("a  b\n\tc ") == ["a", "b", "c"]


def test_variable_tracking_chain_and_its_one_shot_example():
    s = rt.generate("vt", 11, 8, icl_size=6)
    example, main = s.user.split("\n\n" + "Memorize", 1)
    main = "Memorize" + main
    statements = re.findall(r"VAR (\w+) = (VAR (\w+)|\d+) ?$", main, re.M)
    assert [name for name, _, _ in statements] == s.answers and len(s.answers) == 5
    assert all(len(v) == 5 and v.isupper() for v in s.answers)
    value = statements[0][1]
    assert 10000 <= int(value) <= 99998 and all(prev == s.answers[i] for i, (_, _, prev) in enumerate(statements[1:]))
    assert main.count(rt.NOISE) == 8 and f"assigned the value {value} in the text above" in main
    assert s.answer_prefix == (" Answer: According to the chain(s) of variable assignment in the text above, 5 variables "
                               f"are assigned the value {value}, they are: ")
    # the example: value 12345, three-letter variables, answered, noise of its own size
    ex = re.findall(r"VAR (\w+) = (?:VAR \w+|12345) ?$", example, re.M)
    assert len(ex) == 5 and all(len(v) == 3 for v in ex) and example.count(rt.NOISE) == 6
    assert example.endswith("5 variables are assigned the value 12345, they are:  " + " ".join(ex))
    assert rt.vt_example("vt", 11, 6) == example


@pytest.mark.parametrize("length, common, uncommon, ex_common, ex_uncommon", [(4096, 30, 3, 10, 3), (2048, 6, 1, 3, 1)])
def test_common_words_counts_and_few_shot_turn(length, common, uncommon, ex_common, ex_uncommon):
    s = rt.generate("cwe", 5, 60, length=length)
    listing = re.search(r"\n(1\. .*)\nQuestion", s.user).group(1)
    entries = re.findall(ENTRY_RE, listing)
    assert [int(i) for i, _ in entries] == list(range(1, len(entries) + 1))
    counts = Counter(w for _, w in entries)
    assert len(counts) == 60 and {counts[w] for w in s.answers} == {common} and len(s.answers) == 10
    assert {c for w, c in counts.items() if w not in s.answers} == {uncommon}
    (ex_user, ex_answer), = s.shots
    ex_counts = Counter(w for _, w in re.findall(ENTRY_RE, re.search(r"\n(1\. .*)\nQuestion", ex_user).group(1)))
    ex_top = [w for _, w in re.findall(ENTRY_RE, ex_answer.split(":", 1)[1].strip())]
    assert len(ex_counts) == (40 if length >= 4096 else 20) and {ex_counts[w] for w in ex_top} == {ex_common}
    assert {c for w, c in ex_counts.items() if w not in ex_top} == {ex_uncommon}
    assert ex_answer.startswith(s.answer_prefix + " 1. ")
    assert s.answer_prefix == " Answer: The top 10 words that appear most often in the list are:"


def test_frequent_words_follow_zipf_and_skip_the_noise_word():
    assert rt.fwe_vocab_size(4096) == 80 and rt.fwe_vocab_size(8192) == 162
    assert rt.zeta(2.0) == pytest.approx(math.pi ** 2 / 6, rel=1e-12) and rt.zeta(4.0) == pytest.approx(math.pi ** 4 / 90)
    s = rt.generate("fwe", 2, 1000, length=4096)
    words = s.user.split("coded words. ", 1)[1].split("\nQuestion")[0].split(" ")
    counts = Counter(words)
    z = math.pi ** 2 / 6
    assert counts["..."] == int(1000 / z) and [counts[w] for w in s.answers] == [int(1000 * k ** -2 / z) for k in (2, 3, 4)]
    assert [w for w, _ in counts.most_common(4)] == ["...", *s.answers]
    assert all(re.fullmatch(r"[a-z]{6}", w) for w in counts if w != "...")


def test_string_match_all_scores_as_the_reference():
    assert rt.string_match_all(" 1234567.", ["1234567"]) == 1.0
    # a right answer inside other text still counts (substring, as the reference's `in`)
    assert rt.string_match_all("The numbers are 9991234567 and more", ["1234567"]) == 1.0
    # a partial multi-value answer: the share found
    assert rt.string_match_all("1111111, 2222222 and that is all", ["1111111", "2222222", "3333333", "4444444"]) == 0.5
    assert rt.string_match_all("ABC-Def", ["abc-DEF"]) == 1.0  # case ignored
    assert rt.string_match_all("", ["x"]) == 0.0
    assert rt.postprocess("  a\x00b\tc \n") == "a\nb\nc"
    with pytest.raises(ValueError, match="without answers"):
        rt.string_match_all("x", [])


def test_fit_size_finds_the_largest_haystack_that_fits():
    assert rt.fit_size(lambda s: 10 + 7 * s, 100, 1) == 12
    assert rt.fit_size(lambda s: 10 + 7 * s, 100, 50) == 12
    assert rt.fit_size(lambda s: 10 + 7 * s, 45, 1, smallest=5) == 5
    with pytest.raises(ValueError, match="smallest haystack needs 45 tokens"):
        rt.fit_size(lambda s: 10 + 7 * s, 44, 1, smallest=5)
    assert rt.min_size("niah_multikey_1") == 1 and rt.min_size("niah_multivalue") == 1
    assert rt.min_size("niah_multikey_2") == 1 and rt.min_size("vt") == 5 and rt.min_size("cwe") == 11


def test_render_base_and_chat():
    s = rt.Sample("cwe", 0, 1, "Q", " A:", ["x"], shots=[("U1", " A: 1. x")])
    assert rt.render(s, None) == "U1 A: 1. x\nQ A:"
    chat = lambda msgs: "".join(f"<{m['role']}>{m['content']}" for m in msgs) + "<assistant>"  # noqa: E731
    assert rt.render(s, chat) == "<user>U1<assistant> A: 1. x<user>Q<assistant> A:"


def test_samples_are_reproducible_from_their_seed():
    a, b = rt.generate("niah_multikey_1", 99, 40, essay=ESSAY), rt.generate("niah_multikey_1", 99, 40, essay=ESSAY)
    assert a == b and rt.generate("niah_multikey_1", 100, 40, essay=ESSAY) != a
    seeds = {ruler.sample_seed(0, t, 4096, i) for t in rt.TASKS for i in range(20)}
    assert len(seeds) == 11 * 20 and ruler.sample_seed(0, "vt", 4096, 3) == ruler.sample_seed(0, "vt", 4096, 3)
    assert set(rt.TASKS) == {"niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
                             "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe"}
    with pytest.raises(ValueError, match="essay haystack needs text"):
        rt.generate("niah_single_2", 1, 10)
    assert random.Random(1).random() == random.Random(1).random()


def _record(task: str, depth: float | None, exact: float, other: float, index: int) -> dict:
    out = lambda s: {"text": "", "score": s, "prefill_s": 1.0, "plan": {"ceiling": 1.0}}  # noqa: E731
    return {"task": task, "length": 4096, "index": index, "seed": index, "size": 1, "n_prompt": 4000,
            "depth": depth, "answers": ["x"], "outputs": {"exact": out(exact), "ridge": out(other)}}


def test_summary_pairs_scores_and_finds_the_cell_it_loses_most_in():
    recs = [_record("niah_single_1", 0.1, 1.0, 1.0, 0), _record("niah_single_1", 0.9, 1.0, 0.5, 1),
            _record("cwe", None, 0.6, 0.0, 2), _record("cwe", None, 0.4, 0.4, 3)]
    res = ruler.RulerResult(model="m.gguf", conditions={"exact": {}, "ridge": {}}, options={}, template="base",
                            sources=[], deviations=[], samples=recs)
    ruler.summarise(res, n_boot=200)
    avg = res.summary["4096"]["average"]["ridge"]
    assert avg["delta"]["estimate"] == pytest.approx(100 * (0 - 0.5 - 0.6 + 0) / 4)
    assert avg["same_answer"] == 1.0    # the texts are all equal; only the scores differ
    assert res.summary["4096"]["niah_single_1"]["ridge"]["delta"]["estimate"] == pytest.approx(-25.0)
    # cwe has no depth: its cell is all its prompts, and its mean loss (-30) is below the needle cell's (-50 on one)
    assert res.worst["4096"]["ridge"] == {"task": "niah_single_1", "depth": "0.8-1.0", "delta": -50.0, "n": 1}
    recs[1]["outputs"]["ridge"]["score"] = 1.0
    ruler.summarise(res, n_boot=200)
    assert res.worst["4096"]["ridge"] == {"task": "cwe", "depth": "all", "delta": pytest.approx(-30.0), "n": 2}
    assert list(res.by_depth["4096"]) == ["0.0-0.2", "0.8-1.0"]


def test_a_compared_condition_gets_its_paired_difference_from_the_one_it_is_compared_with():
    """Two map files for the same split (e.g. two calibration budgets): the second condition's
    difference from the first, prompt by prompt, beside each one's difference from exact."""
    from ridgefill_cpp.quality.ruler_report import markdown

    recs = [_record("niah_single_1", 0.5, e, r, i) for i, (e, r) in enumerate([(1.0, 1.0), (1.0, 0.0), (1.0, 1.0), (0.0, 0.0)])]
    for rec, b in zip(recs, [0.0, 1.0, 1.0, 1.0]):
        rec["outputs"]["ridge B"] = {"text": "", "score": b, "prefill_s": 1.0, "plan": {"ceiling": 1.0}}
    conds = {n: {"kind": "ridge", "maps": None, "split": 4, "settings": None, "compared_with": None}
             for n in ("exact", "ridge", "ridge B")}
    conds["ridge B"]["compared_with"] = "ridge"
    res = ruler.RulerResult(model="m.gguf", conditions=conds, options={"tasks": ["niah_single_1"], "samples": 4},
                            template="base", sources=[], deviations=[], samples=recs)
    ruler.summarise(res, n_boot=200)
    avg = res.summary["4096"]["average"]
    assert avg["ridge B"]["vs"]["estimate"] == pytest.approx(100 * (3 - 2) / 4)   # B - ridge, prompt by prompt
    assert avg["ridge B"]["delta"]["estimate"] == pytest.approx(100 * (3 - 3) / 4)  # B - exact
    assert "vs" not in avg["ridge"] and "vs" not in avg["exact"]
    assert res.summary["4096"]["niah_single_1"]["ridge B"]["vs"] == avg["ridge B"]["vs"]
    md = markdown(res)
    assert "| ridge B − ridge | +25.0 [" in md and "ridge B against ridge, paired on the same prompts: +25.0 [" in md
    with pytest.raises(ValueError, match="two different conditions"):
        ruler.run_ruler("m.gguf", {"exact": None, "ridge": None}, ruler.RulerOptions(lengths=[1024]), "words",
                        compared={"ridge": "ridge"})


def test_a_ttft_ratio_above_its_ceiling_is_warned_of():
    """eval --ruler's TTFT ratio above the mean ceiling of its prompts is noise (issue #53): summarise
    records it, ruler.md says it; prompts timed once each, so a wide spread alone is not judged."""
    from ridgefill_cpp.quality.ruler_report import markdown

    recs = [_record("niah_single_1", 0.5, 1.0, 1.0, i) for i in range(3)]
    for rec, (exact_s, ridge_s, identity_s) in zip(recs, [(2.0, 1.0, 1.6), (6.0, 1.1, 1.7), (2.2, 0.9, 1.5)]):
        rec["outputs"]["exact"]["prefill_s"] = exact_s  # 2 s to 6 s: no warning for that
        rec["outputs"]["ridge"] = {"text": "", "score": 1.0, "prefill_s": ridge_s, "plan": {"ceiling": 1.5}}
        rec["outputs"]["identity"] = {"text": "", "score": 1.0, "prefill_s": identity_s, "plan": {"ceiling": 1.5}}
    conds = {n: {"kind": n, "maps": None, "split": 4, "settings": None} for n in ("exact", "ridge", "identity")}
    res = ruler.RulerResult(model="m.gguf", conditions=conds, options={"tasks": ["niah_single_1"], "samples": 3},
                            template="base", sources=[], deviations=[], samples=recs)
    ruler.summarise(res, n_boot=200)
    assert res.ttft["4096"]["ridge"] == pytest.approx(2.2) and res.ttft["4096"]["identity"] == pytest.approx(2.2 / 1.6)
    (w,) = res.timing_warnings["4096"]  # identity's 1.38x is under 1.5x
    assert (w["variant"], w["kind"], w["ceiling"]) == ("ridge", "above ceiling", 1.5)
    message = ("4096 tokens, ridge: the speedup 2.20x is above its ceiling 1.50x, which no prefill reaches: the "
               "timing is noise, not a speedup. Run again on a quieter machine (nothing else running).")
    assert w["message"] == message and f"> **Warning:** {message}" in markdown(res)
    assert ruler.RulerResult(**json.loads(json.dumps(res.as_dict()))).timing_warnings == res.timing_warnings


# ------------------------------------------------------------------------------------------------
# end to end on a tiny model


@pytest.fixture(scope="module")
def tiny_maps(tiny_models, tmp_path_factory):
    fit = fit_ridge_maps(tiny_models["llama"], corpus.default_documents("calibration"),
                         FitOptions(n_tokens=3000, ctx=128, split=4, n_threads=1))
    return write_map_file(tmp_path_factory.mktemp("ruler-maps") / "tiny.S4.gguf", fit.maps)


TINY_TASKS = "niah_single_1,niah_multikey_2,niah_single_2,vt,fwe"


def test_eval_ruler_end_to_end(tiny_models, tiny_maps, cli, tmp_path):
    r = cli("eval", tiny_models["llama"], "--maps", tiny_maps, "--ruler", "--ruler-tasks", TINY_TASKS, "--lengths", "1536",
            "--samples", "2", "--ruler-identity", "--threads", "1", "--out", tmp_path / "r")
    assert r.exit_code == 0, r.output
    assert {p.name for p in (tmp_path / "r").iterdir()} == {"ruler.md", "ruler.json", "ruler.png", "ruler.samples.jsonl"}
    res = json.loads((tmp_path / "r" / "ruler.json").read_text())
    assert list(res["conditions"]) == ["exact", "ridge S=4", "identity S=4"]
    assert len(res["samples"]) == 5 * 2 and res["template"] == "base"
    for rec in res["samples"]:
        assert rec["n_prompt"] + rt.TASKS[rec["task"]].max_new_tokens <= 1536
        assert rec["n_prompt"] > 1536 - rt.TASKS[rec["task"]].max_new_tokens - 120  # filled to the length, near enough
        assert set(rec["outputs"]) == set(res["conditions"])
        for name, o in rec["outputs"].items():
            assert o["score"] == rt.string_match_all(o["text"], rec["answers"])
            assert (o["plan"].get("n_filled", 0) > 0) == (name != "exact")
        assert rec["seed"] == ruler.sample_seed(0, rec["task"], 1536, rec["index"])
        if rec["task"] != "fwe":
            assert 0 <= rec["depth"] < 1
    avg = res["summary"]["1536"]["average"]
    scores = {n: [r["outputs"][n]["score"] for r in res["samples"]] for n in res["conditions"]}
    for n in res["conditions"]:
        assert avg[n]["score"]["estimate"] == pytest.approx(100 * sum(scores[n]) / len(scores[n]))
        assert avg[n]["delta"]["estimate"] == pytest.approx(100 * (sum(scores[n]) - sum(scores["exact"])) / len(scores[n]))
    assert avg["exact"]["same_answer"] == 1.0 and set(res["summary"]["1536"]) == set(TINY_TASKS.split(",")) | {"average"}
    md = (tmp_path / "r" / "ruler.md").read_text()
    assert "| | avg | niah_single_1 | niah_multikey_2 | niah_single_2 | vt | fwe |" in md and "| Δ ridge S=4 |" in md
    assert "essay haystack" in md and "RULER at 1536 tokens" in r.output


def test_eval_ruler_compares_map_files_for_the_same_split(tiny_models, tiny_maps, cli, tmp_path):
    """--compare-maps with --ruler: each file is a condition at the first file's split, paired with
    it. A copy of the same maps answers every prompt as the first file does: its difference is 0."""
    copy = tmp_path / "tiny-copy.gguf"
    shutil.copyfile(tiny_maps, copy)
    r = cli("eval", tiny_models["llama"], "--maps", tiny_maps, "--compare-maps", copy, "--ruler", "--ruler-tasks",
            "niah_single_1,fwe", "--lengths", "1024", "--samples", "2", "--threads", "1", "--out", tmp_path / "r")
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "r" / "ruler.json").read_text())
    name = "ridge S=4 (tiny-copy.gguf)"
    assert list(res["conditions"]) == ["exact", "ridge S=4", name]
    assert res["conditions"][name]["compared_with"] == "ridge S=4" and res["conditions"][name]["maps"] == str(copy)
    assert res["conditions"]["ridge S=4"]["compared_with"] is None
    for rec in res["samples"]:
        assert rec["outputs"][name]["text"] == rec["outputs"]["ridge S=4"]["text"]
        assert rec["outputs"][name]["plan"]["n_filled"] == rec["outputs"]["ridge S=4"]["plan"]["n_filled"] > 0
    vs = res["summary"]["1024"]["average"][name]["vs"]
    assert vs["estimate"] == vs["low"] == vs["high"] == 0.0
    assert f"| {name} − ridge S=4 |" in (tmp_path / "r" / "ruler.md").read_text()
    r = cli("eval", tiny_models["llama"], "--maps", tiny_maps, "--compare-maps", tiny_maps, "--ruler",
            "--out", tmp_path / "twice")
    assert r.exit_code == 1 and "listed twice" in r.output and not (tmp_path / "twice").exists()


def test_an_interrupted_ruler_run_goes_on_from_its_journal(tiny_models, tiny_maps, tmp_path):
    """A run killed after two prompts (and while writing the third's record) goes on where it
    stopped: the finished prompts come from the journal, the rest are run, and the result is the
    uninterrupted run's; more samples extend it; a journal of other settings, or a damaged one, is
    refused and left as it was."""
    from ridgefill_cpp.runtime.prefill import RidgeFill

    conds = lambda tail=16: {"exact": None, "ridge": RidgeFill(tiny_maps, split=4, tail=tail, min_prompt=0)}  # noqa: E731
    opts = lambda n: ruler.RulerOptions(tasks=("niah_single_1", "fwe"), lengths=[1024], samples=n, n_threads=1)  # noqa: E731
    model, journal = tiny_models["llama"], tmp_path / "out" / ruler.JOURNAL

    def outputs(res):
        return [(r["task"], r["index"], {n: (o["text"], o["score"]) for n, o in r["outputs"].items()}) for r in res.samples]

    whole = ruler.run_ruler(model, conds(), opts(2), "")

    class Killed(Exception):
        pass

    def kill_in_third(done, total, what):
        if done == 5:  # the third prompt's exact run: two prompts are finished
            raise Killed

    with pytest.raises(Killed):
        ruler.run_ruler(model, conds(), opts(2), "", progress=kill_in_third, journal=journal)
    assert len(journal.read_text().splitlines()) == 1 + 2
    with open(journal, "a") as f:
        f.write('{"task": "fwe", "len')  # the record a killed run was writing
    calls = []
    resumed = ruler.run_ruler(model, conds(), opts(2), "", progress=lambda d, t, w: calls.append(t), journal=journal)
    assert resumed.reused == 2 and set(calls) == {2 * 2}  # two prompts left, two conditions each
    assert outputs(resumed) == outputs(whole)
    assert resumed.summary["1024"]["average"]["ridge"]["delta"] == whole.summary["1024"]["average"]["ridge"]["delta"]
    assert len(journal.read_text().splitlines()) == 1 + 4 and journal.read_text().endswith("\n")

    more = ruler.run_ruler(model, conds(), opts(3), "", journal=journal)
    assert more.reused == 4 and len(more.samples) == 6 and outputs(more)[:2] == outputs(whole)[:2]

    before = journal.read_bytes()
    with pytest.raises(ValueError, match=r"RULER run with other settings \(the conditions .* differ\)"):
        ruler.run_ruler(model, conds(tail=32), opts(2), "", journal=journal)
    with pytest.raises(ValueError, match=r"other settings \(the haystack text differ"):
        ruler.run_ruler(model, conds(), opts(2), "some other words", journal=journal)
    assert journal.read_bytes() == before
    lines = before.decode().splitlines(keepends=True)
    journal.write_text("".join(lines[:2] + ["not json\n"] + lines[2:]))
    with pytest.raises(ValueError, match="line 3: not a prompt record"):
        ruler.run_ruler(model, conds(), opts(2), "", journal=journal)
    journal.write_text("{}\n")
    with pytest.raises(ValueError, match="not a RULER journal"):
        ruler.run_ruler(model, conds(), opts(2), "", journal=journal)


def test_eval_ruler_goes_on_in_the_same_out_folder(tiny_models, tiny_maps, cli, tmp_path):
    args = ("eval", tiny_models["llama"], "--maps", tiny_maps, "--ruler", "--ruler-tasks", "niah_single_1", "--lengths",
            "1024", "--threads", "1", "--out", tmp_path / "r")
    r = cli(*args, "--samples", "1")
    assert r.exit_code == 0, r.output
    r = cli(*args, "--samples", "2")
    assert r.exit_code == 0, r.output
    assert "1 of 2 prompts from" in r.output
    res = json.loads((tmp_path / "r" / "ruler.json").read_text())
    assert res["reused"] == 1 and [rec["index"] for rec in res["samples"]] == [0, 1]
    assert "1 of the 2 prompts were run in earlier sittings" in (tmp_path / "r" / "ruler.md").read_text()
    r = cli(*args, "--samples", "2", "--tail", "32")
    assert r.exit_code == 1 and "other settings (the conditions" in r.output


def test_eval_ruler_with_every_row_exact_answers_as_exact(tiny_models, tiny_maps, tmp_path):
    """RidgeFill that keeps every prompt row exact (fraction 1) runs the same computation as exact
    prefill: word-for-word the same answers on every prompt, a zero difference with a zero-width CI."""
    from ridgefill_cpp.runtime.prefill import RidgeFill

    conds = {"exact": None, "all exact": RidgeFill(tiny_maps, split=4, exact_fraction=1.0, min_prompt=0)}
    res = ruler.run_ruler(tiny_models["llama"], conds, ruler.RulerOptions(tasks=("niah_single_1", "fwe"), lengths=[1024],
                                                                          samples=2, n_threads=1), "")
    for rec in res.samples:
        assert rec["outputs"]["all exact"]["text"] == rec["outputs"]["exact"]["text"]
        assert rec["outputs"]["all exact"]["plan"]["n_filled"] == 0
    d = res.summary["1024"]["average"]["all exact"]
    assert d["same_answer"] == 1.0 and d["delta"]["estimate"] == d["delta"]["low"] == d["delta"]["high"] == 0.0


def test_eval_ruler_bad_input(tiny_models, tiny_maps, cli, tmp_path):
    def run(*args):
        return cli("eval", tiny_models["llama"], "--maps", tiny_maps, *args, "--out", tmp_path / "x")

    r = run("--ruler", "--ruler-tasks", "niah_single_1,qa_1")
    assert r.exit_code == 1 and "RULER tasks qa_1: choose from niah_single_1" in r.output
    r = run("--ruler", "--ruler-tasks", "vt,vt")
    assert r.exit_code == 1 and "listed twice" in r.output
    r = run("--samples", "3")
    assert r.exit_code == 1 and "go with --ruler" in r.output
    r = run("--ruler", "--docs", "4", "--codes", "2")
    assert r.exit_code == 1 and "--docs, --codes: only the standard evaluation" in r.output
    r = run("--ruler", "--lengths", "150")
    assert r.exit_code == 1 and "RULER prompts need more than" in r.output
    r = run("--ruler", "--lengths", "8192")
    assert r.exit_code == 1 and "longer than the model's context" in r.output
    r = run("--ruler", "--ruler-tasks", "vt", "--lengths", "300")
    assert r.exit_code == 1 and "vt at 300 tokens: even the smallest haystack needs" in r.output
    empty = tmp_path / "blank.txt"
    empty.write_text("   \n")
    r = run("--ruler", "--ruler-tasks", "niah_single_2", "--text", empty, "--lengths", "1024")
    assert r.exit_code == 1 and "text found" in r.output
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="essay haystack has no text"):
        ruler.run_ruler(tiny_models["llama"], {"exact": None}, ruler.RulerOptions(tasks=("niah_single_2",), lengths=[1024]),
                        " \n ")
    with pytest.raises(ValueError, match="first condition must be exact"):
        ruler.run_ruler(tiny_models["llama"], {}, ruler.RulerOptions(lengths=[1024]), "words")
