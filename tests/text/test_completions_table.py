"""The held-out completions table: the first rows' prompt / greedy completion / score per scorer, kept by
``GreedyHeldOut``, written to ``<output_dir>/completions.jsonl`` at every evaluation and logged to TensorBoard as
a markdown table, never among the numbers (history, summary.json, scalars)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from unialign.text import evaluate
from unialign.trainers.loop import COMPLETIONS_FILE, TrainerLoop
from unialign.trainers.outputs import markdown_table, read_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")


class _Policy:
    """Greedy 'generation' that echoes the prompt's last word."""

    def generate(self, prompts, greedy=True):
        return {"texts": [p.split()[-1] for p in prompts]}


def _exact(prompts, completions, answer, **_):
    return [float(c == a) for c, a in zip(completions, answer)]


def _odd_none(prompts, completions, **_):  # "no score" on every other sample, NaN on the third
    return [None if i % 2 else (math.nan if i == 2 else 1.0) for i in range(len(completions))]


ROWS = [{"prompt": f"say w{i}", "answer": f"w{i}" if i % 3 else "x"} for i in range(7)]


def test_samples_are_the_first_rows_across_batches_with_a_score_per_scorer():
    means, samples = evaluate.greedy_samples(_Policy(), ROWS, {"exact": _exact, "odd": _odd_none}, batch_size=3,
                                             keep=5)
    assert means == evaluate.greedy_scores(_Policy(), ROWS, {"exact": _exact, "odd": _odd_none}, batch_size=3)
    assert [s["prompt"] for s in samples] == [r["prompt"] for r in ROWS[:5]]  # 3 from the first batch, 2 after
    assert [s["completion"] for s in samples] == [f"w{i}" for i in range(5)]
    assert [s["exact"] for s in samples] == [0.0, 1.0, 1.0, 0.0, 1.0]
    # per batch of 3: 1.0, None, NaN -> None ("no score" is null in the table, never 0)
    assert [s["odd"] for s in samples] == [1.0, None, None, 1.0, None]
    assert evaluate.greedy_samples(_Policy(), ROWS, {"exact": _exact}, keep=0)[1] == []


def test_greedy_held_out_keeps_num_samples_and_refuses_a_scorer_named_like_a_field():
    held_out = evaluate.GreedyHeldOut(_Policy(), ROWS, {"exact": _exact}, batch_size=4, num_samples=2)
    assert held_out.samples == [] and held_out() == {"exact": 4 / 7}
    assert held_out.samples == [{"prompt": "say w0", "completion": "w0", "exact": 0.0},
                                {"prompt": "say w1", "completion": "w1", "exact": 1.0}]
    with pytest.raises(ValueError, match="completion"):
        evaluate.GreedyHeldOut(_Policy(), ROWS, {"completion": _exact})
    with pytest.raises(ValueError, match="num_samples"):
        evaluate.GreedyHeldOut(_Policy(), ROWS, {"exact": _exact}, num_samples=-1)


def test_markdown_table_renders_in_tensorboard_as_the_text_generated():
    from tensorboard.plugin_util import markdown_to_safe_html

    rows = [{"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2*3*4?"}],
             "completion": "a | b\n#### <b>24</b> _x_ `y` [z](u) \\", "score": 0.123456, "other": None}]
    page = markdown_to_safe_html(markdown_table(rows))
    assert page.count("<th>") == 4 and page.count("<td>") == 4 and "<tbody>" in page
    for shown in ("system: be brief<br>user: 2*3*4?", "a | b<br>#### &lt;b&gt;24&lt;/b&gt; _x_ `y` [z](u) \\",
                  "<td>0.1235</td>", "<td></td>"):
        assert shown in page, (shown, page)
    assert "<em>" not in page and "<code>" not in page and "<a " not in page and "<b>" not in page


def _loop(tmp_path: Path, step: int, resume_step: int | None, main: bool = True):
    return SimpleNamespace(acc=SimpleNamespace(is_main_process=main), cfg=SimpleNamespace(output_dir=str(tmp_path)),
                           step=step, _samples_resume_step=resume_step, _samples_started=False)


def test_a_resume_keeps_the_rows_its_checkpoint_covers_and_appends_after(tmp_path):
    path = tmp_path / COMPLETIONS_FILE
    old = [{"step": s, "prompt": "p", "completion": f"old{s}", "score": 1.0} for s in (0, 2, 4, 6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in old) + '{"step": 8, "prompt": "cut sh')  # killed mid-line
    assert [r["step"] for r in read_jsonl(path)] == [0, 2, 4, 6]
    loop = _loop(tmp_path, step=0, resume_step=4)  # resuming checkpoint-4; its "before" evaluation runs at step 0
    TrainerLoop._write_samples(loop, [{"prompt": "p", "completion": "new0", "score": math.nan}])
    loop.step = 6
    TrainerLoop._write_samples(loop, [{"prompt": "p", "completion": "new6", "score": 0.5}])
    rows = read_jsonl(path)
    assert [(r["step"], r["completion"]) for r in rows] == [(0, "new0"), (2, "old2"), (4, "old4"), (6, "new6")]
    assert rows[0]["score"] is None  # strict JSON: NaN is null
    json.loads(path.read_text().splitlines()[0])  # every line parses
    TrainerLoop._write_samples(_loop(tmp_path, step=0, resume_step=None), [{"prompt": "q", "completion": "c"}])
    assert read_jsonl(path) == [{"step": 0, "prompt": "q", "completion": "c"}]  # a fresh run starts the file afresh
    other = tmp_path / "other"
    TrainerLoop._write_samples(_loop(other, step=0, resume_step=None, main=False), [{"prompt": "q", "completion": "c"}])
    assert not (other / COMPLETIONS_FILE).exists()  # only the main process writes


