"""The README as a user reads it. Its walkthrough ("DAPO on your own prompts and reward") is
run as written: the blocks marked `<!-- walkthrough: PATH -->` are written to a fresh folder
and the block marked `<!-- walkthrough: run -->` is run there, with only the overrides that
turn the one-GPU job into a tiny CPU one (TINY). The rewards the run logged must be the
user's function's. The examples of docs/rl.md (`<!-- example: FILE -->`) run against fake
engine results. Every relative link in the README and docs/ must point at a file, and the
README stays short."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MARKED = re.compile(r"<!-- (walkthrough|example): (\S+) -->[ \t]*\n```[A-Za-z]*\n(.*?)\n```", re.S)

# The README's job is for one GPU, from an SFT run's weights (ckpt.hf). On CPU: the tiny
# model, no GPU share for the engine, no SFT weights, 2 rollouts of 4 prompts x 4 samples.
# A random tiny model answers nothing right, so every group's rewards are equal and dynamic
# sampling would drop them all: it is off here (the reward is still computed for every response).
TINY = ["cluster.device=cpu", "cluster.num_cpus=4", "model.preset=tiny", "model.dtype=float32",
        "rollout.gpus_per_engine=0", "ckpt.hf=null", "train.steps=2", "rollout.n_samples_per_prompt=4",
        "train.global_batch_size=8", "data.seq_len=256", "rollout.dynamic_sampling=false",
        "log.wandb.mode=disabled"]


def marked_blocks(path: Path, kind: str) -> dict[str, str]:
    """name -> the fenced block right after each `<!-- kind: name -->` in `path`."""
    out: dict[str, str] = {}
    for k, name, body in MARKED.findall(path.read_text()):
        if k == kind:
            assert name not in out, f"{path.name}: two blocks marked {kind}: {name}"
            out[name] = body + "\n"
    return out


def load_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_walkthrough_runs_dapo_with_the_users_prompts_and_reward(tmp_path):
    """The walkthrough's files and command, on CPU: the job succeeds, trains its rollouts,
    evaluates its held-out prompts, writes hf/, and every reward in rollouts.jsonl is what the
    user's function gives for that response (plus the job's overlong shaping). The user's
    function scores 0 or 1, where the built-in rewards score -1 or 1: a job that scored with
    anything else fails here."""
    from miles.algo.rewards import overlong_penalty

    blocks = marked_blocks(README, "walkthrough")
    run = blocks.pop("run", None)
    assert run is not None, "the README has no block marked <!-- walkthrough: run -->"
    assert {Path(n).suffix for n in blocks} >= {".jsonl", ".py", ".yaml"}, sorted(blocks)
    for name, text in blocks.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (command,) = [line for line in run.splitlines() if line.strip() and not line.strip().startswith("#")]
    argv = shlex.split(command, comments=True)
    assert argv[:2] == ["miles", "rl"], command
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # as a user: a local cluster
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "miles.cli", *argv[1:], *TINY], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    print(f"the walkthrough's job took {time.perf_counter() - t0:.1f} s")
    assert p.returncode == 0, f"`{command}` exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"

    (job_file,) = [n for n in blocks if n.endswith(".yaml")]
    job = yaml.safe_load(blocks[job_file])
    (run_dir,) = (tmp_path / "runs").glob(f"{job['name']}-*")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout/raw_reward" in r]
    assert [r["step"] for r in steps] == [1, 2], [r["step"] for r in rows]
    for r in steps:
        assert 0.0 <= r["rollout/raw_reward"] <= 1.0, r  # the user's scale: 0 or 1
        assert r["train/updates"] == 2 and r["data/skipped_rows"] == 0, r
    summary = json.loads((run_dir / "summary.json").read_text())
    name = job["data"]["eval_name"]
    assert f"eval/{name}/accuracy" in summary and f"eval/{name}/accuracy_start" in summary, summary
    assert (run_dir / "hf" / "config.json").is_file() and (run_dir / "hf" / "tokenizer.json").is_file()

    # Every logged response's reward is the user's function of it, shaped as the job says.
    (reward_file,) = [n for n in blocks if n.endswith(".py")]
    module, _, function = job["algo"]["reward"].partition(":")
    assert Path(reward_file).stem == module, (reward_file, job["algo"]["reward"])
    score = getattr(load_module(tmp_path / reward_file, "walkthrough_reward"), function)
    (prompts_file,) = [n for n in blocks if n.endswith(".jsonl")]
    prompts = [json.loads(x) for x in blocks[prompts_file].splitlines()]
    algo = job["algo"]
    records = [json.loads(x) for x in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    samples = [s for r in records for s in r["samples"]]
    assert len(samples) == 2 * 4 * 4, len(samples)  # every response of both rollouts is logged
    for s in samples:
        row = prompts[int(s["prompt"].rsplit(":", 1)[1]) - 1]  # ids are "<file name>:<row>"
        want = score(s["text"], row["label"], [{"role": "user", "content": row["prompt"]}])
        want += float(overlong_penalty(s["trained_tokens"], algo["overlong_max_len"], algo["overlong_cache"]))
        assert s["reward"] == pytest.approx(want, abs=1e-9), s


def test_the_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines <= 420, f"README.md has {lines} lines: move detail to docs/"


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_relative_link_in_the_readme_and_docs_points_at_a_file():
    bad = []
    for doc in [README, *DOCS]:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)  # links inside code are not links
        for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                bad.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", file.read_text(), flags=re.S), re.M)
                if anchor not in {_slug(h) for h in headings}:
                    bad.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


class FakeClient:
    """What a generate function's client returns, without engines: each answer's tokens,
    log-prob -0.5 each, from weights of version 3; the bodies it was sent are kept."""

    def __init__(self, tokenizer, answers: list[str]):
        self.tokenizer, self.answers, self.bodies = tokenizer, list(answers), []

    async def generate(self, body: dict) -> dict:
        self.bodies.append(body)
        ids = self.tokenizer.encode(self.answers.pop(0), add_special_tokens=False).ids
        return {"output_ids": ids, "meta_info": {"output_token_logprobs": [[-0.5, t, None] for t in ids],
                                                 "finish_reason": {"type": "stop"}, "weight_version": 3}}


def test_the_examples_of_the_rl_docs_score_and_generate_as_documented(tmp_path):
    """docs/rl.md's reward function scores as its docstring says and loads by its job-file
    name; its generate function stops after a right answer and otherwise appends the
    untrained retry tokens and a second turn, every request holding the transcript so far and
    both turns within the sample's max_new_tokens."""
    from tokenizers import Tokenizer

    from miles.algo.rewards import load_reward
    from miles.data.sft import tokenizer_path

    examples = marked_blocks(ROOT / "docs" / "rl.md", "example")
    assert set(examples) == {"my_reward.py", "retry.py"}, sorted(examples)
    for name, text in examples.items():
        (tmp_path / name).write_text(text)
    for name in ("my_reward", "retry"):  # another test's module of the same name, imported in this process
        sys.modules.pop(name, None)
    importlib.invalidate_caches()
    sys.path.insert(0, str(tmp_path))
    try:
        score = load_reward("my_reward:score")  # as algo.reward names it
        retry = importlib.import_module("retry")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("my_reward", None)
        sys.modules.pop("retry", None)
    question = [{"role": "user", "content": "Which is larger: 27 or 34?"}]
    assert score("It is 34.\nAnswer: 34", "34", question) == 1.0
    assert score("Answer: 27", "34", question) == -0.5
    assert score("I do not know", "34", question) == -1.0
    assert score("Which is larger: 27 or 34? Answer: 34", "34", question) == -1.0

    tok = Tokenizer.from_file(tokenizer_path("tiny"))
    prompt = [5, 6, 7]
    sample = {"id": "1/0/p:1/0", "input_ids": prompt, "return_logprob": True, "label": "34", "messages": question,
              "sampling_params": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 40, "seed": 7}}
    right = FakeClient(tok, ["Answer: 34"])
    t = asyncio.run(retry.retry_once(right, dict(sample)))
    first = tok.encode("Answer: 34", add_special_tokens=False).ids
    assert t.turns == 1 and t.ids == prompt + first and t.loss_mask == [0] * 3 + [1] * len(first)

    wrong = FakeClient(tok, ["Answer: 27", "Answer: 34"])
    t = asyncio.run(retry.retry_once(wrong, dict(sample)))
    a, b = (tok.encode(x, add_special_tokens=False).ids for x in ("Answer: 27", "Answer: 34"))
    hint = retry.WRONG
    assert t.turns == 2 and t.ids == prompt + a + hint + b
    assert t.loss_mask == [0] * 3 + [1] * len(a) + [0] * len(hint) + [1] * len(b)
    assert t.logprobs == [0.0] * 3 + [-0.5] * len(a) + [0.0] * len(hint) + [-0.5] * len(b)
    assert [x["input_ids"] for x in wrong.bodies] == [prompt, prompt + a + hint]  # token in, token out
    budget = [x["sampling_params"]["max_new_tokens"] for x in wrong.bodies]
    assert budget[0] == budget[1] and 2 * budget[0] + len(hint) <= 40, budget
    assert wrong.bodies[0]["sampling_params"]["seed"] == 7 and sample["sampling_params"]["max_new_tokens"] == 40