def test_trainer_writes_the_table_at_every_evaluation_and_tensorboard_shows_it(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.trainers.test_online import make

    rows = [{"prompt": f"{i}+{i}?", "answer": str(2 * i)} for i in range(5)]
    trainer = make(tmp_path, max_steps=2, eval_steps=1, report_to="tensorboard")
    scorers = {"exact": _exact, "length": lambda p, c, **_: [float(len(x)) for x in c]}
    trainer.evaluator = evaluate.GreedyHeldOut(trainer.policy, rows, scorers, batch_size=2, num_samples=3)
    before = trainer.evaluate()
    assert set(before) == {"eval/exact", "eval/length"} and all(type(v) is float for v in before.values())
    history = trainer.train()
    assert all(isinstance(v, (int, float)) for h in history for v in h.values())  # the table never enters it
    table = read_jsonl(tmp_path / COMPLETIONS_FILE)
    assert [r["step"] for r in table] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert all(set(r) == {"step", "prompt", "completion", "exact", "length"} for r in table)
    assert [r["prompt"] for r in table[:3]] == [r["prompt"] for r in rows[:3]]
    assert all(r["length"] == len(r["completion"]) for r in table)
    events = EventAccumulator(str(next(tmp_path.rglob("events.out.tfevents.*")).parent), size_guidance={"tensors": 0})
    events.Reload()
    text = events.Tensors("eval/completions/text_summary")
    assert [e.step for e in text] == [0, 1, 2]
    markdown = text[-1].tensor_proto.string_val[0].decode()
    assert markdown.splitlines()[0] == "| prompt | completion | exact | length |" and len(markdown.splitlines()) == 5
    assert [e.step for e in events.Scalars("eval/exact")] == [0, 1, 2]  # the numbers still go to the scalars


@pytest.mark.slow
def test_grpo_math_writes_completions_jsonl_at_each_evaluation(tmp_path):
    from tests.test_scripts import run

    s = run("grpo_math", ["--max_steps", "2", "--num_eval", "10", "--prompts_per_step", "2", "--num_generations", "2",
                          "--eval_steps", "1", "--output_dir", str(tmp_path), "--report_to", "none"])
    rows = read_jsonl(tmp_path / COMPLETIONS_FILE)
    assert [r["step"] for r in rows] == [0] * 8 + [1] * 8 + [2] * 8  # the first 8 held-out rows, per evaluation
    assert all(set(r) == {"step", "prompt", "completion", "accuracy"} and r["accuracy"] in (0.0, 1.0) for r in rows)
    assert all(isinstance(r["completion"], str) and r["prompt"] for r in rows)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["before"] == s["before"] and math.isfinite(summary["after"]) and summary["steps"] == 2
    assert not any("completion" in k for k in summary)  # the table stays out of the numbers


def test_a_resumed_run_continues_the_file_of_the_run_it_resumes(tmp_path):
    from tests.trainers.test_online import make

    rows = [{"prompt": f"{i}+{i}?", "answer": str(2 * i)} for i in range(3)]
    for max_steps, resume in ((2, None), (3, "latest")):
        trainer = make(tmp_path, max_steps=max_steps, eval_steps=1, save_steps=1, resume_from_checkpoint=resume)
        trainer.evaluator = evaluate.GreedyHeldOut(trainer.policy, rows, {"exact": _exact}, num_samples=2)
        trainer.evaluate()
        trainer.train()
        if resume is None:  # as if killed after checkpoint-1: its step-2 rows are trained again
            (tmp_path / "checkpoint-2").rename(tmp_path / "gone")
    table = read_jsonl(tmp_path / COMPLETIONS_FILE)
    assert [r["step"] for r in table] == [0, 0, 1, 1, 2, 2, 3, 3]  # no step twice


def test_a_resume_after_a_kill_during_the_final_save_doubles_no_step(tmp_path):
    """The run evaluated step 2 and wrote checkpoint-2, then died saving final/: its resume evaluates step 2 again
    (its final evaluation), which replaces that step's rows instead of appending a second copy."""
    from tests.trainers.test_online import make

    rows = [{"prompt": f"{i}+{i}?", "answer": str(2 * i)} for i in range(3)]
    for resume in (None, "latest"):
        trainer = make(tmp_path, max_steps=2, save_steps=1, resume_from_checkpoint=resume)
        trainer.evaluator = evaluate.GreedyHeldOut(trainer.policy, rows, {"exact": _exact}, num_samples=2)
        trainer.evaluate()
        trainer.train()
        if resume is None:
            from unialign.trainers import rundir

            rundir.release(tmp_path)  # killed before finish_run
    table = read_jsonl(tmp_path / COMPLETIONS_FILE)
    assert [r["step"] for r in table] == [0, 0, 2, 2]
